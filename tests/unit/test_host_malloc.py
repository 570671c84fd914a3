"""runner/host_malloc.py: after keep_freed_heap, a step-sized block comes from the heap and is reused once freed,
instead of being mapped (and page-faulted) anew; the environment's own malloc settings win."""

import ctypes

import pytest
import torch

from banyan.runner.host_malloc import keep_freed_heap


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo():
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        pytest.skip("no glibc mallinfo2 here")
    mallinfo2.restype = _Mallinfo2
    return mallinfo2()


def test_a_step_sized_block_comes_from_the_heap_and_is_kept():
    if not keep_freed_heap():
        pytest.skip("no glibc mallopt here, or the environment sets malloc's behaviour")
    size = 50 << 20  # a batch-256 step's logits over a 49k vocabulary
    before = _mallinfo()
    block = torch.empty(size, dtype=torch.uint8)
    block.fill_(1)
    during = _mallinfo()
    assert during.hblkhd - before.hblkhd < size  # not a mapping of its own
    del block
    after = _mallinfo()
    assert after.arena >= during.arena - (1 << 20)  # freed, it stays with the heap for the next step


def test_the_environments_malloc_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert keep_freed_heap() is False
