"""First PPO step on 2 ranks (ZeRO-3, inference TP 1 and 2) ≡ 1 process (fp32, greedy, same seeds)."""
import json
import shutil

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.distributed
KEYS = ("actor/loss", "critic/loss", "reward/mean", "kl/mean", "response/length")


def first_step(src, dst, nproc, tp):
    shutil.copytree(src, dst)
    proc = run_cli("stage=ppo", f"run.dir={dst}", "train.max_steps=1", "ppo.prompts_per_step=8",
                   "ppo.samples_per_prompt=2", "ppo.ppo_epochs=2", "ppo.minibatches_per_epoch=2",
                   "ppo.temperature=0", "logger.progress=false", "eval.gold_prompts=8", "eval.gold_samples=1",
                   "train.eval_every=0", "train.save_every=0", "data.synthetic.num_records=2000",
                   "engine.zero_stage=3", f"engine.inference_tp_size={tp}", nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(x) for x in (dst / "ppo" / "metrics.jsonl").read_text().splitlines() if "actor/loss" in x][0]


def test_two_ranks_match_one_process(small_pipeline, tmp_path):
    ref = first_step(small_pipeline, tmp_path / "one", 1, 1)
    for tp in (1, 2):
        got = first_step(small_pipeline, tmp_path / f"two_tp{tp}", 2, tp)
        for k in KEYS:
            assert abs(got[k] - ref[k]) <= 1e-4 * max(abs(ref[k]), 1e-3), (tp, k, got[k], ref[k])
