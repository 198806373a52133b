"""Losses as pure tensor functions."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """Bradley-Terry ranking loss per pair: -log σ(r_chosen - r_rejected - margin) (InstructGPT eq. 1;
    the margin as in Llama 2)."""
    return -F.logsigmoid(chosen.float() - rejected.float() - margin)
