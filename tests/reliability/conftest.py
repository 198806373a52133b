"""The reliability suite's runs. The PPO jobs of the selected tests start together (the CI has two
cores and one 2-worker job keeps about one busy); each test waits for its own."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from tests.reliability import helpers
from tests.reliability.helpers import Job, When, free_port, workers

PPO_STEPS, PPO_SAVE_EVERY = 4, 2
OVERLAPPED = ("ppo_reference", "ppo_two_nodes", "ppo_restarted")


def ppo_args(run_dir, *extra: str) -> list[str]:
    """A bounded PPO (GAE: actor and critic) run, checkpointing every 2 of its 4 steps, one thread
    per rank (so one node × 2 workers and two nodes × 1 worker do the same arithmetic)."""
    return [
        "stage=ppo",
        f"run.dir={run_dir}",
        f"train.max_steps={PPO_STEPS}",
        "ppo.prompts_per_step=8",
        "ppo.samples_per_prompt=2",
        "ppo.ppo_epochs=1",
        "ppo.minibatches_per_epoch=2",
        "logger.progress=false",
        "eval.gold_prompts=8",
        "eval.gold_samples=1",
        "train.eval_every=0",
        f"train.save_every={PPO_SAVE_EVERY}",
        "data.synthetic.num_records=2000",
        "engine.threads_per_rank=1",
        "ppo.min_rm_accuracy=0",
        *extra,
    ]


def one_node(nproc: int = 2, **kw) -> list[str]:
    return [
        f"launcher.nproc_per_node={nproc}",
        f"launcher.rdzv_endpoint=127.0.0.1:{free_port()}",
        *[f"launcher.{k}={v}" for k, v in kw.items()],
    ]


def two_nodes(args, log_dir, name) -> list[Job]:
    """The same job as two launchers (launcher.nnodes=2, one worker each) on loopback."""
    port = free_port()
    return [
        Job(
            *args,
            "launcher.nnodes=2",
            "launcher.nproc_per_node=1",
            f"launcher.node_rank={i}",
            f"launcher.rdzv_endpoint=127.0.0.1:{port}",
            f"launcher.rdzv_id={name}",
            log=log_dir / f"{name}_node{i}.txt",
        )
        for i in (0, 1)
    ]


class Pending:
    """Jobs started now, awaited by whoever needs their result first."""

    def __init__(self, run_dir, *jobs: Job, **extra):
        self.run_dir, self.jobs, self.extra, self._done = run_dir, jobs, extra, False

    def result(self):
        if not self._done:
            for j in self.jobs:
                rc = j.wait(600)
                assert rc == 0, j.tail()
            self._done = True
        return self.run_dir

    def stop(self) -> None:
        for j in self.jobs:
            if j.proc.poll() is None:
                j.kill_tree()


def _copy_pipeline(small_pipeline, tmp_path_factory, name):
    root = tmp_path_factory.mktemp(name)
    shutil.copytree(small_pipeline, root / "run")
    return root, root / "run"


@pytest.fixture(scope="session")
def ppo_reference(small_pipeline, tmp_path_factory):
    """PPO on one node with two workers (launcher.nproc_per_node=2), never interrupted."""
    root, run = _copy_pipeline(small_pipeline, tmp_path_factory, "ppo_reference")
    p = Pending(run, Job(*ppo_args(run), *one_node(2), log=root / "log.txt"))
    yield p
    p.stop()


@pytest.fixture(scope="session")
def ppo_two_nodes(small_pipeline, tmp_path_factory):
    """The same PPO on two simulated nodes (two launchers, one worker each)."""
    root, run = _copy_pipeline(small_pipeline, tmp_path_factory, "ppo_two_nodes")
    p = Pending(run, *two_nodes(ppo_args(run), root, "ppo2n"))
    yield p
    p.stop()


@pytest.fixture(scope="session")
def ppo_restarted(small_pipeline, tmp_path_factory):
    """The same PPO with launcher.max_restarts=1; rank 0 (it writes metrics.jsonl and the trainer
    state) gets SIGKILL as soon as the first checkpoint is complete."""
    root, run = _copy_pipeline(small_pipeline, tmp_path_factory, "ppo_restarted")
    job = Job(*ppo_args(run), *one_node(2, max_restarts=1), log=root / "log.txt")
    ckpt = run / "ppo" / "checkpoints" / f"step_{PPO_SAVE_EVERY:08d}" / "trainer_state.json"

    def kill_rank0():
        ranks = workers(job.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[0], signal.SIGKILL)
        return ranks

    p = Pending(run, job, kill=When(ckpt.exists, kill_rank0, job, 400, "the first checkpoint"))
    yield p
    p.stop()


@pytest.fixture(scope="session", autouse=True)
def _overlap_ppo_jobs(request):
    wanted = {n for item in request.session.items for n in getattr(item, "fixturenames", ())}
    for name in OVERLAPPED:
        if name in wanted:
            request.getfixturevalue(name)


@pytest.fixture(autouse=True)
def _no_leftover_jobs():
    """A test that fails while its jobs run must not leave them eating the CI's two cores."""
    started = len(helpers.RUNNING)
    yield
    for job in helpers.RUNNING[started:]:
        if job.proc.poll() is None:
            job.kill_tree()
