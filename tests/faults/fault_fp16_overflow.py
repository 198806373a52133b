"""An fp16 overflow: before chosen optimizer steps of a trained model, one gradient element becomes
inf — what a backward that overflowed fp16 leaves — on every rank or on one rank only; each step's
weights before and after are recorded, so a test sees what the engine did with it.

``arg``: comma-separated ``key=value``: ``at=K`` (the K-th call of ``TrainEngine.step`` of each
engine, 1-based; required), ``times=N`` (N calls in a row from K, default 1), ``rank=R`` (on that
rank only; default every rank), ``role=ROLE`` (engines of that role only: actor, critic,
reward_model; default any), ``out=DIR`` (each rank appends one JSON line per step call to
``DIR/steps_rank<r>.jsonl``: ``call``, ``role``, ``poisoned``, ``before`` and ``after`` (digests of
this rank's parameters), ``norm``, ``loss_scale``, ``skipped``).

``poison(engine)`` is importable as it is (the 2-rank workers of tests/distributed use it
in-process).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path


def _local(t):
    # a DTensor's shard on this rank (a view)
    return t.to_local() if hasattr(t, "to_local") else t


def poison(engine) -> None:
    """Sets one element of this rank's first non-empty gradient to inf (in place)."""
    import torch

    for p in engine.model.parameters():
        if p.grad is not None and _local(p.grad).numel():
            with torch.no_grad():
                _local(p.grad).view(-1)[0] = float("inf")
            return
    raise AssertionError("fault fp16_overflow: no gradient to poison on this rank")


def digest(engine) -> str:
    """sha256 of this rank's parameters (its shards under FSDP2), in order."""
    h = hashlib.sha256()
    for p in engine.model.parameters():
        h.update(_local(p.detach()).float().cpu().numpy().tobytes())
    return h.hexdigest()


def _parse(arg: str) -> dict:
    opts = dict(kv.split("=", 1) for kv in arg.split(",") if kv)
    unknown = set(opts) - {"at", "times", "rank", "role", "out"}
    if "at" not in opts or unknown:
        raise ValueError(
            f"fault fp16_overflow: {arg!r}: expected at=K[,times=N][,rank=R][,role=ROLE][,out=DIR]"
        )
    return opts


def install(arg: str) -> None:
    from sitecustomize import after_import

    opts = _parse(arg)
    first, times = int(opts["at"]), int(opts.get("times", 1))
    rank = int(os.environ.get("RANK", "0"))
    on_rank = "rank" not in opts or int(opts["rank"]) == rank
    out = Path(opts["out"]) / f"steps_rank{rank}.jsonl" if "out" in opts else None

    def patch(train) -> None:
        original = train.TrainEngine.step

        def step(self):
            role = self.ecfg.role
            if "role" in opts and role != opts["role"]:
                return original(self)
            self._fault_calls = getattr(self, "_fault_calls", 0) + 1
            poisoned = on_rank and first <= self._fault_calls < first + times
            if poisoned:
                poison(self)
            before = digest(self) if out is not None else None
            norm = original(self)
            if out is not None:
                scaler = self.scaler
                line = {
                    "call": self._fault_calls,
                    "role": role,
                    "poisoned": poisoned,
                    "before": before,
                    "after": digest(self),
                    "norm": norm if math.isfinite(norm) else str(norm),
                    "loss_scale": scaler.scale if scaler is not None else None,
                    "skipped": scaler.skipped if scaler is not None else None,
                }
                out.parent.mkdir(parents=True, exist_ok=True)
                with open(out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(line) + "\n")
            return norm

        train.TrainEngine.step = step

    after_import("rlhf.engine.train", patch)
