"""y = x Wᵀ (+ b) on weights laid out once, when the inference model is built.

Layouts:
- plain: Wᵀ contiguous for one 2-D GEMM per call (any dtype, any device; the reference);
- bf16 on a CPU with AVX-512 BF16 / AMX: oneDNN's blocked layout, reordered once instead of on
  every call (the reorder is most of the cost of a bf16 GEMM at decode batch sizes); the same
  numbers as the plain layout;
- fp32 on a CPU torch built with MKL, for the decode steps: MKL's packed layout for a fixed number
  of rows (``pack_rows``). At decode batch sizes a GEMM is a pass over the weights, and an unpacked
  sgemm spends as long re-packing them as computing; packed, a decode step of the ``small``
  benchmark model takes about half the time. Fewer rows than packed for are zero-padded (a row's
  result does not depend on the other rows); results agree with the plain layout to fp32 rounding
  (bitwise on most shapes; not guaranteed).
- fp32 matrices of at least ``ONEDNN_MIN_WEIGHTS`` weights, where oneDNN exists: its blocked layout
  instead (``pack_onednn``, any number of rows): at 8 rows it streams the weights about twice as
  fast as MKL's packed sgemm on the CPU machine (a ``small`` decode step's GEMMs 23 → 11 ms, the
  512 × 8000 LM head 1.8 → 0.7 ms), and a prefill's GEMMs are no slower; below the threshold its
  ~10 µs more per call loses. Results agree with the plain layout to fp32 rounding.
"""

from __future__ import annotations

from typing import Optional

import torch


def _cpu_supports(dtype: torch.dtype, wanted: torch.dtype, device, probe) -> bool:
    if dtype != wanted or torch.device(device or "cpu").type != "cpu":
        return False
    try:
        return bool(probe())
    except (AttributeError, RuntimeError):  # a build without the backend or the op
        return False


def can_pack(dtype: torch.dtype, device) -> bool:
    """Whether ``prepare_weight(..., packed=True)`` applies: bf16 weights on a CPU oneDNN
    supports."""
    return _cpu_supports(
        dtype,
        torch.bfloat16,
        device,
        lambda: (
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        ),
    )


def can_pack_rows(dtype: torch.dtype, device) -> bool:
    """Whether ``pack_rows`` applies: fp32 weights on a CPU, torch built with MKL (x86 builds)."""
    return _cpu_supports(
        dtype,
        torch.float32,
        device,
        lambda: (
            torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
        ),
    )


def prepare_weight(w: torch.Tensor, packed: bool, for_rows: bool = False) -> torch.Tensor:
    """``w`` [out, in] (a Linear's weight) → the operand ``linear`` takes. ``for_rows``: Wᵀ as a
    view of W, which stays contiguous — ``pack_rows`` packs it without a transpose (5-10x faster),
    and a GEMM with many rows (a prefill) takes the transposed view as fast as a copy."""
    if packed:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
    if for_rows:
        return w.contiguous().t()
    return w.t().contiguous()


def linear(
    x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, packed: bool = False
) -> torch.Tensor:
    """x [..., in] → [..., out]. Unpacked: w is Wᵀ [in, out], one 2-D GEMM — a contiguous copy (no
    packing of a transposed operand on every call: about 2x faster than F.linear at decode sizes on
    CPU), or with ``for_rows`` a view of W (used for prefills only, where the GEMM is large)."""
    if packed:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    if x.dim() == 2:
        return _matmul(x, w, bias)
    y = _matmul(x.reshape(-1, x.shape[-1]), w, bias)
    return y.view(*x.shape[:-1], w.shape[1])


def _matmul(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [m, in] @ w [in, out] (+ bias): one GEMM."""
    if bias is None:
        return torch.mm(x, w)
    return torch.addmm(bias, x, w)


def can_pack_onednn_fp32(dtype: torch.dtype, device) -> bool:
    """Whether ``pack_onednn`` applies: fp32 weights on a CPU torch built with oneDNN (x86
    builds)."""
    return _cpu_supports(
        dtype,
        torch.float32,
        device,
        lambda: (
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        ),
    )


# oneDNN's fp32 GEMM calls cost ~10 µs more than MKL's: it pays from about this many weights (0.5
# MB)
ONEDNN_MIN_WEIGHTS = 1 << 17


def onednn_pays(wt: torch.Tensor) -> bool:
    """Whether ``pack_onednn`` is the faster decode layout for ``wt`` (else MKL's ``pack_rows``)."""
    return wt.numel() >= ONEDNN_MIN_WEIGHTS


def pack_onednn(wt: torch.Tensor) -> torch.Tensor:
    """Wᵀ [in, out] (``prepare_weight(..., for_rows=True)``: a view of W) → oneDNN's blocked layout,
    for ``linear(..., packed=True)`` with any number of rows. At decode batch sizes (a pass over the
    weights, few rows) its fp32 GEMM streams the weights about twice as fast as MKL's packed sgemm
    on this project's CPU machine (docs/history.md), and a prefill's GEMM is no slower."""
    return torch.ops.mkldnn._reorder_linear_weight(wt.t().contiguous())


def pack_rows(wt: torch.Tensor, rows: int) -> torch.Tensor:
    """Wᵀ [in, out] (``prepare_weight(..., for_rows=True)``) → MKL's packed operand for ``rows``
    rows."""
    return torch.ops.mkl._mkl_reorder_linear_weight(wt.t(), rows)


def linear_rows(
    x: torch.Tensor,
    packed: torch.Tensor,
    wt: torch.Tensor,
    rows: int,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x [m, in] with m <= rows → [m, out] on ``pack_rows(wt, rows)``."""
    m = x.shape[0]
    if m < rows:
        x = torch.cat([x, x.new_zeros(rows - m, x.shape[1])])
    y = torch.ops.mkl._mkl_linear(x, packed, wt.t(), bias, rows)
    return y[:m] if m < rows else y
