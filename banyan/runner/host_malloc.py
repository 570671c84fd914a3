"""glibc's malloc set to reuse the large blocks a CPU step frees, instead of unmapping and page-faulting them again.

glibc serves a block above its mmap threshold (dynamic, at most 32 MiB) with a fresh mmap and unmaps it on free, so
each step's logits (256 x 49,152 float32: 50 MB), and a long prefill's activations, arrive as untouched pages that
fault in one by one on first write. On a 2-vCPU EPYC VM a fresh 50 MB result of a multiply took 37-38 ms against
5.5 ms into memory already mapped. With the thresholds below such blocks come from the heap and, freed, stay there
for the next step (benchmarks/README.md, machinery). Blocks under 32 MiB were reused already (a batch of 64 rows'
logits, a 4k-token prefill's activations: no change measured there). The cost: up to TRIM_THRESHOLD of freed heap
stays with the process. GLIBC_TUNABLES or MALLOC_*_ variables in the environment win: then nothing is changed.
"""

from __future__ import annotations

import ctypes
import os

MMAP_THRESHOLD = 128 << 20
"""Blocks below this come from the heap (a KV pool or weights above it are still mapped on their own)."""
TRIM_THRESHOLD = 256 << 20
"""Freed memory at the heap's top kept for reuse, up to this much, instead of returned to the system (little next
to the reserve the KV pool leaves free: host_memory.RESERVE_FRACTION, at least 1 GiB)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_USER_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_heap() -> bool:
    """Set the two thresholds (once per process is enough; again is harmless). Returns whether they are set: False
    without glibc's mallopt (musl's ignores it, macOS has none) or when the environment set malloc's behaviour."""
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
