"""Running untrusted Python (the ``python`` tool's code) in a separate process with limits.

``Sandbox().run(code) -> Result`` writes the code to a fresh temporary directory and runs it there with
the same interpreter (``-I -S``: isolated mode, standard library only), an empty environment, stdin on
/dev/null, in a new session, under these limits (``Limits``):

- time: CPU seconds (RLIMIT_CPU) and wall-clock seconds (the parent kills the whole process group);
- memory: the address space (RLIMIT_AS);
- output: stdout + stderr read up to ``output_bytes``, the process killed once it writes more;
- files: the largest file it may write (RLIMIT_FSIZE), and writes only inside its directory;
- processes: no new processes; threads up to ``processes`` (RLIMIT_NPROC, see below);
- network: none.

Two layers enforce the last three. Where the kernel allows unprivileged namespaces, the child moves into
new user, mount and network namespaces: it has no network interface but a down loopback, and every
mount but its own directory is remounted read-only in its mount namespace. In any case a guard runs
before the code: a Python audit hook that refuses (``PermissionError("sandbox: ... is not allowed")``,
which the code sees as an exception and the policy as stderr) sockets, opening files for writing and
other changes outside the directory, starting processes (fork, exec, spawn, subprocess, os.system),
signals to other processes, ctypes, subinterpreters, changing resource limits or the guard's own
functions; ``_posixsubprocess.fork_exec`` (which raises no audit event) is replaced and ``ctypes``
unloaded before the code runs.

What it does not protect against: it is not a security boundary against a determined attacker. Audit
hooks run in the process they guard, so native code gets around them (an extension module written to
the directory and imported, a bug in the interpreter), as can races between the guard's check of a path
and its use (symlinks swapped by a second thread, ``dir_fd`` arguments the audit events do not carry);
without namespaces (many containers refuse them) those escapes reach the network and every file the
user can write. RLIMIT_NPROC counts the tasks of the user (of the new user namespace, where there is
one: then exactly this process's), so without a namespace it is set to the user's count plus
``processes``, which other processes of the user starting or ending move; and the kernel ignores it
for root, whose code may then start threads bounded only by the CPU and memory limits (processes are
still refused by the guard). Files stay readable wherever the user can read them, and a process in a
user namespace still has the user's identity: without the guard, native code could signal or trace
the user's other processes.

A stronger executor plugs in as any object with ``run(code) -> Result`` (``Executor``): a container
per call, nsjail, gVisor, or a remote service; ``rlhf.envs.tools.python_tool(executor=...)`` takes it.
"""

from __future__ import annotations

import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Protocol

# what Result.limit names
LIMIT_KINDS = ("wall_time", "cpu_time", "memory", "output", "processes", "file_size", "blocked")
_STDERR_LINES = 8  # the end of a traceback the policy sees when its code fails
_READ_CHUNK = 65536


@dataclass(frozen=True)
class Limits:
    """Per-run limits (``ppo.sandbox``)."""

    cpu_s: float = 2.0  # CPU seconds (RLIMIT_CPU: whole seconds, rounded up)
    wall_s: float = 5.0  # wall-clock seconds, then the process group is killed
    memory_mb: int = 256  # address space (RLIMIT_AS): the interpreter maps 14 MB before the code runs
    processes: int = 0  # processes or threads the code may start besides itself (the guard refuses processes)
    output_bytes: int = 10_000  # stdout + stderr kept; the process is killed once it writes more
    file_bytes: int = 1_000_000  # the largest file it may write (RLIMIT_FSIZE)

    def __post_init__(self):
        for key in ("cpu_s", "wall_s", "memory_mb", "output_bytes", "file_bytes"):
            if not getattr(self, key) > 0:
                raise ValueError(f"Limits.{key} must be positive, got {getattr(self, key)!r}")
        if self.processes < 0:
            raise ValueError(f"Limits.processes must be >= 0, got {self.processes!r}")


@dataclass
class Result:
    """One run: its output, how it ended, and which limit stopped it (None: it ended by itself)."""

    stdout: str
    stderr: str
    exit_code: Optional[int]  # negative: killed by that signal; None: stopped by the sandbox (wall time, output)
    limit: Optional[str] = None  # None or one of LIMIT_KINDS
    seconds: float = 0.0
    limits: Optional[Limits] = None  # what it ran under (the numbers in observation's messages)

    def observation(self) -> str:
        """The text the policy sees: stdout (with the end of stderr when the code failed), or one line
        saying which limit stopped it. Short and deterministic (no paths, no timings)."""
        if self.limit is not None:
            return self._limit_message()
        out = self.stdout.rstrip()
        if self.exit_code == 0:
            return out or "(no output)"
        tail = "\n".join(self.stderr.rstrip().splitlines()[-_STDERR_LINES:])
        if not tail.strip() and self.exit_code is not None and self.exit_code < 0:
            tail = f"killed by signal {_signal_name(-self.exit_code)}"
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
            return _GENERIC_MESSAGES.get(self.limit, f"{self.limit} limit exceeded")
        if self.limit == "wall_time":
            return f"timed out after {lim.wall_s:g} s"
        if self.limit == "cpu_time":
            return f"CPU time limit ({lim.cpu_s:g} s) exceeded"
        if self.limit == "memory":
            return f"memory limit ({lim.memory_mb} MB) exceeded"
        if self.limit == "output":
            return f"output truncated at {lim.output_bytes} bytes"
        if self.limit == "file_size":
            return f"file size limit ({lim.file_bytes} bytes) exceeded"
        if self.limit == "processes" and lim.processes == 0:
            return "process limit exceeded: no new processes or threads allowed"
        if self.limit == "processes":
            return f"process limit exceeded: at most {lim.processes} new processes or threads allowed"
        return f"{self.limit} limit exceeded"


_GENERIC_MESSAGES = {
    "wall_time": "timed out",
    "cpu_time": "CPU time limit exceeded",
    "memory": "memory limit exceeded",
    "output": "output truncated",
    "file_size": "file size limit exceeded",
    "processes": "process limit exceeded",
}


class Executor(Protocol):
    """What runs the Python tool's code: ``Sandbox``, or a stronger isolation of the user's."""

    def run(self, code: str) -> Result: ...


class Sandbox:
    """Runs code in a child interpreter under ``limits`` (module docstring). Thread-safe: no shared
    state, no signal handlers; every run has its own directory, process group and pipes."""

    def __init__(self, limits: Limits = Limits()):
        self.limits = limits

    def run(self, code: str) -> Result:
        """Runs ``code`` to its end or to a limit. Never raises on what the code does; a RuntimeError
        when the sandbox itself cannot work (no temporary directory, the interpreter does not start)."""
        start = time.monotonic()
        try:
            tmp = tempfile.TemporaryDirectory(prefix="rlhf-sandbox-", ignore_cleanup_errors=True)
        except OSError as e:
            raise RuntimeError(f"sandbox: cannot create a temporary directory: {e}") from e
        with tmp as workdir:
            try:
                with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
                    f.write(code)
            except OSError as e:
                raise RuntimeError(f"sandbox: cannot write the code to {workdir}: {e}") from e
            return self._run_in(workdir, start)

    def _run_in(self, workdir: str, start: float) -> Result:
        lim = self.limits
        cpu = max(1, math.ceil(lim.cpu_s))
        ready_r, ready_w = os.pipe()  # the child writes one byte once its setup is done
        argv = [sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", _BOOTSTRAP]
        argv += [str(cpu), str(lim.memory_mb * 2**20), str(lim.file_bytes), str(lim.processes), str(ready_w)]
        try:
            proc = subprocess.Popen(
                argv,
                cwd=workdir,
                env={"TMPDIR": workdir},  # nothing of the parent's environment
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: killed as one
                close_fds=True,
                pass_fds=(ready_w,),
            )
        except (OSError, ValueError) as e:
            os.close(ready_r)
            raise RuntimeError(f"sandbox: cannot start {sys.executable or 'the interpreter'}: {e}") from e
        finally:
            os.close(ready_w)
        try:
            out, err, ready, stopped = _collect(proc, ready_r, start + lim.wall_s, lim.output_bytes)
        finally:
            os.close(ready_r)
            exit_code, cpu_used = _kill_and_reap(proc)
        if stopped is None and not ready:
            tail = " | ".join(err.decode("utf-8", "replace").strip().splitlines()[-3:])
            raise RuntimeError(f"sandbox: the child interpreter failed before the code ran (exit {exit_code}): {tail}")
        limit = stopped
        if stopped is not None:
            exit_code = None
        else:
            limit = _limit_of(exit_code, cpu_used, cpu, err)
        return Result(
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            exit_code=exit_code,
            limit=limit,
            seconds=time.monotonic() - start,
            limits=lim,
        )


def _collect(proc: subprocess.Popen, ready_fd: int, deadline: float, cap: int):
    """(stdout, stderr, ready, "wall_time" / "output" / None): the pipes read until the process has exited
    and they are closed, the deadline passes, or more than ``cap`` bytes of output came."""
    out, err, ready = bytearray(), bytearray(), bytearray()
    pidfd = _pidfd(proc.pid)  # readable once the process exits; without one, poll
    exited = group_killed = False
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, out)
            sel.register(proc.stderr, selectors.EVENT_READ, err)
            sel.register(ready_fd, selectors.EVENT_READ, ready)
            if pidfd is not None:
                sel.register(pidfd, selectors.EVENT_READ, None)
            while not exited or len(sel.get_map()) > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return out, err, bool(ready), "wall_time"
                if pidfd is None:
                    remaining = min(remaining, 0.02)
                for key, _ in sel.select(remaining):
                    if key.data is None:
                        exited = True
                        sel.unregister(key.fileobj)
                        continue
                    chunk = os.read(key.fd, _READ_CHUNK)
                    if not chunk:
                        sel.unregister(key.fileobj)
                    elif key.data is ready:
                        ready.extend(chunk[:1])
                    else:
                        room = cap - len(out) - len(err)
                        key.data.extend(chunk[: max(room, 0)])
                        if len(chunk) > room:
                            return out, err, bool(ready), "output"
                if pidfd is None and not exited:
                    exited = _has_exited(proc.pid)
                if exited and not group_killed:
                    # whatever it left behind in its group would keep the pipes open
                    _kill_group(proc.pid)
                    group_killed = True
            return out, err, bool(ready), None
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _pidfd(pid: int) -> Optional[int]:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # Python < 3.9, Linux < 5.3, or refused (seccomp)
        return None


def _has_exited(pid: int) -> bool:
    """Without reaping it: the pid (and so its process group's id) stays reserved until _kill_and_reap."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_and_reap(proc: subprocess.Popen):
    """(exit code, CPU seconds used): the process group killed (the leader is unreaped until then, so the
    group id cannot have been reused), then the leader reaped with its resource usage."""
    _kill_group(proc.pid)
    try:
        os.kill(proc.pid, signal.SIGKILL)  # not proc.kill(): its poll() would reap it, usage lost
    except OSError:
        pass
    for pipe in (proc.stdout, proc.stderr):
        pipe.close()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored by the application)
        proc.returncode = -signal.SIGKILL
        return None, 0.0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _limit_of(exit_code: Optional[int], cpu_used: float, cpu_limit: int, stderr: bytes) -> Optional[str]:
    """Which limit ended a run that the parent did not stop, from its exit and its last stderr line."""
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu_used >= cpu_limit):
        return "cpu_time"  # the soft limit's SIGXCPU, or the hard limit's SIGKILL when it was caught
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
    if "can't start new thread" in last or "[Errno 11] Resource temporarily unavailable" in last:
        return "processes"
    if "[Errno 27] File too large" in last:
        return "file_size"
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


# The child's first code (python -c), run before the user's: isolation, limits, the guard, then main.py
# compiled as "main.py" (tracebacks name no temporary path) and run as __main__. Its arguments: CPU
# seconds, address-space bytes, file bytes, extra processes, the fd of the pipe on which it says it is
# ready (a failure before that is the sandbox's, a RuntimeError in the parent). The limits are set here rather than in a
# preexec_fn: preexec_fn is not safe in a threaded parent (CPython's subprocess docs) and forces fork
# over vfork; nothing of the user's runs before them either way.
_BOOTSTRAP = r"""# rlhf-sandbox
import posix, resource, sys

CPU, MEMORY, FILE_BYTES, PROCESSES, READY = (int(a) for a in sys.argv[1:6])
ROOT = posix.getcwd()


def isolate(root):
    # New user, mount and network namespaces, and every mount but root read-only in the new mount
    # namespace. Returns whether a new user namespace was made (RLIMIT_NPROC then counts this process
    # alone).
    NEWNS, NEWUSER, NEWNET = 0x00020000, 0x10000000, 0x40000000
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
    except Exception:  # no ctypes in this build: no mounts either
        try:
            posix.unshare(NEWUSER | NEWNET)  # Python >= 3.12
            return True
        except (AttributeError, OSError):
            return False
    # root without user namespaces (where it keeps CAP_SYS_ADMIN) can still make the other two
    for flags in (NEWUSER | NEWNS | NEWNET, NEWNS | NEWNET, NEWNET, 0):
        if flags and libc.unshare(flags) == 0:
            break
    if flags & NEWNS:
        readonly_but(root, libc, ctypes)
    return bool(flags & NEWUSER)


def readonly_but(root, libc, ctypes):
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
    MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
    MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
    here = root.encode("utf-8", "surrogateescape")  # UTF-8 mode's file system encoding
    # private first: the bind below must not propagate to the parent's namespace
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return
    if libc.mount(here, here, None, MS_BIND | MS_REC, None) != 0:
        return
    posix.chdir(root)  # the cwd still points below the bind mount
    with open("/proc/self/mountinfo", "rb") as f:
        table = f.read().splitlines()
    for line in table:
        fields = line.split(b" ")
        try:
            pieces = fields[4].split(b"\\")  # octal escapes: \040 is a space
            point = pieces[0] + b"".join(bytes([int(p[:3], 8)]) + p[3:] for p in pieces[1:])
            options = fields[5].split(b",")
        except (IndexError, ValueError):
            continue
        if point == here:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY  # a locked mount keeps its other flags: repeat them
        for name, bit in ((b"nosuid", MS_NOSUID), (b"nodev", MS_NODEV), (b"noexec", MS_NOEXEC)):
            if name in options:
                flags |= bit
        if b"noatime" in options:
            flags |= MS_NOATIME
        elif b"relatime" in options:
            flags |= MS_RELATIME
        else:
            flags |= MS_STRICTATIME
        if b"nodiratime" in options:
            flags |= MS_NODIRATIME
        libc.mount(None, point, None, flags, None)  # best effort: the guard still refuses the writes


def setlimit(kind, soft, hard):
    _, current = resource.getrlimit(kind)
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(kind, (soft, hard))


def tasks_of(uid):
    # RLIMIT_NPROC counts every task (process or thread) of the real user
    n = 0
    for pid in posix.listdir("/proc"):
        if pid.isdigit():
            try:
                with open("/proc/" + pid + "/status", "rb") as f:
                    status = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
                if int(status[b"Uid"].split()[0]) == uid:
                    n += int(status[b"Threads"])
            except (OSError, KeyError, ValueError):
                pass
    return n


user_namespace = isolate(ROOT)
for name in [m for m in sys.modules if m == "_ctypes" or m == "ctypes" or m.startswith("ctypes.")]:
    del sys.modules[name]
setlimit(resource.RLIMIT_CORE, 0, 0)
setlimit(resource.RLIMIT_CPU, CPU, CPU + 1)
setlimit(resource.RLIMIT_FSIZE, FILE_BYTES, FILE_BYTES)
# in a fresh user namespace the count is this process alone; elsewhere the user's other tasks count too
if user_namespace or PROCESSES == 0:
    setlimit(resource.RLIMIT_NPROC, 1 + PROCESSES, 1 + PROCESSES)
else:
    base = tasks_of(posix.getuid())
    setlimit(resource.RLIMIT_NPROC, base + PROCESSES, base + PROCESSES)

import _posixsubprocess


def no_fork_exec(*args, **kwargs):
    raise PermissionError("sandbox: starting processes is not allowed")


_posixsubprocess.fork_exec = no_fork_exec  # the one way to a process that raises no audit event


def inside(
    path,
    _root=ROOT,
    _open_ok=frozenset(("/dev/null", "/dev/stdout", "/dev/stderr")),
    _lstat=posix.lstat,
    _readlink=posix.readlink,
    _getcwd=posix.getcwd,
    _fspath=posix.fspath,
    _item=tuple.__getitem__,
    _isinstance=isinstance,
    _bytes=bytes,
    _str=str,
    _list=list,
    _reversed=reversed,
    _OSError=OSError,
):
    # Whether path, symlinks resolved, lies in the root. Written with the primitives bound as defaults
    # (a tuple: not writable from the user's code) so that patching os.path, os.stat_result or builtins
    # cannot change its answer.
    path = _fspath(path)
    if _isinstance(path, _bytes):
        path = _bytes.decode(path, "utf-8", "surrogateescape")
    path = _str.__add__("", path)  # an exact str: no overridden methods of a subclass
    if path in _open_ok:
        return True
    if not path.startswith("/"):
        path = _getcwd() + "/" + path
    todo = _list(_reversed(path.split("/")))
    done = []
    hops = 0
    while todo:
        name = todo.pop()
        if name == "" or name == ".":
            continue
        if name == "..":
            if done:
                done.pop()
            continue
        here = "/" + "/".join(done + [name])
        try:
            mode = _item(_lstat(here), 0)
        except _OSError:
            done.append(name)
            continue
        if mode & 0o170000 == 0o120000:
            hops += 1
            if hops > 40:
                return False
            target = _readlink(here)
            if target.startswith("/"):
                done = []
            todo.extend(_reversed(target.split("/")))
            continue
        done.append(name)
    resolved = "/" + "/".join(done)
    return resolved == _root or resolved.startswith(_root + "/")


def guard(
    event,
    args,
    _inside=inside,
    _write=0o1 | 0o2 | 0o100 | 0o1000 | 0o2000,  # O_WRONLY O_RDWR O_CREAT O_TRUNC O_APPEND
    _paths=(
        # event, positions of its paths, positions of its dir_fd arguments
        ("os.mkdir", (0,), (2,)),
        ("os.rmdir", (0,), (1,)),
        ("os.remove", (0,), (1,)),
        ("os.rename", (0, 1), (2, 3)),
        ("os.link", (0, 1), (2, 3)),  # a hard link inside to a file outside would write through
        ("os.symlink", (1,), (2,)),
        ("os.chmod", (0,), (2,)),
        ("os.chown", (0,), (3,)),
        ("os.utime", (0,), (3,)),
        ("os.truncate", (0,), ()),
        ("os.setxattr", (0,), ()),
        ("os.removexattr", (0,), ()),
        ("os.chflags", (0,), ()),
        ("os.lchflags", (0,), ()),
        ("shutil.rmtree", (0,), ()),
    ),
    _path_events=frozenset(
        ("os.mkdir", "os.rmdir", "os.remove", "os.rename", "os.link", "os.symlink", "os.chmod", "os.chown",
         "os.utime", "os.truncate", "os.setxattr", "os.removexattr", "os.chflags", "os.lchflags", "shutil.rmtree")
    ),
    _process_events=frozenset(
        ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
         "pty.spawn", "os.startfile")
    ),
    _no_dir_fd=(None, -1, -100),
    _modules=(
        ("ctypes", "native code (ctypes)"),
        ("_ctypes", "native code (ctypes)"),
        ("_posixsubprocess", "starting processes"),
        ("_xxsubinterpreters", "a subinterpreter"),
        ("_xxinterpchannels", "a subinterpreter"),
        ("_interpreters", "a subinterpreter"),  # Python >= 3.13's names
        ("_interpchannels", "a subinterpreter"),
        ("_interpqueues", "a subinterpreter"),
    ),
    _code_attributes=frozenset(("__code__", "__defaults__", "__kwdefaults__")),
    _protected=(),  # (guard, inside), set below
    _getpid=posix.getpid,
    _getpgrp=posix.getpgrp,
    _isinstance=isinstance,
    _len=len,
    _int=int,
    _str=str,
    _PermissionError=PermissionError,
):
    what = None
    if event == "open":
        path, mode, flags = (args + (None, None, None))[:3]
        if _isinstance(flags, _int):
            writes = flags & _write
        else:
            writes = mode is None or not _isinstance(mode, _str) or mode.strip("rbt") != ""
        if writes and not _isinstance(path, _int) and not _inside(path):
            what = "writing outside the working directory"
    elif event in _path_events:
        for name, paths, dir_fds in _paths:
            if name != event:
                continue
            for i in dir_fds:
                if i < _len(args) and args[i] not in _no_dir_fd:
                    what = "a dir_fd argument"
            for i in paths:
                if i >= _len(args) or (event == "os.truncate" and _isinstance(args[i], _int)):
                    continue  # truncating a file opened for writing: the open was checked
                if _isinstance(args[i], _int) or not _inside(args[i]):
                    what = "changing files outside the working directory"
    elif event in _process_events:
        what = "starting processes"
    elif event.startswith("socket."):
        what = "network access"
    elif event.startswith("ctypes."):
        what = "native code (ctypes)"
    elif event == "import":
        for name, why in _modules:
            if args[0] == name:
                what = why
    elif event == "cpython.PyInterpreterState_New":
        what = "a subinterpreter"
    elif event == "os.kill":
        if args[0] != _getpid() and args[0] != 0:
            what = "signalling other processes"
    elif event == "os.killpg":
        if args[0] != _getpgrp():
            what = "signalling other processes"
    elif event == "resource.setrlimit" or (event == "resource.prlimit" and args[2] is not None):
        what = "changing resource limits"
    elif event == "object.__setattr__" and args[1] in _code_attributes:
        for f in _protected:
            if args[0] is f:
                what = "changing the sandbox's guard"
    if what is not None:
        raise _PermissionError("sandbox: " + what + " is not allowed")


defaults = list(guard.__defaults__)
defaults[guard.__code__.co_varnames.index("_protected") - 2] = (guard, inside)
guard.__defaults__ = tuple(defaults)
setlimit(resource.RLIMIT_AS, MEMORY, MEMORY)  # last: the setup above runs under none of it
sys.addaudithook(guard)

main = type(sys)("__main__")
main.__file__ = "main.py"
sys.modules["__main__"] = main
sys.argv[:] = ["main.py"]
posix.write(READY, b"1")  # the parent's sign that the setup above worked
posix.close(READY)
try:
    with open("main.py", "rb") as f:
        source = f.read()
    exec(compile(source, "main.py", "exec", dont_inherit=True), main.__dict__)
except SystemExit:
    raise
except BaseException as e:
    e.__traceback__ = e.__traceback__.tb_next  # the user's frames only
    sys.__excepthook__(type(e), e, e.__traceback__)
    raise SystemExit(1)
"""
