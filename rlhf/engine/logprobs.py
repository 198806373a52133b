"""Log-probs of given tokens under a model in training mode: PPO's responses (what it recomputes),
the SFT / PPO-ptx NLL and DPO's sequence log-probs (the logits of the positions they read only)."""

from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

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
    with mask-derived positions; ``forward`` is an engine's or a model's ``forward`` returning
    logits. ``keep_logits``: ask the model for the logits of the response positions only (the same
    numbers, less memory). The fp32 log-softmax runs a few positions at a time
    (``chunked_logprobs``)."""
    logits = response_logits(forward, sequences, attention_mask, prompt_len, keep_logits)
    return logits_stats(logits, sequences[:, prompt_len:], temperature, entropy)


def logits_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: Optional[str] = None
):
    """``response_stats`` from the response's logits (``response_logits``) and tokens."""
    return chunked_logprobs(logits, targets, scoring_temperature(temperature), entropy=entropy)


def scoring_temperature(temperature: float) -> float:
    """The temperature responses are scored at: the sampling one, and 1 for greedy rollouts
    (temperature
    0), decided here only."""
    return temperature if temperature > 0 else 1.0


def response_logits(
    forward, sequences, attention_mask, prompt_len: int, keep_logits: bool
) -> torch.Tensor:
    """[B, N, V] the logits that predict each response token (those of the positions before
    them)."""
    n = sequences.shape[1] - prompt_len
    extra = {"logits_to_keep": n + 1} if keep_logits else {}
    logits = forward(
        input_ids=sequences,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        **extra,
    ).logits
    return logits[:, -(n + 1) : -1]


def token_logits(
    forward,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    tokens,
    keep_logits: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """([K, V] the logits that predict the response tokens set in ``tokens`` ([B, N]), row-major,
    and the [B, N] bool of those K tokens). Only those positions' logits are computed
    (``logits_at``: a packed forward runs the LM head over them alone; the values are the full
    forward's up to the rounding of a GEMM over fewer rows; a padded one over the response columns,
    ``logits_to_keep``, where the model takes it: ``keep_logits``, as ``response_logits``). With no
    token set the first response position's are computed (a forward still runs: every rank's
    collectives, the backward's hooks) and ``sel`` names it."""
    sel = tokens.bool()
    if not bool(sel.any()):
        sel = torch.zeros_like(sel)
        sel[0, 0] = True
    at = torch.zeros_like(attention_mask, dtype=torch.bool)
    at[:, prompt_len - 1 : prompt_len - 1 + sel.shape[1]] = sel
    extra = {"logits_to_keep": sel.shape[1] + 1} if keep_logits else {}
    logits = forward(
        input_ids=sequences,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        logits_at=at,
        **extra,
    ).logits
    return logits, sel


def spread(values: torch.Tensor, sel: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """[B, N]: ``values`` ([K], differentiable) at ``sel``'s K positions, ``fill`` (detached)
    elsewhere."""
    out = fill.detach().to(values.dtype).clone()
    out[sel] = values
    return out


def token_logprobs(
    forward,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    keep_logits: bool = False,
) -> torch.Tensor:
    """[B, N] log π of the response tokens set in ``tokens``, 0 elsewhere (``token_logits``)."""
    logits, sel = token_logits(forward, sequences, attention_mask, prompt_len, tokens, keep_logits)
    lp, _ = logits_stats(logits[None], sequences[:, prompt_len:][sel][None], temperature)
    out = spread(lp[0], sel, torch.zeros(sel.shape, device=lp.device))
    return torch.where(tokens.bool(), out, 0.0)


def response_logprobs_top1(
    forward,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    keep_logits: bool = False,
) -> torch.Tensor:
    """[B, N, 2]: ``response_logprobs`` and, as a float, the model's greedy token at each response
    position (what a teacher and its student are compared on), from one forward."""
    logits = response_logits(forward, sequences, attention_mask, prompt_len, keep_logits)
    logp, _ = logits_stats(logits, sequences[:, prompt_len:], temperature)
    return torch.stack([logp, logits.argmax(-1).to(logp.dtype)], -1)


def response_logprobs(
    forward,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    keep_logits: bool = False,
) -> torch.Tensor:
    """[B, N] log π(response token); see ``response_stats``."""
    return response_stats(
        forward, sequences, attention_mask, prompt_len, temperature, keep_logits=keep_logits
    )[0]


def target_logprobs(
    forward,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
    target_ids=None,
) -> torch.Tensor:
    """[B, L−1] log p(token t+1 | ..t) at the positions ``targets`` ([B, L−1] bool; token t+1 real),
    zeros elsewhere. Only those positions' logits are computed (``logits_at``: a packed forward runs
    the LM head over them alone) and log-softmaxed; each value is the full forward's at that
    position. ``target_ids``: [B, L−1] the tokens scored (default ``input_ids[:, 1:]``)."""
    if target_ids is None:
        target_ids = input_ids[:, 1:]
    logits = forward(
        input_ids=input_ids, attention_mask=attention_mask, logits_at=F.pad(targets, (0, 1))
    ).logits
    lp, _ = chunked_logprobs(logits[None], target_ids[targets][None])
    return lp.new_zeros(targets.shape).masked_scatter(targets, lp[0])


def nll_sum(forward, batch: dict, device: torch.device) -> tuple[torch.Tensor, int]:
    """The SFT loss of a ``collate_sft`` batch: (sum over its learnt tokens of −log p, their count).
    Summed, not averaged, so the caller divides by the whole global batch's count (a gradient that
    does not depend on how the batch is split)."""
    labels = batch["labels"][:, 1:].to(device)
    targets = labels != -100
    lp = target_logprobs(
        forward,
        batch["input_ids"].to(device),
        batch["attention_mask"].to(device),
        targets,
        labels.clamp(min=0),
    )
    return -(lp * targets).sum(), int(targets.sum())
