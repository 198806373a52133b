"""Loss scaling for fp16 training (``engine.precision=fp16``, ``engine.fp16.*``), with DeepSpeed's
rules.

fp16 keeps 5 exponent bits: gradients below ~6e-8 flush to zero and activations' gradients above
65504 overflow to inf. The engine multiplies the loss by a scale S before backward
(``TrainEngine.backward``) and divides the fp32 gradients by S before clipping and the optimizer
(``TrainEngine.step``); a step whose unscaled gradients hold an inf or a NaN on any rank — the
gradient norm, all-reduced over the shards (FSDP2) or taken over gradients DDP has already
all-reduced, so every rank decides alike — is skipped: gradients dropped, weights, optimizer state
and schedule unchanged.

The scale follows DeepSpeed's ``DynamicLossScaler`` (deepspeed/runtime/fp16/loss_scaler.py) and its
``fp16`` keys and defaults:

- ``loss_scale`` > 0: that static scale for the whole run (an overflow still skips its step);
  0 (default): dynamic, starting at ``2**initial_scale_power`` (16).
- An overflow with hysteresis left (the counter, starting at ``hysteresis`` = 2, above 1) only
  lowers
  the counter; otherwise the scale halves, never below ``min_loss_scale`` (1). An overflow at
  ``min_loss_scale`` with no hysteresis left stops the run (``LossScaleError``, exit 2): the
  gradients are non-finite whatever the scale, the run has diverged.
- A step without overflow that follows a positive multiple of ``loss_scale_window`` (1000) steps
  without overflow (counted from the start or the last overflow) doubles the scale and restores the
  hysteresis counter. ``consecutive_hysteresis=true``: every step without overflow restores it.

The state (scale, steps without overflow, hysteresis counter, skipped steps) is checkpointed
(``state_dict``), so a resumed run scales exactly as an uninterrupted one.
"""

from __future__ import annotations

import logging
import time
from typing import List

import torch

from rlhf.config import FP16Config
from rlhf.errors import UserError

log = logging.getLogger("rlhf")

# a warning for each of the first WARN_FIRST skipped steps, then at most one every WARN_EVERY_S
# seconds (counting the ones in between): a run that overflows often does not flood its log
WARN_FIRST, WARN_EVERY_S = 10, 30.0


class LossScaleError(UserError):
    """The gradients overflowed at the minimum loss scale (exit 2)."""


class LossScaler:
    """The loss scale of one trained model. ``name``: the model's role, for the log; ``main``: this
    rank logs (every rank holds the same state: each decides from the same global norm)."""

    def __init__(self, cfg: FP16Config, name: str = "", main: bool = True):
        self.cfg, self.name, self.main = cfg, name, main
        self.dynamic = cfg.loss_scale == 0
        self.scale = float(cfg.loss_scale) if not self.dynamic else 2.0**cfg.initial_scale_power
        # steps without overflow since the start or the last overflow
        self.good_steps = 0
        # DeepSpeed's cur_hysteresis: an overflow halves the scale at 1
        self.hysteresis = cfg.hysteresis
        # optimizer steps taken or skipped, over the whole run
        self.steps = 0
        self.skipped = 0  # of which skipped for an overflow
        # (time.monotonic of the last overflow warning)
        self._last_warning = -float("inf")
        self._unsaid = 0  # overflows since then not warned of

    @property
    def who(self) -> str:
        """``fp16 (<role>)``: how the messages name this scaler."""
        return f"fp16 ({self.name})" if self.name else "fp16"

    def describe(self) -> str:
        """The log line at the start: the settings in force."""
        if not self.dynamic:
            return (
                f"{self.who}: static loss scale {self.scale:g} (engine.fp16.loss_scale); an "
                "overflow skips its step"
            )
        c = self.cfg
        restored = "when the scale grows"
        if c.consecutive_hysteresis:
            restored = "by every step without overflow"
        return (
            f"{self.who}: dynamic loss scale from 2**{c.initial_scale_power} = "
            f"{self.scale:g}: an overflow skips its "
            f"step; after {c.hysteresis - 1} tolerated "
            f"(engine.fp16.hysteresis={c.hysteresis}, restored {restored}) "
            f"each halves the scale, not below {c.min_loss_scale:g}; {c.loss_scale_window} "
            "steps without overflow "
            f"double it"
        )

    def unscale(self, grads: List[torch.Tensor]) -> None:
        """Divides the (fp32) gradients by the scale in place (a power of two when dynamic:
        exact)."""
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, overflow: bool) -> None:
        """The scale after a step whose gradients did (``overflow``) or did not overflow. Raises
        ``LossScaleError`` on an overflow at the minimum scale with no hysteresis left."""
        self.steps += 1
        if not overflow:
            if self.cfg.consecutive_hysteresis:
                self.hysteresis = self.cfg.hysteresis
            if (
                self.dynamic
                and self.good_steps > 0
                and self.good_steps % self.cfg.loss_scale_window == 0
            ):
                if not self.cfg.consecutive_hysteresis:
                    self.hysteresis = self.cfg.hysteresis
                self.scale *= 2.0
            self.good_steps += 1
            return
        self.skipped += 1
        self.good_steps = 0
        before = self.scale
        if self.dynamic:
            if self.hysteresis > 1:
                self.hysteresis -= 1
            elif self.scale <= self.cfg.min_loss_scale:
                raise LossScaleError(
                    f"{self.who}: the gradients overflowed (inf/NaN) at optimizer "
                    f"step {self.steps} with the loss scale at "
                    f"engine.fp16.min_loss_scale={self.cfg.min_loss_scale:g} "
                    "and no hysteresis left: they are non-finite whatever the scale (the "
                    "run diverged, or an fp16 "
                    "forward overflowed); stopped before the step's update (the last "
                    "checkpoint is kept). "
                    f"A lower train.lr, engine.precision=bf16 or fp32 may train"
                )
            else:
                self.scale = max(self.scale / 2.0, float(self.cfg.min_loss_scale))
        self._warn(before)

    def _warn(self, before: float) -> None:
        """One warning per skipped step, rate-limited (``WARN_FIRST``, ``WARN_EVERY_S``)."""
        if not self.main:
            return
        now = time.monotonic()
        if self.skipped > WARN_FIRST and now - self._last_warning < WARN_EVERY_S:
            self._unsaid += 1
            return
        more = f"; {self._unsaid} more since the previous warning" if self._unsaid else ""
        then = (
            f"loss scale {before:g} → {self.scale:g}"
            if self.scale != before
            else f"loss scale {self.scale:g} kept"
        )
        if self.dynamic and self.scale == before:
            then += (
                f" (engine.fp16.hysteresis: {self.hysteresis - 1} more overflow(s) tolerated "
                "before it halves)"
            )
        log.warning(
            "%s: optimizer step %s: gradients overflowed (inf/NaN): step skipped, %s (%d "
            "skipped in all%s)",
            self.who,
            self.steps,
            then,
            self.skipped,
            more,
        )
        self._last_warning, self._unsaid = now, 0

    def metrics(self, prefix: str) -> dict:
        """``<prefix>/loss_scale`` (after the last step's update: the next step's) and
        ``<prefix>/skipped_steps`` (steps skipped for an overflow so far in the run)."""
        return {f"{prefix}/loss_scale": self.scale, f"{prefix}/skipped_steps": self.skipped}

    # ---- state (trainer_state.json) ----
    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "steps": self.steps,
            "good_steps": self.good_steps,
            "hysteresis": self.hysteresis,
            "skipped": self.skipped,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.steps = int(sd["steps"])
        self.good_steps = int(sd["good_steps"])
        self.hysteresis = int(sd["hysteresis"])
        self.skipped = int(sd["skipped"])
