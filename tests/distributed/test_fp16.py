"""fp16 with loss scaling: 2 processes (torchrun, gloo) ≡ 1 process for ZeRO 0/1/2/3, and an
overflow on one rank only (its gradients poisoned after backward and the reductions) skips the step
on every rank."""

import json

import pytest

from rlhf.engine.mesh import Mesh
from tests.conftest import run_worker
from tests.distributed import fp16_worker as w

pytestmark = pytest.mark.distributed

# fp16 rounds every activation to 10 mantissa bits, and 2 ranks run each row in GEMMs of other
# shapes than 1 process: measured up to 6.8e-5 relative on the CPU (fp32: ~1e-6)
REL = 1e-3


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16") / "curves.json"
    run_worker(w.__file__, str(out))
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference():
    return w.fp16_curve(Mesh(), zero_stage=3)


def test_reference_skips_the_poisoned_steps_and_learns(reference):
    skipped = [s in w.POISONED for s in range(1, w.STEPS + 1)]
    assert [not c[0] for c in reference["changed"]] == skipped
    assert reference["skipped"] == [0, 0, 1, 2, 2, 2]
    # hysteresis 2: the first overflow is tolerated, the second halves 2**12
    assert reference["loss_scale"] == [4096, 4096, 4096, 2048, 2048, 2048]
    assert reference["loss"][-1] < reference["loss"][0]


@pytest.mark.parametrize("zero", w.ZERO_STAGES)
def test_two_ranks_match_one_process_and_skip_together(two_ranks, reference, zero):
    assert two_ranks["world_size"] == 2
    got = two_ranks[f"zero{zero}"]
    for step, changed in enumerate(got["changed"], 1):
        # every rank skipped the poisoned steps, only those
        assert changed == [step not in w.POISONED] * 2, (zero, step, changed)
    assert got["loss_scale"] == reference["loss_scale"] and got["skipped"] == reference["skipped"]
    for a, b in zip(got["loss"], reference["loss"]):
        assert abs(a - b) <= REL * abs(b), (zero, got["loss"], reference["loss"])
