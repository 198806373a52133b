"""The rollout-parity guard end to end: an inference copy that does not match the training weights
(tests/faults/fault_corrupt_inference.py: one layer's matrix perturbed when the hybrid engine builds
it) stops PPO before that step's update with exit 2 and one line; ppo.rollout_guard=rebuild rebuilds
the inference weights, regenerates and goes on when the fault was passing. Healthy runs: every other
PPO test runs with the guard on (its default)."""

import shutil

from tests.conftest import fault_env, run_cli, tree_digest
from tests.e2e.test_ppo import quick_ppo, rows

METRIC = "rollout/logprob_abs_diff_mean"


def error_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("rlhf: error:")]


def stepped(metrics) -> dict:
    """{step: its metrics line} of the lines with the step's experience (reward/mean)."""
    return {r["step"]: r for r in rows(metrics) if "reward/mean" in r}


def test_a_corrupted_inference_copy_stops_the_first_step(small_pipeline, tmp_path):
    shutil.copytree(small_pipeline, tmp_path / "run")
    run = tmp_path / "run"
    proc = run_cli(
        *quick_ppo(run, "train.max_steps=2"), env=fault_env("corrupt_inference", "always")
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # the threshold in force is said at the start
    assert (
        "rollout guard: rollout/logprob_abs_diff_mean above 0.001 (the fp32 default" in proc.stderr
    )
    (line,) = error_lines(proc.stderr)
    assert "ppo: step 1:" in line and f"{METRIC}=" in line and "against 0.001" in line
    assert "llama, inference dtype fp32 (training fp32), TP 1, kernels auto, decode dynamic" in line
    measured = float(line.split(f"{METRIC}=")[1].split()[0])
    # the corruption (~0.7) against fp32's healthy ~1e-7
    assert measured > 0.1, line
    # stopped before the update: no step line, no checkpoint, no export
    assert stepped(run / "ppo" / "metrics.jsonl") == {}
    assert (
        not list((run / "ppo").glob("checkpoints/step_*")) and not (run / "ppo" / "actor").exists()
    )


def test_rebuild_after_a_passing_fault_goes_on_and_a_lasting_one_stops(small_pipeline, tmp_path):
    """``once``: only the first inference copy is corrupted — kept between calls
    (engine.release_inference_cache=false), so without a rebuild step 1 would regenerate with it;
    the rebuild drops it and the run finishes. ``always`` on the resumed run: rebuilt, still off,
    stopped at step 3 with the checkpoint of step 2 and its metrics as they were."""
    shutil.copytree(small_pipeline, tmp_path / "run")
    run = tmp_path / "run"
    rebuild = ("ppo.rollout_guard=rebuild", "engine.release_inference_cache=false")
    args = quick_ppo(run, "train.max_steps=2", "train.save_every=2", *rebuild)
    proc = run_cli(*args, env=fault_env("corrupt_inference", "once"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ppo: step 1: the inference mode's log-probs do not match" in proc.stderr
    assert "rebuilding the inference weights" in proc.stderr and "going on" in proc.stderr
    lines = stepped(run / "ppo" / "metrics.jsonl")
    assert sorted(lines) == [1, 2] and all(r[METRIC] < 1e-5 for r in lines.values()), lines

    metrics_before = (run / "ppo" / "metrics.jsonl").read_text()
    actor = (run / "ppo" / "actor" / "model.safetensors").read_bytes()
    ckpt = run / "ppo" / "checkpoints" / "step_00000002"
    before = tree_digest(ckpt)
    proc = run_cli(*args, "train.max_steps=3", env=fault_env("corrupt_inference", "always"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    assert "ppo: step 3:" in line and "then again after rebuilding the inference weights" in line
    assert "rebuilding the inference weights" in proc.stderr and "Traceback" not in proc.stderr
    assert (run / "ppo" / "metrics.jsonl").read_text() == metrics_before
    assert tree_digest(ckpt) == before
    assert sorted(p.name for p in (run / "ppo" / "checkpoints").glob("step_*")) == ["step_00000002"]
    assert (run / "ppo" / "actor" / "model.safetensors").read_bytes() == actor
