"""Per-token functions of logits and masks (pure tensor functions): log-probabilities, GKD's
divergence between two models' next-token distributions, and what an attention or response mask says
about its rows (positions, last index; left or right padding alike)."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# fp32 working set of one chunk of the log-softmax in ``response_logprobs`` (bytes): big enough that
# a small vocabulary takes the whole response in one chunk, small enough that a 152k vocabulary
# never holds [rows, tokens, vocab] in fp32 at once
LOGSOFTMAX_CHUNK_BYTES = 256 * 2**20


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(targets[t] | ...) from ``logits[t]`` (already aligned), in fp32, at ``temperature``."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def _logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: Optional[str]
):
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = torch.gather(logp_all, -1, targets.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return logp, None
    if entropy == "loss":
        # a loss term: its own log-softmax node, as the plain formula has it
        logp_all = F.log_softmax(logits, dim=-1)
    else:
        # "metric": the log-softmax computed above, detached, at no extra pass
        logp_all = logp_all.detach()
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def chunked_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    entropy: Optional[str] = None,
    chunk_bytes: int = LOGSOFTMAX_CHUNK_BYTES,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """[B, N] log-probs of ``targets`` and, with ``entropy`` ("loss": differentiable; "metric":
    detached, from the same log-softmax), the entropy of softmax(logits / T), from aligned
    ``logits`` [B, N, V], computed over a few positions at a time so that the fp32 log-softmax
    never exists for all of [B, N, V] at once. Under autograd each chunk is
    recomputed in backward (activation checkpointing), so backward holds one chunk too. Each
    position's numbers are those of ``token_logprobs`` on the whole tensor (the same ops per
    row)."""
    B, N, V = logits.shape
    step = max(1, min(N, chunk_bytes // max(B * V * 4, 1)))
    if step >= N:
        return _logprobs_and_entropy(logits, targets, temperature, entropy)
    grad = torch.is_grad_enabled() and logits.requires_grad
    lps, ents = [], []
    for s in range(0, N, step):
        args = (logits[:, s : s + step], targets[:, s : s + step], temperature, entropy)
        if grad:
            # recomputed in backward: one chunk's activations held at a time
            lp, ent = checkpoint(_logprobs_and_entropy, *args, use_reentrant=False)
        else:
            lp, ent = _logprobs_and_entropy(*args)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps, 1), (torch.cat(ents, 1) if entropy else None)


def _divergence(
    student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float, top_k: int
):
    s, t = student.float(), teacher.float()
    if temperature != 1.0:
        s, t = s / temperature, t / temperature
    ls, lt = F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)
    if top_k:
        # the teacher's k likeliest tokens and one bucket for all the others (k + 1 categories):
        # renormalising over the k alone would let the student move its mass off them unseen (a
        # loss of 0 at any such mass: the collapse veRL #5041 met with top-k reverse KL)
        idx = lt.topk(min(top_k, lt.shape[-1]), dim=-1).indices
        ls, lt = _with_tail(ls, idx), _with_tail(lt, idx)
    if beta == 0.0:  # forward KL(teacher ‖ student)
        return (lt.exp() * (lt - ls)).sum(-1)
    if beta == 1.0:  # reverse KL(student ‖ teacher)
        return (ls.exp() * (ls - lt)).sum(-1)
    mix = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), 0)
    return beta * (lt.exp() * (lt - mix)).sum(-1) + (1 - beta) * (ls.exp() * (ls - mix)).sum(-1)


def _with_tail(logp: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[..., V] log-probs → [..., k + 1]: those of the k tokens ``idx`` and, last, the log of all
    the others' mass (summed over them, not 1 − the k's: no cancellation when the k hold nearly
    all; at least e^-69 ≈ 1e-30, where the k are the whole vocabulary)."""
    rest = torch.logsumexp(logp.scatter(-1, idx, float("-inf")), dim=-1, keepdim=True)
    return torch.cat([logp.gather(-1, idx), rest.clamp(min=-69.0)], -1)


def chunked_divergence(
    student: torch.Tensor,
    teacher: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    top_k: int = 0,
    chunk_bytes: int = LOGSOFTMAX_CHUNK_BYTES,
) -> torch.Tensor:
    """[B, N] GKD's generalised Jensen–Shannon divergence between the student's and the teacher's
    next-token distributions at each position (aligned logits [B, N, V], at ``temperature``): with M
    = β·P_teacher + (1 − β)·P_student, β·KL(P_teacher ‖ M) + (1 − β)·KL(P_student ‖ M); β = 0 is the
    forward KL(teacher ‖ student), β = 1 the reverse KL(student ‖ teacher) (Agarwal et al. 2024;
    TRL's ``beta``). ``top_k`` > 0: over the teacher's k likeliest tokens and one category for
    the rest of the vocabulary (a lower bound of the full divergence). Computed a few positions at
    a time (each chunk recomputed in backward) so that fp32 [B, N, V] never exists at once;
    differentiable in ``student``."""
    B, N, V = student.shape
    # (two log-softmaxes and the mixture; with top_k, each with its k masked out too)
    held = 6 if top_k else 4
    step = max(1, min(N, chunk_bytes // max(B * V * 4 * held, 1)))
    grad = torch.is_grad_enabled() and student.requires_grad
    out = []
    for s in range(0, N, step):
        args = (student[:, s : s + step], teacher[:, s : s + step], beta, temperature, top_k)
        out.append(
            checkpoint(_divergence, *args, use_reentrant=False) if grad else _divergence(*args)
        )
    return torch.cat(out, 1)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over the real tokens of each row (0 on the left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last set position of each row (0 for an empty row): the last non-pad token of
    an attention mask, the last response token of a response mask."""
    t = torch.arange(mask.shape[1], device=mask.device)
    return (t[None, :] * mask.long()).argmax(-1)
