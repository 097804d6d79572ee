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


def relayout(buf, transposed: bool) -> bytearray | None:
    """`buf` with its V blocks stored transposed (`transposed`) or as rows, in a new buffer of
    the same size; None when it is already laid out so (the caller restores `buf` itself)."""
    r = _Reader(memoryview(buf).cast("B"))
    moves: list[tuple[int, int, int, int, int, int]] = []  # (header at, v type, element bytes, channels, cells, data at)
    r.raw(8)  # llama.cpp's magic and the exporting sequence's id
    (n_stream,) = r.take("<I")
    flags: list[int] = []  # where each stream's "V transposed" flag sits
    for _ in range(n_stream):
        (cells,) = r.take("<I")
        if cells == 0:
            continue
        _skip_cells(r, cells)
        flags.append(r.at)
        v_trans, n_layer = r.take("<II")
        if v_trans not in (0, 1):
            raise KVStateFormatError(f"unexpected V layout flag {v_trans}")
        for _ in range(n_layer):  # K blocks are the same in either layout
            _, row_bytes = r.take("<iQ")
            r.raw(cells * row_bytes)
        for _ in range(n_layer):
            header = r.at
            if v_trans:
                v_type, el_bytes, channels = r.take("<iII")
            else:
                v_type, row_bytes = r.take("<iQ")
                if v_type not in ELEMENT_BYTES:
                    raise KVStateFormatError(f"V of ggml type {v_type} can't be stored transposed")
                el_bytes = ELEMENT_BYTES[v_type]
                channels = row_bytes // el_bytes
            data = r.at
            r.raw(channels * cells * el_bytes)
            if bool(v_trans) != transposed:
                moves.append((header, v_type, el_bytes, channels, cells, data))
    if r.at != len(r.buf):
        raise KVStateFormatError(f"{len(r.buf) - r.at} bytes of the KV state left unread")
    if not moves:
        return None
    out = bytearray(r.buf)  # both V headers are 12 bytes: every other byte stays where it is
    for at in flags:
        struct.pack_into("<I", out, at, int(transposed))
    for header, v_type, el_bytes, channels, cells, data in moves:
        if el_bytes not in (2, 4):
            raise KVStateFormatError(f"V elements of {el_bytes} bytes")
        struct.pack_into("<iII" if transposed else "<iQ", out, header,
                         *((v_type, el_bytes, channels) if transposed else (v_type, el_bytes * channels)))
        dtype = np.uint16 if el_bytes == 2 else np.uint32  # bytes moved, never reinterpreted
        shape = (cells, channels) if transposed else (channels, cells)  # the source's
        src = np.frombuffer(r.buf, dtype=dtype, count=cells * channels, offset=data).reshape(shape)
        dst = np.frombuffer(out, dtype=dtype, count=cells * channels, offset=data).reshape(shape[::-1])
        dst[...] = src.T
    return out


def _skip_cells(r: _Reader, cells: int) -> None:
    """Past the cells' positions and sequence ids, which stay as they are. Each cell of a
    sequence's own export names one sequence (12 bytes), checked at once; any other count, cell
    by cell."""
    if r.at + 12 * cells <= len(r.buf):
        fixed = np.frombuffer(r.buf, dtype="<u4", count=3 * cells, offset=r.at)
        if (fixed[1::3] == 1).all():
            r.at += 12 * cells
            return
    for _ in range(cells):
        _, n_seq = r.take("<iI")
        r.raw(4 * n_seq)
