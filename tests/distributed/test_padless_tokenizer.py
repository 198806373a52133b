"""A model whose tokenizer has no pad token, on 2 ranks (ZeRO-3): the pad that is added grows the
embeddings on every rank (rank 0's loaded model and the other ranks' meta models alike), so SFT and
the reward stage from the raw checkpoint train and export a model whose tokenizer and embeddings
agree, and PPO from the raw checkpoint runs (before: rank 1 aborted, the reward stage asserted on
padding_idx, PPO indexed out of range)."""

import pytest

from tests.conftest import run_cli
from tests.e2e.test_tokenizer_pad import (
    assert_hf_scores_like_rlhf_score,
    assert_vocab_agrees,
    raw_model,
)

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    # ~40 s; tests/e2e/test_tokenizer_pad.py covers the shapes in the default run
]
COMMON = (
    "train.save_every=0",
    "logger.progress=false",
    "engine.precision=fp32",
    "engine.zero_stage=3",
    "data.synthetic.num_records=400",
)


def test_padless_tokenizer_sft_reward_ppo_on_two_ranks(tmp_path):
    raw = raw_model(tmp_path / "raw")
    run = tmp_path / "run"
    proc = run_cli(
        "stage=sft",
        f"run.dir={run}",
        f"model.path={raw}",
        "train.max_steps=2",
        "train.global_batch=8",
        "train.warmup_steps=0",
        "eval.gold_prompts=4",
        "eval.gold_samples=1",
        *COMMON,
        nproc=2,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_vocab_agrees(run / "sft" / "model")

    proc = run_cli(
        "stage=reward",
        f"run.dir={run}",
        f"reward.model_path={raw}",
        "train.max_steps=2",
        "train.global_batch=8",
        *COMMON,
        nproc=2,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_vocab_agrees(run / "reward" / "model")
    assert_hf_scores_like_rlhf_score(run / "reward" / "model")  # pad ≠ EOS

    proc = run_cli(
        "stage=ppo",
        f"run.dir={run}",
        "ppo.min_rm_accuracy=0",
        f"ppo.actor_path={raw}",
        "train.max_steps=1",
        "ppo.prompts_per_step=4",
        "ppo.samples_per_prompt=2",
        "ppo.ppo_epochs=1",
        "ppo.minibatches_per_epoch=1",
        "ppo.max_new_tokens=8",
        "eval.gold_prompts=4",
        "eval.gold_samples=1",
        "train.eval_every=0",
        "engine.inference_tp_size=2",
        *COMMON,
        nproc=2,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_vocab_agrees(run / "ppo" / "actor")
