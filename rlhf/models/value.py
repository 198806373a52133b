"""Scalar heads on a causal LM backbone: reward model and critic.

The model is a standard ``AutoModelForSequenceClassification`` (num_labels=1), so the reward model
is a plain Hugging Face artifact. Its head (``score``) runs on every position (the critic's values);
the score of a sequence is the value at its last non-pad token (for a model whose pad is its EOS,
the last before its trailing EOS, as Transformers' pooling reads it: ``end_pad``). Position ids come
from the attention mask, so left and right padding score alike. A reward-model ensemble
(``reward.ensemble=k``) is the same model with k labels: member i is the head's row i, over the one
backbone (docs/ppo.md).
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
# beside an exported reward model: {mean, std, step, eval/*} of its held-out scores (PPO normalises
# by them)
REWARD_STATS_FILE = "reward_stats.json"


def head_name(model: nn.Module) -> str:
    for name in HEAD_NAMES:
        if hasattr(model, name):
            return name
    raise ValueError(f"{type(model).__name__} has no scalar head (score)")


def head_module(model: nn.Module) -> nn.Module:
    return getattr(model, head_name(model))


def members(config) -> int:
    """The ensemble members of a sequence classifier (its labels: 1 for a plain reward model)."""
    return int(getattr(config, "num_labels", 1) or 1)


def mean_head(model: nn.Module, scales=None) -> None:
    """Turns a k-member model into a one-label one whose score is the mean of the members' (each
    first multiplied by ``scales[i]``): the critic's start from an ensemble. Linear, so exact. On
    the meta device (ranks that receive their weights later) only the shape changes."""
    head = head_module(model)
    k = head.weight.shape[0]
    if k == 1 and scales is None:
        return
    w = torch.as_tensor(scales if scales is not None else [1.0] * k, dtype=head.weight.dtype)
    new = nn.Linear(head.weight.shape[1], 1, bias=head.bias is not None, device=head.weight.device)
    new = new.to(head.weight.dtype)
    if head.weight.device.type != "meta":
        with torch.no_grad():
            new.weight.copy_(
                (head.weight * w.to(head.weight.device)[:, None]).mean(0, keepdim=True)
            )
            if head.bias is not None:
                new.bias.copy_((head.bias * w.to(head.bias.device)).mean(0, keepdim=True))
    setattr(model, head_name(model), new)
    model.config.num_labels = 1


def init_head(model: nn.Module) -> None:
    """normal(0, 1/sqrt(d+1)) weight, zero bias (the N-implementation-details study)."""
    head = head_module(model)
    d = head.weight.shape[1]
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / math.sqrt(d + 1))
        if getattr(head, "bias", None) is not None:
            head.bias.zero_()


class ScalarHeadModel(nn.Module):
    """Per-token values [B, T] of a Hugging Face sequence-classification model: backbone, then head
    ([B, T, k] for an ensemble of k members).

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
        """``kwargs``: a packed batch's sequence bounds (rlhf/engine/packing.py), passed to the
        backbone."""
        # with LoRA: the HF model, its adapted layers in place
        hf = unwrap(self.hf)
        backbone = getattr(hf, hf.base_model_prefix)
        if position_ids is None:
            position_ids = _positions(attention_mask)
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        ).last_hidden_state
        out = head_module(hf)(hidden)
        if out.shape[-1] > 1:  # an ensemble: [B, T, k]
            return out.float()
        # sum over the size-1 head dimension: the same numbers as squeeze(-1), but a new tensor, not
        # a view (FSDP2 warns that a module returning a view can break backward)
        return out.sum(-1).float()


def end_pad(config) -> Optional[int]:
    """The token a reward model's score is read before when it ends a row: its pad where the pad is
    also its EOS — Transformers' pooling reads the last token that is not the pad, and
    DeepSpeed-Chat's reward models (every family but Llama: rlhf/models/dschat.py) were trained on
    that position —; None for any other model (rlhf's own: pad and EOS differ), read at the last
    real token."""
    pad = getattr(config, "pad_token_id", None)
    eos = getattr(config, "eos_token_id", None)
    if pad is None or pad not in (eos if isinstance(eos, (list, tuple)) else [eos]):
        return None
    return pad


def sequence_scores(
    values: torch.Tensor,
    attention_mask: torch.Tensor,
    input_ids: Optional[torch.Tensor] = None,
    end_pad: Optional[int] = None,
) -> torch.Tensor:
    """The value at each row's last real token: [B] from [B, T] values, [B, k] from an ensemble's.
    ``end_pad`` (``end_pad(config)``): the last real token of ``input_ids`` that is not that id."""
    rows = torch.arange(values.shape[0], device=values.device)
    if end_pad is not None:
        attention_mask = attention_mask.bool() & input_ids.ne(end_pad)
    return values[rows, last_index(attention_mask)]
