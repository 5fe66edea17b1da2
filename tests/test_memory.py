"""mirage_serve.memory: the heap settings a build uses around each work item."""

import ctypes

import pytest
import torch

from mirage_serve import memory


def _mmapped_bytes() -> int:
    """Bytes glibc holds in mmapped chunks now (mallinfo2.hblkhd)."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2().hblkhd


SIZE = 64 << 20  # 64 MiB: above glibc's largest mmap threshold
needs_glibc = pytest.mark.skipif(not memory.supported(), reason="the C library is not glibc")


@needs_glibc
def test_large_tensors_come_from_the_heap_inside_and_from_mmap_outside():
    torch.ones(SIZE, dtype=torch.uint8)  # first use: thread pools and the like start here, not below
    with memory.retained_heap():
        before = _mmapped_bytes()
        x = torch.ones(SIZE, dtype=torch.uint8)
        inside = _mmapped_bytes() - before
        del x
    before = _mmapped_bytes()
    y = torch.ones(SIZE, dtype=torch.uint8)
    outside = _mmapped_bytes() - before
    del y
    assert inside < SIZE <= outside


@needs_glibc
def test_nested_blocks_restore_the_defaults_only_at_the_outermost():
    torch.ones(SIZE, dtype=torch.uint8)
    with memory.retained_heap():
        with memory.retained_heap():
            pass
        before = _mmapped_bytes()
        x = torch.ones(SIZE, dtype=torch.uint8)
        inside = _mmapped_bytes() - before  # still retained after the inner block ended
        del x
    before = _mmapped_bytes()
    y = torch.ones(SIZE, dtype=torch.uint8)
    outside = _mmapped_bytes() - before
    del y
    assert inside < SIZE <= outside


def test_an_exception_inside_restores_the_defaults():
    with pytest.raises(ValueError), memory.retained_heap():
        raise ValueError("boom")
    assert memory._depth == 0


def test_without_glibc_it_is_a_no_op(monkeypatch):
    monkeypatch.setattr(memory, "_glibc", lambda: None)
    assert not memory.supported()
    with memory.retained_heap():
        memory.trim()
    assert memory._depth == 0
