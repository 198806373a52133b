"""Learning-rate schedules equivalent to DeepSpeed's WarmupLR, WarmupDecayLR, and a cosine variant.

Each is a multiplier of the peak learning rate as a function of the optimizer step (0-based).
"""

from __future__ import annotations

import math

import torch


def lr_factor(
    step: int, *, kind: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0
) -> float:
    """warmup: linear 0→1 over warmup_steps then constant (DeepSpeed WarmupLR, linear type).
    warmup_decay: warmup, then linear decay to min_ratio at total_steps (WarmupDecayLR).
    cosine: warmup, then half a cosine down to min_ratio at total_steps. constant: 1."""
    if kind == "constant":
        return 1.0
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "warmup":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    if kind == "warmup_decay":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    if kind == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {kind}")


def make_scheduler(optimizer, tcfg, total_steps: int):
    def fn(s):
        return lr_factor(
            s,
            kind=tcfg.scheduler,
            warmup_steps=tcfg.warmup_steps,
            total_steps=total_steps,
            min_ratio=tcfg.min_lr_ratio,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
