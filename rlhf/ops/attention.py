import torch
import torch.nn.functional as F


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA over the cache. q [B, H, Tq, d]; k, v [B, KV, Tk, d] (grouped-query: H = g·KV);
    mask [B, 1, Tq, Tk] bool, True = attend. Rows with no valid key (left padding) give zeros."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return torch.nan_to_num(out, nan=0.0) if not mask.any(-1).all() else out
