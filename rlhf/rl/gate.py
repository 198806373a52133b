"""The over-optimisation gate (``ppo.stop_disagreement``, ``ppo.stop_kl``; docs/ppo.md).

Its signals, read every step from the experience before the update: the reward the policy is
trained on (``reward/mean``), a reward-model ensemble's disagreement on the rollouts
(``reward/ensemble_std``) and the KL per sequence (``kl/mean``), each as a mean over the last
``WINDOW`` steps. The gate fires when the disagreement passes ``ppo.stop_disagreement`` times its mean
over the run's first ``WINDOW`` steps (the SFT policy's own rollouts, where the reward model was
calibrated), or the KL passes ``ppo.stop_kl``. It keeps a copy of the actor at the step with the best
windowed reward (the weights that generated that step's rollouts), which the stage exports when the
gate fires. Without a gate, an ensemble's disagreement passing ``WARN_RATIO`` times its start is said
once in the log; so is a final ``eval/reward_greedy`` (the reward model's reward of the policy's greedy
held-out answers) more than ``ppo.warn_heldout_drop`` below step 0's. State it owns:
``state_dict`` (trainer state) and the copy (``actor_best.safetensors`` in a checkpoint).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

from rlhf.rl.snapshot import ActorCopy

log = logging.getLogger("rlhf")

WINDOW = 5  # steps each signal is averaged over
WARN_RATIO = 2.0  # an ensemble's disagreement this many times its start: a warning, gate or not


def _mean(xs: list) -> float:
    return sum(xs) / len(xs)


class Gate:
    def __init__(
        self,
        stop_disagreement: Optional[float],
        stop_kl: Optional[float],
        actor=None,
        warn_heldout_drop: Optional[float] = None,
    ):
        self.max_ratio, self.max_kl, self.max_drop = stop_disagreement, stop_kl, warn_heldout_drop
        self.heldout_start: Optional[float] = None  # eval/reward_greedy at step 0
        self.heldout_warned = False
        self.first: list = []  # the disagreement of the run's first WINDOW steps
        self.recent: dict = {"reward": [], "disagreement": [], "kl": []}  # the last WINDOW steps
        self.best_value, self.best_step, self.warned = -math.inf, None, False
        self.best = ActorCopy(actor, "actor_best.safetensors") if self.on and actor is not None else None

    @property
    def on(self) -> bool:
        return self.max_ratio is not None or self.max_kl is not None

    def ratio(self) -> Optional[float]:
        """The disagreement over the last WINDOW steps against the first WINDOW (None until known)."""
        d = self.recent["disagreement"]
        if len(self.first) < WINDOW or len(d) < WINDOW or _mean(self.first) <= 0:
            return None
        return _mean(d) / _mean(self.first)

    def observe(self, step: int, reward: float, disagreement: Optional[float], kl: float) -> Optional[str]:
        """Step ``step``'s signals (1-based, before its update). Takes the actor's copy at a new best
        windowed reward; returns why the gate fires, or None."""
        for key, v in (("reward", reward), ("disagreement", disagreement), ("kl", kl)):
            if v is not None:
                self.recent[key] = (self.recent[key] + [v])[-WINDOW:]
        if disagreement is not None and len(self.first) < WINDOW:
            self.first.append(disagreement)
        if len(self.recent["reward"]) == WINDOW and _mean(self.recent["reward"]) > self.best_value:
            self.best_value, self.best_step = _mean(self.recent["reward"]), step
            if self.best is not None:
                self.best.take()
        ratio = self.ratio()
        if ratio is not None and ratio > WARN_RATIO and not self.warned:
            self.warned = True
            log.warning(
                "ppo: step %d: the reward models disagree %.1f× as much on the policy's samples as at the "
                "start (reward/ensemble_std): the policy may be exploiting their errors%s",
                step,
                ratio,
                "" if self.max_ratio else "; ppo.stop_disagreement stops the run at such a point",
            )
        if self.max_ratio is not None and ratio is not None and ratio > self.max_ratio:
            return (
                f"the ensemble's disagreement over the last {WINDOW} steps is {ratio:.2f}× its first "
                f"{WINDOW} steps' (ppo.stop_disagreement={self.max_ratio:g})"
            )
        kls = self.recent["kl"]
        if self.max_kl is not None and len(kls) == WINDOW and _mean(kls) > self.max_kl:
            return f"the KL over the last {WINDOW} steps is {_mean(kls):.3f} per sequence (ppo.stop_kl={self.max_kl:g})"
        return None

    def heldout(self, step: int, reward: float, final: bool = False) -> Optional[str]:
        """An evaluation's ``eval/reward_greedy``: the first is the reference; the final one returns
        the warning when it is more than ``warn_heldout_drop`` below it. Mid-run ones are not judged:
        on the embedded task they dip by 0.08–0.11 at 20–40 iterations on seeds that end within 0.02
        of the start (the greedy dip of docs/performance.md), as much as on the seed that ends 0.065 down."""
        if self.heldout_start is None:
            self.heldout_start = reward
            return None
        drop = self.heldout_start - reward
        if not final or self.max_drop is None or self.heldout_warned or drop <= self.max_drop:
            return None
        self.heldout_warned = True
        return (
            f"ppo: step {step}: the reward model scores the policy's greedy answers to held-out prompts "
            f"{drop:.3f} lower than at the start ({reward:.3f} against {self.heldout_start:.3f}, "
            f"eval/reward_greedy; ppo.warn_heldout_drop={self.max_drop:g}): the policy may be getting worse where it "
            f"does not train (a sign of an SFT policy unsure of its answers: docs/ppo.md)"
        )

    def state_dict(self) -> dict:
        return {
            "heldout_start": self.heldout_start,
            "heldout_warned": self.heldout_warned,
            "first": self.first,
            "recent": self.recent,
            "best_value": self.best_value if self.best_step is not None else None,
            "best_step": self.best_step,
            "warned": self.warned,
        }

    def load_state_dict(self, state: dict) -> None:
        self.first, self.recent = list(state["first"]), {k: list(v) for k, v in state["recent"].items()}
        self.best_step, self.warned = state["best_step"], state["warned"]
        self.heldout_start, self.heldout_warned = state.get("heldout_start"), state.get("heldout_warned", False)
        self.best_value = state["best_value"] if state["best_value"] is not None else -math.inf
