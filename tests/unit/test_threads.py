"""CPU threads on a shared machine: the cores this process may use (affinity, cgroup quota),
OpenMP's short spin set before torch loads (a user's value wins), and the one warning when the step
rate collapses while other processes take the cores."""

import logging
import os
import subprocess
import sys

from rlhf import threads
from rlhf.outputs.log import Pace


def test_tame_openmp_sets_a_short_spin_and_keeps_the_users_value():
    env = {"KMP_BLOCKTIME": "200"}
    threads.tame_openmp(env)
    assert env == {"GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "200"}


def test_importing_rlhf_tames_openmp_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k not in threads.OPENMP_WAIT}
    code = "import rlhf, os, sys; print(os.environ['GOMP_SPINCOUNT'], 'torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["1000", "False"]


def test_cgroup_quota_caps_the_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    own = tmp_path / "self_cgroup"
    own.write_text("0::/\n")
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.usable_cores(tmp_path, own) == (
        2,
        "a cgroup CPU quota of 1.5 cores (8 in this process's CPU affinity)",
    )
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.usable_cores(tmp_path, own) == (8, "8 in this process's CPU affinity")
    # a Slurm job's own cgroup, below the root: its quota, and its parent's where smaller
    job = tmp_path / "system.slice" / "slurm" / "job_7"
    job.mkdir(parents=True)
    own.write_text("0::/system.slice/slurm/job_7\n")
    (job / "cpu.max").write_text("400000 100000\n")
    assert threads.usable_cores(tmp_path, own)[0] == 4
    (job.parent / "cpu.max").write_text("300000 100000\n")
    assert threads.usable_cores(tmp_path, own)[0] == 3
    for f in (tmp_path / "cpu.max", job / "cpu.max", job.parent / "cpu.max"):
        f.unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.usable_cores(tmp_path, own)[0] == 3


def test_default_threads_share_the_affinity_between_local_ranks(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 4})
    monkeypatch.setattr(threads, "_cgroup_quota", lambda root=None, own=None: None)
    assert threads.default_threads(1) == (3, "3 in this process's CPU affinity")
    assert threads.default_threads(2) == (1, "3 in this process's CPU affinity shared by 2 ranks")
    assert threads.default_threads(8)[0] == 1


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def _run(pace, clock, seconds_per_step):
    for s in seconds_per_step:
        clock.t += s
        pace.done = getattr(pace, "done", 0) + 1
        pace.step(pace.done)


def _pace(load):
    clock = Clock()
    pace = Pace(
        "sft",
        clock,
        logging.getLogger("test-pace"),
        window_s=10.0,
        min_steps=5,
        load=lambda: load,
        cores=lambda: 2,
        threads=lambda: 2,
    )
    return pace, clock


def test_pace_warns_once_when_steps_collapse_under_load(caplog):
    pace, clock = _pace(load=5.0)
    with caplog.at_level(logging.WARNING, logger="test-pace"):
        _run(pace, clock, [0.1] * 201)  # 10 steps/s
        _run(pace, clock, [2.0] * 40)  # 0.5 steps/s: 20x slower, for 80 s
        _run(pace, clock, [2.0] * 40)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert lines[0].startswith(
        "sft: 0.50 steps/s, 20.0x slower than earlier in this run (10.00 steps/s)"
    )
    assert (
        "load average of 5.0 on 2 usable cores" in lines[0]
        and "engine.threads_per_rank=1 (this run uses 2)" in lines[0]
    )


def test_pace_is_quiet_without_load_or_for_one_slow_window(caplog):
    # a slower phase of the run itself (longer responses): not the machine
    pace, clock = _pace(load=1.0)
    with caplog.at_level(logging.WARNING, logger="test-pace"):
        _run(pace, clock, [0.1] * 201 + [2.0] * 80)
    busy, bclock = _pace(load=5.0)
    with caplog.at_level(logging.WARNING, logger="test-pace"):
        # one 30-s evaluation inside a window
        _run(busy, bclock, [0.1] * 201 + [30.0] + [0.1] * 200)
    assert not caplog.records


def test_a_small_model_trains_on_one_thread_a_larger_one_on_the_cores(monkeypatch):
    import torch

    monkeypatch.setattr(threads, "_largest", 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        said = threads.fit_to_model(530_000, cores=2)
        assert torch.get_num_threads() == 1 and said.startswith(
            "1 CPU thread per rank: a model of 0.5M parameters"
        )
        assert threads.fit_to_model(400_000, cores=2) is None  # unchanged: no second line
        said = threads.fit_to_model(135_000_000, cores=2)
        assert (
            torch.get_num_threads() == 2
            and said == "2 CPU threads per rank: a model of 135.0M parameters uses them"
        )
        assert threads.fit_to_model(530_000, cores=2) is None  # the largest model so far decides
    finally:
        torch.set_num_threads(before)
