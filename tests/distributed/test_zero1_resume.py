"""ZeRO-1 (DDP + ZeroRedundancyOptimizer) through the CLI on 2 ranks: a run resumed from its
checkpoint (optimizer state gathered on rank 0, re-partitioned at load) ends with the weights of
the uninterrupted run, and the optimizer-state file loads on one process too."""

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import quick_sft_args, run_cli

# ~35 s; ZeRO-1 parity runs by default (test_parity.py)
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_zero1_resume_matches_uninterrupted(tmp_path):
    # a constant rate: the schedule must not depend on train.max_steps, which the two halves change
    common = [
        "engine.zero_stage=1",
        "train.save_every=2",
        "train.scheduler=constant",
        "train.warmup_steps=0",
    ]
    ref, run = tmp_path / "ref", tmp_path / "run"
    proc = run_cli(*quick_sft_args(ref, steps=4), *common, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(*quick_sft_args(run, steps=2), *common, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "sft/checkpoints/step_00000002/actor.optim_zero1.pt").is_file()
    proc = run_cli(*quick_sft_args(run, steps=4), *common, nproc=2)
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr[-3000:]
    a = load_file(str(ref / "sft/model/model.safetensors"))
    b = load_file(str(run / "sft/model/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = torch.load(
        run / "sft/checkpoints/step_00000004/actor.optim_zero1.pt", weights_only=True
    )
    # every parameter's AdamW state, gathered
    assert len(state["state"]) == len(list(a))
