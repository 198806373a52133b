import torch
import torch.nn.functional as F


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA over the cache. q [B, H, Tq, d]; k, v [B, KV, Tk, d] (grouped-query: H = g·KV);
    mask [B, 1, Tq, Tk] bool (True = attend) or additive in q's dtype (0 / -inf: what SDPA turns a bool
    mask into on every call); every row must allow at least one key (the caller lets left-padding
    rows attend to themselves, so that no NaN can reach a value vector)."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return out
