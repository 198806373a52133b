"""How the process's host (CPU) memory is allocated (``engine.host_malloc``).

glibc's ``malloc`` maps every block of more than 32 MiB afresh with ``mmap`` and unmaps it on
``free``: each new block is then faulted in page by page (4 KiB, zeroed by the kernel). A training
step on the CPU allocates and frees hundreds of such blocks — a real vocabulary's logits, their
log-softmax and gradients, 100–300 MB each — and on the machines of docs/machines.md a 200 MB block
filled once costs 50–250 ms of page faults against 7 ms when the memory is reused (``bench`` note in
docs/performance.md): a third of a SmolLM2 GRPO step went to the kernel (``sys`` time).

``reuse`` (the default on the CPU) asks glibc, through ``mallopt``, to serve large blocks from its
heap and keep freed memory for the next ones (no ``mmap`` for the main thread's allocations, no
trimming), the effect jemalloc or tcmalloc have under ``LD_PRELOAD`` without a library to install.
The process then holds on to its peak: resident memory does not fall after a large step.
``system`` leaves glibc as it is. Nothing here changes a computed number; where the C library is not
glibc (macOS, musl) ``reuse`` is a no-op and the log says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger("rlhf")

# mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

_applied = False


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
    # a threshold past any block: freed memory stays in the heap; no block mapped on its own
    ok = libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1 and libc.mallopt(_M_MMAP_MAX, 0) == 1
    if not ok:
        return "engine.host_malloc=reuse: glibc refused mallopt: the system allocator"
    return ""


def _glibc():
    """The process's C library when it is glibc, else None."""
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc
