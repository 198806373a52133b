"""logger.tensorboard through the CLI: a short SFT run's event files, read back with TensorBoard's
EventAccumulator, hold metrics.jsonl's values at its steps; without the package, exit 2 and one line
before anything is written."""

from tests.conftest import ROOT, quick_sft_args, run_cli
from tests.unit.outputs.test_tensorboard import events, jsonl_as_events, same


def test_stage_run_writes_metrics_as_scalars(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(
        *quick_sft_args(run, steps=6),
        "train.log_every=2",
        "train.eval_every=3",
        "logger.tensorboard=true",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = events(run / "tensorboard" / "sft"), jsonl_as_events(run / "sft" / "metrics.jsonl")
    assert {"loss", "lr", "gold/score", "eval/loss", "mem/peak_gb"} <= set(got)
    assert same(got, want) and [s for s, _ in got["loss"]] == [1, 2, 4, 6]
    assert (
        f"TensorBoard: {run / 'tensorboard' / 'sft'} (tensorboard --logdir {run / 'tensorboard'})"
        in proc.stderr
    )


def test_missing_package_exits_2(tmp_path):
    # a tensorboard whose import fails, first on the path
    fake = tmp_path / "site"
    (fake / "tensorboard").mkdir(parents=True)
    (fake / "tensorboard" / "__init__.py").write_text(
        "raise ImportError(\"No module named 'tensorboard'\")\n"
    )
    env = {"PYTHONPATH": f"{fake}:{ROOT}"}
    proc = run_cli(
        "stage=sft", f"run.dir={tmp_path / 'run'}", "logger.tensorboard=true", env=env, timeout=120
    )
    errors = [x for x in proc.stderr.splitlines() if x.startswith("rlhf: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "logger.tensorboard=true needs the tensorboard package" in errors[0]
    assert "pip install 'rlhf[tensorboard]'" in errors[0]
    assert not (tmp_path / "run").exists()
