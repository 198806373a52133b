"""Per-token log-probabilities and the masked token NLL (pure tensor functions)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(targets[t] | ...) from ``logits[t]`` (already aligned), in fp32, at ``temperature``."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def shifted_nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum over tokens of -log p(labels[t+1] | ..t) where labels != -100, and the token count.

    Summing (not averaging) per micro-batch lets the caller divide by the token count of the whole
    global batch, which makes the gradient independent of how the batch is split."""
    logits, labels = logits[:, :-1], labels[:, 1:]
    mask = labels != -100
    lp = token_logprobs(logits, labels.clamp(min=0))
    return -(lp * mask).sum(), int(mask.sum())
