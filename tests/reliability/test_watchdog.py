"""The pieces behind the failure tests, without launching jobs: which exceptions are a lost peer,
how the silent peer is named, and which failed rank the launcher reports (and with which code)."""

import datetime
import signal

import pytest

from rlhf.launcher import launch, watchdog
from tests.reliability.helpers import free_port

GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] "
    "Timed out waiting 20000ms for send operation to complete"
)
GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
    "by peer [127.0.0.1]:4567"
)
GLOO_CONNECT = (
    "Gloo connectFullMesh failed with "
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] "
    "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:35227"
)


@pytest.fixture
def two_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(watchdog, "_heartbeat", None)


def test_collective_failures_are_recognised(two_ranks):
    f = watchdog.collective_failure(RuntimeError(GLOO_TIMEOUT), 600)
    assert f.code == watchdog.EXIT_PEER == 3
    assert (
        f.message
        == "collective timed out after 20 s waiting for a peer (rank 1 stopped answering?)"
    )
    for text in (GLOO_CLOSED, GLOO_CONNECT):
        f = watchdog.collective_failure(RuntimeError(text), 600)
        assert f.message.startswith(
            "lost (or could not open) the connection to a peer (rank 1 died"
        ), f
    try:
        # wrapped (e.g. by torch.distributed.checkpoint): the cause counts
        try:
            raise RuntimeError(GLOO_TIMEOUT)
        except RuntimeError as e:
            raise ValueError("saving the checkpoint failed") from e
    except ValueError as e:
        assert watchdog.collective_failure(e, 600) is not None


@pytest.mark.parametrize(
    "exc", [RuntimeError("CUDA out of memory"), ValueError("request timed out"), KeyError("peer")]
)
def test_other_errors_are_bugs(two_ranks, exc):
    assert watchdog.collective_failure(exc, 600) is None


def test_single_process_has_no_peers(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert watchdog.collective_failure(RuntimeError(GLOO_TIMEOUT), 600) is None


def test_heartbeat_names_the_silent_rank(monkeypatch):
    import torch.distributed as dist

    port = free_port()
    # held for the test: the store serves while it lives
    _server = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )
    monkeypatch.setenv(watchdog.HEARTBEAT_STORE_ENV, f"127.0.0.1:{port}")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "unit")
    beats = [watchdog.Heartbeat(r, 3).start() for r in range(3)]
    try:
        # everyone alive; rank 0 now exits (stops beating)
        assert beats[0].silent_peers() == []
        beats[2].stop()  # rank 2 "stops answering"
        assert beats[1].silent_peers() == [2]  # not rank 0: it said it was exiting
        assert beats[1].first_to_report() and not beats[0].first_to_report()
    finally:
        for b in beats:
            b.stop()


def _failure(rank, pid, exitcode, tmp_path, message=None, printed=False):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error{rank}_{pid}.json"
    if message is not None:
        import json

        path.write_text(
            json.dumps({"message": message, "timestamp": 1, "rlhf": {"printed": printed}})
        )
    return ProcessFailure(local_rank=rank, pid=pid, exitcode=exitcode, error_file=str(path))


def _child_failure(failures):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    return launch.child_failure(ChildFailedError("rlhf", failures))


def test_launcher_reports_the_root_cause(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "_terminated_by_agent", {102})
    # rank 1 found bad input (exit 2) and printed nothing; rank 0 was terminated by the agent
    code, line, _ = _child_failure(
        {
            0: _failure(0, 102, -signal.SIGTERM, tmp_path),
            1: _failure(1, 101, 2, tmp_path, "f.jsonl:3: record has no field 'x'"),
        }
    )
    assert (code, line) == (2, "f.jsonl:3: record has no field 'x'")
    # a rank timed out (exit 3, printed its line) and the agent SIGKILLed the stopped one
    code, line, cause = _child_failure(
        {
            0: _failure(0, 101, 3, tmp_path, "collective timed out", printed=True),
            1: _failure(1, 102, -signal.SIGKILL, tmp_path),
        }
    )
    assert (code, line, cause) == (3, None, "collective timed out")
    # killed from outside (OOM killer): 128 + 9, named beside the survivor's own line
    code, line, _ = _child_failure(
        {
            1: _failure(1, 103, -signal.SIGKILL, tmp_path),
            0: _failure(0, 104, 3, tmp_path, "lost the connection", printed=True),
        }
    )
    assert (code, line) == (137, "worker rank 1 (pid 103) was killed by SIGKILL")
    # bad input seen by rank 1 only (ranks > 0 do not print it): the launcher does, once
    code, line, _ = _child_failure(
        {
            1: _failure(1, 107, 2, tmp_path, "bad record"),
            0: _failure(0, 108, 3, tmp_path, "lost the connection", printed=True),
        }
    )
    assert (code, line) == (2, "bad record")
    # a bug: its own exit code, its traceback is above
    code, line, _ = _child_failure({0: _failure(0, 105, 1, tmp_path)})
    assert (code, line) == (
        1,
        "worker rank 0 (pid 105) exited with code 1 (its traceback is above)",
    )


EXIT_WITH_A_BUSY_HEARTBEAT = r"""
import datetime, os, sys, time
import torch.distributed as dist
import rlhf.launcher.watchdog as W
W.BEAT_S = 0.0005  # the heartbeat thread is almost always inside a store call
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=5))
os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(store.port)
hb = W.start_heartbeat(0, 2)
assert hb._thread is not None and hb._thread.is_alive()
time.sleep(0.05)
sys.exit(2)  # an error's way out, without shutdown()
"""


def test_exit_code_survives_a_heartbeat_inside_a_store_call():
    """A daemon thread still inside a C++ store call when the interpreter finalizes aborts the
    process (exit 134, "terminate called without an active exception") after its work is done.
    Before the heartbeat was stopped and joined at exit, 8 of 12 such exits aborted."""
    import subprocess
    import sys

    from tests.conftest import ENV, ROOT

    procs = [
        subprocess.Popen(
            [sys.executable, "-c", EXIT_WITH_A_BUSY_HEARTBEAT],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    assert [code for code, _ in results] == [2] * 6, [err[-300:] for _, err in results]


FINISH_WITH_A_BUSY_THREAD = r"""
import datetime, logging, os, sys, threading
import torch.distributed as dist
from rlhf.engine.mesh import end_process
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=5))
def busy():  # always inside a C++ call that releases the GIL, like a gloo thread at teardown
    while True:
        store.add("k", 1)
threading.Thread(target=busy, daemon=True).start()
logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
logging.getLogger("t").info("logged before the end")
sys.stdout.write("written, not flushed")
if sys.argv[2] == "end_process":
    end_process()
"""


def test_a_finished_worker_ends_with_its_output_and_without_finalization(tmp_path):
    """``end_process`` (the last call of every torchrun worker): exit 0 with stdout and the log file
    flushed, where the interpreter's finalization with a thread inside a C++ call aborts some
    exits."""
    import subprocess
    import sys

    from tests.conftest import ENV, ROOT

    def launch(i, how):
        env = {**ENV, "LOCAL_RANK": "0"}
        cmd = [
            sys.executable,
            "-c",
            FINISH_WITH_A_BUSY_THREAD,
            str(tmp_path / f"{how}{i}.log"),
            how,
        ]
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    procs = [launch(i, "end_process") for i in range(6)]
    control = [launch(i, "finalize") for i in range(4)]  # measured: 24 of 24 such exits abort
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert [code for code, _, _ in results] == [0] * 6, [err[-300:] for _, _, err in results]
    assert any(p.wait(timeout=120) == -6 for p in control), (
        "finalization no longer aborts: the control shows nothing"
    )
    assert all(out == "written, not flushed" for _, out, _ in results)
    assert all(
        "logged before the end" in (tmp_path / f"end_process{i}.log").read_text() for i in range(6)
    )
