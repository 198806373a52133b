"""Scalar heads on a causal LM backbone: reward model and critic.

The model is a standard ``AutoModelForSequenceClassification`` (num_labels=1), so the reward model
is a plain Hugging Face artifact. Its head (``score``) runs on every position; a forward hook keeps
those per-token values (the critic's values), and the score of a sequence is the value at its last
non-pad token. Position ids come from the attention mask, so left and right padding score alike.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def head_module(model: nn.Module) -> nn.Module:
    for name in ("score", "classifier", "v_head"):
        if hasattr(model, name):
            return getattr(model, name)
    raise ValueError(f"{type(model).__name__} has no scalar head (score)")


def init_head(model: nn.Module) -> None:
    """normal(0, 1/sqrt(d+1)) weight, zero bias (the N-implementation-details study)."""
    head = head_module(model)
    d = head.weight.shape[1]
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / math.sqrt(d + 1))
        if getattr(head, "bias", None) is not None:
            head.bias.zero_()


class TokenValues:
    """Captures the head's per-token output during the model's own forward (FSDP-safe)."""

    def __init__(self, model: nn.Module):
        self.values = None
        self._handle = head_module(model).register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        self.values = output.squeeze(-1).float()

    def remove(self) -> None:
        self._handle.remove()


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last non-pad token of each row (works for left and right padding)."""
    t = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (t[None, :] * attention_mask.long()).argmax(-1)


def token_values(forward, capture: TokenValues, input_ids, attention_mask) -> torch.Tensor:
    """[B, T] values from ``forward`` (an engine's or a model's) with mask-derived positions."""
    forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask))
    return capture.values


def sequence_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return values.gather(1, last_index(attention_mask)[:, None]).squeeze(1)
