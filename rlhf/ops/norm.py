from typing import Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back, then scaled (the order HF Llama/Qwen2/Mistral use)."""
    if x.dtype == torch.float32:
        # the weight inside: the same product (n·w = w·n), one op fewer
        return F.rms_norm(x, (x.shape[-1],), weight=weight, eps=eps)
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)  # (computes in fp32 inside, rounds once)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """LayerNorm with its bias, as ``nn.LayerNorm`` computes it (OPT, GPT-2)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
