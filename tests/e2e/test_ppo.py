"""PPO through the CLI: the embedded default (after SFT and reward), critic-free GRPO with the rule
reward, hybrid vs HF experience, resume after SIGKILL, non-finite updates, real data."""

import json
import signal
import sys

import pytest
import torch

from tests.conftest import killed_at, quick_sft_args, run_cli


def rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def gold_of(path):
    return [r["gold/score"] for r in rows(path) if "gold/score" in r]


# the least gain over 30 iterations each learning test accepts, from the default SFT model (and, for
# GAE, the default reward model); measured (run.seed 1234, 128 prompts × 2, gold 0.531 at the
# start): GAE +0.15 (reward/gold_corr 0.64 on average), GRPO +0.17, RLOO +0.15, REINFORCE++ +0.18.
GAIN = {"gae": 0.1, "grpo": 0.1, "rloo": 0.1, "reinforce_pp": 0.1}


def quick_ppo(run_dir, *extra):
    return [
        "stage=ppo",
        f"run.dir={run_dir}",
        "train.max_steps=4",
        "ppo.prompts_per_step=8",
        "ppo.samples_per_prompt=2",
        "ppo.ppo_epochs=1",
        "ppo.minibatches_per_epoch=2",
        "logger.progress=false",
        "eval.gold_prompts=8",
        "eval.gold_samples=1",
        "train.eval_every=0",
        "train.save_every=0",
        "data.synthetic.num_records=2000",
        "engine.precision=fp32",
        "ppo.min_rm_accuracy=0",
        *extra,
        # a 30-step reward model: below the default gate
    ]


# about 3 minutes; the recipe's targets (docs/stages.md "Learning over seeds")
@pytest.mark.slow
def test_default_ppo_beats_sft(default_reward_run):
    proc = run_cli("stage=ppo", f"run.dir={default_reward_run}", timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = default_reward_run / "ppo"
    gold = gold_of(out / "metrics.jsonl")
    sft_gold = gold_of(default_reward_run / "sft" / "metrics.jsonl")[-1]
    # the same prompts and decoding as the SFT stage's
    assert gold[0] == pytest.approx(sft_gold)
    assert gold[-1] >= sft_gold + 0.25, (sft_gold, gold)
    steps = [r for r in rows(out / "metrics.jsonl") if "reward/mean" in r]
    assert max(r["kl/mean"] for r in steps) < 3.0
    first = sum(r["reward/mean"] for r in steps[:10]) / 10
    last = sum(r["reward/mean"] for r in steps[-10:]) / 10
    assert last > first
    for name in ("actor", "critic"):
        assert (out / name / "model.safetensors").is_file()
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    AutoModelForCausalLM.from_pretrained(out / "actor")
    AutoModelForSequenceClassification.from_pretrained(out / "critic")


def test_grpo_with_rule_reward_raises_gold(default_sft_run, tmp_path):
    """GRPO with the gold rule as reward, 30 iterations from the default SFT model (the recipe's
    full 80 are bench/seeds.py's and tests/e2e/test_seeds.py's): gold rises, and no critic is loaded
    or saved."""
    gold = short_learning_run(
        default_sft_run,
        tmp_path,
        "algorithm.estimator=grpo",
        "ppo.use_reward_model=false",
        "ppo.reward_fn=rlhf.rewards.gold",
    )
    assert gold[-1] >= gold[0] + GAIN["grpo"], gold
    assert not (tmp_path / "ppo" / "critic").exists()
    # the first 4 rollouts at steps 1, 10, 20, 30 (logger.samples_every=10), with their reward's
    # parts
    samples = [json.loads(x) for x in (tmp_path / "ppo" / "samples.jsonl").read_text().splitlines()]
    rollouts = [s for s in samples if s["kind"] == "rollout"]
    assert [s["step"] for s in rollouts] == [k for k in (1, 10, 20, 30) for _ in range(4)]
    for s in rollouts:
        assert (
            "rule" in s["parts"]
            and "model" not in s["parts"]
            and s["reward"] == pytest.approx(sum(s["parts"].values()))
        )
        assert s["gold"] in (0.0, 1.0) and s["tokens"] > 0 and s["prompt"] and "advantage" in s
    assert {s["step"] for s in samples if s["kind"] == "eval"} == {0, 30}


def short_learning_run(sft_run, run_dir, *extra):
    """30 PPO iterations from the default SFT model, gold measured at the start and the end."""
    import shutil

    shutil.copytree(sft_run / "sft", run_dir / "sft")
    if (sft_run / "reward").is_dir():
        shutil.copytree(sft_run / "reward", run_dir / "reward")
    proc = run_cli(
        "stage=ppo",
        f"run.dir={run_dir}",
        "train.max_steps=30",
        "train.eval_every=0",
        "train.save_every=0",
        "eval.gold_prompts=128",
        "eval.gold_samples=2",
        "logger.progress=false",
        *extra,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return gold_of(run_dir / "ppo" / "metrics.jsonl")


# ~60 s; learning is bench/seeds.py's claim; the default run's representative: GRPO's above
@pytest.mark.slow
def test_gae_ppo_with_the_reward_model_raises_gold(default_reward_run, tmp_path):
    """PPO with a critic on the default reward model's scores (the pipeline's own path, no gold rule
    in the reward): 30 iterations must raise the held-out gold, and the reward must track the
    gold."""
    gold = short_learning_run(default_reward_run, tmp_path)
    assert gold[-1] >= gold[0] + GAIN["gae"], gold
    steps = [r for r in rows(tmp_path / "ppo" / "metrics.jsonl") if "reward/gold_corr" in r]
    assert sum(r["reward/gold_corr"] for r in steps) / len(steps) > 0.5, steps[-1]


# ~30 s each; their mechanics run by default (test_other_estimators_run), learning: GRPO's
@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp"])
def test_critic_free_estimators_raise_gold(default_sft_run, tmp_path, estimator):
    """RLOO and REINFORCE++ with the gold rule as reward: 30 iterations must raise the held-out gold
    (a sign error, a baseline that cancels the signal or a dead update leaves it where it was)."""
    gold = short_learning_run(
        default_sft_run,
        tmp_path,
        f"algorithm.estimator={estimator}",
        "ppo.use_reward_model=false",
        "ppo.reward_fn=rlhf.rewards.gold",
    )
    assert gold[-1] >= gold[0] + GAIN[estimator], gold


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp"])
def test_other_estimators_run(small_pipeline, tmp_path, estimator):
    import shutil

    shutil.copytree(small_pipeline, tmp_path / "run")
    proc = run_cli(*quick_ppo(tmp_path / "run", f"algorithm.estimator={estimator}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = [x for x in rows(tmp_path / "run" / "ppo" / "metrics.jsonl") if "reward/mean" in x]
    assert len(r) == 4 and all("critic/loss" not in x for x in r)
    for x in r:
        # reward/mean is the sum of its logged parts: the reward model's score and the no-EOS
        # penalty
        assert x["reward/model"] + x["reward/penalty"] == pytest.approx(x["reward/mean"], abs=1e-6)
        assert "reward/rule" not in x  # no rule reward in this run


def test_ptx_and_ema_actor(small_pipeline, tmp_path):
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(small_pipeline, tmp_path / "run")
    proc = run_cli(*quick_ppo(tmp_path / "run", "algorithm.ptx_coef=0.5", "ppo.ema_decay=0.5"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = [x for x in rows(tmp_path / "run" / "ppo" / "metrics.jsonl") if "reward/mean" in x]
    assert all(x["ptx/loss"] > 0 for x in r)
    actor = load_file(str(tmp_path / "run" / "ppo" / "actor" / "model.safetensors"))
    ema = load_file(str(tmp_path / "run" / "ppo" / "actor_ema" / "model.safetensors"))
    assert actor.keys() == ema.keys()
    assert any(not torch.equal(actor[k], ema[k]) for k in actor)  # an average, not a copy


def test_hybrid_and_hf_give_identical_greedy_experience(small_pipeline, tmp_path):
    import shutil

    firsts = []
    for hybrid in ("true", "false"):
        d = tmp_path / hybrid
        shutil.copytree(small_pipeline, d)
        proc = run_cli(
            *quick_ppo(d, "ppo.temperature=0", f"engine.hybrid={hybrid}", "train.max_steps=1")
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        firsts.append(next(x for x in rows(d / "ppo" / "metrics.jsonl") if "reward/mean" in x))
    a, b = firsts
    for k in ("reward/mean", "kl/mean", "response/length", "actor/loss", "critic/loss"):
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize(
    "episodes",
    [
        (),
        # 3-turn episodes, rewarded per turn (slow: the single-turn case is the default run's
        # representative)
        pytest.param(
            ("env.name=tests.e2e.agent_envs.Echo", "env.max_turns=3"), marks=pytest.mark.slow
        ),
    ],
    ids=["single_turn", "multi_turn"],
)
def test_ppo_resume_after_sigkill(small_pipeline, tmp_path, episodes):
    import shutil

    ref, run = tmp_path / "ref", tmp_path / "run"
    shutil.copytree(small_pipeline, ref)
    shutil.copytree(small_pipeline, run)
    # the EMA resumes too
    args = ["train.max_steps=6", "train.save_every=2", "ppo.ema_decay=0.5", *episodes]
    assert run_cli(*quick_ppo(ref, *args)).returncode == 0
    killed_at(quick_ppo(run, *args), run / "ppo/checkpoints/step_00000002/trainer_state.json")
    proc = run_cli(*quick_ppo(run, *args))
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr[-2000:]
    from safetensors.torch import load_file

    for name in ("actor", "critic", "actor_ema"):
        a = load_file(str(ref / "ppo" / name / "model.safetensors"))
        b = load_file(str(run / "ppo" / name / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_nonfinite_rewards_skip_then_stop(small_pipeline, tmp_path):
    import shutil

    shutil.copytree(small_pipeline, tmp_path / "run")
    proc = run_cli(
        *quick_ppo(
            tmp_path / "run",
            "ppo.reward_fn=tests.e2e.nan_reward.nan_reward",
            "ppo.max_nonfinite_in_a_row=2",
        )
    )
    assert proc.returncode == 2
    assert "non-finite" in proc.stderr and "Traceback" not in proc.stderr


def test_ppo_gsm8k_smoke(real_data, tmp_path):
    sft = run_cli(
        "stage=sft",
        f"run.dir={tmp_path}",
        f"data.path={real_data / 'gsm8k/train.jsonl.gz'}",
        "data.format=gsm8k",
        "train.max_steps=3",
        "train.global_batch=8",
        "train.save_every=0",
        "logger.progress=false",
        "data.max_prompt_len=96",
        "data.max_response_len=64",
        "eval.gold_prompts=4",
        "eval.max_new_tokens=8",
        "data.eval_size=16",
    )
    assert sft.returncode == 0, sft.stderr[-2000:]
    proc = run_cli(
        "stage=ppo",
        f"run.dir={tmp_path}",
        f"data.path={real_data / 'gsm8k/train.jsonl.gz'}",
        "data.format=gsm8k",
        "algorithm.estimator=grpo",
        "ppo.use_reward_model=false",
        "ppo.reward_fn=rlhf.rewards.gold",
        "train.max_steps=2",
        "ppo.prompts_per_step=4",
        "ppo.samples_per_prompt=2",
        "ppo.max_new_tokens=48",
        "ppo.ppo_epochs=1",
        "ppo.minibatches_per_epoch=1",
        "data.max_prompt_len=96",
        "eval.gold_prompts=4",
        "eval.max_new_tokens=8",
        "data.eval_size=16",
        "logger.progress=false",
        "train.save_every=0",
        # current GRPO practice on real data: clip-higher, dynamic sampling, Dr.GRPO's normaliser
        "algorithm.clip_ratio_high=0.28",
        "ppo.dynamic_sampling=true",
        "ppo.dynamic_sampling_max_rounds=1",
        "algorithm.loss_agg=token_sum_norm",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in rows(tmp_path / "ppo" / "metrics.jsonl") if "reward/rule" in r]
    assert len(steps) == 2
    # a 3-step SFT model never writes the right '#### <n>' (reward/rule 0) and runs past 48 tokens
    # on some rows (the no-EOS penalty); groups whose samples all scored alike were counted and
    # refilled
    for r in steps:
        assert r["reward/rule"] == 0.0 and r["reward/penalty"] < 0.0, r
        assert 0 <= r["dynamic/dropped_groups"] <= 4 * (r["dynamic/rounds"] + 1), r


def test_ppo_without_reward_model_exits_2(tmp_path):
    assert run_cli(*quick_sft_args(tmp_path, steps=2), "train.save_every=0").returncode == 0
    proc = run_cli("stage=ppo", f"run.dir={tmp_path}", timeout=120)
    assert proc.returncode == 2 and "run stage=reward first" in proc.stderr


def test_grpo_with_current_practice(small_pipeline, tmp_path):
    """Clip-higher, dynamic sampling, Dr.GRPO's token_sum_norm without std, the soft overlong
    penalty and filter, MIS correction, and kl_coef=0 (no reference model at all) together."""
    import shutil

    shutil.copytree(small_pipeline, tmp_path / "run")
    proc = run_cli(
        *quick_ppo(
            tmp_path / "run",
            "algorithm.estimator=grpo",
            "ppo.use_reward_model=false",
            "ppo.reward_fn=rlhf.rewards.gold",
            "ppo.samples_per_prompt=4",
            "algorithm.clip_ratio_high=0.28",
            "ppo.dynamic_sampling=true",
            "algorithm.loss_agg=token_sum_norm",
            "algorithm.std_normalize=false",
            "ppo.overlong_buffer=4",
            "ppo.overlong_filter=true",
            "algorithm.mismatch_correction=mis",
            "algorithm.kl_coef=0",
            "train.max_steps=2",
        )
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = [x for x in rows(tmp_path / "run" / "ppo" / "metrics.jsonl") if "reward/mean" in x]
    assert len(r) == 2
    for x in r:
        # no reference: the actor is its own reference
        assert x["kl/mean"] == 0.0
        assert x["dynamic/dropped_groups"] >= 0 and "dynamic/rounds" in x and "reward/overlong" in x
        # fp32: the inference mode matches training
        assert x["rollout/logprob_abs_diff_max"] < 1e-4
        assert x["rollout/correction_mean"] == 1.0  # nothing to correct: MIS masks no token


def test_sigterm_saves_a_ppo_checkpoint(small_pipeline, tmp_path):
    """Slurm's SIGTERM before the kill: PPO saves where it is (actor, critic, trainer state) and
    exits 143."""
    import shutil

    from tests.e2e.test_sft import _stop_when_logging

    run = tmp_path / "run"
    shutil.copytree(small_pipeline, run)
    cmd = [
        sys.executable,
        "-m",
        "rlhf",
        *quick_ppo(run, "train.max_steps=500", "train.log_every=1"),
    ]
    code, err = _stop_when_logging(cmd, run / "ppo" / "metrics.jsonl", signal.SIGTERM, lines=3)
    assert code == 143, err[-2000:]
    assert "stopped by SIGTERM after step" in err
    ckpts = list((run / "ppo" / "checkpoints").glob("step_*/trainer_state.json"))
    assert len(ckpts) == 1


@pytest.mark.slow  # ~17 s
def test_a_failing_rerun_loses_no_metrics(small_pipeline, tmp_path):
    """A fresh rerun over a finished run that fails at its first step: the earlier metrics survive
    whole (moved to metrics.jsonl.prev once the new run writes), the earlier actor stays."""
    import shutil

    shutil.copytree(small_pipeline, tmp_path / "run")
    run = tmp_path / "run"
    assert run_cli(*quick_ppo(run, "train.max_steps=2")).returncode == 0
    old_metrics = (run / "ppo" / "metrics.jsonl").read_text()
    old_actor = (run / "ppo" / "actor" / "model.safetensors").read_bytes()
    proc = run_cli(
        *quick_ppo(
            run,
            "train.max_steps=2",
            "ppo.reward_fn=tests.e2e.nan_reward.nan_reward",
            "ppo.max_nonfinite_in_a_row=1",
            "run.resume=false",
        )
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    kept = run / "ppo" / "metrics.jsonl.prev"
    assert kept.read_text() == old_metrics and len(old_metrics.splitlines()) >= 3
    assert (run / "ppo" / "actor" / "model.safetensors").read_bytes() == old_actor


def test_models_from_anywhere(small_pipeline, tmp_path):
    """ppo.actor_path, ppo.reward_model_path and ppo.critic_path start PPO from exported models
    outside run.dir: the same first step as the run whose run.dir holds them (fp32, greedy, no
    reward scaling, so the critic started from ppo.critic_path is the reward model as it is in
    both)."""
    import shutil

    from safetensors.torch import load_file

    same = (
        "recipe=embedded",
        "train.max_steps=1",
        "ppo.temperature=0",
        "algorithm.reward_norm=none",
    )
    shutil.copytree(small_pipeline, tmp_path / "inside")
    assert run_cli(*quick_ppo(tmp_path / "inside", *same)).returncode == 0
    proc = run_cli(
        *quick_ppo(
            tmp_path / "outside",
            *same,
            f"ppo.actor_path={small_pipeline / 'sft' / 'model'}",
            f"ppo.reward_model_path={small_pipeline / 'reward' / 'model'}",
            f"ppo.critic_path={small_pipeline / 'reward' / 'model'}",
        )
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"ppo: reward model {small_pipeline / 'reward' / 'model'}" in proc.stderr
    assert f"ppo: critic starts from {small_pipeline / 'reward' / 'model'}" in proc.stderr
    a, b = (
        [r for r in rows(tmp_path / d / "ppo" / "metrics.jsonl") if "actor/loss" in r][-1]
        for d in ("inside", "outside")
    )
    for k in ("reward/mean", "actor/loss", "critic/loss"):
        assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), k
    for name in ("actor", "critic"):
        wa, wb = (
            load_file(str(tmp_path / d / "ppo" / name / "model.safetensors"))
            for d in ("inside", "outside")
        )
        assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) == 0.0, name
    bad = run_cli(
        *quick_ppo(
            tmp_path / "bad",
            f"ppo.actor_path={small_pipeline / 'sft' / 'model'}",
            "ppo.reward_model_path=/no/such/rm",
        ),
        timeout=120,
    )
    assert (
        bad.returncode == 2 and "ppo.reward_model_path=/no/such/rm: no such directory" in bad.stderr
    )
    actor = f"ppo.actor_path={small_pipeline / 'sft' / 'model'}"
    for extra, says in (
        ((f"ppo.reward_model_path={small_pipeline / 'sft' / 'model'}",), "not a reward model"),
        (
            (
                f"ppo.critic_path={small_pipeline / 'sft' / 'model'}",
                f"ppo.reward_model_path={small_pipeline / 'reward' / 'model'}",
            ),
            "not a reward model",
        ),
        (
            (
                f"ppo.reward_model_path={small_pipeline / 'reward' / 'model'}",
                "ppo.use_reward_model=false",
                "ppo.reward_fn=rlhf.rewards.gold",
                "algorithm.estimator=grpo",
            ),
            "nothing uses it",
        ),
    ):
        bad = run_cli(*quick_ppo(tmp_path / "bad", actor, *extra), timeout=120)
        errors = [x for x in bad.stderr.splitlines() if x.startswith("rlhf: error:")]
        assert bad.returncode == 2 and len(errors) == 1 and says in errors[0], bad.stderr[-2000:]
