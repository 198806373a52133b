"""Learning that holds for seeds other than the default: the embedded pipeline (SFT → reward → PPO
with the reward model, and GRPO with the rule reward from the same SFT policy) through
bench/seeds.py, with the recipe's per-seed targets (docs/stages.md, "Learning over seeds")."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ENV, ROOT

SEEDS = (1, 3)


def figures(stdout: str) -> dict:
    """{seed: {metric: value}} from the bench's JSON lines (the per-seed ones, not
    min/median/max)."""
    out = {}
    for line in stdout.splitlines():
        row = json.loads(line)
        if row["variant"].startswith("seed"):
            out.setdefault(int(row["variant"][4:]), {})[row["metric"]] = row["value"]
    return out


# two whole pipelines (≈ 15 minutes on 2 cores)
@pytest.mark.slow
def test_two_other_seeds_meet_the_targets(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "seeds.py"),
            "--seeds",
            *map(str, SEEDS),
            "--parallel",
            "2",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figs = figures(proc.stdout)
    assert sorted(figs) == list(SEEDS), proc.stdout
    for seed, f in figs.items():
        where = f"seed {seed}: {f}"
        assert f["sft_gold_greedy"] >= 0.8 and 0.25 <= f["sft_gold"] <= 0.7, where
        assert f["rm_accuracy"] >= 0.95, where
        assert "ppo_refused" not in f, where
        assert f["ppo_gain"] >= 0.25 and f["ppo_gold_greedy"] >= f["sft_gold_greedy"] - 0.02, where
        assert f["grpo_gain"] >= 0.25 and f["grpo_gold_greedy"] >= f["sft_gold_greedy"] - 0.02, (
            where
        )
