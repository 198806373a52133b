"""``engine.host_malloc``: with ``reuse`` a large tensor comes from glibc's heap, not a mapping of
its own (what made every logits tensor page-fault afresh); ``system`` leaves glibc as it is. Each
case in a process of its own (the setting is the process's)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlhf import host_memory

PROBE = r"""
import ctypes, sys, torch
from rlhf import host_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
print(repr(host_memory.configure(sys.argv[1])))
before = libc.mallinfo2().hblkhd
x = torch.ones(16 * 2**20)  # 64 MiB
mapped = libc.mallinfo2().hblkhd - before
del x
y = torch.full((16 * 2**20,), 2.0)
print(mapped, float(y.sum()))
"""


def probe(mode: str):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    mapped, total = out[1].split()
    return out[0], int(mapped), float(total)


@pytest.mark.skipif(
    host_memory._glibc() is None or not hasattr(host_memory._glibc(), "mallinfo2"),
    reason="glibc's mallopt and mallinfo2 (glibc 2.33+) only",
)
def test_reuse_serves_large_blocks_from_the_heap():
    said, mapped, total = probe("reuse")
    assert said == "''" and mapped == 0
    assert total == 2.0 * 16 * 2**20  # a block reused after a free holds what is written
    said, mapped, _ = probe("system")
    assert mapped >= 64 * 2**20


SETTLE = r"""
import sys, torch
from rlhf import host_memory

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) * 1024

def step(mib):
    x = torch.ones(mib * 2**18)  # mib MiB, every page touched
    del x
    held = rss()
    host_memory.settle()
    return held - rss()

host_memory.configure(sys.argv[1])
host_memory.settle()  # the first step's end: the ceiling, twice its resident set
small = step(64)
big = step(2 * rss() // 2**20)
print(small, big)
"""


@pytest.mark.skipif(
    host_memory._glibc() is None or not hasattr(host_memory._glibc(), "malloc_trim"),
    reason="glibc's malloc_trim only",
)
def test_settle_gives_the_freed_heap_back_past_twice_the_first_steps():
    """Under ``reuse`` a freed block stays resident for the next step's blocks while the resident
    set is under twice the first step's; past it ``settle`` gives the free heap back. Under
    ``system`` the block was unmapped at its free, and ``settle`` has nothing to do."""

    def given_back(mode: str):
        out = subprocess.run(
            [sys.executable, "-c", SETTLE, mode], capture_output=True, text=True, check=True
        )
        return [int(v) for v in out.stdout.split()[-2:]]

    small, big = given_back("reuse")
    assert abs(small) < 16 * 2**20  # kept for reuse
    assert big >= 200 * 2**20
    assert all(abs(v) < 32 * 2**20 for v in given_back("system"))


def test_configure_is_once_and_system_is_a_no_op(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", False)
    assert host_memory.configure("system") == ""
    assert not host_memory._applied
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    assert "no glibc" in host_memory.configure("reuse")
    assert host_memory.configure("reuse") == ""  # once per process
