"""model.disable_dropout through the stages: PPO (actor, reference) and DPO (policy, reference) on a
GPT-2 whose config carries dropout 0.1 train and export without it, and say so once per model;
model.disable_dropout=false keeps it and says that instead. (The ratio's numbers:
tests/unit/models/test_dropout.py.)"""

import json

from tests.conftest import run_cli
from tests.e2e.test_lora import tiny_gpt2

COMMON = (
    "logger.progress=false",
    "engine.precision=fp32",
    "train.save_every=0",
    "data.synthetic.num_records=300",
    "eval.gold_prompts=0",
    "data.eval_size=8",
    "train.max_steps=1",
    "train.warmup_steps=0",
)
GPT2_DROPOUT = ("resid_pdrop", "embd_pdrop", "attn_pdrop")


def dropouts(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    return {k: cfg[k] for k in GPT2_DROPOUT}


def test_ppo_and_dpo_run_and_export_without_dropout(tmp_path):
    base = tiny_gpt2(tmp_path / "gpt2")
    assert set(dropouts(base).values()) == {0.1}
    run = tmp_path / "run"
    proc = run_cli(
        "stage=ppo",
        f"run.dir={run}",
        f"ppo.actor_path={base}",
        "algorithm.estimator=grpo",
        "ppo.use_reward_model=false",
        "ppo.reward_fn=rlhf.rewards.gold",
        "ppo.prompts_per_step=4",
        "ppo.samples_per_prompt=2",
        "ppo.ppo_epochs=1",
        "ppo.minibatches_per_epoch=1",
        "ppo.max_new_tokens=4",
        "train.eval_every=0",
        *COMMON,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for role in ("actor", "reference"):
        assert (
            proc.stderr.count(
                f"dropout off in the {role} (model.disable_dropout=true; it had resid_pdrop=0.1"
            )
            == 1
        )
    assert set(dropouts(run / "ppo" / "actor").values()) == {0.0}

    proc = run_cli(
        "stage=dpo",
        f"run.dir={run}",
        f"dpo.model_path={base}",
        "train.global_batch=8",
        "model.disable_dropout=false",
        *COMMON,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for role in ("policy", "reference"):
        assert (
            f"dropout kept on in the {role} (model.disable_dropout=false): resid_pdrop=0.1"
            in proc.stderr
        )
    assert set(dropouts(run / "dpo" / "model").values()) == {0.1}
