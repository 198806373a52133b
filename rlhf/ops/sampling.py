"""Fused sampling: temperature, top-k, top-p (nucleus), greedy; log-probs at the temperature."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    # rows of a prompt: consecutive (``prompt_major``)
    samples_per_prompt: int = 1
    seed: int = 0


def prompt_major(items: list, samples_per_prompt: int) -> list:
    """The row layout of every generation: each prompt's samples in consecutive rows
    (``[a, a, b, b]`` for two samples of prompts ``a``, ``b``). What the rows of a ``Generation``,
    the examples they are scored against and the groups of GRPO/RLOO (``scores.view(-1, samples)``)
    assume."""
    return [x for x in items for _ in range(samples_per_prompt)]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Masks (to -inf) what top-k and then top-p exclude; keeps at least one token per row."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _ban_column(x: torch.Tensor, ban: Optional[int], ban_now: Optional[torch.Tensor]) -> None:
    """In place: column ``ban`` of ``x`` to -inf (where ``ban_now``, when given)."""
    if ban is None:
        return
    if ban_now is None:
        x[:, ban].fill_(float("-inf"))
    else:
        x[:, ban].masked_fill_(ban_now, float("-inf"))


def sample(
    logits: torch.Tensor,
    p: SamplingParams,
    u: Optional[torch.Tensor],
    ban: Optional[int] = None,
    ban_now: Optional[torch.Tensor] = None,
):
    """Next tokens [B] and their log-probs [B] under softmax(logits / temperature) (the distribution
    PPO optimises; greedy reports the temperature-1 log-prob), by inverse CDF with the uniform draws
    ``u`` ([B, 1] in [0, 1) on the logits' device, a column of ``rlhf.engine.draws.row_draws``; None
    when greedy). ``ban``: a token that may not be drawn now (EOS before min_new_tokens) —
    everywhere, or where ``ban_now`` (a 0-dim bool tensor on the device: static shapes and no host
    synchronisation, the static decode step) is true; the log-probs stay those of the unmodified
    policy."""
    # .float() below copies: ours to write into
    fresh = logits.dtype != torch.float32
    logits = logits.float()
    if p.temperature <= 0:
        logp = torch.log_softmax(logits, -1)
        allowed = logits
        if ban is not None:
            allowed = logits.clone()
            _ban_column(allowed, ban, ban_now)
        tokens = allowed.argmax(-1)
    else:
        # x / 1 == x exactly: skip the division (and copy only when the ban must write)
        if p.temperature != 1.0:
            scaled = logits / p.temperature
        elif ban is not None and not fresh:
            scaled = logits.clone()
        else:
            scaled = logits
        logp = torch.log_softmax(scaled, -1)
        # after the log-probs; -inf / T = -inf: the same as banning before scaling
        _ban_column(scaled, ban, ban_now)
        probs = filter_logits(scaled, p.top_k, p.top_p).softmax(-1)
        # Inverse CDF: one uniform draw per row (torch.multinomial draws far more on CPU).
        cdf = probs.cumsum(-1)
        u = u.to(probs.device) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
