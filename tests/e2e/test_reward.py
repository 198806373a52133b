"""Reward stage through the CLI, on top of the default SFT run."""

import json

import pytest
import torch

from tests.conftest import quick_sft_args, reward_from_default_sft, run_cli, score_cli


# the recipe's 1500 steps (~2 min); the export's behaviour: short_reward_run's tests below
@pytest.mark.slow
def test_default_reward_run(default_reward_run):
    out = default_reward_run / "reward"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if "eval/accuracy" in r][-1]
    # the recipe's target (docs/stages.md "Learning over seeds")
    assert final["eval/accuracy"] >= 0.95, final
    assert final["eval/chosen_score"] > final["eval/rejected_score"]
    assert all(k in rows[0] for k in ("loss", "accuracy"))
    stats = json.loads((out / "model" / "reward_stats.json").read_text())
    assert stats["std"] > 0 and stats["eval/accuracy"] == final["eval/accuracy"]


def test_contrast_pairs_are_trained_on_and_scored(default_sft_run, tmp_path):
    """reward.contrast: the opening line names the pairs, each kind's held-out accuracy is logged,
    and a reward model trained with them ranks the held-out chosen answers above an empty one and
    above another prompt's answer."""
    run_dir = tmp_path / "run"
    proc = reward_from_default_sft(default_sft_run, run_dir, 300, "reward.contrast=[other,empty]")
    assert "with contrast pairs other+empty at 0.25 each" in proc.stderr
    rows = [json.loads(x) for x in (run_dir / "reward" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if "eval/accuracy" in r][-1]
    assert final["eval/contrast_empty_accuracy"] >= 0.95, final
    assert final["eval/contrast_other_accuracy"] >= 0.8, final
    stats = json.loads((run_dir / "reward" / "model" / "reward_stats.json").read_text())
    assert stats["eval/contrast_empty_accuracy"] == final["eval/contrast_empty_accuracy"]


def test_hf_model_reproduces_stage_scores(short_reward_run):
    """AutoModelForSequenceClassification.from_pretrained scores like the stage's own scorer."""
    from transformers import AutoModelForSequenceClassification

    from rlhf.config import SyntheticConfig
    from rlhf.data import synthetic
    from rlhf.score import RewardScorer

    model_dir = short_reward_run / "reward" / "model"
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    assert hf.config.num_labels == 1
    scorer = RewardScorer(str(model_dir))
    _, held_out = synthetic.generate(SyntheticConfig(), 256, seed=1234)
    exs = held_out[:32]
    ours = scorer.score([e.prompt for e in exs], [e.chosen for e in exs])
    seqs = scorer.encode([e.prompt for e in exs], [e.chosen for e in exs])
    with torch.no_grad():
        # plain HF: one sequence at a time, no padding, HF's own pooling
        theirs = torch.stack([hf(input_ids=torch.tensor([s])).logits[0, 0] for s in seqs])
    assert (ours - theirs).abs().max().item() <= 1e-5
    right = scorer.score([e.prompt for e in exs], [e.chosen for e in exs])
    wrong = scorer.score([e.prompt for e in exs], [e.rejected for e in exs])
    assert (right > wrong).float().mean() >= 0.8
    stats = json.loads((model_dir / "reward_stats.json").read_text())
    # the stage's held-out mean score is reproduced by the saved model
    all_right = scorer.score([e.prompt for e in held_out], [e.chosen for e in held_out])
    all_wrong = scorer.score([e.prompt for e in held_out], [e.rejected for e in held_out])
    assert abs(torch.cat([all_right, all_wrong]).mean().item() - stats["mean"]) <= 1e-4


def test_score_cli(short_reward_run, tmp_path):
    model_dir = short_reward_run / "reward" / "model"
    proc = score_cli(
        model_dir, "--prompt", "Q: What is 03 + 45?\nA:", "--response", " The answer is 48."
    )
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(proc.stdout.splitlines()[0])) == {"score", "normalized"}

    # preference pairs: one line per pair, then the accuracy (a trained RM ranks them well)
    from rlhf.config import SyntheticConfig
    from rlhf.data import synthetic

    _, held_out = synthetic.generate(SyntheticConfig(), 256, seed=1234)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": e.prompt, "chosen": e.chosen, "rejected": e.rejected}) + "\n"
            for e in held_out[:64]
        )
    )
    proc = score_cli(model_dir, "--jsonl", pairs)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert len(lines) == 65 and set(lines[0]) == {"chosen", "rejected", "correct"}
    assert lines[-1]["pairs"] == 64 and lines[-1]["accuracy"] >= 0.8
    # not a reward model / no such directory: exit 2, one line
    for bad, fragment in (
        (short_reward_run / "sft" / "model", "not a reward model"),
        (tmp_path / "nope", "no such directory"),
    ):
        proc = score_cli(bad, "--prompt", "x", "--response", "y")
        assert (
            proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr
        ), proc.stderr


def test_reward_on_hh(default_sft_run, real_data, tmp_path):
    """Real HH pairs end to end: the model must fit 32 of them (evaluated on the same 32). Scoring
    the wrong position, swapping chosen and rejected or cutting the responses apart would leave it
    near chance; a tiny arithmetic model cannot generalise on HH, so held-out accuracy would say
    nothing."""
    import gzip

    pairs = tmp_path / "hh32.jsonl"
    with gzip.open(real_data / "hh-rlhf/harmless-base-test.jsonl.gz", "rt") as f:
        # short conversations: nothing is truncated away
        lines = [x for x in f if len(x) < 1200][:32]
    pairs.write_text("".join(lines))
    proc = run_cli(
        "stage=reward",
        f"run.dir={tmp_path}",
        f"model.path={default_sft_run / 'sft' / 'model'}",
        f"data.path={pairs}",
        "data.format=hh",
        f"data.eval_path={pairs}",
        "train.max_steps=40",
        "train.global_batch=8",
        "train.lr=1e-3",
        "train.warmup_steps=4",
        "train.save_every=0",
        "logger.progress=false",
        "data.max_prompt_len=256",
        "data.max_response_len=192",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "reward" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval/accuracy"] >= 0.9, rows[-1]


def test_reward_without_sft_exits_2(tmp_path):
    proc = run_cli("stage=reward", f"run.dir={tmp_path}", timeout=120)
    assert proc.returncode == 2
    assert "run stage=sft first or set model.path" in proc.stderr


def test_reward_resume_after_checkpoint(tmp_path):
    """A rerun with a larger train.max_steps resumes from the last checkpoint instead of starting
    over."""
    assert run_cli(*quick_sft_args(tmp_path, steps=10)).returncode == 0
    args = [
        "stage=reward",
        f"run.dir={tmp_path}",
        "train.max_steps=6",
        "train.save_every=3",
        "logger.progress=false",
        "train.global_batch=16",
        "data.synthetic.num_records=500",
    ]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli(*args, "train.max_steps=9")
    assert (
        again.returncode == 0 and "resumed from" in again.stderr and "step_00000006" in again.stderr
    )


@pytest.mark.slow  # ~36 s
def test_later_stages_start_from_the_previous_output(tmp_path):
    """model.path is the SFT stage's input: run_all.sh passes it to every stage, and the reward
    stage must still start from the SFT output (reward.model_path chooses another start
    explicitly)."""
    base, run = tmp_path / "base", tmp_path / "run"
    assert run_cli(*quick_sft_args(base, steps=2), "train.save_every=0").returncode == 0
    user_model = base / "sft" / "model"
    proc = run_cli(*quick_sft_args(run, steps=2), f"model.path={user_model}", "train.save_every=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    args = [
        "stage=reward",
        f"run.dir={run}",
        f"model.path={user_model}",
        "train.max_steps=1",
        "train.save_every=0",
        "logger.progress=false",
        "train.global_batch=16",
        "data.synthetic.num_records=500",
    ]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"reward: starting from {run / 'sft' / 'model'} (the SFT output" in proc.stderr
    proc = run_cli(*args, f"reward.model_path={user_model}", "run.resume=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"reward: starting from {user_model} (reward.model_path)" in proc.stderr
