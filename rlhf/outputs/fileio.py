"""Atomic writes: a temporary name, then a rename. A crash never leaves a half-written file or
directory in place of a good one."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine and is not a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc (macOS): existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def remove_stale_temps(directory: Path) -> None:
    """Deletes ``.<name>.tmp-<pid>`` / ``.<name>.old-<pid>`` leftovers of writers that died (a kill
    in the middle of a save), so restarted runs do not pile them up. Live writers' files stay."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        name = p.name
        if not name.startswith("."):
            continue
        for marker in (".tmp-", ".old-"):
            pid = name.rpartition(marker)[2] if marker in name else ""
            if pid.isdigit() and int(pid) != os.getpid() and not pid_running(int(pid)):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)


def temp_dir_for(final: Path) -> Path:
    """A fresh sibling directory to fill before ``replace_dir``."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def replace_dir(tmp: Path, final: Path) -> None:
    """Moves a finished ``tmp`` directory to ``final``, replacing an older ``final`` whole."""
    tmp, final = Path(tmp), Path(final)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
