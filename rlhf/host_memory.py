"""How the process's host (CPU) memory is allocated (``engine.host_malloc``).

glibc's ``malloc`` maps a large block (past its mmap threshold, at most 32 MiB) afresh with ``mmap``
and unmaps it on ``free``: each new block is then faulted in page by page (4 KiB, zeroed by the
kernel). A training step on the CPU allocates and frees hundreds of such blocks — a real
vocabulary's logits, their log-softmax and gradients, 100–300 MB each. On the CPU machine of
docs/performance.md a 200 MB block filled once cost 52 ms against 7 ms when the memory is reused,
and a 3-step SmolLM2 GRPO run (``ppo.lm_head=response``) spent 20.6 s in the kernel (``sys`` time)
of its 66 s of wall time, 12.9 of 62 with ``reuse`` (docs/history.md, 2026-11-29).

``reuse`` (the default on the CPU) asks glibc, through ``mallopt``, to serve every block from its
heap and keep freed memory for the next ones (``M_MMAP_MAX`` 0, no trimming), the effect jemalloc or
tcmalloc have under ``LD_PRELOAD`` without a library to install; threads other than the main one
still map blocks past their arena's 64 MiB. Blocks of many sizes, freed and taken again in a new
order each step, fragment that heap: kept as it was, a SmolLM2 GRPO run's resident memory grew by
0.3 GB a step (2.5 → 7.5 GB in 12 steps) over 1.6 GB in use. Trimming the heap (``malloc_trim``)
at every step's end held it at 4.8–5.3 GB but cost the next step its page faults again (about 10%
of a step). So ``settle`` (the stages' ``end_of_step``, a rollout worker's request) trims only when
the resident set has passed twice what it was at the first step's end: the growth is bounded, and
the trims, with their faults, come every few steps (docs/history.md, 2026-11-29: the heap between
steps).
``system`` leaves glibc as it is. Nothing here changes a computed number; where the C library is not
glibc (macOS, musl) ``reuse`` is a no-op and the log says so.
"""

from __future__ import annotations

import ctypes
import platform
from typing import Optional

# mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

_applied = False
_trim = None  # glibc's malloc_trim once reuse is applied
# settle's bound: twice the resident set at the first step's end
_ceiling: Optional[int] = None


def configure(mode: str) -> str:
    """Applies ``engine.host_malloc`` to this process (once; later calls do nothing) and returns a
    line for the log ('' when there is nothing to say)."""
    global _applied
    if mode == "system" or _applied:
        return ""
    _applied = True
    libc = _glibc()
    if libc is None:
        return (
            f"engine.host_malloc=reuse: no glibc here ({platform.system()}): the system allocator"
        )
    # no block mapped on its own; then a trim threshold past any block: freed memory stays
    if libc.mallopt(_M_MMAP_MAX, 0) != 1:
        return "engine.host_malloc=reuse: glibc refused mallopt: the system allocator"
    if libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) != 1:
        return "engine.host_malloc=reuse: glibc refused the trim threshold: freed heap is trimmed"
    global _trim
    _trim = libc.malloc_trim
    return ""


def settle() -> None:
    """The end of a step under ``reuse`` (a no-op otherwise): the heap's free pages back to the
    system once the resident set passes twice what it was at the first step's end."""
    global _ceiling
    if _trim is None:
        return
    kb = status_kb("VmRSS")
    if kb is None:
        return
    rss = kb * 1024
    if _ceiling is None:
        _ceiling = 2 * rss
    elif rss > _ceiling:
        _trim(0)


def status_kb(field: str) -> Optional[int]:
    """A figure of this process's /proc/self/status in KiB (``VmRSS``, ``VmHWM``), None where there
    is no such file (macOS) or field."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _glibc():
    """The process's C library when it is glibc, else None."""
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc
