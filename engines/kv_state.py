"""llama.cpp's per-sequence KV state (`llama_state_seq_get_data`), re-laid for another context.

A context with flash attention stores V as rows per cell; without it, V is stored transposed
(a row per channel, the cells along it), and llama.cpp refuses to restore a sequence's state
into a context of the other layout. `relayout` rewrites the V blocks of such a buffer for the
layout wanted, so that a prompt prefilled on a flash-attention context can decode on one
without (docs/engines.md).

The buffer, as this llama.cpp writes it for one sequence: a u32 magic, the i32 id of the
sequence it came from, a u32 stream count, then per stream
a u32 cell count and, if it is not 0, per cell (i32 position, u32 n_seq_id, n_seq_id i32 ids),
a u32 "V transposed" flag, a u32 layer count, per layer the K block (i32 type, u64 row bytes,
cells x row bytes), then per layer the V block: (i32 type, u64 row bytes, cells x row bytes)
as rows, or (i32 type, u32 element bytes, u32 channels, channels x cells x element bytes)
transposed.
"""

from __future__ import annotations

import struct

import numpy as np


# ggml types a V cache can take without flash attention (f32, f16, bf16): a row-laid block names
# its row's bytes only, so the element's come from its type.
ELEMENT_BYTES = {0: 4, 1: 2, 30: 2}


class KVStateFormatError(RuntimeError):
    """The buffer is not laid out as this module reads it (another llama.cpp version or model
    family): the KV can't be moved between contexts of different layouts."""


class _Reader:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise KVStateFormatError("the KV state ended early")
        out = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return out

    def raw(self, n: int) -> memoryview:
        if self.at + n > len(self.buf):
            raise KVStateFormatError("the KV state ended early")
        out = self.buf[self.at : self.at + n]
        self.at += n
        return out


def relayout(buf, transposed: bool) -> bytes | None:
    """`buf` with its V blocks stored transposed (`transposed`) or as rows; None when it is
    already laid out so (the caller restores `buf` itself, no copy made)."""
    r = _Reader(memoryview(buf).cast("B"))
    out: list[bytes] = []
    changed = False
    out.append(bytes(r.raw(8)))  # llama.cpp's magic and the exporting sequence's id, as they are
    (n_stream,) = r.take("<I")
    out.append(struct.pack("<I", n_stream))
    for _ in range(n_stream):
        (cells,) = r.take("<I")
        out.append(struct.pack("<I", cells))
        if cells == 0:
            continue
        out.append(bytes(_skip_cells(r, cells)))
        v_trans, n_layer = r.take("<II")
        if v_trans not in (0, 1):
            raise KVStateFormatError(f"unexpected V layout flag {v_trans}")
        out.append(struct.pack("<II", int(transposed), n_layer))
        for _ in range(n_layer):  # K blocks are the same in either layout
            start = r.at
            _, row_bytes = r.take("<iQ")
            r.raw(cells * row_bytes)
            out.append(bytes(r.buf[start : r.at]))
        changed |= bool(v_trans) != transposed
        for _ in range(n_layer):
            if v_trans:
                v_type, el_bytes, channels = r.take("<iII")
                data = r.raw(channels * cells * el_bytes)
            else:
                v_type, row_bytes = r.take("<iQ")
                data = r.raw(cells * row_bytes)
                if v_type not in ELEMENT_BYTES:
                    raise KVStateFormatError(f"V of ggml type {v_type} can't be stored transposed")
                el_bytes = ELEMENT_BYTES[v_type]
                channels = row_bytes // el_bytes
            if bool(v_trans) == transposed:
                out.append(_v_header(v_type, el_bytes, channels, transposed) + bytes(data))
                continue
            dtype = np.dtype(f"V{el_bytes}")  # any element type: bytes moved, never reinterpreted
            shape = (channels, cells) if v_trans else (cells, channels)
            moved = np.frombuffer(data, dtype=dtype).reshape(shape).T
            out.append(_v_header(v_type, el_bytes, channels, transposed) + np.ascontiguousarray(moved).tobytes())
    if r.at != len(r.buf):
        raise KVStateFormatError(f"{len(r.buf) - r.at} bytes of the KV state left unread")
    return b"".join(out) if changed else None


def _skip_cells(r: _Reader, cells: int) -> memoryview:
    """The cells' positions and sequence ids, as they are. Each cell of a sequence's own export
    names one sequence (12 bytes), read at once; any other count, cell by cell."""
    start = r.at
    if r.at + 12 * cells <= len(r.buf):
        fixed = np.frombuffer(r.buf, dtype="<u4", count=3 * cells, offset=r.at)
        if (fixed[1::3] == 1).all():
            r.at += 12 * cells
            return r.buf[start : r.at]
    for _ in range(cells):
        _, n_seq = r.take("<iI")
        r.raw(4 * n_seq)
    return r.buf[start : r.at]


def _v_header(v_type: int, el_bytes: int, channels: int, transposed: bool) -> bytes:
    if transposed:
        return struct.pack("<iII", v_type, el_bytes, channels)
    return struct.pack("<iQ", v_type, el_bytes * channels)
