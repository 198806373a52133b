"""Token-budget micro-batches (train.max_tokens_per_micro_batch) give the gradient of row-count
ones: SFT's, the reward stage's and DPO's real train_step, fp32, in one process and over 2 real
processes (torchrun, gloo, ZeRO-3), against the single-process step without accumulation. The losses
divide by the global batch's token or pair count, so only the float summation order differs."""

import json

import pytest
import torch

from rlhf.engine.mesh import Mesh
from tests.conftest import run_worker
from tests.distributed import token_budget_worker as w

# relative: the whole gradient (every parameter as one vector) and the loss
TOL = 1e-6


def assert_same(got, ref, what):
    (losses, grads), (ref_losses, ref_grads) = got, ref
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= TOL * abs(b), (what, losses, ref_losses)
    for step, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        assert g.keys() == r.keys(), what
        err = sum(float((g[k] - r[k]).double().norm() ** 2) for k in r) ** 0.5
        norm = sum(float(r[k].double().norm() ** 2) for k in r) ** 0.5
        assert err <= TOL * norm, (what, step, err / norm)


@pytest.fixture(scope="module")
def references():
    return {stage: w.stage_grads(Mesh(), stage, 0)[:2] for stage in w.STAGES}


@pytest.mark.parametrize("stage", w.STAGES)
def test_one_process_budgets_match_row_count_micro_batches(references, stage):
    counts = set()
    for budget in (12, 30, 1000):
        # rows over the budget alone ... everything in one micro-batch
        losses, grads, per_step = w.stage_grads(Mesh(), stage, budget)
        counts.update(n for n, _ in per_step)
        assert_same((losses, grads), references[stage], f"{stage} max_tokens={budget}")
    assert len(counts) >= 3 and 1 in counts and w.GLOBAL_BATCH in counts, counts
    # and the row-count path with accumulation (the reference is micro = the whole batch)
    assert_same(w.stage_grads(Mesh(), stage, 0, micro=2)[:2], references[stage], f"{stage} micro=2")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("token_budget")
    run_worker(w.__file__, str(out))
    results = json.loads((out / "results.json").read_text())
    grads = {}
    for name in results:
        if name != "world_size":
            flat = load_file(str(out / f"{name}.st"))
            grads[name] = [
                {k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith(f"{s}/")}
                for s in range(w.STEPS)
            ]
    return results, grads


@pytest.mark.distributed
def test_two_ranks_budgets_match_one_process(two_ranks, references):
    results, grads = two_ranks
    assert results["world_size"] == 2
    differed = False
    for stage in w.STAGES:
        for budget in w.BUDGETS[stage]:
            name = f"{stage}_{budget}"
            # per rank, per step: [micro-batches, the rank's own count]
            counts = results[name]["counts"]
            for (n0, own0), (n1, own1) in zip(*counts):
                assert n0 == n1 == max(own0, own1), (name, counts)  # one agreed count, every rank
                differed |= own0 != own1
            assert_same((results[name]["losses"], grads[name]), references[stage], name)
    assert differed, "no step where the ranks' own counts differed: the agreement went untested"


@pytest.mark.slow
@pytest.mark.distributed
def test_ppo_two_ranks_budgets_match_row_count_micro_batches(tmp_path):
    """ppo.max_tokens_per_micro_batch on 2 ranks (uneven shares of a minibatch: agreed counts,
    zero-weight stand-in rows) ≡ the same 2 ranks with row-count micro-batches."""
    from tests.distributed import ppo_token_budget_worker as pw

    out = tmp_path / "ppo.pt"
    run_worker(pw.__file__, str(out))
    results = torch.load(out)
    ref = results[0]
    for budget in pw.BUDGETS[1:]:
        got = results[budget]
        for key, want in ref["scored"].items():
            scale = max(1.0, float(want.abs().max()))
            assert float((got["scored"][key] - want).abs().max()) <= TOL * scale, (budget, key)
        for g, r in zip(got["actor"] + got["critic"], ref["actor"] + ref["critic"], strict=True):
            assert_same(([1.0], [g]), ([1.0], [r]), f"ppo max_tokens={budget}")
