"""The Python tool's sandbox (rlhf/envs/sandbox/): output and tracebacks, every limit, the guard
alone (files, network, processes, environment), nothing left running, concurrent runs, the modes.
Every run is bounded by the sandbox's own wall limit (1–2 s here). Hostile code:
test_sandbox_hostile.py."""

import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlhf import config
from rlhf.envs.builtin import environment, say_sandbox
from rlhf.envs.sandbox import MODE_CHOICES, Limits, Result, Sandbox, SandboxError, modes
from rlhf.envs.sandbox import run as sandbox_run
from rlhf.errors import ConfigError

FAST = Limits(cpu_s=1, wall_s=2)


@pytest.fixture(scope="module")
def box():
    return Sandbox(FAST)


@pytest.fixture
def sessions(monkeypatch):
    """The pids of the calls' launchers started during the test: each leads its own session."""
    started = []
    spawn = sandbox_run.SERVER.spawn

    def recording(*args, **kwargs):
        launcher = spawn(*args, **kwargs)
        started.append(launcher.pid)
        return launcher

    monkeypatch.setattr(sandbox_run.SERVER, "spawn", recording)
    return started


def alive_in_sessions(sids):
    """Pids of live processes (zombies included) whose session is one of ``sids``, from /proc."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # after "pid (comm) ": state ppid pgrp session
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) in sids:
            found.append(int(name))
    return found


def test_prints_and_exits(box):
    r = box.run("print('hi é')\nprint(6 * 7)")
    assert (r.stdout, r.exit_code, r.limit) == ("hi é\n42\n", 0, None)
    assert r.observation() == "hi é\n42"
    assert box.run("x = 1").observation() == "(no output)"
    r = box.run("import sys\nprint('a')\nsys.exit(3)")
    assert (r.exit_code, r.limit, r.observation()) == (3, None, "a\nexit code 3")


def test_a_failure_shows_the_end_of_its_traceback_without_paths(box):
    r = box.run("def f():\n    return 1 / 0\n\nprint('before')\nf()")
    assert r.exit_code == 1 and r.limit is None
    obs = r.observation()
    assert obs.startswith("before\n") and obs.endswith("ZeroDivisionError: division by zero")
    assert 'File "main.py", line 2, in f' in obs
    assert "/tmp" not in obs and "<string>" not in obs  # the same text on every run
    assert box.run("print(").observation().endswith("SyntaxError: '(' was never closed")


def test_an_endless_loop_is_stopped_by_a_time_limit(box):
    r = box.run("while True:\n    pass")
    assert r.limit in ("cpu_time", "wall_time")
    assert r.seconds < FAST.wall_s + 1.5
    assert r.observation() in ("CPU time limit (1 s) exceeded", "timed out after 2 s")


def test_sleeping_is_stopped_by_the_wall_limit():
    r = Sandbox(Limits(wall_s=1)).run("import time\nprint('start', flush=True)\ntime.sleep(100)")
    assert (r.limit, r.exit_code) == ("wall_time", None)
    assert 0.9 <= r.seconds < 2.5
    assert r.observation() == "timed out after 1 s"


def test_a_fork_bomb_is_stopped_and_leaves_nothing_running(box, sessions):
    r = box.run("import os\nwhile True:\n    os.fork()")
    assert r.limit in ("blocked", "processes")
    assert r.seconds < FAST.wall_s + 1.5
    assert sessions and alive_in_sessions(set(sessions)) == []
    for sid in sessions:
        with pytest.raises(ProcessLookupError):
            os.killpg(sid, 0)
    # other ways to a process are refused too, and the sandbox still works afterwards
    for code in ("import subprocess\nsubprocess.run(['true'])", "import os\nos.system('true')"):
        assert box.run(code).observation() == "sandbox: starting processes is not allowed"
    assert box.run("print('alive')").observation() == "alive"
    assert alive_in_sessions(set(sessions)) == []


def test_a_memory_hog_hits_the_memory_limit():
    r = Sandbox(Limits(cpu_s=1, wall_s=2)).run("x = bytearray(2**31)\nprint('allocated')")
    assert r.limit == "memory"
    assert r.observation() == "memory limit (256 MB) exceeded"
    # the interpreter itself fits well inside the default
    assert (
        Sandbox(Limits(memory_mb=64))
        .run("import json, math, re, fractions\nprint(1)")
        .observation()
        == "1"
    )


def test_a_flood_of_output_is_cut_and_stopped(box):
    r = box.run("import sys\nsys.stdout.write('x' * 10_000_000)\nprint('never')")
    assert (r.limit, r.exit_code) == ("output", None)
    assert len(r.stdout) + len(r.stderr) <= FAST.output_bytes
    assert r.observation() == "output truncated at 10000 bytes"
    assert r.seconds < FAST.wall_s  # stopped once over, not at the deadline


def test_files_are_written_inside_the_directory_only(box):
    target = f"/tmp/escape_test_{uuid.uuid4().hex}"
    try:
        r = box.run(f"open({target!r}, 'w').write('x')")
        assert r.limit == "blocked"
        assert r.observation() == "sandbox: writing outside the working directory is not allowed"
        assert not os.path.exists(target)
        # through a symlink made inside the directory: resolved, refused
        r = box.run(f"import os\nos.symlink({target!r}, 'link')\nopen('link', 'w').write('x')")
        assert r.limit == "blocked" and not os.path.exists(target)
    finally:
        if os.path.exists(target):
            os.remove(target)
    r = box.run(
        "with open('out.txt', 'w') as f:\n    f.write('kept')\nprint(open('out.txt').read())"
    )
    assert r.observation() == "kept"
    r = box.run(
        "import tempfile\nwith tempfile.NamedTemporaryFile() as f:\n    f.write(b'x')\nprint('ok')"
    )
    assert r.observation() == "ok"  # TMPDIR is the run's directory


def test_a_file_over_the_size_limit_is_refused():
    r = Sandbox(Limits(file_bytes=1000, wall_s=2)).run(
        "with open('big', 'wb') as f:\n    f.write(b'x' * 5000)"
    )
    assert r.limit == "file_size"
    assert r.observation() == "file size limit (1000 bytes) exceeded"


def test_the_network_is_refused(box):
    r = box.run(
        "import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 9))\nprint('connected')"
    )
    assert r.limit == "blocked"
    assert r.observation() == "sandbox: network access is not allowed"


def test_the_parents_environment_is_not_inherited(box, monkeypatch):
    monkeypatch.setenv("RLHF_SANDBOX_MARKER", "secret-value")
    r = box.run("import os\nprint(dict(os.environ))")
    assert r.exit_code == 0
    assert "RLHF_SANDBOX_MARKER" not in r.stdout and "secret-value" not in r.stdout
    assert "PATH" not in r.stdout and "HOME" not in r.stdout


def test_the_guard_survives_patching_of_what_it_uses(box):
    target = f"/tmp/escape_test_{uuid.uuid4().hex}"
    code = (
        "import builtins, os, os.path\n"
        "os.path.realpath = lambda p: os.getcwd() + '/x'\n"
        "os.stat_result.__getitem__ = lambda self, i: 0\n"
        "builtins.isinstance = lambda *a: False\n"
        "builtins.len = lambda x: 0\n"
        f"open({target!r}, 'w')\n"
    )
    try:
        assert box.run(code).limit == "blocked"
        assert not os.path.exists(target)
    finally:
        if os.path.exists(target):
            os.remove(target)
    assert box.run("import ctypes").observation() == "sandbox: native code (ctypes) is not allowed"
    assert (
        box.run("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))").limit
        == "blocked"
    )
    assert box.run("import os\nos.kill(1, 0)").limit == "blocked"


def test_the_guard_alone_refuses():
    """The ``guard`` mode (no namespaces): the audit hook refuses what the kernel would have."""
    target = f"/tmp/escape_test_{uuid.uuid4().hex}"
    box = Sandbox(FAST, mode="guard")
    try:
        assert box.run(f"open({target!r}, 'w')").limit == "blocked"
        assert not os.path.exists(target)
    finally:
        if os.path.exists(target):
            os.remove(target)
    assert box.run("import socket\nsocket.socket()").limit == "blocked"
    assert box.run("open('a', 'w').write('ok')\nprint(open('a').read())").observation() == "ok"
    assert (
        box.run("import os\nos.fork()").observation()
        == "sandbox: starting processes is not allowed"
    )
    # a hard link inside the directory to a file outside it would write through
    victim = f"/tmp/escape_test_{uuid.uuid4().hex}"
    try:
        with open(victim, "w") as f:
            f.write("kept")
        assert (
            box.run(f"import os\nos.link({victim!r}, 'l')\nopen('l', 'w').write('x')").limit
            == "blocked"
        )
        with open(victim) as f:
            assert f.read() == "kept"
    finally:
        os.remove(victim)
    r = box.run("import gc\nprint(sum(type(o).__name__ == 'CDLL' for o in gc.get_objects()))")
    # a fresh interpreter: nothing of the setup's ctypes
    assert r.observation() == "0"


def test_concurrent_runs_from_a_thread_pool(box):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: box.run(f"print({i} * {i})"), range(8)))
    assert [r.observation() for r in results] == [str(i * i) for i in range(8)]


def test_a_fork_of_the_trainer_gets_a_server_of_its_own(box):
    """Forks while other threads make calls: each child's call runs on a server of its own (the
    parent's lock may have been held at the fork), and the parent's calls never wait on a child."""
    stop, wrong = threading.Event(), []

    def calls():
        while not stop.is_set():
            r = box.run("print(1)")
            if r.observation() != "1":
                wrong.append(r)

    threads = [threading.Thread(target=calls) for _ in range(3)]
    for t in threads:
        t.start()
    children = []
    try:
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = 0 if Sandbox(FAST).run("print(2)").observation() == "2" else 1
                finally:
                    os._exit(code)
            children.append(pid)
            time.sleep(0.05)
        deadline, codes = time.monotonic() + 60, {}
        while len(codes) < len(children) and time.monotonic() < deadline:
            for pid in children:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join()
        for pid in children:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    assert len(codes) == len(children), "a forked child's call hung"
    assert set(codes.values()) == {0}
    assert wrong == []


def test_pipes_closed_before_the_exit_and_a_dead_server(box):
    # the pipes close before the exit
    r = box.run("import os\nprint(1, flush=True)\nos.close(1)\nos.close(2)")
    assert (r.observation(), r.exit_code) == ("1", 0)
    # the launcher server died: the next call starts another
    sandbox_run.SERVER.proc.kill()
    sandbox_run.SERVER.proc.wait()
    assert box.run("print('again')").observation() == "again"


@pytest.fixture
def fresh_server():
    """The launcher server takes its programs and view when it starts: the test's patches reach the
    one started after this, and the next test starts another without them."""
    sandbox_run.SERVER.stop()
    yield
    sandbox_run.SERVER.stop()


def test_a_broken_setup_is_the_sandboxs_error_not_the_codes(monkeypatch, fresh_server):
    real = sandbox_run._program
    broken = "import sys\nsys.exit('setup failed')"
    monkeypatch.setattr(
        sandbox_run, "_program", lambda name: broken if name == "launch.py" else real(name)
    )
    with pytest.raises(
        SandboxError, match=r"sandbox: the launcher server ended: exit 1: setup failed"
    ):
        Sandbox(FAST, mode="guard").run("print(1)")


def test_what_the_kernel_refuses_is_one_line_from_the_launcher(monkeypatch, fresh_server):
    """A view that cannot be built (here: on a directory that is not there) is the sandbox's error,
    with the launcher's reason, never the code's output."""
    monkeypatch.setattr(sandbox_run, "view_base", lambda: "/nonexistent-view-base")
    for mode in modes.candidates()[:-1]:
        with pytest.raises(
            SandboxError, match=rf"sandbox \({mode}\): the setup failed before the code ran"
        ):
            Sandbox(FAST, mode=mode).run("print(1)")


def test_the_strongest_mode_is_probed_once_and_said(monkeypatch, caplog):
    calls = []

    def probe(mode):
        calls.append(mode)
        return "refused here"

    monkeypatch.setattr(sandbox_run, "_found", None)
    monkeypatch.setattr(sandbox_run, "probe", probe)
    assert sandbox_run.isolation().mode == "guard" and sandbox_run.isolation().mode == "guard"
    # once, in order; guard needs no probe
    assert calls == [m for m in modes.candidates() if m != "guard"]
    assert sandbox_run.settle("auto").mode == "guard" and sandbox_run.settle("user").mode == "user"
    with pytest.raises(ValueError, match="refused here"):
        sandbox_run.settle("namespaces")
    env = config.EnvConfig(tools=["python"])
    with caplog.at_level("INFO", logger="rlhf"):
        say_sandbox(env, logging.getLogger("rlhf"))
        say_sandbox(config.EnvConfig(tools=["calculator"]), logging.getLogger("rlhf"))
    # the calculator needs no sandbox: nothing said
    [record] = caplog.records
    assert record.levelname == "WARNING" and "isolation guard only" in record.getMessage()
    assert "refused here" in record.getMessage() and "signals to the trainer" in record.getMessage()
    env.sandbox.isolation, env.name = "namespaces", "tools"
    with pytest.raises(
        ConfigError, match=r"env\.sandbox\.isolation=namespaces, but the kernel allows none here"
    ):
        environment(env)
    assert config.SANDBOX_ISOLATION == MODE_CHOICES


def test_this_machine_isolates_with_namespaces_or_says_why():
    found = sandbox_run.isolation()
    if found.mode == "guard":
        pytest.skip(f"the kernel allows no namespaces here: {found.refused}")
    r = Sandbox(FAST).run(
        "import os\nprint(os.getpid(), os.getppid(), [p for p in os.listdir('/proc') if "
        "p.isdigit()], os.getcwd())"
    )
    # pid 2 of its own namespace, init (1) hidden, its tmpfs
    assert r.observation() == "2 1 ['2'] /work"


def test_new_limits_are_validated_and_named():
    for bad in ({"disk_bytes": 0}, {"files": 0}, {"open_files": 3}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Limits(**bad)
    lim = Limits(disk_bytes=1000, files=10, open_files=16)
    assert (
        Result("", "", None, "disk", limits=lim).observation()
        == "disk limit (1000 bytes, 10 files) exceeded"
    )
    assert (
        Result("", "", None, "open_files", limits=lim).observation()
        == "open file limit (16) exceeded"
    )
    assert Result("", "", None, "disk").observation() == "disk limit exceeded"


def test_observations_of_results_from_any_executor():
    assert Result("", "", None, "wall_time").observation() == "timed out"
    assert Result("", "", -11, None).observation() == "killed by signal SIGSEGV"
    err = (
        "Traceback (most recent call last):\nPermissionError: sandbox: network access is not "
        "allowed\n"
    )
    assert Result("", err, 1, "blocked").observation() == "sandbox: network access is not allowed"
    limited = Result("", "", None, "processes", limits=Limits(processes=2))
    assert (
        limited.observation()
        == "process limit exceeded: at most 2 new processes or threads allowed"
    )
