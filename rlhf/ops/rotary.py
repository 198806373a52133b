"""Rotary embedding in the interleaved layout, as one complex multiplication.

HF rotates dimension j of a head with dimension j + d/2 ("rotate_half"). The injection policy
permutes the rows of the q and k projections so that those pairs sit next to each other
(2j, 2j+1): attention only uses q·k, which the same permutation of both leaves unchanged, and the
rotation becomes q ⊙ e^{iθ} on complex pairs — one op instead of seven.
"""

from typing import Optional

import torch


def interleave_permutation(head_dim: int, device=None) -> torch.Tensor:
    """New dimension 2j ← old j, 2j+1 ← old j + d/2."""
    half = torch.arange(head_dim // 2, device=device)
    return torch.stack([half, half + head_dim // 2], dim=1).reshape(-1)


def rotary_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float, dtype: torch.dtype
):
    """Complex rotations [B, T, d/2] (scaling · e^{i·pos·inv_freq}) for integer ``positions`` [B,
    T]."""
    angles = positions.float()[..., None] * inv_freq.float()[None, None, :]
    return torch.polar(torch.full_like(angles, scaling), angles)


def apply_rotary_(
    x: torch.Tensor, rot: torch.Tensor, head_dim: Optional[int] = None
) -> torch.Tensor:
    """In place, all heads at once: x [..., H·d] (interleaved layout, last dimension contiguous,
    e.g. the q and k columns of a fused QKV output); rot [..., 1, r/2] complex: each (even, odd)
    pair of a head multiplied by its complex rotation (computed in fp32 for lower precisions).
    Partial rotary (``head_dim`` d > r, Phi-3): the first r dimensions of each head rotate, the
    others pass through."""
    half = rot.shape[-1]
    d = head_dim or 2 * half
    xf = x if x.dtype == torch.float32 else x.float()
    heads = xf.unflatten(-1, (-1, d))
    if d != 2 * half:
        heads = heads[..., : 2 * half]
    torch.view_as_complex(heads.unflatten(-1, (half, 2))).mul_(rot)
    return x if xf is x else x.copy_(xf)
