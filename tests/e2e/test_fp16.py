"""engine.precision=fp16 through the CLI on the CPU, with an overflow injected into chosen optimizer
steps (tests/faults/fault_fp16_overflow.py: one gradient element set to inf after backward): the
step is skipped (weights unchanged across it), the loss scale follows engine.fp16.* and the step
lines carry it with the skipped count; PPO trains through more overflows in a row than
ppo.max_nonfinite_in_a_row; a resumed run scales and trains as the uninterrupted one, bit for
bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import fault_env, run_cli
from tests.reliability.helpers import metrics, numbers_by_step

# a small embedded model and batch: fp16 GEMMs are slow on the CPU
TINY = [
    "logger.progress=false",
    "engine.precision=fp16",
    "eval.gold_prompts=0",
    "data.synthetic.num_records=600",
    "data.eval_size=16",
    "train.global_batch=16",
    "train.warmup_steps=0",
    # (the resumed run extends train.max_steps: the same schedule)
    "train.scheduler=constant",
    "train.log_every=1",
    "train.save_every=2",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.intermediate_size=128",
]
# 1-based optimizer steps whose gradients overflow
STEPS, POISONED = 6, (2, 3)


def sft(run: Path, steps: int, fault: str | None):
    env = fault_env("fp16_overflow", fault) if fault else None
    proc = run_cli(
        "stage=sft", f"run.dir={run}", f"train.max_steps={steps}", *TINY, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def fault_lines(out: Path) -> list:
    return [json.loads(x) for x in (out / "steps_rank0.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def overflowed(tmp_path_factory):
    """SFT, 6 steps, the gradients of steps 2 and 3 overflowing: (run dir, the fault's record,
    stderr)."""
    tmp = tmp_path_factory.mktemp("fp16")
    proc = sft(tmp / "run", STEPS, f"at={POISONED[0]},times={len(POISONED)},out={tmp / 'fault'}")
    return tmp / "run", fault_lines(tmp / "fault"), proc.stderr


def test_sft_skips_the_overflowed_steps_and_halves_the_scale(overflowed):
    run, steps, stderr = overflowed
    assert [s["poisoned"] for s in steps] == [s in POISONED for s in range(1, STEPS + 1)]
    for s in steps:
        # the weights stay across a skipped step, and only there
        assert (s["before"] == s["after"]) == s["poisoned"], s
    rows = [r for r in metrics(run / "sft" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # hysteresis 2 (the default): step 2's overflow is tolerated, step 3's halves 2**16
    assert [r["train/loss_scale"] for r in rows] == [65536, 65536, 32768, 32768, 32768, 32768]
    assert [r["train/skipped_steps"] for r in rows] == [0, 1, 2, 2, 2, 2]
    assert rows[-1]["loss"] < rows[0]["loss"]  # and the other steps train
    assert "fp16 (actor): dynamic loss scale from 2**16 = 65536" in stderr
    assert (
        "optimizer step 2: gradients overflowed (inf/NaN): step skipped, loss scale 65536 kept"
        in stderr
    )
    assert (
        "optimizer step 3: gradients overflowed (inf/NaN): step skipped, loss scale 65536 → 32768"
        in stderr
    )
    state = json.loads(
        (run / "sft" / "checkpoints" / "step_00000004" / "trainer_state.json").read_text()
    )
    assert state["loss_scalers"]["actor"] == {
        "scale": 32768,
        "steps": 4,
        "good_steps": 1,
        "hysteresis": 1,
        "skipped": 2,
    }


def test_grpo_trains_through_overflows_in_a_row(overflowed, tmp_path):
    """4 overflows in a row of the actor's updates (ppo.max_nonfinite_in_a_row=3 counts non-finite
    losses and fp32 gradients, not the loss scaler's overflows): skipped, the scale halving from the
    2nd."""
    run = overflowed[0]
    ppo = [
        "stage=ppo",
        f"run.dir={run}",
        "train.max_steps=2",
        "algorithm.estimator=grpo",
        "ppo.use_reward_model=false",
        "ppo.reward_fn=rlhf.rewards.gold",
        "ppo.prompts_per_step=4",
        "ppo.samples_per_prompt=2",
        "ppo.ppo_epochs=1",
        "ppo.minibatches_per_epoch=2",
        "train.save_every=0",
        "logger.progress=false",
        "engine.precision=fp16",
        "eval.gold_prompts=0",
    ]
    proc = run_cli(*ppo, env=fault_env("fp16_overflow", f"at=1,times=4,role=actor,out={tmp_path}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in metrics(run / "ppo" / "metrics.jsonl") if "actor/loss" in r]
    assert [(r["actor/loss_scale"], r["actor/skipped_steps"]) for r in rows] == [
        (32768, 2),
        (8192, 4),
    ]
    assert "nonfinite_skipped" not in rows[0] and "nonfinite_skipped" not in rows[1]
    # 2 updates a step, all skipped
    assert all(s["before"] == s["after"] for s in fault_lines(tmp_path))
    # the inference copy of fp16 training on the CPU is fp32; the guard compares at fp16
    assert (
        "rollout guard: rollout/logprob_abs_diff_mean above 0.02 (the fp16 default" in proc.stderr
    )
    assert "inference dtype fp32 (training fp16)" in proc.stderr


@pytest.mark.slow
def test_sft_resume_is_bit_exact_with_the_loss_scale(overflowed, tmp_path):
    """The same run stopped after step 4 (a checkpoint after both overflows: scale 32768, hysteresis
    used) and continued to step 6 without the fault: every number and the exported weights equal the
    uninterrupted run's."""
    run = overflowed[0]
    sft(tmp_path / "run", 4, f"at={POISONED[0]},times={len(POISONED)}")
    proc = sft(tmp_path / "run", STEPS, None)
    assert "resumed from" in proc.stderr and "(step 4)" in proc.stderr
    resumed, whole = (numbers_by_step(r / "sft" / "metrics.jsonl") for r in (tmp_path / "run", run))
    # (the first run's final evaluation, at step 4)
    resumed[4].pop("eval/loss")
    assert resumed == whole
    assert [resumed[s]["train/loss_scale"] for s in (4, 5, 6)] == [32768] * 3
    model = "sft/model/model.safetensors"
    assert (tmp_path / "run" / model).read_bytes() == (run / model).read_bytes()
