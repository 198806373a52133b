"""Attention over the KV cache (SDPA), with the kernel choice made per device.

On CPU: one SDPA call with ``enable_gqa`` and the additive mask (the reference numbers), except
for a half-precision decode step (below). On CUDA an additive mask together with ``enable_gqa``
leaves SDPA only its math kernel, so the grouped query heads are folded into the query length
instead: the g query heads that share a KV head become g·T query rows against that KV head ([B, KV,
g·T, d]), which the memory-efficient kernel takes with a mask and without copying K/V; with no mask
needed (prefill of unpadded rows, no sliding window) the call is causal with no mask, which the
flash kernel takes. The CPU's bf16 kernel with ``enable_gqa`` is slow at one query a row (a decode
step of SmolLM2's shape at batch 64: 4.1 ms a layer against 0.55 folded, where fp32 takes 0.5–0.8
either way), so a half-precision decode step folds there too; fp32 keeps the reference call.
"""

import itertools
from typing import Optional

import torch
import torch.nn.functional as F


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    fold_groups: Optional[bool] = None,
) -> torch.Tensor:
    """SDPA over the cache. q [B, H, Tq, d]; k, v [B, KV, Tk, d] (grouped-query: H = g·KV, query
    head h uses KV head h // g); mask [B, 1, Tq, Tk] bool (True = attend) or additive in q's dtype
    (0 / -inf), or None for plain causal attention (Tq == Tk); every row must allow at least one key
    (the caller lets left-padding rows attend to themselves, so that no NaN can reach a value
    vector). ``fold_groups``: fold the query groups into the query length (default: on CUDA, and for
    a half-precision decode step, Tq = 1)."""
    if mask is None:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
        )
    B, H, T, d = q.shape
    if fold_groups is None:
        half = q.dtype in (torch.bfloat16, torch.float16)
        fold_groups = q.device.type == "cuda" or (T == 1 and half)
    kv = k.shape[1]
    if not fold_groups or H == kv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != kv)
    g = H // kv
    # (one query a row: its mask [B, 1, 1, Tk] broadcasts over the g folded rows as it is)
    folded = mask if T == 1 else mask.expand(B, 1, T, mask.shape[-1]).repeat(1, 1, g, 1)
    out = F.scaled_dot_product_attention(q.reshape(B, kv, g * T, d), k, v, attn_mask=folded)
    return out.view(B, H, T, d)


def varlen_kernel_fits(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether ``torch.nn.attention.varlen.varlen_attn`` (flash attention over packed sequences)
    takes these operands: a CUDA device, half precision, a head size the flash kernels support."""
    try:
        from torch.nn.attention import varlen  # noqa: F401  (absent from older torch builds)
    except ImportError:
        return False
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
    )


def attend_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of packed sequences with no padding anywhere: q [total, H, d], k, v
    [total, KV, d] (grouped-query as in ``attend``), sequence i = rows cu[i]:cu[i+1] (``cu`` int32
    [n+1], ``max_len`` the longest); ``window``: keys at most window − 1 positions back (the
    additive masks' rule). Returns [total, H, d]. Where the flash kernel fits
    (``varlen_kernel_fits``) one ``varlen_attn`` call; elsewhere one causal SDPA per sequence — the
    reference the CPU tests compare the packed prefill against (the CPU's prefill itself stays on
    the masked path)."""
    H, kv = q.shape[1], k.shape[1]
    if varlen_kernel_fits(q.dtype, q.device, q.shape[-1]):
        from torch.nn.attention.varlen import varlen_attn

        # window_size=(left, right) keys around the query; -1: no limit
        left = -1
        if window:
            left = window - 1

        # q, k, v arrive as column slices of the fused QKV output (row stride = its width): dense
        # copies for the kernel, a small cost beside the prefill's GEMMs
        return varlen_attn(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            cu,
            cu,
            max_len,
            max_len,
            enable_gqa=H != kv,
            window_size=(left, 0),
        )
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for s, e in itertools.pairwise(bounds):
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
        if window and e - s > window:
            i = torch.arange(e - s, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=H != kv)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=H != kv)
        out[s:e] = o.transpose(0, 1)
    return out
