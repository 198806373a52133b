"""Log-probs of given responses under a model in training mode (what PPO recomputes)."""

from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch

from rlhf.algorithms.tokens import chunked_logprobs, position_ids


def keeps_logits(module) -> bool:
    """Whether ``module.forward`` takes ``logits_to_keep`` (HF causal LMs since 4.50): then only the
    response positions go through the LM head."""
    try:
        return "logits_to_keep" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def response_stats(
    forward,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    entropy: Optional[str] = None,
    keep_logits: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """([B, N] log π(response token), [B, N] entropy or None) at ``temperature`` (1 when greedy;
    ``entropy``: None, "loss" or "metric", see ``chunked_logprobs``),
    with mask-derived positions; ``forward`` is an engine's or a model's ``forward`` returning logits.
    ``keep_logits``: ask the model for the logits of the response positions only (the same numbers,
    less memory). The fp32 log-softmax runs a few positions at a time (``chunked_logprobs``)."""
    n = sequences.shape[1] - prompt_len
    extra = {"logits_to_keep": n + 1} if keep_logits else {}
    logits = forward(
        input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids(attention_mask), **extra
    ).logits
    t = temperature if temperature > 0 else 1.0  # greedy rollouts (temperature 0) score at 1: decided here only
    return chunked_logprobs(logits[:, -(n + 1) : -1], sequences[:, prompt_len:], t, entropy=entropy)


def response_logprobs(
    forward,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    keep_logits: bool = False,
) -> torch.Tensor:
    """[B, N] log π(response token); see ``response_stats``."""
    return response_stats(forward, sequences, attention_mask, prompt_len, temperature, keep_logits=keep_logits)[0]
