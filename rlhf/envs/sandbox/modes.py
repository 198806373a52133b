"""How a call is isolated: one row per mode, and the strongest this machine allows (found once).

``root`` and ``user`` give the same guarantees; they differ in what the kernel must allow. ``guard`` is
what is left where it allows neither. docs/agents.md has the threat model and the measured matrix.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

ISOLATED = (
    "its own PID namespace (the trainer is not visible: no signal, renice, affinity change or ptrace "
    "reaches it; every process of a call dies with the call), a uid of its own (no other process's), "
    "no network, its own IPC, a read-only view of the interpreter and system libraries only (no /tmp, "
    "/home, /dev/shm or project files), a size-capped tmpfs as its directory, no capabilities"
)


@dataclass(frozen=True)
class Mode:
    name: str
    needs: str  # what the kernel must allow
    protects: str
    loses: str  # against the isolated modes; "" for none


MODES: Dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("root", "the trainer runs as root with CAP_SYS_ADMIN", ISOLATED, ""),
        Mode(
            "user",
            "unprivileged user namespaces (and, for a root trainer, an interpreter any user may read)",
            ISOLATED,
            "",
        ),
        Mode(
            "guard",
            "nothing",
            "limits (CPU, memory, file size, open files, threads where the trainer is not root) and the "
            "audit guard, which refuses writes outside the call's directory, sockets, processes, signals "
            "and ctypes from Python code",
            "native code or a gap in the audit events reaches everything the trainer's user can: signals "
            "to the trainer, every readable file, the network, the disk beyond the file-size limit",
        ),
    )
}
MODE_CHOICES = ("auto", "namespaces") + tuple(MODES)  # ppo.sandbox.isolation
PROBE = "import os\nprint(os.getpid())"  # in a PID namespace: 2 (init is 1)


@dataclass
class Isolation:
    mode: str
    refused: Dict[str, str] = field(default_factory=dict)  # mode -> why it could not be used

    def line(self) -> str:
        """What the log says: the mode, and for ``guard`` what is lost and why."""
        row = MODES[self.mode]
        if not row.loses:
            return f"sandbox: isolation {self.mode}: {row.protects}"
        why = "; ".join(f"{name}: {reason}" for name, reason in self.refused.items())
        return f"sandbox: isolation {self.mode} only ({why or 'ppo.sandbox.isolation'}): {row.loses}"

    @property
    def weak(self) -> bool:
        return bool(MODES[self.mode].loses)


_lock = threading.Lock()
_found: Optional[Isolation] = None


def _forked() -> None:
    """In a fork's child: another thread may have held the lock at the fork."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def candidates() -> Tuple[str, ...]:
    return ("root", "user", "guard") if os.geteuid() == 0 else ("user", "guard")


def probe(mode: str) -> Optional[str]:
    """None if a call in ``mode`` works here, else why not."""
    from rlhf.envs.sandbox.limits import Limits
    from rlhf.envs.sandbox.run import Sandbox, SandboxError

    try:
        result = Sandbox(Limits(cpu_s=2, wall_s=10)).call(PROBE, mode)
    except SandboxError as e:
        return str(e).split(": ", 1)[-1]
    if result.exit_code != 0 or result.stdout.split() != ["2"]:
        return f"the probe call gave {result.observation()!r}"
    return None


def isolation() -> Isolation:
    """The strongest mode that works on this machine, probed on first use (about 0.1 s a mode)."""
    global _found
    with _lock:
        if _found is None:
            refused = {}
            for mode in candidates():
                why = probe(mode) if mode != "guard" else None
                if why is None:
                    _found = Isolation(mode, refused)
                    break
                refused[mode] = why
        return _found


def settle(choice: str) -> Isolation:
    """The isolation for ``ppo.sandbox.isolation``: ``auto`` the strongest, ``namespaces`` the strongest
    or a ValueError saying why none works, or a mode by name (not probed)."""
    if choice in MODES:
        return Isolation(choice)
    found = isolation()
    if choice == "namespaces" and found.weak:
        raise ValueError(found.line())
    return found
