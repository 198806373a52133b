"""samples.jsonl: what the policy writes while it trains, beside metrics.jsonl and cut back with it
on resume; the progress line says what the reward is made of."""

import json

from rlhf.outputs.log import MetricsWriter
from rlhf.rl.metrics import reward_line


def test_samples_follow_the_metrics_file_on_resume(tmp_path):
    path = tmp_path / "ppo" / "metrics.jsonl"
    w = MetricsWriter(path, is_main=True, resume_step=None)
    for step in (10, 20, 30):
        w.log(step, loss=1.0)
        w.samples(
            step,
            "rollout",
            [{"prompt": "p\n", "response": "r|é", "reward": 0.5, "parts": {"rule": 0.5}}],
        )
    w.close()
    again = MetricsWriter(path, is_main=True, resume_step=20)  # resumed from step 20's checkpoint
    again.samples(30, "eval", [{"prompt": "q", "response": "a", "gold": float("nan")}])
    again.close()
    rows = [
        json.loads(x)
        for x in (tmp_path / "ppo" / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    assert [(r["step"], r["kind"]) for r in rows] == [
        (10, "rollout"),
        (20, "rollout"),
        (30, "eval"),
    ]
    assert (
        rows[0]["response"] == "r|é"
        and rows[0]["parts"] == {"rule": 0.5}
        and rows[2]["gold"] is None
    )


def test_off_rank_zero_nothing_is_written(tmp_path):
    w = MetricsWriter(tmp_path / "metrics.jsonl", is_main=False, resume_step=None)
    w.samples(1, "eval", [{"prompt": "q"}])
    w.close()
    assert not any(tmp_path.iterdir())


def test_the_reward_line_shows_its_parts():
    row = {"reward/mean": -0.844, "reward/rule": 0.125, "reward/overlong": -0.969}
    assert reward_line(row, ["rule", "overlong"]) == "-0.844 (rule 0.125, overlong -0.969)"
    assert reward_line(row, ["rule"]) == "-0.844"


def test_a_run_that_writes_no_samples_leaves_no_earlier_runs_behind(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = MetricsWriter(path, is_main=True, resume_step=None)
    for step in (1, 2, 3):
        first.log(step, loss=1.0)
        first.samples(step, "rollout", [{"prompt": "p"}])
    first.close()
    # writes no samples (logger.samples=0)
    resumed = MetricsWriter(path, is_main=True, resume_step=2)
    resumed.log(3, loss=0.5)
    resumed.close()
    samples = tmp_path / "samples.jsonl"
    assert [json.loads(x)["step"] for x in samples.read_text().splitlines()] == [1, 2]
    fresh = MetricsWriter(path, is_main=True, resume_step=None)
    fresh.log(1, loss=2.0)
    fresh.close()
    assert samples.read_text() == "" and (tmp_path / "samples.jsonl.prev").is_file()
