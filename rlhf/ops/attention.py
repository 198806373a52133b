"""Attention over the KV cache (SDPA), with the kernel choice made per device.

On CPU: one SDPA call with ``enable_gqa`` and the additive mask (the reference numbers).
On CUDA an additive mask together with ``enable_gqa`` leaves SDPA only its math kernel, so the
grouped query heads are folded into the query length instead: the g query heads that share a KV
head become g·T query rows against that KV head ([B, KV, g·T, d]), which the memory-efficient
kernel takes with a mask and without copying K/V; with no mask needed (prefill of unpadded rows,
no sliding window) the call is causal with no mask, which the flash kernel takes.
"""
from typing import Optional

import torch
import torch.nn.functional as F


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
           fold_groups: Optional[bool] = None) -> torch.Tensor:
    """SDPA over the cache. q [B, H, Tq, d]; k, v [B, KV, Tk, d] (grouped-query: H = g·KV, query head h
    uses KV head h // g); mask [B, 1, Tq, Tk] bool (True = attend) or additive in q's dtype (0 / -inf),
    or None for plain causal attention (Tq == Tk); every row must allow at least one key (the caller
    lets left-padding rows attend to themselves, so that no NaN can reach a value vector).
    ``fold_groups``: fold the query groups into the query length (default: on CUDA)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    if fold_groups is None:
        fold_groups = q.device.type == "cuda"
    B, H, T, d = q.shape
    kv = k.shape[1]
    if not fold_groups or H == kv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != kv)
    g = H // kv
    out = F.scaled_dot_product_attention(q.reshape(B, kv, g * T, d), k, v,
                                         attn_mask=mask.expand(B, 1, T, mask.shape[-1]).repeat(1, 1, g, 1))
    return out.view(B, H, T, d)
