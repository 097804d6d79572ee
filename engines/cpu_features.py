"""What this CPU computes natively, from the kernel's CPU flags (Linux /proc/cpuinfo).

Engines pick kernels by it: llama.cpp's AMX repack and its attention in decode steps
(`llamacpp_engine`). Read once per process; empty where /proc/cpuinfo is missing.
"""

from __future__ import annotations

from functools import lru_cache

@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (the first processor's; every core of a box has the same)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_amx() -> bool:
    """Intel AMX tiles (Sapphire Rapids and later)."""
    return "amx_tile" in cpu_flags()


def cpu_has_avx512() -> bool:
    """AVX-512 Foundation: 512-bit vectors, which ggml's matrix products use."""
    return "avx512f" in cpu_flags()
