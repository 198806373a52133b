"""Reward shaping of one step's rows: the terms the collector (rlhf/rl/experience.py) adds to or
takes from the rewards — on-policy distillation's per-token reward, the reward model's part without
its line in response length, a failed episode's reward filled from its group."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from rlhf.engine.mesh import Mesh


def distillation(
    logp: torch.Tensor,
    teacher: torch.Tensor,
    actor: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    mesh: Mesh,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """On-policy distillation's reward, [B, N]: −``coef`` × (log π_actor − log π_teacher) of each
    sampled policy token (``mask``), the per-token estimate of the reverse KL(π_actor ‖ π_teacher);
    and its metrics over every rank: ``distill/reverse_kl`` (per token), ``distill/reverse_kl_seq``
    (per sequence) and ``distill/agreement`` (the share of policy tokens where the two models'
    greedy tokens agree). ``teacher``, ``actor``: [B, N, 2] log-probs and greedy tokens
    (``response_logprobs_top1``)."""
    rkl = (logp - teacher[..., 0]) * mask
    tokens, rows = mesh.sum(float(mask.sum())), mesh.sum(float(mask.shape[0]))
    agree = (teacher[..., 1] == actor[..., 1]).float() * mask
    metrics = {
        "distill/reverse_kl": mesh.sum(float(rkl.sum())) / max(tokens, 1.0),
        "distill/reverse_kl_seq": mesh.sum(float(rkl.sum())) / max(rows, 1.0),
        "distill/agreement": mesh.sum(float(agree.sum())) / max(tokens, 1.0),
    }
    return -coef * rkl, metrics


def length_debiased(
    score: torch.Tensor, length: torch.Tensor, mesh: Mesh
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(``score`` less its least-squares line in ``length`` over every rank's rows, centred: the
    mean score is kept; the slope, a 0-dim tensor). Collective."""
    x, y = length.to(score.dtype), score
    n, sx, sy, sxx, sxy = (
        mesh.sum(float(v)) for v in (x.numel(), x.sum(), y.sum(), (x * x).sum(), (x * y).sum())
    )
    var = sxx - sx * sx / n
    slope = (sxy - sx * sy / n) / var if var > 1e-9 else 0.0
    return y - slope * (x - sx / n), torch.tensor(slope, dtype=score.dtype)


def fill_failed(score: torch.Tensor, failed: torch.Tensor, group: int) -> torch.Tensor:
    """``score`` with each failed row replaced by the mean of its group's other rows (0 if none)."""
    s, f = score.view(-1, group), failed.view(-1, group).float()
    ok = 1.0 - f
    mean = (s * ok).sum(1, keepdim=True) / ok.sum(1, keepdim=True).clamp(min=1.0)
    return torch.where(f.bool(), mean.expand_as(s), s).reshape(-1)
