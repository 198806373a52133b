"""Hostile code against the sandbox: the matrix of hostile_code.py (71 cases, each bounded by a
1.5-s wall limit), run by a separate "trainer" process and checked from outside it
(hostile_code.py's docstring).

With the guard and without it (the kernel's isolation alone), in the strongest mode this machine
allows; and, where this machine can show it, in the ``user`` mode: as another user, and as root
without CAP_SYS_ADMIN (as in a container). Skipped with the reason where the kernel allows no
namespaces: there the guard alone protects, and modes.py says so in the log.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from rlhf.envs.sandbox import isolation

HELPER = Path(__file__).with_name("hostile_code.py")
# a representative of each kind, for the default suite's runs in the user mode (all of them: slow)
USER_MODE_CASES = (
    "pidfd_kill_parent",
    "sigio_parent",
    "renice_parent",
    "affinity_parent",
    "proc_scan",
    "read_secret_in_home",
    "dir_fd_fifo",
    "fork_and_outlive",
    "thread_bomb",
    "fill_disk",
    "mmap_64g",
    "tcp_connect",
    "abstract_socket",
    "chroot_escape",
)


def matrix(prefix, *args, env=None):
    """Runs the matrix in a trainer started with ``prefix`` (an interpreter, maybe behind setpriv)
    and fails with every case that was not contained."""
    secret = f"rlhf-secret-{uuid.uuid4().hex}"
    proc = subprocess.run(
        [*prefix, str(HELPER), secret, *args], capture_output=True, text=True, timeout=600, env=env
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    done = rows[-1] if rows and "done" in rows[-1] else None
    last = [r["case"] for r in rows if "case" in r][-1:]
    assert proc.returncode == 0 and done, (
        f"the trainer ended early (exit {proc.returncode}) after {last}: {proc.stderr[-3000:]}"
    )
    failures = [
        f"{r['case']}: {r['problems']} | {r['observation'][-200:]!r}"
        for r in rows
        if r.get("problems")
    ]
    assert not failures, "\n".join(failures)
    return done


@pytest.fixture(scope="module")
def isolated():
    found = isolation()
    if found.mode == "guard":
        pytest.skip(
            f"the kernel allows no namespaces here (the guard alone protects): {found.refused}"
        )
    return found.mode


def test_hostile_code_is_contained(isolated):
    done = matrix([sys.executable])
    assert done == {"done": 71, "mode": isolated}


def test_hostile_code_is_contained_by_the_kernel_alone(isolated):
    """Without the audit hook (as if native code had switched it off): what the guard refused, the
    kernel's isolation still holds."""
    assert matrix([sys.executable], "--no-guard")["done"] == 71


def world_runnable_python():
    """An interpreter every user may run (the user mode's view is built as the call's own uid), or
    skip."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip(
            "needs root and setpriv to start a trainer as another user or without CAP_SYS_ADMIN"
        )
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        path = os.path.realpath(candidate)
        if os.path.exists(path) and _every_user_can_run(path):
            if (
                subprocess.run(
                    [path, "-c", "import sys; assert sys.version_info >= (3, 9)"]
                ).returncode
                == 0
            ):
                return path
    pytest.skip(
        "no interpreter here that every user may run (this one lies under a private directory)"
    )


def _every_user_can_run(path):
    parts = Path(path).parents
    return (
        all(os.stat(p).st_mode & stat.S_IXOTH for p in parts)
        and os.stat(path).st_mode & stat.S_IXOTH
    )


def _cases(full):
    return [] if full else ["--only", *USER_MODE_CASES]


@pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_user_mode_as_another_user(isolated, full):
    """A trainer that is not root: a user namespace of the call's own, the trainer's uid mapped."""
    python = world_runnable_python()
    home = tempfile.mkdtemp(prefix="rlhf-hostile-home-")
    try:
        os.chown(home, 71534, 71534)
        prefix = ["setpriv", "--reuid=71534", "--regid=71534", "--clear-groups", python]
        done = matrix(
            prefix, "--mode", "user", *_cases(full), env={"HOME": home, "PATH": os.environ["PATH"]}
        )
        assert done["mode"] == "user" and done["done"] == (71 if full else len(USER_MODE_CASES))
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_user_mode_as_root_without_cap_sys_admin(isolated, full):
    """Root in a container without CAP_SYS_ADMIN: the root mode is refused, the user mode is chosen,
    and the call still runs under a uid of its own."""
    python = world_runnable_python()
    prefix = ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", python]
    done = matrix(prefix, *_cases(full))
    assert done["mode"] == "user" and done["done"] == (71 if full else len(USER_MODE_CASES))
