"""Exponential moving average of the actor's (possibly sharded) parameters (``ppo.ema_decay``):
updated after each PPO epoch, saved with checkpoints, exported as ``ppo/actor_ema/``."""

from __future__ import annotations

import torch

from rlhf.rl.snapshot import ActorCopy


class EMA(ActorCopy):
    """Exponential moving average of the actor's (possibly sharded) parameters."""

    def __init__(self, engine, decay: float):
        super().__init__(engine, "actor_ema.safetensors")
        self.decay = decay

    def update(self) -> None:
        with torch.no_grad():
            for n, p in self.engine.model.named_parameters():
                self.shadow[n].lerp_(p.detach(), 1.0 - self.decay)
