"""Storage that fails a run: a checkpoint damaged on disk (a truncated shard, a flipped byte) is
found by its manifest at resume, moved aside, and the run goes on from the checkpoint before it; a
save that runs out of space (tests/faults/fault_enospc.py) ends the run with exit 4 and one line,
leaving the previous checkpoint intact. Either way the rerun ends with the weights of an
uninterrupted run, bit for bit (fp32)."""

import re
import shutil
import time

import pytest
import torch

from rlhf.engine.checkpoint import verify_checkpoint
from rlhf.engine.mesh import Mesh
from tests.conftest import fault_env, quick_sft_args, run_cli
from tests.reliability.helpers import flip_byte, truncate, weights

# checkpoints at steps 2, 4 and 6, all kept
STEPS, SAVE_EVERY = 6, 2
SHARD = "__0_0.distcp"


def sft_args(run) -> list:
    """quick_sft_args at a few seconds a run: small batches, no gold evaluation."""
    quick = [a for a in quick_sft_args(run, steps=STEPS) if not a.startswith("eval.")]
    small = ["train.global_batch=8", "data.eval_size=16", "eval.gold_prompts=0"]
    return [*quick, *small, f"train.save_every={SAVE_EVERY}", "train.keep_checkpoints=3"]


def ckpt(run, step: int):
    return run / "sft" / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run, with fault_enospc counting (N=0: never failing) the files its saves
    write."""
    run = tmp_path_factory.mktemp("reference") / "run"
    proc = run_cli(*sft_args(run), env=fault_env("enospc", "0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    writes = re.findall(r"^fault_enospc: write (\d+): (.*)$", proc.stderr, re.M)
    assert writes, proc.stderr[-2000:]
    return run, [(int(i), path) for i, path in writes]


def assert_same_weights(run, reference_run):
    a, b = weights(reference_run / "sft" / "model"), weights(run / "sft" / "model")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_damaged_checkpoints_are_set_aside_and_the_run_resumes_before_them(reference, tmp_path):
    """The newest checkpoint's shard truncated, the one before it with a flipped byte: the rerun
    checks both, sets both aside and resumes from the third."""
    ref, _ = reference
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    truncate(ckpt(run, STEPS) / SHARD)
    flip_byte(ckpt(run, STEPS - SAVE_EVERY) / SHARD)
    # as if killed between its last checkpoint and the export: the rerun resumes instead of being
    # done
    (run / "sft" / "done.json").unlink()

    proc = run_cli(*sft_args(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = ckpt(run, SAVE_EVERY)
    warnings = [x for x in proc.stderr.splitlines() if "is damaged" in x]
    assert len(warnings) == 2, proc.stderr[-3000:]
    for warning, step, check in zip(warnings, (STEPS, STEPS - SAVE_EVERY), ("size", "sha256")):
        assert f"checkpoint {ckpt(run, step)} is damaged ({SHARD}: {check}" in warning, warning
        assert warning.endswith(f"resuming from {resumed}"), warning
        assert (ckpt(run, step).with_name(f"step_{step:08d}.damaged") / SHARD).is_file(), (
            "moved aside, not deleted"
        )
    assert f"resumed from {resumed} (step {SAVE_EVERY})" in proc.stderr
    assert verify_checkpoint(ckpt(run, STEPS), Mesh()) is None  # saved again, whole
    assert_same_weights(run, ref)


def test_a_save_that_runs_out_of_space_exits_4_and_the_rerun_resumes(reference, tmp_path):
    ref, writes = reference
    # the second file the second save writes: the disk fills up in the middle of step_4
    second_save = [i for i, path in writes if f"/.step_{2 * SAVE_EVERY:08d}.tmp-" in path]
    n = second_save[1]
    run = tmp_path / "run"
    proc = run_cli(*sft_args(run), env=fault_env("enospc", str(n)))
    assert proc.returncode == 4, proc.stderr[-3000:]
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("rlhf: error:")]
    assert (
        f"saving checkpoint step_{2 * SAVE_EVERY:08d} failed: [Errno 28] No space left on device"
        in line
    ), line
    assert line.endswith(f"it resumes from {ckpt(run, SAVE_EVERY)}"), line
    assert [p.name for p in (run / "sft" / "checkpoints").iterdir()] == [ckpt(run, SAVE_EVERY).name]
    assert not [p for p in run.rglob("*") if ".tmp-" in p.name], (
        "no temporary file or directory left"
    )
    assert verify_checkpoint(ckpt(run, SAVE_EVERY), Mesh()) is None

    proc = run_cli(*sft_args(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {ckpt(run, SAVE_EVERY)} (step {SAVE_EVERY})" in proc.stderr
    assert_same_weights(run, ref)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_that_runs_out_of_space_alone_ends_the_job_with_4(tmp_path):
    """Rank 1's RNG file (its second write of a save, after its DCP shard) hits ENOSPC while rank 0
    waits in the barrier: rank 1 exits 4 without entering it, and the job ends at once (well within
    engine.timeout_s) with 4 and rank 1's line."""
    run = tmp_path / "run"
    args = [
        *sft_args(run),
        "launcher.nproc_per_node=2",
        "engine.threads_per_rank=1",
        "engine.timeout_s=120",
    ]
    t0 = time.monotonic()
    proc = run_cli(*args, env=fault_env("enospc", "2@1"), timeout=300)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 100, "nobody waited for the collective timeout"
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("rlhf: error:")]
    assert (
        f"saving checkpoint step_{SAVE_EVERY:08d} failed on rank 1: [Errno 28]" in line
        and "rng_rank1.pt" in line
    )
    assert line.endswith("it starts the stage over (no complete checkpoint yet)"), line
    assert not (run / "sft" / "checkpoints" / f"step_{SAVE_EVERY:08d}").exists()
