"""The disk fills up in the middle of a save: ``install(N)`` makes the N-th file the run writes into
a save's temporary directory (a checkpoint's or an export's ``.<name>.tmp-<pid>/``, whatever is
nested in it) fail with ``OSError(ENOSPC)``; every earlier write succeeds and so does everything the
run writes elsewhere (metrics, config). As on a full disk the file is created, empty, before the
error.

The writes counted are those of the layers a save goes through: Python's ``open`` / ``io.open`` for
writing (DCP's shards and metadata, JSON files, tokenizer configs), ``torch.save`` to a path (the
RNG and ZeRO-1 files) and ``safetensors.torch.save_file`` (exports, the EMA actor). Each process
counts its own; ``N@R`` fails only in the process of global rank R (``$RANK``). ``N = 0`` fails
nothing and prints every counted write on stderr as ``fault_enospc: write <i>: <path>``: how a test
finds the N that hits the save it wants.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import re
import sys
import threading

from sitecustomize import after_import

# rlhf.outputs.fileio.temp_dir_for's names
TEMP_DIR = re.compile(r"^\..+\.tmp-\d+$")
_lock = threading.Lock()
_count = 0
_fail_at = 0


def _in_save(path) -> bool:
    """Whether ``path`` lies inside a save's temporary directory."""
    try:
        parts = os.path.abspath(os.fspath(path)).split(os.sep)[:-1]
    except TypeError:  # a file descriptor, a buffer
        return False
    return any(TEMP_DIR.match(p) for p in parts)


def _write(path) -> None:
    """Counts one write into a save; the N-th creates the file empty and raises ENOSPC."""
    global _count
    if not _in_save(path):
        return
    with _lock:
        _count += 1
        n = _count
    if not _fail_at:
        print(f"fault_enospc: write {n}: {os.fspath(path)}", file=sys.stderr, flush=True)
        return
    if n == _fail_at:
        with _real_open(path, "wb"):
            pass
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))


_real_open = builtins.open


def _open(file, mode="r", *args, **kwargs):
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        _write(file)
    return _real_open(file, mode, *args, **kwargs)


def _patch_torch(torch) -> None:
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            _write(f)
        return real(obj, f, *args, **kwargs)

    torch.save = save


def _patch_safetensors(module) -> None:
    real = module.save_file

    def save_file(tensors, filename, *args, **kwargs):
        _write(filename)
        return real(tensors, filename, *args, **kwargs)

    module.save_file = save_file


def install(arg: str) -> None:
    global _fail_at
    n, _, rank = (arg or "0").partition("@")
    if rank and rank != os.environ.get("RANK", "0"):
        return
    _fail_at = int(n)
    builtins.open = _open
    # pathlib's Path.open calls io.open (DCP opens its shards so)
    io.open = _open
    after_import("torch", _patch_torch)
    after_import("safetensors.torch", _patch_safetensors)
