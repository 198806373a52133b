"""y = x Wᵀ (+ b) on weights laid out once, when the inference model is built.

Two layouts: Wᵀ contiguous for one 2-D GEMM per call (fp32, and any device), or — bf16 on a CPU
with AVX-512 BF16 / AMX — oneDNN's blocked layout, reordered once instead of on every call
(the reorder is most of the cost of a bf16 GEMM at decode batch sizes). Both give the same
numbers as ``x @ Wᵀ`` in that dtype.
"""
from __future__ import annotations

from typing import Optional

import torch


def can_pack(dtype: torch.dtype, device) -> bool:
    """Whether ``prepare_weight(..., packed=True)`` applies: bf16 weights on a CPU oneDNN supports."""
    if dtype != torch.bfloat16 or torch.device(device or "cpu").type != "cpu":
        return False
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def prepare_weight(w: torch.Tensor, packed: bool, batch_hint: Optional[int] = None) -> torch.Tensor:
    """``w`` [out, in] (a Linear's weight) → the operand ``linear`` takes."""
    if packed:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), batch_hint)
    return w.t().contiguous()


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, packed: bool = False) -> torch.Tensor:
    """x [..., in] → [..., out]. Unpacked: w is Wᵀ [in, out], one 2-D GEMM (pre-transposed: no packing
    of a transposed operand on every call, about 2x faster than F.linear at decode sizes on CPU)."""
    if packed:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    if x.dim() == 2:
        return torch.addmm(bias, x, w) if bias is not None else torch.mm(x, w)
    flat = x.reshape(-1, x.shape[-1])
    y = torch.addmm(bias, flat, w) if bias is not None else torch.mm(flat, w)
    return y.view(*x.shape[:-1], w.shape[1])
