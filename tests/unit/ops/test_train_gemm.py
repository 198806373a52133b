"""engine.training_gemm=onednn: the training Linear GEMMs through oneDNN on the CPU, against
torch's F.linear (values and gradients at fp32 rounding; training steps of a model)."""

import io

import pytest
import torch
import torch.nn.functional as F

from rlhf.compose import compose_config
from rlhf.config import EngineConfig, TrainConfig
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import TrainEngine
from rlhf.errors import ConfigError
from rlhf.ops import train_gemm
from tests.infer_helpers import tiny_model

needs_onednn = pytest.mark.skipif(not train_gemm.available(), reason="torch without oneDNN")


def test_config_values():
    assert EngineConfig().training_gemm == "torch"
    cfg = compose_config(["engine.training_gemm=onednn"])[0]
    assert cfg.engine.training_gemm == "onednn"
    with pytest.raises(ConfigError, match=r"engine.training_gemm"):
        EngineConfig(training_gemm="mkl")
    # the pretrained recipes: oneDNN where the build has it
    cfg = compose_config(["recipe=smollm2_arith", "stage=ppo"])[0]
    assert cfg.engine.training_gemm == "auto" and cfg.ppo.lm_head == "response"


def test_auto_is_onednn_where_available_else_torch(monkeypatch):
    from rlhf.engine.mesh import Mesh
    from rlhf.engine.train import apply_training_gemm

    monkeypatch.setattr(train_gemm, "MIN_WEIGHTS", 0)
    for available in (True, False):
        monkeypatch.setattr(train_gemm, "available", lambda a=available: a)
        model = tiny_model("llama")
        apply_training_gemm(model, EngineConfig(training_gemm="auto"), Mesh())
        swapped = any(isinstance(m, train_gemm.OneDNNLinear) for m in model.modules())
        assert swapped == available


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("frozen", [False, True])
def test_linear_and_its_gradients_equal_f_linear(bias, frozen):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 96, generator=g, requires_grad=True)
    w = (torch.randn(160, 96, generator=g) / 10).requires_grad_(not frozen)
    b = torch.randn(160, generator=g).requires_grad_(not frozen) if bias else None
    up = torch.randn(3, 7, 160, generator=g)
    grads = []
    for fn in (F.linear, train_gemm.linear):
        y = fn(x, w, b)
        assert y.shape == (3, 7, 160)
        leaves = [x] + ([] if frozen else [w] + ([b] if bias else []))
        grads.append([y] + list(torch.autograd.grad((y * up).sum(), leaves)))
    for ref, got in zip(*grads):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    y = train_gemm.linear(x, w, b)
    assert not y._is_view()  # in-place ops on the output stay allowed, as on F.linear's
    y.mul_(2)
    # bf16 (autocast or bf16 tensors) and anything off the fp32 CPU path is F.linear itself
    xb, wb = x.detach().bfloat16(), w.detach().bfloat16()
    assert torch.equal(train_gemm.linear(xb, wb), F.linear(xb, wb))


@needs_onednn
def test_training_steps_match_torch_gemms(monkeypatch):
    """Three AdamW steps of a tiny Llama with every Linear through oneDNN end where torch's GEMMs
    end (fp32 rounding); the install reaches the Linear layers only (embedding, norms untouched)."""
    monkeypatch.setattr(train_gemm, "MIN_WEIGHTS", 0)
    ids = torch.randint(3, 97, (4, 12), generator=torch.Generator().manual_seed(1))
    finals = []
    for gemm in ("torch", "onednn"):
        model = tiny_model("llama")
        engine = TrainEngine(
            model,
            Mesh(),
            EngineConfig(training_gemm=gemm),
            TrainConfig(lr=1e-3, warmup_steps=0, max_steps=3),
        )
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        patched = [m for m in linears if isinstance(m, train_gemm.OneDNNLinear)]
        assert len(patched) == (len(linears) if gemm == "onednn" else 0)
        engine.train()
        for _ in range(3):
            out = engine.forward(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
        finals.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if gemm == "onednn":
            # the swapped class pickles and loads back
            buf = io.BytesIO()
            torch.save(model, buf)
            buf.seek(0)
            back = torch.load(buf, weights_only=False)
            assert sum(isinstance(m, train_gemm.OneDNNLinear) for m in back.modules()) == len(
                patched
            )
    for k, ref in finals[0].items():
        torch.testing.assert_close(finals[1][k], ref, rtol=1e-4, atol=1e-5, msg=k)
