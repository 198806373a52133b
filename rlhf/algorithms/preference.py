"""Preference losses as pure tensor functions (no project imports): the reward model's pairwise
Bradley-Terry loss (``pairwise_loss``) and direct preference optimisation.

Every loss reads the *summed* log-probability of each pair's responses — the response tokens only,
EOS included, never the prompt — under the policy (with gradient) and under the frozen reference
(computed once, without gradient). With h = (log π(y_w) − log π(y_l)) − (log π_ref(y_w) − log
π_ref(y_l)):

  sigmoid  −log σ(β h)                                   DPO (Rafailov et al., 2023)
  cDPO     −(1 − ε) log σ(β h) − ε log σ(−β h)           sigmoid with label_smoothing ε: ε of the
                                                         pairs assumed flipped (the loss stops at a
                                                         finite margin instead of pushing h to ∞)
  ipo      (h − 1/(2β))²                                 IPO (Azar et al., 2023), on the summed
                                                         log-probs as the paper writes it (TRL
                                                         averages per token instead)

Optionally (``sft_coef`` α > 0, RPO — Pang et al., 2024; TRL's rpo_alpha; Llama 3's recipe) each
pair adds α × the chosen response's negative log-likelihood per token. Why: when chosen and rejected
differ in a token or two (the embedded task's answers differ in a digit), the shared tokens cancel
in h and the DPO terms can grow h while the chosen response's own likelihood falls — the mass goes
to sequences neither response holds (measured: " The answer is 4." where 38 was right). The NLL term
keeps the chosen responses likely.

The implicit rewards β (log π − log π_ref) of chosen and rejected responses come back detached: what
the policy has learnt to prefer, for metrics (accuracy = share of pairs whose chosen reward is
higher).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

LOSSES = ("sigmoid", "ipo")


def response_mask(attention_mask: torch.Tensor, prompt_len: torch.Tensor) -> torch.Tensor:
    """[B, T−1] bool: which shifted targets (token t+1, predicted by the logits at t) belong to the
    response — at or after the row's ``prompt_len`` and not padding (right-padded rows)."""
    pos = torch.arange(1, attention_mask.shape[1], device=attention_mask.device)[None, :]
    return (pos >= prompt_len.to(attention_mask.device)[:, None]) & attention_mask[:, 1:].bool()


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] sum of the masked per-token log-probs (``torch.where``: a non-finite value at a masked
    position, e.g. a padding token, cannot leak into the sum)."""
    return torch.where(mask, token_logprobs, torch.zeros_like(token_logprobs)).sum(-1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    sft_coef: float = 0.0,
    chosen_tokens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses [B], chosen rewards [B], rejected rewards [B]) from summed response
    log-probs; ``chosen_tokens`` [B]: the chosen responses' token counts (needed with ``sft_coef``).

    Per pair, not averaged: the caller divides the sum by the pair count of the whole global batch,
    so the gradient does not depend on how the batch is split over micro-batches and ranks."""
    if loss not in LOSSES:
        raise ValueError(f"unknown DPO loss {loss!r}: expected one of {', '.join(LOSSES)}")
    if loss != "sigmoid" and label_smoothing:
        raise ValueError("label_smoothing applies to the sigmoid loss (cDPO), not to ipo")
    if sft_coef and chosen_tokens is None:
        raise ValueError("sft_coef needs chosen_tokens (the token count of each chosen response)")
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    # fp32 at least (bf16 log-probs), fp64 kept
    h = h.to(torch.promote_types(h.dtype, torch.float32))
    if loss == "sigmoid":
        losses = -F.logsigmoid(beta * h)
        if label_smoothing:
            losses = (1.0 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-beta * h)
    else:  # ipo
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    if sft_coef:
        losses = losses - sft_coef * policy_chosen.to(h.dtype) / chosen_tokens.clamp(min=1).to(
            h.dtype
        )
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach().to(h.dtype)
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach().to(h.dtype)
    return losses, chosen_rewards, rejected_rewards


def pairwise_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0
) -> torch.Tensor:
    """Bradley-Terry ranking loss per pair: -log σ(r_chosen - r_rejected - margin) (InstructGPT eq.
    1; the margin as in Llama 2)."""
    return -F.logsigmoid(chosen.float() - rejected.float() - margin)
