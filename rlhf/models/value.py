"""Scalar heads on a causal LM backbone: reward model and critic.

The model is a standard ``AutoModelForSequenceClassification`` (num_labels=1), so the reward model
is a plain Hugging Face artifact. Its head (``score``) runs on every position (the critic's values);
the score of a sequence is the value at its last non-pad token. Position ids come from the attention
mask, so left and right padding score alike.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from rlhf.algorithms.tokens import last_index
from rlhf.algorithms.tokens import position_ids as _positions
from rlhf.models.lora import unwrap

HEAD_NAMES = ("score", "classifier", "v_head")
# beside an exported reward model: {mean, std, step, eval/*} of its held-out scores (PPO normalises by them)
REWARD_STATS_FILE = "reward_stats.json"


def head_name(model: nn.Module) -> str:
    for name in HEAD_NAMES:
        if hasattr(model, name):
            return name
    raise ValueError(f"{type(model).__name__} has no scalar head (score)")


def head_module(model: nn.Module) -> nn.Module:
    return getattr(model, head_name(model))


def init_head(model: nn.Module) -> None:
    """normal(0, 1/sqrt(d+1)) weight, zero bias (the N-implementation-details study)."""
    head = head_module(model)
    d = head.weight.shape[1]
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / math.sqrt(d + 1))
        if getattr(head, "bias", None) is not None:
            head.bias.zero_()


class ScalarHeadModel(nn.Module):
    """Per-token values [B, T] of a Hugging Face sequence-classification model: backbone, then head.

    The values are this module's own output, so FSDP (which hooks module outputs to re-gather
    weights for backward) and DDP see them; the HF model inside is saved unchanged."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        """``kwargs``: a packed batch's sequence bounds (rlhf/engine/packing.py), passed to the backbone."""
        hf = unwrap(self.hf)  # with LoRA: the HF model, its adapted layers in place
        backbone = getattr(hf, hf.base_model_prefix)
        if position_ids is None:
            position_ids = _positions(attention_mask)
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        ).last_hidden_state
        # sum over the size-1 head dimension: the same numbers as squeeze(-1), but a new tensor, not a
        # view (FSDP2 warns that a module returning a view can break backward)
        return head_module(hf)(hidden).sum(-1).float()


def sequence_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return values.gather(1, last_index(attention_mask)[:, None]).squeeze(1)
