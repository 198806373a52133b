"""The parent side of a sandboxed call: ``Sandbox(limits).run(code) -> Result``.

A call writes the code to a fresh host directory, asks the launcher server (launch.py, one per
process) to fork a launcher there with pipes for stdout, stderr and control, reads them until the
call ends, a limit stops it, or the wall clock runs out, then kills what is left and has the
launcher reaped.
"""

from __future__ import annotations

import math
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Optional, Protocol

from rlhf.envs.sandbox.limits import Limits, Result, limit_of
from rlhf.envs.sandbox.modes import MODES, PROBE, Isolation, candidates

READ_CHUNK = 65536
# the control pipe's messages are a few bytes; more is not read
CONTROL_BYTES = 4096
# where a view may be built: the first that exists and holds none of the paths shown
VIEW_BASES = ("/tmp", "/mnt", "/run", "/var/tmp", "/media", "/srv")
# the system's shared libraries, shown read-only beside the interpreter's own prefix
SYSTEM_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/etc/ld.so.cache")
# the code's directory in the view: the first free
WORK_DIRS = ("/work", "/sandbox", "/rlhf-sandbox")


class SandboxError(RuntimeError):
    """The sandbox itself cannot work (not the code's failure): no directory, no interpreter, a
    setup the kernel refused."""


class Executor(Protocol):
    """What runs the Python tool's code: ``Sandbox``, or a stronger isolation of the user's."""

    def run(self, code: str) -> Result: ...


@lru_cache(maxsize=None)
def _program(name: str) -> str:
    return (Path(__file__).parent / name).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def view_paths() -> tuple:
    """The host paths a namespace call sees, read-only: the system's libraries and this
    interpreter's prefix (symlinks such as /lib -> usr/lib stay symlinks), none inside another."""
    exe = os.path.realpath(sys.executable)
    wanted = list(SYSTEM_PATHS) + [os.path.realpath(sys.base_prefix), os.path.dirname(exe)]
    kept = []
    for path in wanted:
        if not os.path.lexists(path):
            continue
        if any(
            path == k or path.startswith(k.rstrip("/") + "/") for k in kept if not os.path.islink(k)
        ):
            continue
        kept.append(path)
    return tuple(kept)


@lru_cache(maxsize=None)
def work_dir() -> str:
    """The code's directory inside the view: /work, unless a path shown lies there (a venv copied
    under /work, say), which its tmpfs would hide."""
    for name in WORK_DIRS:
        if not any(
            p == name or p.startswith(name + "/") or name.startswith(p + "/") for p in view_paths()
        ):
            return name
    raise SandboxError(
        f"sandbox: every name for the code's directory ({', '.join(WORK_DIRS)}) is taken "
        "in the view"
    )


@lru_cache(maxsize=None)
def view_base() -> Optional[str]:
    """The host directory the view's tmpfs is mounted on (in the call's own mount namespace)."""
    for base in VIEW_BASES:
        if os.path.isdir(base) and not os.path.islink(base):
            if not any(p == base or p.startswith(base + "/") for p in view_paths()):
                return base
    return None


class Sandbox:
    """Runs code in a child interpreter under ``limits``, isolated by ``mode`` (modes.py: ``root``,
    ``user``, ``guard``; None: the strongest this machine allows, found once per process).
    Thread-safe: no shared state, no signal handlers; every call has its own directory, processes
    and pipes."""

    def __init__(self, limits: Optional[Limits] = None, mode: Optional[str] = None):
        self.limits = limits or Limits()
        self.mode = mode

    def run(self, code: str) -> Result:
        """Runs ``code`` to its end or to a limit. Never raises on what the code does; a
        SandboxError when the sandbox itself cannot work."""
        return self.call(code, self.mode or isolation().mode)

    def call(self, code: str, mode: str) -> Result:
        """One call in ``mode``."""
        start = time.monotonic()
        if len(code.encode("utf-8", "surrogatepass")) > self.limits.disk_bytes:
            # it would not fit its directory
            return Result("", "", None, "disk", time.monotonic() - start, self.limits)
        try:
            tmp = tempfile.TemporaryDirectory(prefix="rlhf-sandbox-", ignore_cleanup_errors=True)
        except OSError as e:
            raise SandboxError(f"sandbox: cannot create a temporary directory: {e}") from e
        with tmp as workdir:
            try:
                with open(
                    os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="surrogatepass"
                ) as f:
                    f.write(code)
            except OSError as e:
                raise SandboxError(f"sandbox: cannot write the code to {workdir}: {e}") from e
            return self._launch(workdir, mode, start)

    def call_args(self, mode: str) -> list:
        """A call's arguments to the server (launch.py's ``serve``): the mode, then its NUMBERS."""
        lim = self.limits
        if mode != "guard" and view_base() is None:
            raise SandboxError(
                f"sandbox: no directory to build the view on (none of {', '.join(VIEW_BASES)})"
            )
        numbers = (
            max(1, math.ceil(lim.cpu_s)),
            lim.memory_mb * 2**20,
            lim.file_bytes,
            lim.processes,
            lim.disk_bytes,
            lim.files,
            lim.open_files,
        )
        return [mode, *map(str, numbers)]

    def _launch(self, workdir: str, mode: str, start: float) -> Result:
        lim = self.limits
        here = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            message = "\0".join(self.call_args(mode)).encode("utf-8", "surrogateescape")
            launcher = SERVER.spawn(message, here)
        finally:
            os.close(here)
        try:
            out, err, control, stopped = _collect(
                launcher.reads, start + lim.wall_s, lim.output_bytes
            )
        finally:
            # done already, or stopped: the rest of the call dies with it
            launcher.close()
        ready, failure, ended = _parse_control(bytes(control))
        if failure is not None or (stopped is None and not ready):
            why = failure or " | ".join(err.decode("utf-8", "replace").strip().splitlines()[-3:])
            raise SandboxError(f"sandbox ({mode}): the setup failed before the code ran: {why}")
        if stopped is not None:
            exit_code, limit = None, stopped
        else:
            # None: killed from outside (the OOM killer)
            exit_code, cpu_used = ended or (None, 0.0)
            limit = limit_of(exit_code, cpu_used, max(1, math.ceil(lim.cpu_s)), bytes(err))
        return Result(
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            exit_code=exit_code,
            limit=limit,
            seconds=time.monotonic() - start,
            limits=lim,
        )


class Server:
    """launch.py's server, one per process: started on first use, started again if it died or if
    this process is a fork of the one that started it. Requests are serialized (a fork each: about a
    millisecond); the calls then run concurrently."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc: Optional[subprocess.Popen] = None
        self.sock: Optional[socket.socket] = None
        self.owner = 0  # the pid of the process that started it

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        python = os.path.realpath(sys.executable)
        argv = [python, "-I", "-S", "-B", "-X", "utf8", "-c", _program("launch.py"), "serve"]
        argv += [
            str(theirs.fileno()),
            str(os.getpid()),
            python,
            view_base() or "",
            work_dir(),
            _program("guard.py"),
        ]
        argv += list(view_paths())
        try:
            self.proc = subprocess.Popen(
                argv,
                cwd="/",
                env={},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,  # read once it has died: why
                start_new_session=True,
                close_fds=True,
                pass_fds=(theirs.fileno(),),
            )
        except (OSError, ValueError) as e:
            ours.close()
            raise SandboxError(f"sandbox: cannot start {python}: {e}") from e
        finally:
            theirs.close()
        self.sock, self.owner = ours, os.getpid()

    def stop(self) -> None:
        """Ends the server (its socket closed: it exits); the next call starts another."""
        with self.lock:
            if self.sock is not None:
                self.sock.close()
            if self.proc is not None and self.owner == os.getpid():
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                self.proc.stderr.close()
            self.proc = self.sock = None

    def spawn(self, args: bytes, here: int) -> "Launcher":
        """Forks a launcher for a call in the directory ``here`` (an fd)."""
        with self.lock:
            for _ in range(2):
                # a server that died is started again, once
                if self.owner != os.getpid() or self.proc is None or self.proc.poll() is not None:
                    if self.sock is not None:
                        self.sock.close()
                    self._start()
                try:
                    socket.send_fds(self.sock, [args], [here])
                    reply, fds, _, _ = socket.recv_fds(self.sock, 64, 4)
                except OSError:
                    reply, fds = b"", []
                for fd in fds:
                    os.set_inheritable(fd, False)  # (received fds are not close-on-exec)
                if reply.startswith(b"P") and len(fds) >= 3:
                    return Launcher(int(reply[1:]), fds[:3], fds[3] if len(fds) > 3 else None)
                for fd in fds:
                    os.close(fd)
                why = self._died()
        raise SandboxError(f"sandbox: the launcher server ended: {why}")

    def forked(self) -> None:
        """In a child of a fork of this process: nothing of the parent's server (its lock may be
        held, its socket would keep it alive after the parent); the child starts its own on its
        first call."""
        self.lock = threading.Lock()
        if self.sock is not None:
            self.sock.close()
        self.proc = self.sock = None
        self.owner = 0

    def _died(self) -> str:
        """Why the server stopped answering (its exit and the end of its stderr); it is gone after
        this."""
        proc, self.proc = self.proc, None
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        tail = proc.stderr.read().decode("utf-8", "replace").strip().splitlines()[-3:]
        proc.stderr.close()
        return f"exit {proc.returncode}" + (": " + " | ".join(tail) if tail else "")


class Launcher:
    """A call's launcher: the read ends of its stdout, stderr and control pipes, and the process by
    a pidfd (exactly that process, even once it has exited) where the kernel has them, else by
    pid."""

    def __init__(self, pid: int, reads: list, pidfd: Optional[int]):
        self.pid, self.reads, self.pidfd = pid, reads, pidfd

    def close(self) -> None:
        """Kills the launcher (the rest of the call dies with it) and closes the pipes."""
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except OSError:  # it has exited
            pass
        for fd in self.reads + ([self.pidfd] if self.pidfd is not None else []):
            os.close(fd)
        self.reads, self.pidfd = [], None


SERVER = Server()
os.register_at_fork(after_in_child=SERVER.forked)


def _parse_control(data: bytes):
    """(ready, the setup's failure or None, (exit code, CPU seconds) of the code's process or
    None)."""
    if data.startswith(b"E"):
        return False, data[1:].split(b"\n", 1)[0].decode("utf-8", "replace"), None
    ready = data.startswith(b"R")
    rest = data[1:] if ready else data
    ended = None
    if rest.startswith(b"X") and rest.endswith(b"\n"):
        status, cpu = rest[1:-1].split(b" ")
        ended = (os.waitstatus_to_exitcode(int(status)), float(cpu))
    elif rest.startswith(b"E"):
        return ready, rest[1:].split(b"\n", 1)[0].decode("utf-8", "replace"), None
    return ready, None, ended


def _collect(fds, deadline: float, cap: int):
    """(stdout, stderr, control, "wall_time" / "output" / None): stdout, stderr and the control pipe
    read until all are closed (every process of the call has ended), the deadline passes, or more
    than ``cap`` bytes of output came."""
    out, err, control = bytearray(), bytearray(), bytearray()
    with selectors.DefaultSelector() as sel:
        for fd, data in zip(fds, (out, err, control)):
            sel.register(fd, selectors.EVENT_READ, data)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return out, err, control, "wall_time"
            for key, _ in sel.select(remaining):
                chunk = os.read(key.fd, READ_CHUNK)
                if not chunk:
                    sel.unregister(key.fd)
                elif key.data is control:
                    control.extend(chunk[: max(CONTROL_BYTES - len(control), 0)])
                else:
                    room = cap - len(out) - len(err)
                    key.data.extend(chunk[: max(room, 0)])
                    if len(chunk) > room:
                        return out, err, control, "output"
    return out, err, control, None


# ---- the strongest mode this machine allows ----

_lock = threading.Lock()
_found: Optional[Isolation] = None


def _forked() -> None:
    """In a fork's child: another thread may have held the lock at the fork."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def probe(mode: str) -> Optional[str]:
    """None if a call in ``mode`` works here, else why not."""
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
    """The isolation for ``env.sandbox.isolation``: ``auto`` the strongest, ``namespaces`` the
    strongest or a ValueError saying why none works, or a mode by name (not probed)."""
    if choice in MODES:
        return Isolation(choice)
    found = isolation()
    if choice == "namespaces" and found.weak:
        raise ValueError(found.line())
    return found
