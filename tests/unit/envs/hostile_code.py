"""Hostile code against the sandbox, each case checked from outside by the process that runs it (the
"trainer"): its pid alive, its priority and CPU affinity unchanged, no file created or changed
outside (the /tmp, /dev/shm, home and project listings, a victim file, a FIFO and a pty it holds
open, an abstract socket it listens on), no process of the call left running, the disk not filled,
its secrets (an environment variable, its argv, a file in its home) nowhere in the output, and the
limit named.

Run by tests/unit/envs/test_sandbox_hostile.py as a separate process, so that a case that kills its
trainer shows as a failure instead of ending the test session:

    python tests/unit/envs/hostile_code.py [--mode MODE] [--no-guard] [--only NAME ...] SECRET

prints one JSON line per case: {"case", "problems", "limit", "observation"}, then {"done": n}. With
``--no-guard`` the audit hook is not installed: what is left is the kernel's isolation alone.
Standard library only (it also runs under a system interpreter as another user).
"""

import argparse
import json
import os
import socket
import stat
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

# tests/unit/envs/hostile_code.py: the repository four levels up
ROOT = os.path.abspath(__file__)
for _ in range(4):
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)

from rlhf.envs.sandbox import Limits, Sandbox, isolation  # noqa: E402
from rlhf.envs.sandbox import run as sandbox_run  # noqa: E402
from rlhf.envs.sandbox.launch import ID_BASE  # noqa: E402

# the case's limit is not checked (only what is seen from outside)
ANY = "any"


@dataclass
class Case:
    name: str
    code: str
    # the limit expected with the guard (None: the code ends by itself)
    guarded: Optional[str] = None
    kernel: Optional[str] = ANY  # the limit expected without it
    limits: dict = field(default_factory=dict)
    # a text the observation must hold (with the guard)
    shows: str = ""
    # a text no output may hold, with the guard or without it
    never: str = ""


KILL_CHILD = (
    "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\nprint('forked')"
)
DAEMON = (
    "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        "
    "time.sleep(30)\n"
    "    os._exit(0)\nprint('daemon')"
)
SIGIO = (
    "import os, fcntl\nr, w = os.pipe()\nfcntl.fcntl(r, fcntl.F_SETOWN, {target})\n"
    "fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | "
    "os.O_ASYNC)\nos.write(w, b'x')\nprint('sent')"
)
SCAN_PROC = (
    "import os\nfor p in [p for p in os.listdir('/proc') if p.isdigit()]:\n    for f in "
    "('cmdline', 'environ'):\n"
    "        try:\n            print(p, f, open('/proc/' + p + '/' + f, 'rb').read()[:300])\n"
    "        except OSError as e:\n            print(p, f, type(e).__name__)"
)
CTYPES = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
# native code from memory: a memfd is on no noexec mount
MEMFD_EXTENSION = (
    "import glob, os, sysconfig, importlib.util as u, importlib.machinery as m\n"
    "src = glob.glob(sysconfig.get_path('platstdlib') + '/lib-dynload/_json*.so')[0]\n"
    "fd = os.memfd_create('x')\nos.write(fd, open(src, 'rb').read())\np = '/proc/self/fd/%d' % fd\n"
    "u.module_from_spec(u.spec_from_file_location('_json', p, "
    "loader=m.ExtensionFileLoader('_json', p)))\n"
    "print('loaded')"
)
# native code (_ctypes loaded without an import) reads every key of its session keyring
KEYRING_READ = (
    "import _imp, glob, os, sysconfig, importlib.machinery as m\n"
    "p = glob.glob(sysconfig.get_path('platstdlib') + '/lib-dynload/_ctypes*.so')[0]\n"
    "c = _imp.create_dynamic(m.ModuleSpec('_ctypes', None, origin=p))\n"
    "sc = c.dlsym(c.dlopen(None), 'syscall')\n"
    "nr = {'x86_64': 250, 'aarch64': 219}[os.uname().machine]\n"
    "ring = c.call_function(sc, (nr, 0, -3, 0))  # KEYCTL_GET_KEYRING_ID of the session keyring\n"
    "ids = bytes(4096)\nn = c.call_function(sc, (nr, 11, ring, ids, 4096))  # KEYCTL_READ: "
    "its keys\n"
    "print('keyring', ring, n)\n"
    "for i in range(0, max(n, 0), 4):\n"
    "    buf = bytes(4096)\n"
    "    k = int.from_bytes(ids[i:i + 4], 'little')\n"
    "    got = c.call_function(sc, (nr, 11, k, buf, 4096))\n"
    "    print(k, buf[:max(got, 0)])"
)


# a write through a directory fd: the path the audit event carries is relative
DIR_FD = (
    "import os\nd = os.open('/tmp', os.O_RDONLY)\nfd = os.open({name!r}, {flags}, "
    "dir_fd=d)\nos.write(fd, b'pwned')"
)
ALL_PTYS = (
    "import os\nfor n in os.listdir('/dev/pts'):\n    os.write(os.open('/dev/pts/' + n, "
    "os.O_WRONLY), b'pwned')"
)
SET_CLOCK = (
    "import time\ntime.clock_settime(time.CLOCK_REALTIME, "
    "time.clock_gettime(time.CLOCK_REALTIME))\nprint('set')"
)
THREAD_BOMB = (
    "import threading, time\nfor _ in range(600):\n"
    "    threading.Thread(target=time.sleep, args=(5,), daemon=True).start()"
)
THREE_THREADS = (
    "import threading\nts = [threading.Thread(target=lambda: None) for _ in range(3)]\n"
    "for t in ts:\n    t.start()\nfor t in ts:\n    t.join()\nprint('ok')"
)
# an extension module written to the directory, then loaded: its tmpfs is noexec
OWN_EXTENSION = (
    "import glob, importlib.util, shutil, sysconfig\n"
    "src = glob.glob(sysconfig.get_path('platstdlib') + '/lib-dynload/_json*.so')[0]\n"
    "shutil.copy(src, './_json.so')\n"
    "spec = importlib.util.spec_from_file_location('_json', './_json.so')\n"
    "importlib.util.module_from_spec(spec)\nprint('loaded')"
)


def cases(env):
    """The matrix; ``env`` holds the trainer's paths (victim, fifo, pty, secret file, socket,
    project)."""
    return [
        # the trainer: signals, priority, affinity, limits, tracing
        Case(
            "pidfd_kill_parent",
            "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), "
            "9)\nprint('sent')",
        ),
        Case("kill_parent", "import os\nos.kill(os.getppid(), 9)", "blocked"),
        Case("kill_everything", "import os\nos.kill(-1, 9)\nprint('sent')", "blocked"),
        # 0 inside: its own group
        Case("killpg_parent", "import os\nos.killpg(os.getpgid(os.getppid()), 9)", ANY),
        Case("kill_trainer_pid", f"import os\nos.kill({env['trainer']}, 9)", "blocked"),
        Case("sigio_parent", SIGIO.format(target="os.getppid()")),
        Case("sigio_parent_group", SIGIO.format(target="-os.getpgid(os.getppid())")),
        Case("sigio_trainer_pid", SIGIO.format(target=env["trainer"])),
        Case(
            "renice_parent",
            "import os\nos.setpriority(os.PRIO_PROCESS, os.getppid(), 19)\nprint('done')",
        ),
        Case(
            "renice_trainer",
            f"import os\nos.setpriority(os.PRIO_PROCESS, {env['trainer']}, 19)\nprint('done')",
        ),
        Case(
            "renice_user", "import os\nos.setpriority(os.PRIO_USER, os.getuid(), 19)\nprint('done')"
        ),
        Case(
            "renice_parent_group",
            "import os\nos.setpriority(os.PRIO_PGRP, os.getpgid(os.getppid()), 19)",
        ),
        Case(
            "affinity_parent", "import os\nos.sched_setaffinity(os.getppid(), {0})\nprint('done')"
        ),
        Case(
            "affinity_trainer",
            f"import os\nos.sched_setaffinity({env['trainer']}, {{0}})\nprint('done')",
        ),
        Case(
            "prlimit_parent",
            "import os, resource\nresource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (3, 3))",
            "blocked",
        ),
        Case(
            "ptrace_parent",
            CTYPES + "import os\nprint(libc.ptrace(16, os.getppid(), 0, 0), ctypes.get_errno())",
            "blocked",
        ),
        # what it may read
        Case("proc_scan", SCAN_PROC),
        Case("proc_parent_root", "import os\nprint(os.listdir('/proc/%d/root' % os.getppid()))"),
        Case("trainer_environ", f"print(open('/proc/{env['trainer']}/environ', 'rb').read())"),
        Case("read_secret_in_home", f"print(open({env['secret']!r}).read())"),
        Case("list_home", f"import os\nprint(os.listdir({env['home']!r}))"),
        Case(
            "read_project",
            f"print(open({os.path.join(env['project'], 'README.md')!r}).read()[:200])",
        ),
        Case("read_shadow", "print(open('/etc/shadow').read())"),
        Case("list_dev", "import os\nprint(sorted(os.listdir('/dev')))"),
        Case("environment", "import os\nprint(dict(os.environ))", shows="{"),
        # what it may write
        Case("write_tmp", f"open({env['victim'] + '.new'!r}, 'w').write('x')", "blocked"),
        Case("overwrite_victim", f"open({env['victim']!r}, 'w').write('pwned')", "blocked"),
        Case(
            "dir_fd_fifo",
            DIR_FD.format(name=os.path.basename(env["fifo"]), flags="os.O_WRONLY | os.O_NONBLOCK"),
        ),
        Case(
            "dir_fd_victim",
            DIR_FD.format(name=os.path.basename(env["victim"]), flags="os.O_WRONLY | os.O_TRUNC"),
        ),
        Case(
            "write_pty",
            f"import os\nfd = os.open({env['pty']!r}, os.O_WRONLY)\nos.write(fd, b'pwned')",
            "blocked",
        ),
        Case(
            "write_all_ptys",
            ALL_PTYS,
        ),
        Case("write_dev_shm", "open('/dev/shm/pwned', 'w').write('x')", "blocked"),
        Case(
            "write_home", f"open({os.path.join(env['home'], 'pwned')!r}, 'w').write('x')", "blocked"
        ),
        Case(
            "symlink_out",
            f"import os\nos.symlink({env['victim']!r}, 'link')\nopen('link', 'w').write('pwned')",
            "blocked",
        ),
        Case(
            "hardlink_out",
            f"import os\nos.link({env['victim']!r}, 'l')\nopen('l', 'w').write('pwned')",
            "blocked",
        ),
        Case("write_interpreter", "import sys\nopen(sys.executable, 'ab').write(b'x')", "blocked"),
        Case("chmod_interpreter", "import os, sys\nos.chmod(sys.executable, 0o777)", "blocked"),
        Case("mkdir_in_root", "import os\nos.mkdir('/pwned')", "blocked"),
        Case(
            "chroot_escape",
            "import os\nos.mkdir('x')\nos.chroot('x')\nos.chdir('../../..')\nos.chroot('.')\n"
            "print(os.listdir('/'))",
        ),
        Case("setuid_root", "import os\nos.setuid(0)\nprint(os.getuid())"),
        Case(
            "set_clock",
            SET_CLOCK,
        ),
        Case(
            "unshare_user_ns",
            CTYPES + "print(libc.unshare(0x10000000), ctypes.get_errno())",
            "blocked",
        ),
        # processes and threads
        Case("fork_and_outlive", KILL_CHILD, "blocked", limits={"processes": 2}),
        Case("daemonize", DAEMON, "blocked", limits={"processes": 2}),
        Case("fork_bomb", "import os\nwhile True:\n    os.fork()", "blocked", "processes"),
        Case(
            "thread_bomb",
            THREAD_BOMB,
            "processes",
            "processes",
        ),
        Case(
            "threads_within_limit",
            THREE_THREADS,
            None,
            None,
            limits={"processes": 3},
        ),
        Case("subprocess", "import subprocess\nsubprocess.run(['true'])", "blocked"),
        # resources
        Case("memory_hog", "x = bytearray(2**31)", "memory", "memory"),
        Case("mmap_64g", "import mmap\nmmap.mmap(-1, 64 * 2**30)", "memory", "memory"),
        Case("cpu_loop", "while True:\n    pass", ANY, ANY, limits={"cpu_s": 1}),
        Case("sleep", "import time\ntime.sleep(100)", "wall_time", "wall_time"),
        Case("output_flood", "import sys\nsys.stdout.write('x' * 10_000_000)", "output", "output"),
        Case("big_file", "open('big', 'wb').write(b'x' * 2_000_000)", "file_size", "file_size"),
        Case(
            "fill_disk",
            "for i in range(200):\n    open('f%d' % i, 'wb').write(b'x' * 999_000)",
            "disk",
            "disk",
        ),
        Case(
            "many_files",
            "for i in range(100_000):\n    open('f%d' % i, 'w').close()",
            "disk",
            "disk",
        ),
        Case(
            "open_files",
            "fs = [open('/dev/null') for _ in range(10_000)]",
            "open_files",
            "open_files",
        ),
        # the network and IPC
        Case(
            "tcp_connect",
            "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
            "blocked",
        ),
        Case(
            "abstract_socket",
            "import socket\ns = "
            f"socket.socket(socket.AF_UNIX)\ns.connect({env['abstract']!r})\ns.send(b'pwned')",
            "blocked",
        ),
        Case("hostname", "import os\nprint(os.uname().nodename)"),
        # native code
        Case(
            "ctypes_left_over",
            "import gc\nprint(sum(type(o).__name__ in ('CDLL', 'PyDLL') for o in "
            "gc.get_objects()))",
            shows="0",
        ),
        Case("import_ctypes", "import ctypes", "blocked"),
        Case(
            "extension_from_directory",
            OWN_EXTENSION,
        ),
        Case("memfd_extension", MEMFD_EXTENSION, ANY, ANY, never="loaded"),
        Case("keyring_read", KEYRING_READ, "blocked"),
        Case("proc_keys", "print(open('/proc/keys').read(), open('/proc/key-users').read())"),
        Case(
            "signal_init",
            "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(1), "
            "signal.SIGINT)\nprint('sent')",
        ),
        Case("code_over_the_disk", "x = 1\n" * 5000, "disk", "disk", limits={"disk_bytes": 10_000}),
        Case("coding_cookie", "# coding: latin-1\nprint('\u00e9')", shows="\u00e9"),
        Case(
            "proc_self_mem",
            "import os\nfd = os.open('mem', os.O_RDWR, dir_fd=os.open('/proc/self', "
            "os.O_RDONLY))\nprint('opened')",
        ),
        Case(
            "rlimit_raise",
            "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
            "blocked",
        ),
    ]


# where the trainer looks for files the code should not have made
def watched(env):
    return [d for d in ("/tmp", "/dev/shm", env["home"], env["project"]) if os.path.isdir(d)]


def pid_ns(pid):
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def call_processes(own_ns, before):
    """Live processes started since ``before`` in another PID namespace or under a call's own
    uid."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in before:
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if fields.get("State", "").split()[:1] == ["Z"]:
            continue
        uid = int(fields["Uid"].split()[0])
        if pid_ns(name) not in (own_ns, None) or uid >= ID_BASE:
            found.append(f"{name} ({fields.get('Name', '').strip()})")
    return found


class Outside:
    """What the trainer sees before and after a call."""

    def __init__(self, env):
        self.env = env
        self.priority = os.getpriority(os.PRIO_PROCESS, 0)
        self.affinity = os.sched_getaffinity(0)
        self.listings = {d: set(os.listdir(d)) for d in watched(env)}
        self.free = os.statvfs("/tmp").f_bavail * os.statvfs("/tmp").f_frsize
        self.pids = {int(p) for p in os.listdir("/proc") if p.isdigit()}

    def problems(self, result, fifo_fd, pty_fd, listener):
        found = []
        if os.getpriority(os.PRIO_PROCESS, 0) != self.priority:
            found.append("the trainer's priority changed")
            os.setpriority(os.PRIO_PROCESS, 0, self.priority) if os.geteuid() == 0 else None
        if os.sched_getaffinity(0) != self.affinity:
            found.append("the trainer's affinity changed")
            os.sched_setaffinity(0, self.affinity)
        for d, names in self.listings.items():
            new = {
                n
                for n in set(os.listdir(d)) - names
                if not n.startswith(("pytest-", "rlhf-sandbox-"))
            }
            if new:
                found.append(f"new files in {d}: {sorted(new)}")
        with open(self.env["victim"]) as f:
            if f.read() != "kept":
                found.append("the victim file changed")
        for what, fd in (("fifo", fifo_fd), ("pty", pty_fd)):
            try:
                if os.read(fd, 100):
                    found.append(f"something was written to the {what}")
            except (BlockingIOError, OSError):
                pass
        try:
            conn, _ = listener.accept()
            conn.close()
            found.append("the abstract socket got a connection")
        except (BlockingIOError, OSError):
            pass
        time.sleep(0.05)
        left = call_processes(pid_ns("self"), self.pids)
        if left:
            found.append(f"processes left: {left}")
        used = self.free - os.statvfs("/tmp").f_bavail * os.statvfs("/tmp").f_frsize
        if used > 50_000_000:
            found.append(f"/tmp lost {used} bytes")
        text = result.stdout + result.stderr
        if self.env["secret_value"] in text:
            found.append("a secret of the trainer's reached the code")
        if result.limit is None and result.exit_code is None:
            found.append("the call ended without a status")
        return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("secret")
    ap.add_argument("--mode", default=None)
    ap.add_argument("--no-guard", action="store_true")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    if args.no_guard:
        text = sandbox_run._program("guard.py")
        assert "    install(ROOT)\n" in text
        unguarded = text.replace("    install(ROOT)\n", "    pass\n")
        sandbox_run._program = lambda name: unguarded if name == "guard.py" else text_of(name)
    # before the launcher server starts: it and its calls inherit the keyring
    add_secret_key(args.secret)
    mode = args.mode or isolation().mode
    tag = uuid.uuid4().hex[:12]
    home = os.path.expanduser("~")
    env = {
        "trainer": os.getpid(),
        "victim": f"/tmp/rlhf-victim-{tag}",
        "fifo": f"/tmp/rlhf-fifo-{tag}",
        "secret": os.path.join(home, f".rlhf-secret-{tag}"),
        "secret_value": args.secret,
        "home": home,
        "project": ROOT,
        "abstract": f"\0rlhf-hostile-{tag}",
    }
    os.environ["RLHF_HOSTILE_SECRET"] = args.secret
    made = [env["victim"], env["fifo"], env["secret"]]
    try:
        with open(env["victim"], "w") as f:
            f.write("kept")
        with open(env["secret"], "w") as f:
            f.write(args.secret)
        os.chmod(env["secret"], stat.S_IRUSR)
        os.mkfifo(env["fifo"])
        fifo_fd = os.open(env["fifo"], os.O_RDONLY | os.O_NONBLOCK)
        master, slave = os.openpty()
        os.set_blocking(master, False)
        env["pty"] = os.ttyname(slave)
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(env["abstract"])
        listener.listen(1)
        listener.setblocking(False)
        n = 0
        for case in cases(env):
            if args.only and case.name not in args.only:
                continue
            outside = Outside(env)
            limits = {"cpu_s": 2, "wall_s": 1.5, **case.limits}
            result = Sandbox(Limits(**limits), mode=mode).run(case.code)
            problems = outside.problems(result, fifo_fd, master, listener)
            expected = case.kernel if args.no_guard else case.guarded
            if expected != ANY and result.limit != expected:
                problems.append(f"limit {result.limit!r}, expected {expected!r}")
            if case.shows and not args.no_guard and case.shows not in result.observation():
                problems.append(f"the observation lacks {case.shows!r}")
            if case.never and case.never in result.stdout + result.stderr:
                problems.append(f"the output holds {case.never!r}")
            row = {
                "case": case.name,
                "problems": problems,
                "limit": result.limit,
                "observation": result.observation()[-300:],
            }
            print(json.dumps(row), flush=True)
            n += 1
        print(json.dumps({"done": n, "mode": mode}), flush=True)
    finally:
        for path in made:
            if os.path.lexists(path):
                os.remove(path)


def add_secret_key(secret):
    """A key in a fresh session keyring of the trainer, its payload and description the secret (as
    pam_keyinit and ssh sessions hold credentials); nothing where the kernel refuses keyctl."""
    import ctypes

    numbers = {"x86_64": (250, 248), "aarch64": (219, 217)}.get(os.uname().machine)
    if numbers is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    keyctl, add_key = numbers
    if libc.syscall(keyctl, 1, None) < 0:
        # KEYCTL_JOIN_SESSION_KEYRING: anonymous, dies with us
        return
    payload = secret.encode()
    # into the session keyring
    libc.syscall(add_key, b"user", b"rlhf-" + payload, payload, len(payload), -3)


def text_of(name):
    with open(os.path.join(os.path.dirname(sandbox_run.__file__), name), encoding="utf-8") as f:
        return f.read()


if __name__ == "__main__":
    main()
