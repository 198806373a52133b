"""A copy of the actor's (possibly sharded) parameters, kept beside it: saved with checkpoints,
restored at resume, exported as a Hugging Face model. The EMA actor (``rl/ema.py``) and the gate's
best actor (``rl/gate.py``) are such copies."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import distribute_tensor

from rlhf.engine.checkpoint import write_hf


class ActorCopy:
    """This rank's shard of a copy of the actor's parameters; ``file``: its name in a checkpoint."""

    def __init__(self, engine, file: str):
        self.engine, self.file = engine, file
        self.shadow = {n: p.detach().clone() for n, p in engine.model.named_parameters()}

    def take(self) -> None:
        """The actor's parameters as they are now."""
        with torch.no_grad():
            for n, p in self.engine.model.named_parameters():
                self.shadow[n].copy_(p.detach())

    def restore(self) -> None:
        """Puts the copy into the actor (its optimizer state untouched: for an export, not for
        training on)."""
        with torch.no_grad():
            for n, p in self.engine.model.named_parameters():
                p.copy_(self.shadow[n])

    def _full(self) -> dict:
        out = {}
        for n, t in self.shadow.items():
            out[n] = t.full_tensor() if hasattr(t, "full_tensor") else t
        return out

    def save(self, ckpt_path) -> None:
        full = {k: v.contiguous() for k, v in self._full().items()}
        if self.engine.mesh.is_main:
            save_file(full, str(ckpt_path / self.file))
        self.engine.mesh.barrier()

    def load(self, ckpt_path) -> None:
        f = ckpt_path / self.file
        if not f.is_file():
            return
        full = load_file(str(f))
        for n, t in self.shadow.items():
            if hasattr(t, "to_local"):
                # a DTensor: this rank's shard of the full tensor
                src = full[n].to(t.to_local().device)
                t.copy_(distribute_tensor(src, t.device_mesh, t.placements))
            else:
                t.copy_(full[n].to(t.device))

    def export(self, out_dir, tokenizer) -> None:
        full = self._full()
        mesh = self.engine.mesh
        if mesh.is_main:
            # as the actor is exported (a LoRA actor merged)
            write_hf(
                self.engine.module,
                {k.removeprefix("module."): v for k, v in full.items()},
                out_dir,
                tokenizer,
            )
        mesh.barrier()
