"""What a sandboxed call may use (``Limits``), how it ended (``Result``), and the text the policy
sees."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Optional

# what Result.limit names
LIMIT_KINDS = (
    "wall_time",
    "cpu_time",
    "memory",
    "output",
    "processes",
    "file_size",
    "disk",
    "open_files",
    "blocked",
)
# the end of a traceback the policy sees when its code fails
STDERR_LINES = 8


@dataclass(frozen=True)
class Limits:
    """Per-call limits (``env.sandbox``)."""

    # CPU seconds (RLIMIT_CPU: whole seconds, rounded up)
    cpu_s: float = 2.0
    # wall-clock seconds, then every process of the call is killed
    wall_s: float = 5.0
    # address space (RLIMIT_AS): the interpreter maps about 14 MB before the code runs
    memory_mb: int = 256
    # processes or threads the code may start besides itself (the guard refuses processes)
    processes: int = 0
    # stdout + stderr kept; the call is stopped once it writes more
    output_bytes: int = 10_000
    # the largest file it may write (RLIMIT_FSIZE)
    file_bytes: int = 1_000_000
    # all its files together (its directory's tmpfs, under kernel isolation)
    disk_bytes: int = 16_000_000
    # files and directories in its directory, main.py included (the tmpfs's inodes)
    files: int = 256
    # file descriptors open at once (RLIMIT_NOFILE), stdin/out/err included
    open_files: int = 64

    def __post_init__(self):
        for key in (
            "cpu_s",
            "wall_s",
            "memory_mb",
            "output_bytes",
            "file_bytes",
            "disk_bytes",
            "files",
        ):
            if not getattr(self, key) > 0:
                raise ValueError(f"Limits.{key} must be positive, got {getattr(self, key)!r}")
        if self.processes < 0:
            raise ValueError(f"Limits.processes must be >= 0, got {self.processes!r}")
        if self.files < 2:
            raise ValueError(
                f"Limits.files must be >= 2 (its directory and main.py), got {self.files!r}"
            )
        if self.memory_mb < 16:
            raise ValueError(
                f"Limits.memory_mb must be >= 16 (the interpreter's own), got {self.memory_mb!r}"
            )
        if self.open_files < 8:
            raise ValueError(
                f"Limits.open_files must be >= 8 (the interpreter's own), got {self.open_files!r}"
            )


@dataclass
class Result:
    """One call: its output, how it ended, and which limit stopped it (None: it ended by itself)."""

    stdout: str
    stderr: str
    # negative: killed by that signal; None: stopped by the sandbox (wall time, output)
    exit_code: Optional[int]
    limit: Optional[str] = None  # None or one of LIMIT_KINDS
    seconds: float = 0.0
    # what it ran under (the numbers in observation's messages)
    limits: Optional[Limits] = None

    def observation(self) -> str:
        """The text the policy sees: stdout (with the end of stderr when the code failed), or one
        line saying which limit stopped it. Short and deterministic (no paths, no timings)."""
        if self.limit is not None:
            return self._limit_message()
        out = self.stdout.rstrip()
        if self.exit_code == 0:
            return out or "(no output)"
        tail = "\n".join(self.stderr.rstrip().splitlines()[-STDERR_LINES:])
        if not tail.strip() and self.exit_code is not None and self.exit_code < 0:
            tail = f"killed by signal {signal_name(-self.exit_code)}"
        elif not tail.strip():
            tail = f"exit code {self.exit_code}"
        return "\n".join(part for part in (out, tail) if part)

    def _limit_message(self) -> str:
        lim = self.limits
        if self.limit == "blocked":
            for line in reversed(self.stderr.splitlines()):
                if "sandbox: " in line:
                    return line[line.index("sandbox: ") :].strip()
            return "sandbox: operation not allowed"
        if lim is None:
            return GENERIC_MESSAGES.get(self.limit, f"{self.limit} limit exceeded")
        if self.limit == "processes" and lim.processes == 0:
            return "process limit exceeded: no new processes or threads allowed"
        return (
            LIMIT_MESSAGES[self.limit].format(lim=lim)
            if self.limit in LIMIT_MESSAGES
            else f"{self.limit} limit exceeded"
        )


# a limit's line, with the numbers it ran under
LIMIT_MESSAGES = {
    "wall_time": "timed out after {lim.wall_s:g} s",
    "cpu_time": "CPU time limit ({lim.cpu_s:g} s) exceeded",
    "memory": "memory limit ({lim.memory_mb} MB) exceeded",
    "output": "output truncated at {lim.output_bytes} bytes",
    "file_size": "file size limit ({lim.file_bytes} bytes) exceeded",
    "disk": "disk limit ({lim.disk_bytes} bytes, {lim.files} files) exceeded",
    "open_files": "open file limit ({lim.open_files}) exceeded",
    "processes": "process limit exceeded: at most {lim.processes} new processes or threads allowed",
}
# the same, for a Result of an executor that gave no Limits
GENERIC_MESSAGES = {
    "wall_time": "timed out",
    "cpu_time": "CPU time limit exceeded",
    "memory": "memory limit exceeded",
    "output": "output truncated",
    "file_size": "file size limit exceeded",
    "disk": "disk limit exceeded",
    "open_files": "open file limit exceeded",
    "processes": "process limit exceeded",
}
# the end of an error's last line -> the limit that caused it
ERRNO_LIMITS = (
    ("[Errno 12] Cannot allocate memory", "memory"),  # ENOMEM: mmap, os.read into a buffer
    ("[Errno 27] File too large", "file_size"),  # EFBIG
    ("[Errno 28] No space left on device", "disk"),  # ENOSPC: the tmpfs's bytes or inodes
    ("[Errno 24] Too many open files", "open_files"),  # EMFILE
    ("[Errno 11] Resource temporarily unavailable", "processes"),  # EAGAIN from clone
    ("can't start new thread", "processes"),
)


def limit_of(
    exit_code: Optional[int], cpu_used: float, cpu_limit: int, stderr: bytes
) -> Optional[str]:
    """Which limit ended a call that the parent did not stop, from its exit and its last stderr
    line."""
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu_used >= cpu_limit):
        # the soft limit's SIGXCPU, or the hard limit's SIGKILL when it was caught
        return "cpu_time"
    if exit_code == -signal.SIGXFSZ:
        return "file_size"
    if not exit_code:
        return None
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    last = lines[-1] if lines else ""
    if last.startswith("MemoryError"):
        return "memory"
    if last.startswith("PermissionError: sandbox: "):
        return "blocked"
    for text, kind in ERRNO_LIMITS:
        if text in last:
            return kind
    return None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
