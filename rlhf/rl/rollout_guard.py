"""The rollout-parity guard (``ppo.rollout_guard``, ``ppo.rollout_guard_max``; docs/ppo.md).

The inference mode samples the rollouts with weights of its own (the hybrid engine's copy of the
actor's training weights, in ``engine.inference_dtype``), and the step then recomputes the log-probs
of the same tokens in training mode. Both are the one policy: they differ by float rounding only
(measured on the embedded task, docs/ppo.md: 2e-8 to 8e-8 nats per token in fp32, 3e-4 to 3e-3 with
bf16). A copy that does not match the training weights (a wrong shard or layout, stale or corrupted
weights, a broken kernel) differs by orders of magnitude more, and PPO would go on training on
another policy's samples. So every step that generated with the inference mode reads
``rollout/logprob_abs_diff_mean`` (the mean |log π_rollout − log π_old| over every rank's response
tokens: ``rlhf.rl.metrics.step_metrics``) before its update and, above the threshold of the compared
precision, stops the run (exit 2, one line naming the step, the model family, the inference settings
and the numbers) — or with ``ppo.rollout_guard=rebuild`` first drops the inference weights,
regenerates the step's rollouts from weights built afresh and checks again.

The mean, not ``rollout/logprob_abs_diff_max``: the largest single token's difference is set by the
rarest token sampled — healthy bf16 steps reach 0.2–0.6 nats there (as much as a corrupted copy's
max) while their mean stays below 3e-3 — whereas a wrong weight moves the mean. The max is named in
the message beside it.

The guard only reads numbers: a step it lets through trains exactly as without it.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Dict, Optional, Tuple, TypeVar

from rlhf.config import ROLLOUT_GUARD_MAX
from rlhf.engine.mesh import name_of
from rlhf.errors import UserError

log = logging.getLogger("rlhf")

METRIC = "rollout/logprob_abs_diff_mean"  # what the guard judges
MAX_METRIC = "rollout/logprob_abs_diff_max"  # named beside it

# the default thresholds on rollout/logprob_abs_diff_mean (nats per token; config.py
# ROLLOUT_GUARD_MAX) by the lower precision of the two computations (the inference copy's dtype, the
# actor's training precision), over the healthy values measured on the embedded task (docs/ppo.md,
# "The rollout-parity guard"): fp32 ≤ 8.3e-8 (12 000×), bf16 ≤ 2.7e-3 (18×; larger models in bf16
# are reported at 1e-2 to 4e-2 between separate inference engines), fp16 ≤ 1.4e-4 (140×; 3 more
# mantissa bits than bf16: a larger model's gap should stay 8× below bf16's)

Exp = TypeVar("Exp")


class RolloutMismatch(UserError):
    """The inference mode's log-probs do not match the training recompute (exit 2)."""


def compute_dtype(inference_dtype: str, train_precision: str) -> str:
    """The precision the two log-probs are compared at: the coarser side's — bf16 when either
    computes in bf16 (a bf16 inference copy, or fp32 rollouts recomputed under bf16 autocast), else
    fp16 when either does (7 and 10 mantissa bits), else fp32."""
    for dtype in ("bf16", "fp16"):
        if dtype in (inference_dtype, train_precision):
            return dtype
    return "fp32"


def threshold(rollout_guard_max: float, dtype: str) -> float:
    """The threshold in force: ``ppo.rollout_guard_max``, or its dtype's default when 0."""
    if rollout_guard_max > 0:
        return rollout_guard_max
    return ROLLOUT_GUARD_MAX[dtype]


def exceeds(mean: Optional[float], limit: float) -> bool:
    """A measured mean over the limit (a non-finite one too: NaN log-probs are no match)."""
    if mean is None:
        return False
    return not math.isfinite(mean) or mean > limit


class RolloutGuard:
    """``mode``: stop | rebuild | off; ``limit``: the threshold (``threshold``); ``dtype``
    (fp32/bf16/fp16) and ``settings`` (the model family and inference settings, for the messages);
    ``active``: false when no rollout comes from the inference mode (HF generate), when nothing is
    checked; ``main``: this rank logs the warnings (every rank decides alike: one says it)."""

    def __init__(
        self,
        mode: str,
        limit: float,
        dtype: str,
        settings: str,
        active: bool = True,
        default: bool = True,
        main: bool = True,
    ):
        self.mode, self.limit, self.dtype, self.settings = mode, limit, dtype, settings
        self.active = active and mode != "off"
        # the limit is the dtype's default (not ppo.rollout_guard_max)
        self.default = default
        self.main = main

    @classmethod
    def of(cls, ppo, hybrid, train_precision: str) -> "RolloutGuard":
        """The guard of a PPO run: ``ppo`` its PPOConfig, ``hybrid`` the HybridEngine (its dtype, TP
        size, kernels, decode loop and model family), ``train_precision`` the actor's
        (fp32/bf16/fp16)."""
        inference = name_of(hybrid.dtype)
        dtype = compute_dtype(inference, train_precision)
        family = hybrid.policy.family if hybrid.policy is not None else "?"
        settings = (
            f"{family}, inference dtype {inference} (training {train_precision}), TP {hybrid.tp}, "
            f"kernels {hybrid.ecfg.inference_kernels}, decode {hybrid.decode}"
        )
        return cls(
            ppo.rollout_guard,
            threshold(ppo.rollout_guard_max, dtype),
            dtype,
            settings,
            active=hybrid.inject,
            default=not ppo.rollout_guard_max,
            main=hybrid.mesh.is_main,
        )

    def _limit_text(self) -> str:
        if self.default:
            return f"{self.limit:g} (the {self.dtype} default of ppo.rollout_guard_max)"
        return f"ppo.rollout_guard_max={self.limit:g}"

    def describe(self) -> str:
        """The log line at the start: the guard's decision and the threshold in force."""
        if self.mode == "off":
            return "ppo: rollout guard off (ppo.rollout_guard=off)"
        if not self.active:
            return (
                "ppo: rollout guard: nothing to check (rollouts from HF generate carry no "
                "inference log-probs)"
            )
        then = "stop the run"
        if self.mode == "rebuild":
            then = (
                "rebuild the inference weights and regenerate once, then stop the run if still "
                "above"
            )
        return (
            f"ppo: rollout guard: {METRIC} above {self._limit_text()} will {then} ({self.settings})"
        )

    def over(self, row: Dict[str, float]) -> bool:
        """Whether a step's metrics (``step_metrics``) pass the threshold."""
        return self.active and exceeds(row.get(METRIC), self.limit)

    def _numbers(self, row: Dict[str, float]) -> str:
        return (
            f"{METRIC}={row[METRIC]:.3g} (max over tokens {row.get(MAX_METRIC, math.nan):.3g}) "
            f"against {self._limit_text()}"
        )

    def checked(
        self,
        step: int,
        collect: Callable[[], Tuple[Exp, Dict[str, float]]],
        rebuild: Callable[[], None],
    ) -> Tuple[Exp, Dict[str, float]]:
        """``collect()`` → (experience, its step_metrics row) of step ``step`` (1-based), checked:
        passed on when within the threshold; else ``rebuild()`` (drops the inference weights and
        whatever the collection moved) and ``collect()`` again with ``ppo.rollout_guard=rebuild``,
        then raises ``RolloutMismatch`` when (still) above. The decision is the same on every rank
        (global numbers)."""
        exp, row = collect()
        if not self.over(row):
            return exp, row
        # the first measurement, when the weights were rebuilt
        first = None
        if self.mode == "rebuild":
            first = row
            self._warn(
                "ppo: step %d: the inference mode's log-probs do not match the training "
                "recompute: %s (%s); "
                "rebuilding the inference weights from the training weights and "
                "regenerating the step",
                step,
                self._numbers(row),
                self.settings,
            )
            rebuild()
            exp, row = collect()
            if not self.over(row):
                self._warn(
                    "ppo: step %d: after rebuilding the inference weights %s=%.3g: within "
                    "%g, going on",
                    step,
                    METRIC,
                    row.get(METRIC, math.nan),  # (nan: no token to compare)
                    self.limit,
                )
                return exp, row
        raise RolloutMismatch(self.message(step, row, first))

    def _warn(self, msg: str, *args) -> None:
        if self.main:
            log.warning(msg, *args)

    def message(
        self, step: int, row: Dict[str, float], before: Optional[Dict[str, float]] = None
    ) -> str:
        """The one line of a stop (``before``: the first measurement, when the weights were
        rebuilt)."""
        rebuilt = ""
        if before is not None:
            rebuilt = (
                f" (first {before[METRIC]:.3g}, then again after rebuilding the inference weights)"
            )
        hint = "ppo.rollout_guard=rebuild regenerates once with weights built afresh; "
        if before is not None:
            hint = ""
        return (
            f"ppo: step {step}: the inference mode's log-probs of the sampled tokens do "
            "not match the training "
            f"recompute: {self._numbers(row)}{rebuilt}; {self.settings}; stopped before "
            "the step's update "
            "(the last checkpoint, if any, is kept): the inference weights differ from "
            "the training weights "
            f"(engine.inference_kernels=reference or engine.hybrid=false narrow it down; {hint}"
            f"ppo.rollout_guard=off runs on regardless)"
        )
