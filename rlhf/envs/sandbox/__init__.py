"""Running untrusted Python (the ``python`` tool's code) in separate processes under kernel
isolation.

``Sandbox(Limits(...)).run(code) -> Result`` runs the code in a fresh interpreter (``-I -S``:
standard library only) with an empty environment and stdin on /dev/null, under limits of CPU and
wall time, memory, output, file size, total disk, open files and threads (``Limits``). Isolation
comes from the kernel where it allows (modes.py: new PID, mount, network, IPC and UTS namespaces, a
uid of the call's own, a read-only view of the interpreter alone, a tmpfs directory), with a Python
audit hook as a second layer (guard.py) that also names what it refuses. The parts:

- run.py: the parent side (a call's directory, pipes, deadline, kill and reap);
- launch.py: the launcher program (namespaces, the view, the namespace's init, the identity);
- guard.py: the sandboxed interpreter's first code (the audit hook, then main.py);
- modes.py: the isolation modes (run.py finds the strongest this machine allows);
- limits.py: ``Limits``, ``Result`` and the text the policy sees.

A stronger executor plugs in as any object with ``run(code) -> Result`` (``Executor``): gVisor's
runsc, nsjail, bubblewrap, a container per call or a remote service (docs/agents.md shows one);
``rlhf.envs.tools.python_tool(executor=...)`` takes it.
"""

from rlhf.envs.sandbox.limits import LIMIT_KINDS, Limits, Result
from rlhf.envs.sandbox.modes import MODE_CHOICES, MODES
from rlhf.envs.sandbox.run import Executor, Sandbox, SandboxError, isolation

__all__ = [
    "LIMIT_KINDS",
    "MODES",
    "MODE_CHOICES",
    "Executor",
    "Limits",
    "Result",
    "Sandbox",
    "SandboxError",
    "isolation",
]
