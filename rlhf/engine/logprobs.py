"""Log-probs of given responses under a model in training mode (what PPO recomputes)."""
from __future__ import annotations

import torch

from rlhf.algorithms.logprobs import token_logprobs
from rlhf.models.value import position_ids


def response_logprobs(forward, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                      temperature: float = 1.0) -> torch.Tensor:
    """[B, N] log π(response token) at ``temperature`` (1 when greedy), with mask-derived positions;
    ``forward`` is an engine's or a model's ``forward`` returning logits."""
    logits = forward(input_ids=sequences, attention_mask=attention_mask,
                     position_ids=position_ids(attention_mask)).logits
    t = temperature if temperature > 0 else 1.0
    return token_logprobs(logits[:, prompt_len - 1:-1], sequences[:, prompt_len:], t)
