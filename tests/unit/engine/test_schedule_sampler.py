import math

import pytest

from rlhf.data.sampler import GlobalBatches
from rlhf.engine.schedule import lr_factor


def test_warmup_lr_is_linear_then_constant():
    f = [lr_factor(s, kind="warmup", warmup_steps=4, total_steps=10) for s in range(8)]
    assert f == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_warmup_decay_reaches_min_at_total():
    def f(s):
        return lr_factor(s, kind="warmup_decay", warmup_steps=2, total_steps=12, min_ratio=0.1)

    assert (
        f(0) == 0.5 and f(2) == 1.0 and f(12) == pytest.approx(0.1) and f(7) == pytest.approx(0.55)
    )


def test_cosine():
    def f(s):
        return lr_factor(s, kind="cosine", warmup_steps=0, total_steps=100, min_ratio=0.0)

    assert f(0) == 1.0 and f(50) == pytest.approx(0.5) and f(100) == pytest.approx(0.0, abs=1e-12)
    assert f(25) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_global_batches_do_not_depend_on_world_or_accumulation():
    gb = GlobalBatches(n=100, global_batch=8, seed=1)
    for step in (0, 5, 12, 13):  # 12 and 13 straddle an epoch boundary
        ref = sorted(gb.global_indices(step))
        for world, micro in ((1, 8), (2, 4), (2, 2), (4, 1), (1, 2)):
            got = [
                i
                for r in range(world)
                for mb in gb.micro_batches(step, r, world, micro)
                for i in mb
            ]
            assert sorted(got) == ref
    epoch0 = [i for s in range(12) for i in gb.global_indices(s)] + gb.global_indices(12)[:4]
    assert sorted(epoch0) == list(range(100))  # each record once per epoch
