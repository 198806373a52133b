"""2 processes (torchrun, gloo) ≡ 1 process for ZeRO 0/1/2/3 and with accumulation (fp32); packed
(the default) ≡ padded forwards on 1 process and 2 ranks."""

import json

import pytest

from rlhf.engine.mesh import Mesh
from tests.conftest import run_worker
from tests.distributed import parity_worker as w

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def two_rank_curves(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity") / "curves.json"
    run_worker(w.__file__, str(out))
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference():
    return w.loss_curve(Mesh(), zero_stage=3, micro=0)


def test_reference_learns(reference):
    assert reference[-1] < reference[0]


@pytest.mark.parametrize("case", [c[0] for c in w.CASES])
def test_two_ranks_match_one_process(two_rank_curves, reference, case):
    assert two_rank_curves["world_size"] == 2
    got = two_rank_curves[case]
    for a, b in zip(got, reference):
        assert abs(a - b) <= 1e-4 * abs(b), (case, got, reference)


def test_accumulation_matches_full_batch_single_process(reference):
    for micro in (4, 2, 1):  # batch 8 ≡ 8/k × k accumulation
        got = w.loss_curve(Mesh(), zero_stage=3, micro=micro)
        for a, b in zip(got, reference):
            assert abs(a - b) <= 1e-4 * abs(b), (micro, got, reference)


def test_reward_two_ranks_match_one_process(two_rank_curves):
    ref = w.reward_curve(Mesh())
    assert ref[-1] < ref[0]
    for a, b in zip(two_rank_curves["reward_zero3"], ref):
        assert abs(a - b) <= 1e-4 * abs(b), (two_rank_curves["reward_zero3"], ref)


def test_packed_equals_padded_one_process_and_two_ranks(two_rank_curves, reference):
    """SFT and reward curves: the padded path (1 process, 2 ranks) ≡ the packed default."""
    padded = w.loss_curve(Mesh(), zero_stage=3, micro=0, packing=False)
    for a, b in zip(padded, reference):
        assert abs(a - b) <= 1e-5 * abs(b), (padded, reference)
    for a, b in zip(two_rank_curves["zero3_padded"], reference):
        assert abs(a - b) <= 1e-4 * abs(b), (two_rank_curves["zero3_padded"], reference)
    reward = w.reward_curve(Mesh())
    for a, b in zip(two_rank_curves["reward_zero3_padded"], reward):
        assert abs(a - b) <= 1e-4 * abs(b), (two_rank_curves["reward_zero3_padded"], reward)


@pytest.fixture(scope="module")
def lora_reference():
    return w.loss_curve(Mesh(), zero_stage=3, micro=0, lora=True)


def test_lora_reference_learns_and_differs(lora_reference, reference):
    assert lora_reference[-1] < lora_reference[0] - 0.05
    # the adapters, not the full weights, trained
    assert abs(lora_reference[-1] - reference[-1]) > 1e-3


@pytest.mark.parametrize("case", [c[0] for c in w.LORA_CASES])
def test_lora_two_ranks_match_one_process(two_rank_curves, lora_reference, case):
    got = two_rank_curves[case]
    for a, b in zip(got, lora_reference):
        assert abs(a - b) <= 1e-4 * abs(b), (case, got, lora_reference)


def test_lora_reward_two_ranks_match_one_process(two_rank_curves):
    ref = w.reward_curve(Mesh(), lora=True)
    assert ref[-1] < ref[0]
    for a, b in zip(two_rank_curves["reward_lora_zero3"], ref):
        assert abs(a - b) <= 1e-4 * abs(b), (two_rank_curves["reward_lora_zero3"], ref)


def test_reward_ensemble_two_ranks_match_one_process(two_rank_curves):
    """A 3-member reward ensemble (bootstrapped pairs) on 2 ranks (ZeRO-3) ≡ 1 process, and it
    learns."""
    ref = w.reward_curve(Mesh(), members=3)
    assert ref[-1] < ref[0], ref
    assert ref != w.reward_curve(Mesh()), "the ensemble's curve is the single model's"
    for a, b in zip(two_rank_curves["reward_ensemble_zero3"], ref):
        assert abs(a - b) <= 1e-4 * abs(b), (two_rank_curves["reward_ensemble_zero3"], ref)
