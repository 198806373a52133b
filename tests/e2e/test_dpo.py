"""DPO stage through the CLI: a short run on the embedded task from a short SFT run, resume, bad
input."""

import json

import pytest

from tests.conftest import quick_sft_args, run_cli

DPO_STEPS = 120


def read_metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def dpo_args(run_dir, *extra):
    return [
        "stage=dpo",
        f"run.dir={run_dir}",
        f"train.max_steps={DPO_STEPS}",
        "train.save_every=60",
        "logger.progress=false",
        "engine.precision=fp32",
        "eval.gold_prompts=16",
        "data.synthetic.num_records=2000",
        *extra,
    ]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A short SFT run (≈ 25 s): right on the held-out prompts only now and then, so DPO has
    work."""
    run_dir = tmp_path_factory.mktemp("dpo") / "run"
    proc = run_cli(*quick_sft_args(run_dir, steps=300), "train.save_every=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


@pytest.fixture(scope="module")
def dpo_run(sft_run):
    """`python -m rlhf stage=dpo` on top of it, with the tuned recipe (conf/stage/dpo.yaml), ≈ 20
    s."""
    proc = run_cli(*dpo_args(sft_run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"dpo: starting from {sft_run / 'sft' / 'model'} (the SFT output" in proc.stderr
    return sft_run


def test_outputs_and_metrics(dpo_run):
    from transformers import AutoModelForCausalLM

    out = dpo_run / "dpo"
    assert (out / "model" / "model.safetensors").is_file() and (
        out / "model" / "tokenizer.json"
    ).is_file()
    AutoModelForCausalLM.from_pretrained(out / "model")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_00000060",
        "step_00000120",
    ]
    rows = read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    for key in (
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracy",
        "rewards/margin",
        "lr",
        "grad_norm",
        "samples_per_s",
    ):
        assert all(key in r for r in train), key
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, DPO_STEPS]
    for key in ("eval/rewards/accuracy", "eval/rewards/margin", "gold/score", "gold/score_greedy"):
        assert all(key in r for r in evals), key
    saved = json.loads((out / "model" / "rlhf_eval.json").read_text())
    assert saved == {
        "step": DPO_STEPS,
        **{k: v for k, v in evals[-1].items() if k not in ("step", "mem/peak_gb")},
    }


def test_held_out_preferences_are_learnt(dpo_run):
    """The policy equals the reference at step 0 (every implicit reward 0, accuracy 0 — strictly
    higher counts); after 120 steps its implicit reward ranks most held-out pairs right (measured
    0.71; a loss with the wrong sign, or one that ignores the pairs, stays at or below 0.5)."""
    evals = [r for r in read_metrics(dpo_run / "dpo" / "metrics.jsonl") if "eval/loss" in r]
    first, last = evals[0], evals[-1]
    assert first["eval/rewards/accuracy"] == 0.0 and first["eval/rewards/margin"] == 0.0
    assert last["eval/rewards/accuracy"] >= 0.6, last
    assert last["eval/rewards/margin"] > 0 and last["eval/loss"] < first["eval/loss"], last
    assert last["eval/logps/chosen"] > last["eval/logps/rejected"] + 1.0, last


def test_rerun_of_the_finished_run_keeps_the_policy(dpo_run):
    """A rerun finds the stage done at step 120: nothing to train, the same exported weights."""
    from safetensors.torch import load_file

    before = load_file(str(dpo_run / "dpo" / "model" / "model.safetensors"))
    proc = run_cli(*dpo_args(dpo_run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dpo: already done (step 120" in proc.stderr and "resumed from" not in proc.stderr
    after = load_file(str(dpo_run / "dpo" / "model" / "model.safetensors"))
    assert before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before)
    steps = [r["step"] for r in read_metrics(dpo_run / "dpo" / "metrics.jsonl") if "loss" in r]
    assert steps == sorted(set(steps))


def test_lora_dpo_trains_adapters_against_the_base(sft_run, tmp_path):
    """model.lora.r > 0: the reference is the policy with its adapters off (every implicit reward 0
    at step 0), only the adapted projections move (norms equal the SFT model's in the merged
    export), the adapter is saved in PEFT format, and the held-out pairs are learnt past 0.6."""
    from safetensors.torch import load_file

    # dpo.model_path alone would pick the pretrained recipe: this SFT model is the embedded task's
    proc = run_cli(
        *dpo_args(
            tmp_path / "run",
            "recipe=embedded",
            f"dpo.model_path={sft_run / 'sft' / 'model'}",
            "model.lora.r=8",
            "model.lora.alpha=16",
            "train.save_every=0",
        )
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run" / "dpo"
    assert (out / "adapter" / "adapter_config.json").is_file()
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval/loss" in r]
    assert evals[0]["eval/rewards/margin"] == 0.0 and evals[0]["eval/rewards/accuracy"] == 0.0
    assert evals[-1]["eval/rewards/accuracy"] >= 0.6, evals[-1]
    sft = load_file(str(sft_run / "sft" / "model" / "model.safetensors"))
    dpo = load_file(str(out / "model" / "model.safetensors"))
    assert sft.keys() == dpo.keys()
    moved = {k for k in sft if not sft[k].equal(dpo[k])}
    assert moved and all(k.endswith("proj.weight") for k in moved), sorted(moved)


def test_data_without_pairs_exits_2(sft_run, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Q{i}?", "response": f" A{i}."}) + "\n" for i in range(40))
    )
    proc = run_cli(
        "stage=dpo",
        f"run.dir={tmp_path / 'run'}",
        f"dpo.model_path={sft_run / 'sft' / 'model'}",
        f"data.path={data}",
        "data.format=prompt_response",
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert (
        len(errors) == 1 and "no preference pairs" in errors[0] and "Traceback" not in proc.stderr
    ), proc.stderr
    assert not (tmp_path / "run" / "dpo").exists()


def test_dpo_without_sft_exits_2(tmp_path):
    proc = run_cli("stage=dpo", f"run.dir={tmp_path}", timeout=120)
    assert (
        proc.returncode == 2
        and "run stage=sft first or set model.path (or dpo.model_path)" in proc.stderr
    )


def _run_all(*args, timeout=600):
    import subprocess

    from tests.conftest import ENV, ROOT

    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_all.sh"), *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_run_all_refuses_an_unknown_stage(tmp_path):
    proc = _run_all("stages=sft,dop", f"run.dir={tmp_path}", timeout=120)
    assert proc.returncode == 2 and "unknown stage 'dop'" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "sft").exists()


# ~40 s on an idle machine, minutes under load
@pytest.mark.slow
def test_run_all_dpo_path(tmp_path):
    """`scripts/run_all.sh stages=sft,dpo`: the leading stages= is the script's, the rest go to
    Hydra."""
    proc = _run_all(
        "stages=sft,dpo",
        f"run.dir={tmp_path}",
        "train.max_steps=30",
        "logger.progress=false",
        "data.synthetic.num_records=2000",
        "eval.gold_prompts=16",
        "train.save_every=0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == {"sft", "dpo", "seconds", "run"}
    assert set(summary["seconds"]) == {"sft", "dpo", "total"}
    assert "eval/rewards/accuracy" in summary["dpo"] and not (tmp_path / "reward").exists()
