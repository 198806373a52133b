"""What an attention mask says about its rows (left or right padding alike)."""
from __future__ import annotations

import torch
from torch import Tensor


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over the real tokens of each row (0 on the left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_index(mask: Tensor) -> Tensor:
    """Index of the last set position of each row (0 for an empty row): the last non-pad token of
    an attention mask, the last response token of a response mask."""
    t = torch.arange(mask.shape[1], device=mask.device)
    return (t[None, :] * mask.long()).argmax(-1)
