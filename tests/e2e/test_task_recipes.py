"""The task recipes run end to end on real data with a user's model (a tiny random-init Llama saved
as a Hugging Face directory): recipe=hh through SFT → reward → PPO → DPO, recipe=gsm8k_grpo through
SFT → GRPO with the answer rule. Only the sizes are cut (steps, batches, lengths); everything else
is the recipe's. Later stages are not told the recipe: they take it from the run's earlier
stages."""

import json

import pytest

from tests.conftest import run_cli

CUT = [
    "train.max_steps=2",
    "train.global_batch=8",
    "logger.progress=false",
    "engine.precision=fp32",
    "data.max_prompt_len=96",
    "data.max_response_len=32",
    "data.eval_size=16",
    "eval.gold_prompts=4",
]


def stage(name, run, *args):
    proc = run_cli(f"stage={name}", f"run.dir={run}", *CUT, *args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_hh_recipe_end_to_end(user_model, real_data, tmp_path):
    run, data = (
        tmp_path / "run",
        f"data.path={real_data / 'hh-rlhf' / 'harmless-base-test.jsonl.gz'}",
    )
    log = stage("sft", run, "recipe=hh", f"model.path={user_model}", data)
    assert "recipe=hh (recipe=hh on the command line)" in log
    for name, extra in (
        ("reward", ()),
        ("ppo", ("ppo.prompts_per_step=4", "ppo.min_rm_accuracy=0")),
        ("dpo", ()),
    ):
        log = stage(name, run, data, *extra)
        assert f"recipe=hh (the recipe of this run's earlier stages ({run}/" in log, name
    saved = (run / "ppo" / "config.yaml").read_text()
    assert "recipe: hh" in saved and "format: hh" in saved and "split: 2,4,4" in saved
    ppo = [json.loads(x) for x in (run / "ppo" / "metrics.jsonl").read_text().splitlines()]
    # GAE with a critic, the recipe's
    assert any("actor/loss" in r and "critic/loss" in r for r in ppo)
    assert (run / "dpo" / "model" / "config.json").is_file()


def gsm8k_sft_then_ppo(recipe, user_model, real_data, run):
    """SFT then GRPO of ``recipe`` on GSM8K, sizes cut; the PPO stage's log and the data
    override."""
    data = f"data.path={real_data / 'gsm8k' / 'train.jsonl.gz'}"
    stage(
        "sft",
        run,
        f"recipe={recipe}",
        f"model.path={user_model}",
        data,
        "data.max_response_len=160",
    )
    cut = (
        "ppo.prompts_per_step=2",
        "ppo.samples_per_prompt=4",
        "data.max_response_len=160",
        "ppo.max_new_tokens=40",
    )
    return stage("ppo", run, data, *cut), data


def test_gsm8k_grpo_recipe_end_to_end(user_model, real_data, tmp_path):
    run = tmp_path / "run"
    log, data = gsm8k_sft_then_ppo("gsm8k_grpo", user_model, real_data, run)
    assert "recipe=gsm8k_grpo" in log and "ppo (grpo)" in log
    rows = [json.loads(x) for x in (run / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/rule" in r for r in rows) and not any("critic/loss" in r for r in rows)
    refused = run_cli("stage=reward", f"run.dir={run}", data, timeout=120)
    assert (
        refused.returncode == 2 and "has no reward stage (its stages: sft, ppo)" in refused.stderr
    )
    assert "recipe=gsm8k_grpo (the recipe of this run's earlier stages" in refused.stderr


# (the default run's representative of episodes with tools: tests/e2e/test_agentic.py)
@pytest.mark.slow
def test_gsm8k_tools_recipe_end_to_end(user_model, real_data, tmp_path):
    """GSM8K with the sandboxed Python tool: prompts rendered with the tool, episodes of up to 4
    turns (a random policy rarely calls it: the path runs, learning is not expected)."""
    run = tmp_path / "run"
    log, _ = gsm8k_sft_then_ppo("gsm8k_tools", user_model, real_data, run)
    assert "recipe=gsm8k_tools" in log and "ppo (grpo)" in log
    saved = (run / "ppo" / "config.yaml").read_text()
    assert "- python" in saved and "max_turns: 4" in saved
    rows = [json.loads(x) for x in (run / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert any("env/turns" in r and "env/tool_use" in r for r in rows)
    assert any("gold/tool_use" in r for r in rows)
