"""DeepSpeed-Chat's own families through the stages from Hugging Face directories, the hybrid
engine's inference mode generating throughout (no HF generate fallback; its rollout log-probs logged
and within fp32 rounding of the training recompute), every export loading as its HF class. Default:
PPO with GAE from an OPT actor (pre-LN, 1.3b-like, tiny) and an OPT-350m-like reward model (post-LN,
project_in/out to a narrower embedding), which is also the critic. Slow: OPT SFT → reward (from its
own base) → PPO, and GPT-2 (Conv1D) SFT → GRPO with the rule reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.infer_helpers import tiny_config

FALLBACK = "generating with HF generate instead"
COMMON = (
    "logger.progress=false",
    "engine.precision=fp32",
    "train.save_every=0",
    "data.synthetic.num_records=300",
    "data.eval_size=8",
    "eval.gold_prompts=8",
    "eval.gold_samples=1",
    "train.warmup_steps=0",
)


def task_tokenizer():
    """A tokenizer trained on the embedded task's strings (pad distinct from EOS)."""
    from rlhf.config import SyntheticConfig
    from rlhf.data import synthetic
    from rlhf.data.tokenizer import train_tokenizer

    return train_tokenizer(
        synthetic.tokenizer_corpus(SyntheticConfig()), vocab_size=300, model_max_length=256
    )


def hf_dir(path: Path, family: str, tok, head: bool = False, **config) -> Path:
    """A random-init causal LM of ``family`` (``head``: a one-label sequence classifier) with
    ``tok``, saved as a Hugging Face directory; tiny (``tests.infer_helpers.tiny_config``),
    ``config`` on top."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ids = dict(
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id
    )
    cfg = tiny_config(family, vocab=len(tok), **ids, **config)
    torch.manual_seed(0)
    if head:
        cfg.num_labels = 1
        AutoModelForSequenceClassification.from_config(cfg).save_pretrained(path)
    else:
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def metric_rows(path: Path) -> list:
    return [json.loads(x) for x in path.read_text().splitlines()]


def assert_inference_mode(proc, metrics: Path) -> None:
    """Rollouts from the inference mode: no fallback line, and its log-probs (which HF generate does
    not return) logged beside the training recompute, within fp32 rounding of it."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert FALLBACK not in proc.stderr, [
        line for line in proc.stderr.splitlines() if FALLBACK in line
    ]
    steps = [r for r in metric_rows(metrics) if "reward/mean" in r]
    assert steps and all("rollout/logprob_abs_diff_max" in r for r in steps), steps
    worst = max(r["rollout/logprob_abs_diff_max"] for r in steps)
    # fp32: rounding (a wrong layout or weight is off by 1e-2 and more)
    assert worst < 1e-4, worst


# OPT-1.3b-like, tiny: pre-LN, final norm, tied
ACTOR = dict(hidden=64, heads=4, intermediate=256)
# OPT-350m-like: post-LN, project_in/out
REWARD = dict(do_layer_norm_before=False, word_embed_proj_dim=32)
PPO = (
    "train.max_steps=2",
    "ppo.prompts_per_step=4",
    "ppo.samples_per_prompt=2",
    "ppo.ppo_epochs=1",
    "ppo.minibatches_per_epoch=1",
    "ppo.max_new_tokens=8",
    "train.eval_every=0",
)


def assert_opt_exports(run: Path, *heads: str) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    assert (
        type(AutoModelForCausalLM.from_pretrained(run / "ppo" / "actor")).__name__
        == "OPTForCausalLM"
    )
    for name in heads:
        model = AutoModelForSequenceClassification.from_pretrained(run / name)
        assert type(model).__name__ == "OPTForSequenceClassification"
        assert model.config.word_embed_proj_dim == 32 and not model.config.do_layer_norm_before


def test_opt_ppo_with_the_inference_mode(tmp_path):
    tok = task_tokenizer()
    actor = hf_dir(tmp_path / "opt-1.3b-like", "opt", tok, **ACTOR)
    reward = hf_dir(tmp_path / "opt-350m-like", "opt", tok, head=True, **REWARD)
    run = tmp_path / "run"
    proc = run_cli(
        "stage=ppo",
        f"run.dir={run}",
        f"ppo.actor_path={actor}",
        f"ppo.reward_model_path={reward}",
        "ppo.min_rm_accuracy=0",
        *PPO,
        *COMMON,
    )
    assert_inference_mode(proc, run / "ppo" / "metrics.jsonl")
    assert_opt_exports(run, "ppo/critic")


# three stages (~1.5 min on an idle 2-core machine)
@pytest.mark.slow
def test_opt_sft_reward_and_ppo_with_the_inference_mode(tmp_path):
    tok = task_tokenizer()
    actor = hf_dir(tmp_path / "opt-1.3b-like", "opt", tok, **ACTOR)
    critic = hf_dir(tmp_path / "opt-350m-like", "opt", tok, **REWARD)
    run = tmp_path / "run"
    proc = run_cli(
        "stage=sft", f"run.dir={run}", f"model.path={actor}", "train.max_steps=4", *COMMON
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the SFT stage's gold evaluation generates too
    assert FALLBACK not in proc.stderr
    proc = run_cli(
        "stage=reward",
        f"run.dir={run}",
        f"reward.model_path={critic}",
        "train.max_steps=4",
        *COMMON,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("stage=ppo", f"run.dir={run}", "ppo.min_rm_accuracy=0", *PPO, *COMMON)
    assert_inference_mode(proc, run / "ppo" / "metrics.jsonl")
    assert_opt_exports(run, "reward/model", "ppo/critic")


# the GPT-2 actor path once more (~40 s); its modules: tests/unit/models/test_policy_sweep.py
@pytest.mark.slow
def test_gpt2_sft_and_grpo_with_the_inference_mode(tmp_path):
    base = hf_dir(tmp_path / "gpt2", "gpt2", task_tokenizer())
    run = tmp_path / "run"
    proc = run_cli(
        "stage=sft", f"run.dir={run}", f"model.path={base}", "train.max_steps=4", *COMMON
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert FALLBACK not in proc.stderr
    proc = run_cli(
        "stage=ppo",
        f"run.dir={run}",
        "algorithm.estimator=grpo",
        "ppo.use_reward_model=false",
        "ppo.reward_fn=rlhf.rewards.gold",
        *PPO,
        *COMMON,
    )
    assert_inference_mode(proc, run / "ppo" / "metrics.jsonl")


def test_held_out_prompts_are_cut_as_training_prompts_are(tmp_path):
    """A model with a short position table (GPT-2's learned positions) and prompts that only fit
    once cut to data.max_prompt_len: the step-0 evaluation of held-out prompts applies the training
    prompts' rule (it used to send them whole and crash); a prompt that still cannot fit is one
    line, exit 2."""
    from rlhf.config import SyntheticConfig
    from rlhf.data import synthetic

    tok = task_tokenizer()
    prompt_len = len(tok(synthetic.prompt_text(3, 45, 2))["input_ids"])
    new = 6
    base = hf_dir(tmp_path / "gpt2", "gpt2", tok, n_positions=prompt_len + new - 2)
    # every prompt of the task has prompt_len tokens
    assert SyntheticConfig().max_operand == 49
    args = [
        "stage=ppo",
        f"model.path={base}",
        "algorithm.estimator=grpo",
        "ppo.use_reward_model=false",
    ]
    args += [
        "ppo.reward_fn=rlhf.rewards.gold",
        "train.max_steps=1",
        "ppo.prompts_per_step=2",
        "ppo.samples_per_prompt=2",
    ]
    args += [f"ppo.max_new_tokens={new}", f"eval.max_new_tokens={new}", *COMMON]
    proc = run_cli(*args, f"run.dir={tmp_path / 'cut'}", f"data.max_prompt_len={prompt_len - 4}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gold/score" in metric_rows(tmp_path / "cut" / "ppo" / "metrics.jsonl")[0]
    proc = run_cli(*args, f"run.dir={tmp_path / 'whole'}", f"data.max_prompt_len={prompt_len}")
    lines = [x for x in proc.stderr.splitlines() if x.startswith("rlhf: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[
        -3000:
    ]
    assert "position table" in lines[0] and "lower data.max_prompt_len" in lines[0]


def test_generate_cuts_a_long_prompt_to_the_position_table(tmp_path):
    """rlhf.generate --file on GPT-2's learned positions: a prompt longer than the table leaves
    beside the new tokens keeps its end (the training prompts' rule), said once; --max-prompt-len
    cuts further; new tokens that leave no room are one line, exit 2."""
    from tests.conftest import tool_cli

    tok = task_tokenizer()
    base = hf_dir(tmp_path / "gpt2", "gpt2", tok, n_positions=24)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 3 + 45? " * 8 + "\nWhat is 1 + 2?\n")
    assert len(tok("What is 3 + 45? " * 8)["input_ids"]) > 24
    proc = tool_cli("generate", base, "--file", prompts, "--max-new-tokens", 6, "--temperature", 0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in proc.stdout.splitlines()]
    assert len(rows) == 2 and all(r["tokens"] <= 6 for r in rows)
    assert (
        "rlhf.generate: 1 prompt(s) longer than 18 tokens keep their last 18 (--max-prompt-len)"
        in proc.stderr
    )
    proc = tool_cli(
        "generate", base, "--file", prompts, "--max-new-tokens", 6, "--max-prompt-len", 4
    )
    assert (
        proc.returncode == 0 and "2 prompt(s) longer than 4 tokens keep their last 4" in proc.stderr
    )
    proc = tool_cli("generate", base, "--file", prompts, "--max-new-tokens", 30)
    assert (
        proc.returncode == 2
        and "no room for a prompt" in proc.stderr
        and "Traceback" not in proc.stderr
    )
