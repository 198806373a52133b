"""How a call is isolated: one row per mode (run.py probes them, strongest first, once).

``root`` and ``user`` give the same guarantees; they differ in what the kernel must allow. ``guard``
is what is left where it allows neither. docs/agents.md has the threat model and the measured
matrix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, Tuple

ISOLATED = (
    "its own PID namespace (the trainer is not visible: no signal, renice, affinity change "
    "or ptrace "
    "reaches it; every process of a call dies with the call), a uid of its own (no other "
    "process's), "
    "no network, its own IPC, a read-only view of the interpreter and system libraries "
    "only (no /tmp, "
    "/home, /dev/shm or project files), a size-capped tmpfs as its directory, no capabilities"
)


@dataclass(frozen=True)
class Mode:
    name: str
    needs: str  # what the kernel must allow
    protects: str
    # against the isolated modes; "" for none
    loses: str


MODES: Dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("root", "the trainer runs as root with CAP_SYS_ADMIN", ISOLATED, ""),
        Mode(
            "user",
            "unprivileged user namespaces (and, for a root trainer, an interpreter any "
            "user may read)",
            ISOLATED,
            "",
        ),
        Mode(
            "guard",
            "nothing",
            "limits (CPU, memory, file size, open files, threads where the trainer is not "
            "root) and the "
            "audit guard, which refuses writes outside the call's directory, sockets, "
            "processes, signals "
            "and ctypes from Python code",
            "native code or a gap in the audit events reaches everything the trainer's "
            "user can: signals "
            "to the trainer, every readable file, the network, the disk beyond the file-size limit",
        ),
    )
}
MODE_CHOICES = ("auto", "namespaces") + tuple(MODES)  # env.sandbox.isolation
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
        return (
            f"sandbox: isolation {self.mode} only ({why or 'env.sandbox.isolation'}): {row.loses}"
        )

    @property
    def weak(self) -> bool:
        return bool(MODES[self.mode].loses)


def candidates() -> Tuple[str, ...]:
    """The modes to try, strongest first (run.py's ``isolation`` probes them)."""
    return ("root", "user", "guard") if os.geteuid() == 0 else ("user", "guard")
