"""The rollout-parity guard's logic (rlhf/rl/rollout_guard.py): the threshold per compared
precision, its decisions on a step's numbers, stop and rebuild, and the defaults against the gaps a
real inference copy shows in fp32 and bf16 (the end-to-end runs:
tests/e2e/test_rollout_guard.py)."""

import math

import pytest
import torch

from rlhf.config import ROLLOUT_GUARD_MAX, EngineConfig, PPOConfig, TrainConfig
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.logprobs import response_logprobs
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import TrainEngine
from rlhf.errors import ConfigError, UserError
from rlhf.ops import SamplingParams
from rlhf.rl.rollout_guard import (
    MAX_METRIC,
    METRIC,
    RolloutGuard,
    RolloutMismatch,
    compute_dtype,
    threshold,
)
from tests.infer_helpers import Tok, mixed_prompts, tiny_model

SETTINGS = "llama, inference dtype fp32 (training fp32), TP 1, kernels auto, decode dynamic"


def row(mean, mx=None):
    return {METRIC: mean, MAX_METRIC: 10 * mean if mx is None else mx, "reward/mean": 0.0}


def test_threshold_per_compared_precision():
    assert compute_dtype("fp32", "fp32") == "fp32"
    # bf16 on either side: fp32 rollouts recomputed under bf16 autocast differ as much as a bf16
    # copy's
    assert (
        compute_dtype("bf16", "fp32")
        == compute_dtype("fp32", "bf16")
        == compute_dtype("bf16", "bf16")
        == "bf16"
    )
    assert threshold(0.0, "fp32") == ROLLOUT_GUARD_MAX["fp32"] == 1e-3
    assert threshold(0.0, "bf16") == ROLLOUT_GUARD_MAX["bf16"] == 5e-2
    assert threshold(0.2, "fp32") == threshold(0.2, "bf16") == 0.2  # ppo.rollout_guard_max wins
    # fp16 (10 mantissa bits) between them: the coarser side's precision is compared
    assert (
        compute_dtype("fp16", "fp32")
        == compute_dtype("fp32", "fp16")
        == compute_dtype("fp16", "fp16")
        == "fp16"
    )
    assert compute_dtype("fp16", "bf16") == compute_dtype("bf16", "fp16") == "bf16"
    assert threshold(0.0, "fp16") == ROLLOUT_GUARD_MAX["fp16"] == 2e-2
    # fp16's healthy values measured (docs/ppo.md): ≤ 1.4e-4
    assert ROLLOUT_GUARD_MAX["fp16"] >= 100 * 1.4e-4
    # the defaults stand well over the healthy values measured (docs/ppo.md): fp32 ≤ 8.3e-8, bf16 ≤
    # 2.7e-3
    assert ROLLOUT_GUARD_MAX["fp32"] >= 1000 * 8.3e-8 and ROLLOUT_GUARD_MAX["bf16"] >= 15 * 2.7e-3
    # ... and the fp32 one lies within bf16's healthy range (2.7e-4 to 2.7e-3): one threshold cannot
    # serve both
    assert 2.7e-4 < ROLLOUT_GUARD_MAX["fp32"] < 2.7e-3


def test_decisions_on_a_steps_numbers():
    fp32 = RolloutGuard("stop", threshold(0, "fp32"), "fp32", SETTINGS)
    # the mean is judged, not the max
    assert not fp32.over(row(6e-8)) and not fp32.over(row(9e-4, mx=0.5))
    assert fp32.over(row(2e-3)) and fp32.over(row(math.nan)) and fp32.over(row(math.inf))
    # no rollout log-probs that step (HF generate)
    assert not fp32.over({"reward/mean": 0.0})
    bf16 = RolloutGuard("stop", threshold(0, "bf16"), "bf16", SETTINGS)
    assert not bf16.over(row(2.3e-3, mx=0.03)) and bf16.over(row(0.2))
    for off in (
        RolloutGuard("off", 1e-3, "fp32", SETTINGS),
        RolloutGuard("stop", 1e-3, "fp32", SETTINGS, False),
    ):
        assert not off.over(row(5.0))
    assert "off" in RolloutGuard("off", 1e-3, "fp32", SETTINGS).describe()
    assert "HF generate" in RolloutGuard("stop", 1e-3, "fp32", SETTINGS, active=False).describe()
    line = fp32.describe()
    assert "0.001" in line and "fp32 default" in line and METRIC in line and SETTINGS in line
    assert (
        "ppo.rollout_guard_max=0.02"
        in RolloutGuard("stop", 0.02, "bf16", SETTINGS, default=False).describe()
    )


class Steps:
    """A stand-in for the stage's collection: each call returns the next of ``means``."""

    def __init__(self, *means):
        self.means, self.calls, self.rebuilds = list(means), 0, 0

    def collect(self):
        self.calls += 1
        return f"exp{self.calls}", row(self.means.pop(0))

    def rebuild(self):
        self.rebuilds += 1


def test_stop_raises_one_line_naming_step_settings_and_numbers():
    guard, steps = RolloutGuard("stop", 1e-3, "fp32", SETTINGS), Steps(5e-8)
    assert guard.checked(3, steps.collect, steps.rebuild) == ("exp1", row(5e-8))
    steps = Steps(0.25)
    with pytest.raises(RolloutMismatch) as e:
        guard.checked(4, steps.collect, steps.rebuild)
    assert isinstance(e.value, UserError) and steps.rebuilds == 0 and steps.calls == 1
    msg = str(e.value)
    assert "\n" not in msg and "step 4" in msg and SETTINGS in msg
    assert f"{METRIC}=0.25" in msg and "max over tokens 2.5" in msg and "against 0.001" in msg


def test_rebuild_regenerates_once_then_goes_on_or_stops(caplog):
    guard = RolloutGuard("rebuild", 1e-3, "fp32", SETTINGS)
    steps = Steps(0.25, 4e-8)
    with caplog.at_level("WARNING", logger="rlhf"):
        assert guard.checked(2, steps.collect, steps.rebuild) == ("exp2", row(4e-8))
    assert steps.rebuilds == 1 and steps.calls == 2
    assert "rebuilding the inference weights" in caplog.text and "going on" in caplog.text
    steps = Steps(0.25, 0.3)
    with pytest.raises(
        RolloutMismatch, match=r"step 2: .*=0\.3 .*first 0\.25, then again after rebuilding"
    ):
        guard.checked(2, steps.collect, steps.rebuild)
    assert steps.rebuilds == 1 and steps.calls == 2


def test_config_keys_are_checked():
    assert PPOConfig().rollout_guard == "stop" and PPOConfig().rollout_guard_max == 0.0
    with pytest.raises(ConfigError, match=r"ppo.rollout_guard='maybe'.*stop, rebuild or off"):
        PPOConfig(rollout_guard="maybe")
    for bad in (-1e-3, math.nan, math.inf):
        with pytest.raises(ConfigError, match=r"ppo.rollout_guard_max"):
            PPOConfig(rollout_guard_max=bad)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_defaults_against_a_real_inference_copy(dtype):
    """The mean gap a healthy inference copy shows (tiny Llama with peaked weights, sampled) passes
    its dtype's default with a wide margin; bf16's would trip the fp32 default; a kept copy whose
    training weights changed behind its back trips the guard, and ``rebuild_inference`` builds a
    matching one."""
    model = tiny_model("llama")
    ecfg = EngineConfig(inference_dtype=dtype, release_inference_cache=False)
    eng = TrainEngine(model, Mesh(), ecfg, TrainConfig(lr=1e-2, warmup_steps=0))
    hy = HybridEngine(eng, Tok, ecfg)
    guard = RolloutGuard.of(PPOConfig(), hy, "fp32")
    assert guard.dtype == dtype and guard.limit == ROLLOUT_GUARD_MAX[dtype] and guard.active
    assert f"inference dtype {dtype}" in guard.settings and "TP 1" in guard.settings

    def gap():
        sp = SamplingParams(temperature=1.0, max_new_tokens=12, samples_per_prompt=2, seed=5)
        gen = hy.generate(mixed_prompts(), sp)
        with torch.no_grad():
            lp = response_logprobs(
                eng.forward, gen.sequences, gen.attention_mask, gen.prompt_len, 1.0
            )
        m = gen.response_mask.float()
        return float(((lp - gen.logprobs).abs() * m).sum() / m.sum())

    healthy = gap()
    assert healthy < ROLLOUT_GUARD_MAX[dtype] / 5 and not guard.over(row(healthy))
    if dtype == "bf16":
        assert healthy > ROLLOUT_GUARD_MAX["fp32"]
    # the cached copy made stale behind the engine's back (no weights_version bump): the guard sees
    # it, and rebuild_inference() builds it afresh
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(1.5)
    stale = gap()
    assert guard.over(row(stale)), stale
    hy.rebuild_inference()
    assert hy._model is None
    assert not guard.over(row(gap()))
