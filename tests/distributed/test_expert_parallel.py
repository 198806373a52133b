"""Expert parallelism (``engine.expert_parallel=2``, rlhf/engine/experts.py) on the embedded MoE
model (4 experts, top 2), fp32, gloo: each rank holds 2 experts and exchanges tokens by all-to-all.

GRPO on 2 ranks with EP 2 follows the 1-process run step for step (metrics and exported weights
within 1e-5), and its checkpoint resumes on 1 process ending where the uninterrupted run does; SFT
with its load-balancing loss does too (the term over both ranks' tokens); so does GRPO on 4 ranks
with EP 2 (two expert groups, FSDP2 over them) and its resume on 1 process. Bad settings exit 2.
"""

import shutil

import pytest

from tests.conftest import quick_sft_args, run_cli
from tests.distributed.test_world_size import (
    COMMON,
    SAVE,
    assert_same_run,
    cut_after_first_checkpoint,
    run_stage,
)

pytestmark = pytest.mark.distributed

MOE = ("model.num_experts=4", "model.experts_per_token=2")
EP2 = "engine.expert_parallel=2"


@pytest.fixture(scope="module")
def moe_sft(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ep") / "run"
    proc = run_cli(*quick_sft_args(run_dir, steps=30), "train.save_every=0", *MOE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_grpo_with_two_expert_ranks_follows_one_process_and_resumes_on_one(moe_sft, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    run_stage(moe_sft, one, "grpo", 1)
    proc = run_stage(moe_sft, two, "grpo", 2, EP2)
    assert "HF generate instead" not in proc.stderr
    assert_same_run(two, one, "grpo")
    cut = tmp_path / "cut"
    cut_after_first_checkpoint(two, cut, "grpo")
    proc = run_stage(moe_sft, cut, "grpo", 1)
    assert "written by 2 processes, resumed on 1" in proc.stderr, proc.stderr[-3000:]
    assert_same_run(cut, one, "grpo", after=SAVE)


def sft(dst, nproc, *extra):
    dst.mkdir(parents=True)
    proc = run_cli(
        "stage=sft",
        f"run.dir={dst}",
        *COMMON,
        "train.warmup_steps=2",
        *MOE,
        *extra,
        nproc=nproc,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
def test_grpo_with_expert_groups_of_two_on_four_ranks_follows_one_process(moe_sft, tmp_path):
    # EP 2 on 4 ranks: two expert groups holding the same experts, FSDP2 over them
    one, four = tmp_path / "one", tmp_path / "four"
    run_stage(moe_sft, one, "grpo", 1)
    proc = run_stage(moe_sft, four, "grpo", 4, EP2, "engine.threads_per_rank=1")
    assert "2 experts per rank in groups of 2 ranks" in proc.stderr, proc.stderr[-2000:]
    assert_same_run(four, one, "grpo")
    cut = tmp_path / "cut"
    cut_after_first_checkpoint(four, cut, "grpo")
    proc = run_stage(moe_sft, cut, "grpo", 1)
    assert "written by 4 processes, resumed on 1" in proc.stderr, proc.stderr[-3000:]
    assert_same_run(cut, one, "grpo", after=SAVE)


@pytest.mark.slow
def test_sft_with_two_expert_ranks_follows_one_process(tmp_path):
    # the load-balancing term over both ranks' tokens (one micro-batch each): 1 process's
    sft(tmp_path / "one", 1)
    sft(tmp_path / "ep", 2, EP2)
    assert_same_run(tmp_path / "ep", tmp_path / "one", "sft")


@pytest.mark.parametrize(
    "extra, nproc, says",
    [
        ((EP2,), 1, "does not divide the world size (1)"),
        # (each refusal's rule: tests/unit/models/test_moe.py; the 2-rank runs under -m slow)
        pytest.param((EP2, "engine.zero_stage=1"), 2, "needs ZeRO-2 or 3", marks=pytest.mark.slow),
        pytest.param(
            (EP2, "model.lora.r=4", "model.lora.experts=true"),
            2,
            "LoRA on expert-parallel",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_expert_parallel_refusals(extra, nproc, says, tmp_path):
    proc = run_cli(
        "stage=sft",
        f"run.dir={tmp_path / 'run'}",
        "train.max_steps=1",
        "eval.gold_prompts=0",
        *MOE,
        *extra,
        nproc=nproc,
    )
    # (under torchrun: the ranks exit 2, torchrun 1 naming their exit code)
    assert proc.returncode == (2 if nproc == 1 else 1), proc.stderr[-3000:]
    assert nproc == 1 or "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    assert says in proc.stderr, proc.stderr[-3000:]
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
