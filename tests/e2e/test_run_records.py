"""A run's first hour without surprises (issue 28), through the CLI: a finished stage reruns as
done, the gold evaluation says its size and can be turned off, every metrics line has the peak
memory, and rlhf.eval scores a policy with the run's own saved data and eval settings."""

import json
import subprocess
import sys

from omegaconf import OmegaConf

from tests.conftest import ENV, REAL_DATA, ROOT, quick_sft_args, run_cli, tool_cli


def rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def eval_cli(*args, timeout=300):
    return tool_cli("eval", *args, timeout=timeout)


def error_lines(proc, prog="python -m rlhf.eval"):
    return [x for x in proc.stderr.splitlines() if x.startswith(f"{prog}: error: ")]


def snapshot(path):
    """{relative path: (mtime_ns, bytes)} of every file under ``path``."""
    return {
        str(p.relative_to(path)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def test_a_finished_stage_reruns_as_done_and_a_larger_max_steps_continues_it(tmp_path):
    run = tmp_path / "run"
    args = [
        *quick_sft_args(run, steps=2),
        "train.save_every=2",
        "eval.gold_prompts=4",
        "data.synthetic.num_records=500",
    ]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    sft = run / "sft"
    # the gold evaluation says what it will generate, then how far it got (a status line: no
    # terminal here)
    assert (
        "gold: 4 held-out prompts × 1 sampled (temperature 1) + 1 greedy = 8 responses"
        in first.stderr
    )
    assert "gold: 8/8 responses (100%)" in first.stderr
    lines = rows(sft / "metrics.jsonl")
    # every line, eval's too
    assert len(lines) == 3 and all(r["mem/peak_gb"] > 0.05 for r in lines), lines
    saved = OmegaConf.load(sft / "config.yaml")
    assert (
        saved.stage,
        saved.train.max_steps,
        saved.eval.gold_prompts,
        saved.data.synthetic.num_records,
    ) == (
        "sft",
        2,
        4,
        500,
    )
    done = json.loads((sft / "done.json").read_text())
    assert (
        done["step"] == 2
        and done["outputs"] == ["model"]
        and set(done["fingerprint"]) >= {"model", "data"}
    )

    # the same command again: one line, exit 0, nothing touched (the export's mtime included)
    before = snapshot(sft)
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    said = [x for x in again.stderr.splitlines() if "already done" in x]
    assert len(said) == 1 and "sft: already done (step 2 = train.max_steps" in said[0], (
        again.stderr[-3000:]
    )
    assert "resumed from" not in again.stderr and "gold:" not in again.stderr
    assert snapshot(sft) == before

    # a larger train.max_steps continues from the last checkpoint
    more = run_cli(*args, "train.max_steps=3")
    assert more.returncode == 0, more.stderr[-3000:]
    assert f"resumed from {sft / 'checkpoints' / 'step_00000002'} (step 2)" in more.stderr
    assert json.loads((sft / "done.json").read_text())["step"] == 3
    assert [r["step"] for r in rows(sft / "metrics.jsonl") if "loss" in r] == [1, 2, 3]

    # run.resume=false trains it again from the start
    fresh = run_cli(*args, "train.max_steps=3", "run.resume=false")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "resumed from" not in fresh.stderr and "already done" not in fresh.stderr
    assert [r["step"] for r in rows(sft / "metrics.jsonl.prev") if "loss" in r] == [1, 2, 3]
    # train.log_every=10
    assert [r["step"] for r in rows(sft / "metrics.jsonl") if "loss" in r] == [1, 3]

    # a run directory from before config.yaml: the embedded task's policy is still scored
    (sft / "config.yaml").unlink()
    proc = eval_cli(sft / "model", "--run-dir", run, "eval.gold_prompts=4", "eval.gold_samples=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["config"] is None and res["data"] == "synthetic:generated" and res["prompts"] == 4


def test_gold_evaluation_can_be_turned_off(tmp_path):
    proc = run_cli(*quick_sft_args(tmp_path, steps=2), "train.save_every=0", "eval.gold_prompts=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("no gold evaluation") == 1 and "gold: " not in proc.stderr
    lines = rows(tmp_path / "sft" / "metrics.jsonl")
    assert not any(k.startswith("gold/") for r in lines for k in r) and "eval/loss" in lines[-1]
    summ = subprocess.run(
        [sys.executable, "-m", "rlhf.summary", str(tmp_path)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert summ.returncode == 0, summ.stderr[-3000:]
    sft = json.loads((tmp_path / "summary.json").read_text())["sft"]
    assert set(sft) == {"eval/loss", "mem/peak_gb"}
    # rlhf.eval follows the run's setting (nothing to evaluate: exit 2), the command line overrides
    # it
    model = tmp_path / "sft" / "model"
    off = eval_cli(model)
    assert (
        off.returncode == 2 and len(error_lines(off)) == 1 and "eval.gold_prompts=0" in off.stderr
    ), off.stderr
    on = eval_cli(model, "eval.gold_prompts=4")
    assert on.returncode == 0, on.stderr[-3000:]
    assert json.loads(on.stdout)["prompts"] == 4


def test_eval_scores_with_the_runs_own_data_and_eval_settings(tmp_path):
    """The GSM8K run's held-out prompts, eval sizes and lengths, not the built-in arithmetic task;
    no saved configuration and no data.* given: exit 2 rather than score the wrong task."""
    run = tmp_path / "run"
    proc = run_cli(
        "stage=sft",
        f"run.dir={run}",
        f"data.path={REAL_DATA / 'gsm8k' / 'train.jsonl.gz'}",
        "data.format=gsm8k",
        "train.max_steps=2",
        "train.global_batch=8",
        "train.save_every=0",
        "train.warmup_steps=1",
        "logger.progress=false",
        "engine.precision=fp32",
        "data.eval_size=16",
        "data.max_prompt_len=96",
        "data.max_response_len=64",
        "eval.gold_prompts=4",
        "eval.gold_samples=1",
        "eval.max_new_tokens=8",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = rows(run / "sft" / "metrics.jsonl")[-1]
    model, saved = run / "sft" / "model", run / "sft" / "config.yaml"

    res_proc = eval_cli(model, "--run-dir", run, "engine.precision=fp32")
    assert res_proc.returncode == 0, res_proc.stderr[-3000:]
    res = json.loads(res_proc.stdout)
    assert "gsm8k" in res["data"] and res["config"] == str(saved) and str(saved) in res_proc.stderr
    assert (res["prompts"], res["samples"], res["max_new_tokens"]) == (4, 1, 8)
    assert (
        res["gold/score"] == final["gold/score"]
        and res["gold/score_greedy"] == final["gold/score_greedy"]
    )

    # the command line wins, key by key
    wider = eval_cli(model, "--run-dir", run, "eval.gold_samples=2")
    assert wider.returncode == 0, wider.stderr[-3000:]
    assert (json.loads(wider.stdout)["prompts"], json.loads(wider.stdout)["samples"]) == (4, 2)

    saved.unlink()
    refused = eval_cli(model, "--run-dir", run)
    assert refused.returncode == 2 and len(error_lines(refused)) == 1, refused.stderr[-3000:]
    assert (
        "no saved stage configuration" in refused.stderr
        and "not trained on the embedded task" in refused.stderr
    )


def test_a_stage_refuses_its_result_once_the_model_it_started_from_is_exported_again(tmp_path):
    """The reward stage's fingerprint holds the identity of the SFT export it started from (its
    export.json: every file's sha256): SFT retrained with other settings makes a rerun of the reward
    stage stop with one line instead of saying 'already done' for the old SFT policy's reward model;
    SFT retrained with the same settings writes the same bytes, and the reward stage stays done."""
    run = tmp_path / "run"
    sft = [*quick_sft_args(run, steps=4), "train.save_every=0", "eval.gold_prompts=0"]
    assert run_cli(*sft).returncode == 0
    manifest = json.loads((run / "sft" / "model" / "export.json").read_text())["files"]
    assert "model.safetensors" in manifest and len(manifest["model.safetensors"]["sha256"]) == 64
    reward = [
        "stage=reward",
        f"run.dir={run}",
        "train.max_steps=4",
        "train.save_every=2",
        "logger.progress=false",
    ]
    reward += ["data.synthetic.num_records=2000", "eval.gold_prompts=0", "engine.precision=fp32"]
    assert run_cli(*reward).returncode == 0
    done = json.loads((run / "reward" / "done.json").read_text())
    assert done["fingerprint"]["input_models"].startswith("model:")

    assert run_cli(*sft, "run.resume=false").returncode == 0  # the same settings: the same export
    same = run_cli(*reward)
    assert same.returncode == 0 and "reward: already done" in same.stderr, same.stderr[-2000:]

    before = snapshot(run / "reward")
    # other settings: another export
    assert run_cli(*sft, "run.resume=false", "train.lr=1e-3").returncode == 0
    again = run_cli(*reward)
    lines = [x for x in again.stderr.splitlines() if x.startswith("rlhf: error:")]
    assert again.returncode == 2 and len(lines) == 1, again.stderr[-2000:]
    assert (
        "another export of the model(s) it starts from" in lines[0]
        and "run.resume=false" in lines[0]
    )
    assert snapshot(run / "reward") == before


def test_a_finished_stage_keeps_its_final_state_so_more_steps_continue_it(tmp_path):
    """train.save_every that does not divide train.max_steps (the pretrained recipe saves every
    500): the last step is checkpointed too, so a larger train.max_steps continues from it."""
    run = tmp_path / "run"
    args = [
        *quick_sft_args(run, steps=3),
        "train.save_every=2",
        "eval.gold_prompts=0",
        "train.log_every=1",
    ]
    assert run_cli(*args).returncode == 0
    ckpts = sorted(p.name for p in (run / "sft" / "checkpoints").iterdir())
    assert ckpts == ["step_00000002", "step_00000003"], ckpts
    more = run_cli(*args, "train.max_steps=5")
    assert more.returncode == 0, more.stderr[-2000:]
    assert f"resumed from {run / 'sft' / 'checkpoints' / 'step_00000003'} (step 3)" in more.stderr
    assert [r["step"] for r in rows(run / "sft" / "metrics.jsonl") if "loss" in r] == [
        1,
        2,
        3,
        4,
        5,
    ]
