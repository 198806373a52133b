"""The training forwards' and backwards' Linear GEMMs through oneDNN on the CPU
(``engine.training_gemm=onednn``).

On a CPU torch routes an fp32 ``F.linear`` to MKL's sgemm. On the CPU machine (an AMD EPYC with
AVX-512) that runs at the AVX2 rate — about 210 GFLOP/s on 2 threads — where oneDNN, which torch
ships too, reaches about 490 on a 2048² GEMM; the three GEMMs of a SmolLM2 layer's Linear at 1,182
tokens (forward, input gradient, weight gradient) run 1.5–1.8× faster through it. The results are
fp32 GEMMs either way and differ at rounding level (another summation order), which is why this is
a choice and not the default: the default keeps torch's numbers, which the numbers contract holds
to. What this covers: every ``nn.Linear`` of a model whose weight has at least ``MIN_WEIGHTS``
entries (smaller ones — LoRA's rank-r matrices at the usual ranks — stay on torch's path: oneDNN's
per-call cost loses there), when
input and weight are fp32 on the CPU outside autocast; anything else (bf16 autocast, CUDA) takes
``F.linear`` as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_WEIGHTS = 65536


def available() -> bool:
    """Whether this torch build has oneDNN's linear op on the CPU."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        )
    except (AttributeError, RuntimeError):
        return False


def _mm(x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    """x [M, K] @ w[N, K]ᵀ (+ bias) by oneDNN: both contiguous."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


class _Linear(torch.autograd.Function):
    """y = x Wᵀ + b with the three GEMMs (y, ∂x, ∂W) through oneDNN."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = _mm(x2, weight, bias)
        # (the input is kept only for the weight's gradient)
        ctx.save_for_backward(x2 if weight.requires_grad else None, weight)
        ctx.in_shape = x.shape
        # (not a view, as F.linear's output is not: in-place ops on it stay allowed)
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1]).contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _mm(g2, weight.t().contiguous()).view(ctx.in_shape)
        if ctx.needs_input_grad[1]:
            gw = _mm(g2.t().contiguous(), x2.t().contiguous())
        if ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear`` with its GEMMs through oneDNN where they apply (fp32 on the CPU, no autocast),
    else ``F.linear`` itself."""
    if (
        x.dtype == weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.numel() > 0
        and not torch.is_autocast_enabled("cpu")
    ):
        return _Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is ``linear``: what ``install`` turns a layer into (its class
    swapped in place: parameters, hooks and state dict unchanged; a pickled model loads back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def install(model: nn.Module) -> int:
    """Turns the ``nn.Linear`` layers of ``model`` with at least ``MIN_WEIGHTS`` weights into
    ``OneDNNLinear``; returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.numel() >= MIN_WEIGHTS:
            m.__class__ = OneDNNLinear
            n += 1
    return n
