"""Exponential moving average of the actor's (possibly sharded) parameters (``ppo.ema_decay``):
updated after each PPO epoch, saved with checkpoints, exported as ``ppo/actor_ema/``."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import distribute_tensor

from rlhf.engine.checkpoint import write_hf


class EMA:
    """Exponential moving average of the actor's (possibly sharded) parameters."""

    def __init__(self, engine, decay: float):
        self.engine, self.decay = engine, decay
        self.shadow = {n: p.detach().clone() for n, p in engine.model.named_parameters()}

    def update(self) -> None:
        with torch.no_grad():
            for n, p in self.engine.model.named_parameters():
                self.shadow[n].lerp_(p.detach(), 1.0 - self.decay)

    def _full(self) -> dict:
        out = {}
        for n, t in self.shadow.items():
            out[n] = t.full_tensor() if hasattr(t, "full_tensor") else t
        return out

    def save(self, ckpt_path) -> None:
        full = {k: v.contiguous() for k, v in self._full().items()}
        if self.engine.mesh.is_main:
            save_file(full, str(ckpt_path / "actor_ema.safetensors"))
        self.engine.mesh.barrier()

    def load(self, ckpt_path) -> None:
        f = ckpt_path / "actor_ema.safetensors"
        if not f.is_file():
            return
        full = load_file(str(f))
        for n, t in self.shadow.items():
            if hasattr(t, "to_local"):  # a DTensor: this rank's shard of the full tensor
                src = full[n].to(t.to_local().device)
                t.copy_(distribute_tensor(src, t.device_mesh, t.placements))
            else:
                t.copy_(full[n].to(t.device))

    def export(self, out_dir, tokenizer) -> None:
        full = self._full()
        mesh = self.engine.mesh
        if mesh.is_main:  # as the actor is exported (a LoRA actor merged)
            write_hf(self.engine.module, {k.removeprefix("module."): v for k, v in full.items()}, out_dir, tokenizer)
        mesh.barrier()
