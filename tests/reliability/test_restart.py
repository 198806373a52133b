"""SIGKILL of a worker mid-PPO under ``launcher.max_restarts=1``: the elastic agent restarts the
workers, they resume from the last checkpoint, and the job ends (exit 0) with the weights, metrics
and checkpoints of a run that was never interrupted."""

import pytest

from tests.reliability.conftest import PPO_SAVE_EVERY, PPO_STEPS
from tests.reliability.helpers import alive, max_weight_diff, metrics, numbers, workers

pytestmark = pytest.mark.distributed


def test_killed_rank_restarts_and_matches_uninterrupted(ppo_restarted, ppo_reference):
    # {rank: pid} of the first attempt; rank 0 got SIGKILL
    killed = ppo_restarted.extra["kill"].result()
    run = ppo_restarted.result()
    job, ppo = ppo_restarted.jobs[0], run / "ppo"
    log = job.log.read_text()
    assert not any(alive(p) for p in killed.values())
    # the launcher has exited, and nothing of it is left
    assert workers(job.pid) == {}
    ckpt = ppo / "checkpoints" / f"step_{PPO_SAVE_EVERY:08d}"
    assert log.count(f"resumed from {ckpt} (step {PPO_SAVE_EVERY})") == 1, log
    assert "rlhf: error:" not in log

    ref = ppo_reference.result()
    for name in ("actor", "critic"):
        diff = max_weight_diff(ref / "ppo" / name, ppo / name)
        print(f"{name}: max |restarted - uninterrupted| = {diff:.3g}")
        assert diff == 0.0, (name, diff)
    # the restarted workers did not log a step twice, and logged what the uninterrupted run did
    rows = metrics(ppo / "metrics.jsonl")
    steps = [r["step"] for r in rows if "actor/loss" in r]
    assert steps == list(range(1, PPO_STEPS + 1)), steps
    assert numbers(rows) == numbers(metrics(ref / "ppo" / "metrics.jsonl"))
    # the run directory holds what an uninterrupted run holds: no half-written checkpoint or export
    ckpts = sorted(p.name for p in (ppo / "checkpoints").iterdir())
    assert ckpts == sorted(p.name for p in (ref / "ppo" / "checkpoints").iterdir()), ckpts
    assert sorted(p.name for p in ppo.iterdir()) == sorted(p.name for p in (ref / "ppo").iterdir())
    leftovers = [str(p) for p in ppo.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name]
    assert not leftovers, leftovers
