"""fp16 loss scaling (rlhf/engine/loss_scale.py): DeepSpeed's rules, the engine's step under fp16,
the resolution of engine.precision=auto and the checkpointed state."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from rlhf.config import EngineConfig, FP16Config, PlacementConfig, TrainConfig
from rlhf.engine.checkpoint import load_checkpoint, save_checkpoint
from rlhf.engine.loss_scale import LossScaleError, LossScaler
from rlhf.engine.mesh import Mesh, inference_dtype_of, precision_of
from rlhf.engine.train import TrainEngine
from rlhf.errors import ConfigError
from tests.faults.fault_fp16_overflow import digest, poison
from tests.infer_helpers import tiny_model


class DeepSpeedOracle:
    """DeepSpeed's DynamicLossScaler.update_scale (deepspeed/runtime/fp16/loss_scaler.py),
    transcribed as the oracle: cur_iter / last_overflow_iter instead of our count of steps without
    overflow."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_window, self.min_scale = scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise RuntimeError("Current loss scale already at minimum")
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1


def scaler(**kw) -> LossScaler:
    return LossScaler(FP16Config(**kw))


def test_growth_after_the_window():
    s = scaler(initial_scale_power=4, loss_scale_window=3)
    scales = []
    for _ in range(8):
        s.update(overflow=False)
        scales.append(s.scale)
    # the 4th step without overflow follows 3 of them: doubles; the 7th follows 6: doubles again
    assert scales == [16, 16, 16, 32, 32, 32, 64, 64]
    assert s.skipped == 0


def test_back_off_with_hysteresis_and_its_restoration():
    s = scaler(initial_scale_power=10, hysteresis=2, loss_scale_window=2)
    s.update(overflow=True)
    assert (s.scale, s.hysteresis, s.skipped) == (1024, 1, 1)  # tolerated: the scale stays
    s.update(overflow=True)
    assert (s.scale, s.hysteresis) == (512, 1)  # no tolerance left: halves
    s.update(overflow=True)
    # and halves again: a halving does not restore the hysteresis
    assert s.scale == 256
    for _ in range(3):
        # the 3rd step without overflow follows 2: doubles, hysteresis restored
        s.update(overflow=False)
    assert (s.scale, s.hysteresis, s.skipped) == (512, 2, 3)
    s.update(overflow=True)
    assert s.scale == 512 and s.hysteresis == 1


def test_consecutive_hysteresis_restores_after_any_good_step():
    s = scaler(initial_scale_power=10, hysteresis=2, consecutive_hysteresis=True)
    for _ in range(5):
        # overflow, good, overflow, ...: never two in a row, never halves
        s.update(overflow=True)
        s.update(overflow=False)
    assert s.scale == 1024 and s.skipped == 5


def test_min_scale_floor_then_stop():
    s = scaler(initial_scale_power=4, hysteresis=1, min_loss_scale=3)
    for want in (8, 4, 3):
        s.update(overflow=True)
        assert s.scale == want
    with pytest.raises(LossScaleError, match=r"engine.fp16.min_loss_scale=3"):
        s.update(overflow=True)


def test_static_scale_never_moves_but_skips():
    s = scaler(loss_scale=128.0, loss_scale_window=1)
    for overflow in (True, True, True, False, False, False, True):
        s.update(overflow)
    assert s.scale == 128 and s.skipped == 4 and not s.dynamic


def test_overflow_warnings_are_rate_limited(caplog):
    s = scaler(loss_scale=128.0)
    with caplog.at_level("WARNING", logger="rlhf"):
        for _ in range(15):
            # within a second: the first 10 are warned, the 5 after them wait
            s.update(overflow=True)
    warned = [r.getMessage() for r in caplog.records if "gradients overflowed" in r.getMessage()]
    assert len(warned) == 10 and "(10 skipped in all)" in warned[-1]
    # half a minute later: one warning, counting the ones in between
    s._last_warning -= 60
    with caplog.at_level("WARNING", logger="rlhf"):
        s.update(overflow=True)
    assert (
        "(16 skipped in all; 5 more since the previous warning)" in caplog.records[-1].getMessage()
    )


@pytest.mark.parametrize("seed", range(6))
def test_same_scales_as_deepspeed_on_random_overflows(seed):
    rng = random.Random(seed)
    kw = dict(
        initial_scale_power=rng.choice([3, 8, 16]),
        loss_scale_window=rng.choice([1, 2, 5]),
        hysteresis=rng.choice([1, 2, 3]),
        consecutive_hysteresis=rng.random() < 0.5,
        min_loss_scale=rng.choice([1, 2]),
    )
    ours = scaler(**kw)
    ds = DeepSpeedOracle(
        2.0 ** kw["initial_scale_power"],
        kw["loss_scale_window"],
        kw["min_loss_scale"],
        kw["hysteresis"],
        kw["consecutive_hysteresis"],
    )
    for _ in range(300):
        overflow = rng.random() < 0.25
        try:
            ds.update_scale(overflow)
        except RuntimeError:
            with pytest.raises(LossScaleError):
                ours.update(overflow)
            return
        ours.update(overflow)
        assert ours.scale == ds.cur_scale and ours.hysteresis == ds.cur_hysteresis, kw


def test_state_round_trip_through_json():
    rng = random.Random(3)
    a = scaler(initial_scale_power=12, loss_scale_window=4, hysteresis=3)
    for _ in range(40):
        a.update(rng.random() < 0.3)
    b = scaler(initial_scale_power=12, loss_scale_window=4, hysteresis=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    for _ in range(40):  # and they go on alike
        overflow = rng.random() < 0.3
        a.update(overflow)
        b.update(overflow)
        assert b.state_dict() == a.state_dict()


@pytest.mark.parametrize(
    "kw,key",
    [
        (dict(loss_scale=-1.0), "engine.fp16.loss_scale"),
        (dict(initial_scale_power=65), "engine.fp16.initial_scale_power"),
        (dict(loss_scale_window=0), "engine.fp16.loss_scale_window"),
        (dict(hysteresis=0), "engine.fp16.hysteresis"),
        (dict(min_loss_scale=0.0), "engine.fp16.min_loss_scale"),
        (dict(initial_scale_power=2, min_loss_scale=8.0), "engine.fp16.min_loss_scale=8 is above"),
    ],
)
def test_bad_settings_name_their_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        FP16Config(**kw)


def test_precision_auto_and_inference_dtype(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert precision_of(EngineConfig(), cpu) == "fp32"
    monkeypatch.setattr(torch.version, "hip", None)
    for major, want in ((7, "fp16"), (8, "bf16"), (9, "bf16")):
        # V100/T4 (emulated bf16 only); A100, H100
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, m=major: (m, 0))
        assert precision_of(EngineConfig(), gpu) == want
        assert inference_dtype_of(EngineConfig(), gpu) == want
    # no fast fp16 GEMMs on the CPU
    assert inference_dtype_of(EngineConfig(precision="fp16"), cpu) == "fp32"
    assert inference_dtype_of(EngineConfig(precision="fp16", inference_dtype="fp16"), cpu) == "fp16"
    assert inference_dtype_of(EngineConfig(precision="bf16"), cpu) == "bf16"
    with pytest.raises(ConfigError, match=r"engine\.actor\.precision='fp8'"):
        EngineConfig(actor=PlacementConfig(precision="fp8"))


# ---- the engine ----


def engine(precision="fp16", **fp16) -> TrainEngine:
    ecfg = EngineConfig(precision=precision, fp16=FP16Config(**fp16))
    return TrainEngine(
        tiny_model("llama"), Mesh(), ecfg, TrainConfig(lr=1e-2, warmup_steps=0, max_steps=10)
    )


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (4, 12), generator=g)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def nll(eng, seed=0):
    b = batch(seed)
    logits = eng.forward(**b).logits.float()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), b["input_ids"][:, 1:].reshape(-1)
    )


def test_fp32_has_no_scaler():
    eng = engine("fp32")
    assert eng.scaler is None and eng.scale_metrics("train") == {}


def test_backward_scales_and_step_unscales():
    eng = engine(initial_scale_power=10)
    assert eng.forward(**batch()).logits.dtype == torch.float16  # autocast fp16 on the bare model
    loss = nll(eng)
    eng.backward(loss)
    grads = [p.grad.clone() for p in eng.model.parameters()]
    ref = torch.autograd.grad(nll(eng), list(eng.model.parameters()))
    # the gradients held before step() are the loss's times 2**10 (to fp16's rounding)
    scaled, true = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref])
    assert float((scaled / 1024 - true).norm()) <= 1e-2 * float(true.norm())
    assert all(g.dtype == torch.float32 for g in grads)  # fp32 master gradients
    norm = eng.step()
    assert abs(norm - float(true.norm())) <= 1e-2 * float(true.norm())  # the unscaled norm
    assert eng.weights_version == 1 and not eng.overflowed


def test_overflow_skips_the_step_then_training_goes_on():
    eng = engine(initial_scale_power=10, hysteresis=2)
    lrs = []
    for i in range(4):
        eng.backward(nll(eng, i))
        if i in (1, 2):
            poison(eng)
        before, version, lr = digest(eng), eng.weights_version, eng.lr
        norm = eng.step()
        lrs.append(lr)
        if i in (1, 2):
            # skipped: weights, schedule and version unchanged, the gradients dropped
            assert digest(eng) == before and eng.weights_version == version and eng.lr == lr
            assert eng.overflowed and not math.isfinite(norm)
            assert all(p.grad is None for p in eng.model.parameters())
        else:
            assert (
                digest(eng) != before and eng.weights_version == version + 1 and not eng.overflowed
            )
    # hysteresis 2: the first overflow is tolerated, the second halves the scale
    assert eng.scale_metrics("train") == {"train/loss_scale": 512.0, "train/skipped_steps": 2}
    # the schedule waited over the two skipped steps
    assert lrs[1] == lrs[2] == lrs[3]


def test_scale_in_checkpoint_and_older_checkpoints_load(tmp_path, caplog):
    eng = engine(initial_scale_power=10, hysteresis=1)
    eng.backward(nll(eng))
    poison(eng)
    eng.step()
    eng.backward(nll(eng, 1))
    eng.step()
    saved = eng.scaler.state_dict()
    assert saved["scale"] == 512 and saved["skipped"] == 1
    ckpt = save_checkpoint(tmp_path / "ck", 2, {"actor": eng}, {"stage": "sft"}, Mesh())
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["loss_scalers"] == {"actor": saved}
    fresh = engine(initial_scale_power=10, hysteresis=1)
    load_checkpoint(ckpt, {"actor": fresh}, Mesh())
    assert fresh.scaler.state_dict() == saved and digest(fresh) == digest(eng)
    # a checkpoint written without fp16 (an fp32 run, or before loss scaling existed) holds none
    fp32 = engine("fp32")
    old = save_checkpoint(tmp_path / "old", 1, {"actor": fp32}, {"stage": "sft"}, Mesh())
    assert "loss_scalers" not in json.loads((old / "trainer_state.json").read_text())
    later = engine(initial_scale_power=10)
    with caplog.at_level("INFO", logger="rlhf"):
        load_checkpoint(old, {"actor": later}, Mesh())
    assert later.scaler.scale == 1024 and "holds no fp16 loss scale" in caplog.text
    # and an fp32 run ignores a saved scale
    load_checkpoint(ckpt, {"actor": engine("fp32")}, Mesh())
