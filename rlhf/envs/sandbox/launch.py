"""The sandbox's launcher: a server, one per trainer process, that forks a launcher per call.

Run as ``python -I -S -B -c <this file's text> serve SOCKET PARENT PYTHON BASE GUARD [BIND ...]`` by
run.py's ``Server``: standard library only, it must not import ``rlhf``. The server starts once (an
interpreter and ctypes: two thirds of a call's start before it existed); each call is a fork of it.

Modes (modes.py says what each protects):

- ``root`` (the trainer runs as root with CAP_SYS_ADMIN): new PID, mount, network, IPC and UTS
  namespaces; the code runs under a uid and gid of its own (ID_BASE + the launcher's pid, unique
  while the call lives), chrooted into a fresh view.
- ``user`` (any user, where the kernel allows user namespaces): the same inside a new user
  namespace;
  a root trainer first drops to the call's own uid, any other keeps its own.
- ``guard``: no namespaces; limits and the audit guard only.

The processes of a call: the launcher (L, a fork of the server in a session of its own, in the
call's host directory) reads main.py. In a namespace mode it enters the namespaces and forks their
init (C1, pid 1), which builds the view, forks the code's process (C2) and waits for it; in the
``guard`` mode L forks C2 itself. C2 sets the limits, enters the view, drops its identity and
``exec``s a fresh interpreter running guard.py (nothing of this setup, ctypes above all, survives
the exec). When C2 ends, its waiter reports its wait status and CPU time on the control pipe; C1's
exit kills whatever else runs in the namespace (in the ``guard`` mode L kills C2's process group).
Each process dies with the one above it (PR_SET_PDEATHSIG): the trainer kills L at the wall limit,
and all of the call goes.

Control pipe: ``E<reason>\n`` (the setup failed: the sandbox's error, not the code's), ``R``
(guard.py is about to run the code), ``X<wait status> <CPU seconds>\n`` (C2 ended).
"""

import os
import posix
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
ST_NOEXEC, ST_NOATIME, ST_NODIRATIME, ST_RELATIME = 8, 1024, 2048, 4096  # statvfs's f_flag bits
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = (
    1,
    4,
    22,
    36,
    38,
)
SIGKILL = 9
# a call's own uid and gid: ID_BASE + the launcher's pid (pid_max is at most 2^22), above the ranges
# systemd gives containers (524288-1879048191)
ID_BASE = 0x70000000
DEVICES = ("null", "zero", "urandom")
# /proc files the code sees as /dev/null: the keyrings' names
MASKED = ("keys", "key-users")
KEYCTL_JOIN_SESSION_KEYRING = 1
# System calls the code's process may not make (EPERM): one row each, a column per architecture.
# Kernel keyrings (the trainer's secrets), memory and io_uring paths around the mounts and the
# filter (memfd_create, userfaultfd, io_uring_*), namespaces and mounts, tracing other processes,
# BPF and perf, modules, kexec, reboot, swap, accounting, quotas, file handles; and, on x86-64, the
# x32 ABI. The kernel refuses most of these to a process without capabilities anyway: the filter is
# the second layer.
DENIED = """
name                x86_64 aarch64
keyctl               250  219
add_key              248  217
request_key          249  218
memfd_create         319  279
userfaultfd          323  282
io_uring_setup       425  425
io_uring_enter       426  426
io_uring_register    427  427
unshare              272   97
setns                308  268
mount                165   40
umount2              166   39
pivot_root           155   41
chroot               161   51
open_tree            428  428
move_mount           429  429
fsopen               430  430
fsconfig             431  431
fsmount              432  432
fspick               433  433
mount_setattr        442  442
ptrace               101  117
process_vm_readv     310  270
process_vm_writev    311  271
bpf                  321  280
perf_event_open      298  241
kexec_load           246  104
init_module          175  105
finit_module         313  273
delete_module        176  106
reboot               169  142
swapon               167  224
swapoff              168  225
acct                 163   89
quotactl             179   60
open_by_handle_at    304  265
name_to_handle_at    303  264
"""
ARCHES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # AUDIT_ARCH_* of each table column
# machine -> (AUDIT_ARCH, {name: number})
SYSCALLS = {
    machine: (
        arch,
        {row.split()[0]: int(row.split()[1 + column]) for row in DENIED.strip().splitlines()[1:]},
    )
    for column, (machine, arch) in enumerate(ARCHES.items())
}


class Kernel:
    """The system calls Python's os module lacks (unshare before 3.12, mount, prctl,
    sethostname)."""

    def __init__(self):
        import ctypes

        self.ctypes = ctypes
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
        self.libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4

    def _check(self, result, what):
        if result != 0:
            errno = self.ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def unshare(self, flags):
        self._check(self.libc.unshare(flags), "unshare")

    def mount(self, source, target, fstype, flags, data=None):
        enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
        self._check(
            self.libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
            f"mount {target}",
        )

    def prctl(self, option, value):
        self._check(self.libc.prctl(option, value, 0, 0, 0), f"prctl {option}")

    def sethostname(self, name):
        self._check(self.libc.sethostname(name, len(name)), "sethostname")

    def new_session_keyring(self, machine):
        """A fresh, empty session keyring for this process (none of the trainer's keys are
        possessed); best effort: where keyctl is refused, the code cannot reach a keyring either."""
        if machine in SYSCALLS:
            self.libc.syscall(SYSCALLS[machine][1]["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None)

    def deny_syscalls(self, machine):
        """The seccomp filter of SYSCALLS (no_new_privs must be set). Returns False on an
        architecture without a table (the namespaces and the guard still hold)."""
        if machine not in SYSCALLS:
            return False
        import struct

        ctypes = self.ctypes
        arch, numbers = SYSCALLS[machine]
        # SECCOMP_RET_ERRNO | EPERM, SECCOMP_RET_ALLOW
        deny, allow = 0x00050000 | 1, 0x7FFF0000
        # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
        ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
        # another ABI: nothing
        code = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny), (ld, 0, 0, 0)]
        if machine == "x86_64":
            code += [(jge, 0, 1, 0x40000000), (ret, 0, 0, deny)]  # the x32 ABI
        for number in numbers.values():
            code += [(jeq, 0, 1, number), (ret, 0, 0, deny)]
        code.append((ret, 0, 0, allow))
        program = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in code))

        class Program(ctypes.Structure):
            _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))

        fprog = Program(len(code), ctypes.addressof(program))
        # FILTER
        self._check(self.libc.prctl(PR_SET_SECCOMP, 2, ctypes.addressof(fprog), 0, 0), "seccomp")
        return True


def fail(ctl, reason):
    """The setup failed: one line on the control pipe, and out (no user code has run)."""
    try:
        os.write(ctl, b"E" + reason.replace("\n", " ").encode("utf-8", "replace")[:1000] + b"\n")
    finally:
        os._exit(1)


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


def tasks_of(uid):
    """The tasks (processes and threads) of ``uid`` in /proc: what RLIMIT_NPROC counts without a
    user namespace of the call's own."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open("/proc/" + pid + "/status", "rb") as f:
                    status = dict(
                        line.split(b":", 1) for line in f.read().splitlines() if b":" in line
                    )
                if int(status[b"Uid"].split()[0]) == uid:
                    n += int(status[b"Threads"])
            except (OSError, KeyError, ValueError):
                pass
    return n


def set_limits(cfg, tasks):
    """The call's limits; ``tasks``: how many tasks of its uid RLIMIT_NPROC already counts. The
    address space last (the setup before it runs under none of it)."""

    def limit(kind, value):
        _, hard = resource.getrlimit(kind)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(kind, (value, value))

    limit(resource.RLIMIT_CORE, 0)
    for kind in ("RLIMIT_MEMLOCK", "RLIMIT_MSGQUEUE", "RLIMIT_RTPRIO", "RLIMIT_NICE"):
        # none of these
        if hasattr(resource, kind):
            limit(getattr(resource, kind), 0)
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu"], cfg["cpu"] + 1))
    limit(resource.RLIMIT_FSIZE, cfg["file_bytes"])
    limit(resource.RLIMIT_NOFILE, cfg["open_files"])
    limit(resource.RLIMIT_NPROC, tasks + cfg["processes"])
    limit(resource.RLIMIT_AS, cfg["memory"])


def exec_code(cfg, root, ready):
    """Replaces this process with a fresh interpreter running guard.py, then main.py in ``root``."""
    python = cfg["python"]
    argv = [python, "-I", "-S", "-B", "-X", "utf8", "-c", cfg["guard"], root, str(ready)]
    os.set_inheritable(ready, True)
    os.execve(python, argv, {"TMPDIR": root})


def identity(mode):
    """(uid, gid) the code runs under: the call's own where the launcher is root, else the
    user's."""
    if posix.getuid() == 0:
        return ID_BASE + posix.getpid(), ID_BASE + posix.getpid()
    return posix.getuid(), posix.getgid()


def enter_namespaces(kernel, mode, uid, gid):
    flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if mode == "user":
        if posix.getuid() == 0:
            # first become the call's own user: the namespace then maps only it
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            # a changed uid made /proc/self root's: the maps below
            kernel.prctl(PR_SET_DUMPABLE, 1)
        kernel.unshare(flags | CLONE_NEWUSER)
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"{uid} {uid} 1")
        write_file("/proc/self/gid_map", f"{gid} {gid} 1")
    else:
        kernel.unshare(flags)
    kernel.mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host


def mount_points(prefix):
    """The mount points at or below ``prefix`` in this mount namespace, from
    /proc/self/mountinfo."""
    with open("/proc/self/mountinfo", "rb") as f:
        table = f.read().splitlines()
    points = []
    for line in table:
        pieces = line.split(b" ")[4].split(b"\\")  # octal escapes: \040 is a space
        point = os.fsdecode(
            pieces[0] + b"".join(bytes([int(p[:3], 8)]) + p[3:] for p in pieces[1:])
        )
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return points


def make_read_only(kernel, point):
    """Remounts a bind read-only, nosuid, nodev, repeating the flags a user namespace may not
    clear."""
    have = os.statvfs(point).f_flag
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    if have & ST_NOEXEC:
        flags |= MS_NOEXEC
    if have & ST_NOATIME:
        flags |= MS_NOATIME
    elif have & ST_RELATIME:
        flags |= MS_RELATIME
    else:
        flags |= MS_STRICTATIME
    if have & ST_NODIRATIME:
        flags |= MS_NODIRATIME
    kernel.mount(None, point, None, flags)


def build_view(kernel, cfg, source, uid, gid):
    """The code's file system, on a tmpfs at cfg["base"]: the paths of cfg["binds"] read-only
    (symlinks as symlinks), /dev/null, /dev/zero, /dev/urandom, a /proc of the new PID namespace,
    and cfg["work"], a tmpfs of cfg["disk_bytes"] bytes and cfg["files"] inodes owned by the code,
    holding main.py. Returns the view's root."""
    base = cfg["base"]
    kernel.mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,nr_inodes=4096,mode=0755")
    for src in cfg["binds"]:
        dst = base + src
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
            continue
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        else:
            open(dst, "wb").close()
        kernel.mount(src, dst, None, MS_BIND | MS_REC)
    for point in mount_points(base):
        if point != base:
            make_read_only(kernel, point)
    os.makedirs(base + "/dev")
    for name in DEVICES:
        open(base + "/dev/" + name, "wb").close()
        kernel.mount("/dev/" + name, base + "/dev/" + name, None, MS_BIND)
    work = base + cfg["work"]
    os.makedirs(work)
    options = f"size={cfg['disk_bytes']},nr_inodes={cfg['files']},mode=0700,uid={uid},gid={gid}"
    kernel.mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, options)
    with open(work + "/main.py", "wb") as f:
        f.write(source)
    os.chown(work + "/main.py", uid, gid)
    os.mkdir(base + "/proc")
    for options in ("hidepid=2", None):
        # hidepid: init (not traceable by the code) is not listed
        try:
            # this process is the new PID namespace's first: the /proc mounted here shows it alone
            kernel.mount("proc", base + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, options)
            break
        except OSError:
            # a kernel that refuses both: no /proc at all
            pass
    for name in MASKED:
        if os.path.exists(base + "/proc/" + name):
            try:
                kernel.mount("/dev/null", base + "/proc/" + name, None, MS_BIND)
            except OSError:
                # the filter still refuses keyctl: names at most, never a payload
                pass
    kernel.mount(None, base, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return base


def start_code(kernel, cfg, base, uid, gid):
    """C2: limits, the view, the identity, then the fresh interpreter. Never returns."""
    ctl = cfg["ctl"]
    try:
        if cfg["mode"] == "root":
            # a uid of its own: this process is its only task
            tasks = 1
        else:
            # the user namespace's launcher, init and this process
            tasks = 3
        set_limits(cfg, tasks)
        os.chroot(base)
        os.chdir(cfg["work"])
        if cfg["mode"] == "root":
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        confine(kernel)
        exec_code(cfg, cfg["work"], ctl)
    except BaseException as e:
        fail(ctl, f"starting the code: {type(e).__name__}: {e}")


def confine(kernel):
    """The last of the setup before the exec: a fresh session keyring, no new privileges, the
    seccomp filter."""
    machine = os.uname().machine
    kernel.new_session_keyring(machine)
    kernel.prctl(PR_SET_NO_NEW_PRIVS, 1)
    kernel.deny_syscalls(machine)


def wait_for(child, ctl, group=False):
    """Waits for the code's process (reaping any other child that ends first: as a namespace's init,
    every orphan ends up here), kills what is left in its process group (``group``: it has its own),
    then says how it ended on the control pipe."""
    if group:
        # ended, not reaped: its group id is still its
        os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)
        try:
            os.killpg(child, SIGKILL)
        except OSError:
            pass
    while True:
        pid, status, usage = os.wait4(-1, 0)
        if pid == child:
            break
    os.write(ctl, b"X%d %.6f\n" % (status, usage.ru_utime + usage.ru_stime))


def fork_code(ctl, start):
    """Forks the code's process, which runs ``start()`` (and never returns); returns its pid."""
    try:
        child = os.fork()
    except OSError as e:
        fail(ctl, f"starting the code: {e}")
    if child == 0:
        start()
    return child


def init(kernel, cfg, source, uid, gid, lifeline):
    """C1, pid 1 of the new PID namespace. Never returns."""
    ctl = cfg["ctl"]
    try:
        kernel.prctl(PR_SET_PDEATHSIG, SIGKILL)
        # Python's KeyboardInterrupt handler off: as the namespace's init, signals from inside it
        # that have no handler are dropped by the kernel (the code may share its uid)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        # out of the launcher's process group: the code may share the launcher's uid
        os.setsid()
        os.set_blocking(lifeline, False)
        try:
            if os.read(lifeline, 1) == b"":
                # the launcher died before the line above: nobody waits for this call
                os._exit(1)
        except BlockingIOError:
            pass
        kernel.prctl(PR_SET_DUMPABLE, 0)  # no ptrace, no /proc/1/* for the code
        kernel.sethostname(b"sandbox")
        base = build_view(kernel, cfg, source, uid, gid)
    except BaseException as e:
        fail(ctl, f"building the view: {type(e).__name__}: {e}")
    wait_for(fork_code(ctl, lambda: start_code(kernel, cfg, base, uid, gid)), ctl)
    # the kernel kills the rest of the namespace
    os._exit(0)


def start_guarded(kernel, cfg):
    """The code's process in the ``guard`` mode: the limits, then the fresh interpreter. Never
    returns."""
    try:
        # kept across the exec: it dies with the launcher
        kernel.prctl(PR_SET_PDEATHSIG, SIGKILL)
        # a group of its own, which the launcher kills once it ended
        os.setpgid(0, 0)
        set_limits(cfg, tasks_of(posix.getuid()))
        confine(kernel)
        exec_code(cfg, posix.getcwd(), cfg["ctl"])
    except BaseException as e:
        fail(cfg["ctl"], f"starting the code: {type(e).__name__}: {e}")


def call(kernel, cfg):
    """One call, in the launcher process L (a fork of the server, in the call's directory). Never
    returns."""
    ctl = cfg["ctl"]
    try:
        with open("main.py", "rb") as f:
            source = f.read()
        if cfg["mode"] == "guard":
            wait_for(fork_code(ctl, lambda: start_guarded(kernel, cfg)), ctl, group=True)
            os._exit(0)
        uid, gid = identity(cfg["mode"])
        enter_namespaces(kernel, cfg["mode"], uid, gid)
    except BaseException as e:
        fail(ctl, f"{type(e).__name__}: {e}")
    # C1 reads EOF on it once this process is gone
    lifeline, keep = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(keep)
        init(kernel, cfg, source, uid, gid, lifeline)
    os.close(lifeline)
    os.waitpid(child, 0)
    os._exit(0)


def serve(sock_fd, constants):
    """The launcher server: one per trainer process (run.py's ``Server``), forking a launcher per
    call.

    A request on the socket (SOCK_SEQPACKET, one message each) is the call's arguments
    (NUL-separated: the mode, then NUMBERS) with the fd of the call's directory; the reply is
    ``P<pid>`` with the read ends of the call's stdout, stderr and control pipes (their write ends
    never reach the trainer, so a fork of it cannot hold a call open) and a pidfd of the launcher,
    by which the trainer kills the call (each process of a call dies with the one above it). The
    server exits when the trainer does (a pidfd of it, and EOF on the socket), and every launcher it
    forked dies with it. A child subreaper: whatever a killed call leaves is reaped here."""
    import selectors
    import socket

    kernel = Kernel()
    kernel.prctl(PR_SET_CHILD_SUBREAPER, 1)
    server = os.getpid()

    def reap(*_):
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass

    signal.signal(signal.SIGCHLD, reap)
    sock = socket.socket(fileno=sock_fd)
    watch = selectors.DefaultSelector()
    watch.register(sock, selectors.EVENT_READ)
    try:
        # readable: it exited
        watch.register(os.pidfd_open(constants["parent"]), selectors.EVENT_READ)
    except (AttributeError, OSError):  # Linux < 5.3: EOF alone
        pass
    while True:
        if any(key.fileobj is not sock for key, _ in watch.select()):
            os._exit(0)  # the trainer is gone
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
        except OSError:
            message = b""
        if not message or len(fds) != 1:
            os._exit(0)
        args = message.decode("utf-8", "surrogateescape").split("\0")
        (out_r, out_w), (err_r, err_w), (ctl_r, ctl) = os.pipe(), os.pipe(), os.pipe()
        here = fds[0]
        cfg = {"mode": args[0], **dict(zip(NUMBERS, map(int, args[1:]))), **constants, "ctl": ctl}
        # not reaped before its pidfd exists
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        pid = os.fork()
        if pid == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
                sock.close()
                kernel.prctl(PR_SET_PDEATHSIG, SIGKILL)
                if posix.getppid() != server:
                    os._exit(1)  # the server died before the line above
                os.setsid()
                null = os.open("/dev/null", os.O_RDONLY)
                for fd, to in ((null, 0), (out_w, 1), (err_w, 2)):
                    os.dup2(fd, to)
                os.fchdir(here)
                for fd in (null, out_w, err_w, here, out_r, err_r, ctl_r):
                    os.close(fd)
            except BaseException as e:
                fail(ctl, f"{type(e).__name__}: {e}")
            call(kernel, cfg)
        try:
            # before it can be reaped: it is this very process
            handle = [os.pidfd_open(pid)]
        except (AttributeError, OSError):  # Linux < 5.3: the trainer kills by pid
            handle = []
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        for fd in (out_w, err_w, ctl, here):
            os.close(fd)
        reads = [out_r, err_r, ctl_r]
        socket.send_fds(sock, [b"P%d" % pid], reads + handle)
        for fd in reads + handle:
            os.close(fd)


NUMBERS = ("cpu", "memory", "file_bytes", "processes", "disk_bytes", "files", "open_files")


def main():
    """``serve SOCKET_FD PARENT PYTHON BASE WORK GUARD_TEXT [BIND ...]`` (run.py's ``Server``)."""
    sock_fd, parent = int(sys.argv[2]), int(sys.argv[3])
    python, base, work, guard = sys.argv[4:8]
    if posix.getppid() != parent:
        os._exit(1)
    constants = {"parent": parent, "python": python, "base": base, "work": work, "guard": guard}
    serve(sock_fd, {**constants, "binds": sys.argv[8:]})


if __name__ == "__main__":
    main()
