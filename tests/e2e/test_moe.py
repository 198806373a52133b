"""A Mixture-of-Experts model through the stages on the embedded task (``model.num_experts``: the
embedded shape with Mixtral's blocks): SFT with the load-balancing loss, then GRPO with the rule in
the inference mode, the rollout's experts replayed in the actor's training forwards. In fp32 the
recompute routes as the rollout did; with a bf16 rollout of the fp32 weights some tokens' experts
flip, and replay brings the recompute's log-probs nearer the rollout's than the run without it."""

import json

import pytest

from tests.conftest import quick_reward, quick_sft_args, run_cli
from tests.e2e.test_ppo import quick_ppo

MOE = ["model.num_experts=4", "model.experts_per_token=2"]


@pytest.fixture(scope="module")
def moe_sft(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("moe") / "run"
    proc = run_cli(
        *quick_sft_args(run_dir, steps=30),
        "train.save_every=0",
        "train.router_z_loss_coef=1e-3",
        *MOE,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((run_dir / "sft" / "model" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    # the load-balancing loss (the config's router_aux_loss_coef) and the experts' load, logged
    rows = [json.loads(x) for x in (run_dir / "sft" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "moe/aux_loss" in r]
    assert steps and all(r["moe/aux_loss"] >= 2.0 - 1e-4 for r in steps)  # k = 2 when balanced
    assert all(r["moe/load_max_mean"] >= 1.0 for r in steps)
    # per MoE layer too (the embedded model's 4 layers), their mean the figure above
    layers = [[r[f"moe/load_max_mean/{j}"] for j in range(4)] for r in steps]
    assert all(abs(sum(x) / 4 - r["moe/load_max_mean"]) < 1e-6 for x, r in zip(layers, steps))
    assert all(r["moe/z_loss"] > 0 for r in steps)
    return run_dir


def grpo(moe_sft, run_dir, *extra):
    import shutil

    shutil.copytree(moe_sft / "sft", run_dir / "sft")
    args = quick_ppo(
        run_dir,
        "train.max_steps=2",
        "algorithm.estimator=grpo",
        "ppo.use_reward_model=false",
        "ppo.reward_fn=rlhf.rewards.gold",
        "ppo.rollout_guard=off",
        *extra,
    )
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no injection policy" not in proc.stderr and "HF generate instead" not in proc.stderr
    rows = [json.loads(x) for x in (run_dir / "ppo" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def test_moe_grpo_replays_the_rollouts_experts(moe_sft, tmp_path):
    # (with the router terms in the update: the balancing loss and the z-loss)
    router = ("algorithm.router_aux_loss_coef=0.01", "algorithm.router_z_loss_coef=1e-3")
    steps = grpo(moe_sft, tmp_path / "fp32", *router)
    assert len(steps) == 2
    for r in steps:
        assert r["moe/routing_flips"] < 0.01
        assert r["rollout/logprob_abs_diff_mean"] < 1e-5
        assert 2.0 - 1e-4 <= r["moe/aux_loss"] < 4.0 and r["moe/z_loss"] > 0
    # a bf16 rollout of the fp32 weights: flips, which replay takes out of the recompute
    bf16 = grpo(moe_sft, tmp_path / "bf16", "engine.inference_dtype=bf16")
    off = grpo(moe_sft, tmp_path / "off", "engine.inference_dtype=bf16", "ppo.routing_replay=false")
    assert bf16[0]["moe/routing_flips"] > 0 and "moe/routing_flips" not in off[0]
    # the first step's rollouts are the same in both runs (same weights, same draws)
    assert bf16[0]["reward/mean"] == off[0]["reward/mean"]
    assert bf16[0]["rollout/logprob_abs_diff_mean"] < off[0]["rollout/logprob_abs_diff_mean"]


def test_moe_sft_with_a_capacity_factor_counts_dropped_slots(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        *quick_sft_args(run_dir, steps=8),
        "train.save_every=0",
        "train.capacity_factor=1.0",
        "train.eval_capacity_factor=2.0",
        *MOE,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "sft" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "moe/dropped" in r]
    # capacity 1.0: an expert past its share of the batch's slots drops the rest
    assert steps and all(0 <= r["moe/dropped"] < 0.5 for r in steps)
    assert any(r["moe/dropped"] > 0 for r in steps)


@pytest.mark.slow
def test_moe_grpo_with_lora_on_the_experts_and_the_balancing_loss(moe_sft, tmp_path):
    # adapters on attention and every expert; after the first update the rollout serves the
    # adapted experts (merged in the inference layout) and the recompute agrees with it
    # (and the load-balancing loss in the update)
    lora = ("model.lora.r=4", "model.lora.experts=true", "algorithm.router_aux_loss_coef=0.01")
    steps = grpo(moe_sft, tmp_path / "lora", *lora)
    assert len(steps) == 2
    assert all(2.0 - 1e-4 <= r["moe/aux_loss"] < 4.0 for r in steps)  # k = 2 when balanced
    assert all(r["rollout/logprob_abs_diff_mean"] < 1e-5 for r in steps)
    assert all(r["moe/routing_flips"] < 0.01 for r in steps)
    adapter = json.loads(
        (tmp_path / "lora" / "ppo" / "adapter" / "adapter_config.json").read_text()
    )
    assert sorted(adapter["target_parameters"]) == [
        "mlp.experts.down_proj",
        "mlp.experts.gate_up_proj",
    ]


@pytest.mark.slow
def test_moe_rollout_worker_at_staleness_0_is_the_colocated_run(moe_sft, tmp_path):
    # the worker's generations carry their routing: the trainer replays it as the colocated run
    # does, to the last bit
    one = ("engine.threads_per_rank=1",)
    sync = grpo(moe_sft, tmp_path / "sync", *one)
    worker = grpo(moe_sft, tmp_path / "worker", *one, "ppo.rollout_workers=1")
    assert len(sync) == len(worker) == 2
    for a, b in zip(sync, worker):
        assert b["moe/routing_flips"] < 0.01
        for k, v in a.items():
            if k in b and not k.startswith(("time/", "mem/")) and "per_s" not in k:
                assert v == b[k], (a["step"], k, v, b[k])


def test_a_moe_reward_model_trains(moe_sft, tmp_path):
    # the scalar head over a MoE model: its own AdamW groups, the experts among them
    import shutil

    shutil.copytree(moe_sft / "sft", tmp_path / "sft")
    quick_reward(tmp_path, "train.max_steps=5")
    assert (tmp_path / "reward" / "model" / "config.json").exists()


def test_capacity_with_activation_checkpointing_is_refused(tmp_path):
    proc = run_cli(
        *quick_sft_args(tmp_path / "run", steps=2),
        "train.capacity_factor=1.0",
        "engine.activation_checkpointing=true",
        *MOE,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "train.capacity_factor with activation checkpointing" in proc.stderr
