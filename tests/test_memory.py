"""mirage_serve.memory: the heap settings a build uses around each work item."""

import subprocess
import sys

import pytest

from mirage_serve import memory

needs_glibc = pytest.mark.skipif(not memory.supported(), reason="the C library is not glibc")


# run in a fresh interpreter: in a process that has already freed large blocks (earlier tests), glibc
# serves a large request from its free lists instead of a new mmap, whatever the settings
CHECK = """
import ctypes, sys, torch
from mirage_serve import memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
SIZE = 64 << 20  # above glibc's largest mmap threshold

def mmapped_by(fn):
    before = libc.mallinfo2().hblkhd
    x = fn()
    grew = libc.mallinfo2().hblkhd - before
    del x
    return grew

torch.ones(SIZE, dtype=torch.uint8)  # first use: thread pools and the like start here
with memory.retained_heap():
    with memory.retained_heap():
        pass
    inside = mmapped_by(lambda: torch.ones(SIZE, dtype=torch.uint8))  # still retained after the inner block
outside = mmapped_by(lambda: torch.ones(SIZE, dtype=torch.uint8))
print(inside, outside)
sys.exit(0 if inside < SIZE <= outside else 1)
"""


@needs_glibc
def test_large_tensors_come_from_the_heap_inside_nested_blocks_and_from_mmap_after():
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr[-2000:])


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
