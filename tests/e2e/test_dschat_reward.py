"""A DeepSpeed-Chat reward model through the CLI: ppo.reward_model_path=<its step-2 output> converts
it into <run.dir>/converted/ (once; reused by a rerun) and PPO's first step is the one the same
weights give as an rlhf reward model; reward.model_path=<it> trains from it; one that cannot be
converted exits 2 with one line."""

import json
import shutil

import pytest
import torch

from tests.conftest import run_cli
from tests.e2e.test_ppo import quick_ppo, rows


def as_dschat(rm_dir, out):
    """An rlhf reward model written as DeepSpeed-Chat's save_hf_format writes its RewardModel: the
    backbone under rwtransformer.*, the head as v_head.weight (pytorch_model.bin), the base model's
    config as create_hf_model leaves it, the tokenizer's files."""
    from safetensors.torch import load_file

    w = load_file(str(rm_dir / "model.safetensors"))
    sd = {"v_head.weight": w.pop("score.weight")}
    sd.update({"rwtransformer." + k[len("model.") :]: v for k, v in w.items()})
    out.mkdir(parents=True)
    torch.save(sd, out / "pytorch_model.bin")
    spec = json.loads((rm_dir / "config.json").read_text())
    for k in ("id2label", "label2id", "num_labels"):
        spec.pop(k, None)
    spec.update(
        architectures=["LlamaForCausalLM"],
        end_token_id=spec["eos_token_id"],
        n_embd=spec["hidden_size"],
    )
    # (create_hf_model; DeepSpeed-Chat's Llama pad is the tokenizer's)
    spec["pad_token_id"] = spec["eos_token_id"]
    (out / "config.json").write_text(json.dumps(spec))
    for f in rm_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out


# about 70 s; the fast representatives: tests/unit/models/test_dschat.py
@pytest.mark.slow
def test_ppo_and_reward_from_a_dschat_reward_model(small_pipeline, tmp_path):
    dschat_dir = as_dschat(small_pipeline / "reward" / "model", tmp_path / "step2_output")
    same = (
        "recipe=embedded",
        "train.max_steps=1",
        "ppo.temperature=0",
        "algorithm.reward_norm=none",
    )
    actor = f"ppo.actor_path={small_pipeline / 'sft' / 'model'}"
    ref = run_cli(
        *quick_ppo(
            tmp_path / "rlhf",
            *same,
            actor,
            f"ppo.reward_model_path={small_pipeline / 'reward' / 'model'}",
        )
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = tmp_path / "dschat"
    proc = run_cli(*quick_ppo(run, *same, actor, f"ppo.reward_model_path={dschat_dir}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    converted = list((run / "converted").iterdir())
    assert len(converted) == 1 and converted[0].name.startswith("reward_model_step2_output-")
    said = [x for x in proc.stderr.splitlines() if "a DeepSpeed-Chat reward model" in x]
    assert (
        len(said) == 1
        and f"ppo.reward_model_path={dschat_dir}" in said[0]
        and "converted in" in said[0]
    )
    assert f"ppo: critic starts from {converted[0]}" in proc.stderr
    a, b = (
        [r for r in rows(d / "ppo" / "metrics.jsonl") if "actor/loss" in r][-1]
        for d in (tmp_path / "rlhf", run)
    )
    for k in ("reward/mean", "reward/model", "actor/loss", "critic/loss", "values/explained_var"):
        # the same weights, read at the same position: bit for bit
        assert a[k] == b[k], (k, a[k], b[k])

    again = run_cli(
        *quick_ppo(run, *same, actor, f"ppo.reward_model_path={dschat_dir}"), timeout=300
    )
    assert again.returncode == 0 and "reusing its conversion" in again.stderr, again.stderr[-2000:]

    reward = run_cli(
        "stage=reward",
        f"run.dir={tmp_path / 'rm'}",
        f"reward.model_path={dschat_dir}",
        "train.max_steps=2",
        "train.save_every=0",
        "logger.progress=false",
        "data.synthetic.num_records=2000",
    )
    assert reward.returncode == 0 and "reward.model_path=" in reward.stderr, reward.stderr[-2000:]
    assert (tmp_path / "rm" / "reward" / "model" / "model.safetensors").is_file()

    bad = tmp_path / "step2_broken"
    shutil.copytree(dschat_dir, bad)
    sd = torch.load(bad / "pytorch_model.bin")
    torch.save({k: v for k, v in sd.items() if "layers.0.mlp" not in k}, bad / "pytorch_model.bin")
    proc = run_cli(*quick_ppo(tmp_path / "bad", actor, f"ppo.reward_model_path={bad}"), timeout=120)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("rlhf: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert (
        "a DeepSpeed-Chat reward model that cannot be converted" in errors[0]
        and "missing" in errors[0]
    )
    assert not (tmp_path / "bad" / "ppo").exists()
