"""A peer that stops answering ends the whole job within the collective timeout, with one clear
line and exit code 3; a worker's own exit code (2: bad input found at runtime) is the job's."""

import json
import os
import re
import signal
import time

import pytest

from tests.conftest import quick_sft_args
from tests.reliability.conftest import one_node
from tests.reliability.helpers import Job, When, alive, kill, wait_until, workers

pytestmark = pytest.mark.distributed
TIMEOUT_S = 20


@pytest.fixture(scope="module")
def stopped_peer(tmp_path_factory):
    """SFT on one node × 2 workers with engine.timeout_s=20; rank 1 gets SIGSTOP once the first
    checkpoint exists. Returns at once: the next test runs while this job starts and times out."""
    root = tmp_path_factory.mktemp("stopped_peer")
    run = root / "run"
    job = Job(
        *quick_sft_args(run, steps=1000),
        "train.save_every=5",
        f"engine.timeout_s={TIMEOUT_S}",
        "engine.threads_per_rank=1",
        *one_node(2),
        log=root / "log.txt",
    )

    def stop_rank1():
        ranks = workers(job.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGSTOP)
        return ranks

    stopper = When(
        (run / "sft" / "checkpoints" / "step_00000005" / "trainer_state.json").exists,
        stop_rank1,
        job,
        400,
        "the first checkpoint",
    )
    yield job, stopper
    if job.proc.poll() is None:
        job.kill_tree()
    for pid in (stopper.value or {}).values():
        kill(pid)


def test_worker_exit_code_is_the_jobs(stopped_peer, tmp_path):
    """Runs while ``stopped_peer`` waits for its timeout (the test asks for it only to overlap)."""
    data = tmp_path / "sft.jsonl"
    with open(data, "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n")
        f.write(json.dumps({"prompt": "q"}) + "\n")  # line 41: no response
    job = Job(
        "stage=sft",
        f"run.dir={tmp_path / 'run'}",
        f"data.path={data}",
        "data.format=prompt_response",
        "train.max_steps=2",
        "logger.progress=false",
        *one_node(2),
        log=tmp_path / "log.txt",
    )
    assert job.wait(300) == 2, job.tail()
    assert job.error_lines() == [
        f"rlhf: error: {data}:41: record has no field 'response' (or set "
        f"data.on_bad_record=skip to skip and count such records)"
    ], job.tail()


def test_stopped_peer_ends_job_with_clear_error(stopped_peer):
    job, stopper = stopped_peer
    ranks = stopper.result()
    rc = job.wait(TIMEOUT_S + 90)
    took = time.monotonic() - stopper.at
    print(f"stopped rank 1: the job ended {took:.1f} s later (timeout {TIMEOUT_S} s), exit {rc}")
    assert rc == 3, job.tail()
    assert not any(alive(p) for p in ranks.values()), "a worker outlived the job"
    lines = job.error_lines()
    assert len(lines) == 1, job.tail()
    assert re.fullmatch(
        rf"rlhf: error: collective timed out after {TIMEOUT_S} s waiting for a peer: rank 1 "
        r"stopped answering \(.*\)",
        lines[0],
    ), lines
    # timeout + naming the silent peer (2.5 s) + the agent's SIGTERM→SIGKILL grace (5 s) + slack
    assert TIMEOUT_S <= took <= TIMEOUT_S + 25, took
    assert "Traceback" not in job.log.read_text()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# ~50 s; the one-node test above covers the worker side
@pytest.mark.slow
def test_stopped_peer_on_the_store_node_ends_every_node(tmp_path):
    """Two nodes; the worker of the node hosting the rendezvous store stops. Its agent sees a live
    worker and torch's would wait forever; the other node's launcher gives up and says so in the
    store (rlhf.launcher.watchdog.JobWatch), and both launchers exit."""
    from tests.reliability.helpers import free_port

    port, run = free_port(), tmp_path / "run"
    args = [
        *quick_sft_args(run, steps=1000),
        "train.save_every=5",
        f"engine.timeout_s={TIMEOUT_S}",
        "engine.threads_per_rank=1",
        "launcher.nnodes=2",
        "launcher.nproc_per_node=1",
        f"launcher.rdzv_endpoint=127.0.0.1:{port}",
        "launcher.rdzv_id=stopped2n",
    ]
    host = Job(*args, "launcher.node_rank=0", log=tmp_path / "host.txt")
    wait_until(lambda: _listening(port), 120, [host], "the rendezvous store")
    other = Job(*args, "launcher.node_rank=1", log=tmp_path / "other.txt")
    wait_until(
        (run / "sft" / "checkpoints" / "step_00000005" / "trainer_state.json").exists,
        400,
        [host, other],
        "the first checkpoint",
    )
    ((rank, victim),) = workers(host.pid).items()
    os.kill(victim, signal.SIGSTOP)
    t_stop = time.monotonic()
    rcs = [j.wait(TIMEOUT_S + 90) for j in (other, host)]
    took = time.monotonic() - t_stop
    print(
        f"stopped rank {rank} on the store's node: both nodes ended {took:.1f} s later, exits {rcs}"
    )
    assert rcs == [3, 3], (other.tail(), host.tail())
    assert not alive(victim)
    assert took <= TIMEOUT_S + 30, took
    cause = (
        f"collective timed out after {TIMEOUT_S} s waiting for a peer: rank {rank} stopped "
        "answering"
    )
    assert len(other.error_lines()) == 1 and other.error_lines()[0].startswith(
        f"rlhf: error: {cause}"
    )
    assert len(host.error_lines()) == 1 and cause in host.error_lines()[0], host.tail()
