"""The over-optimisation gate (``ppo.stop_disagreement``, ``ppo.stop_kl``; docs/ppo.md).

Its signals, read every step from the experience before the update: the reward the policy is
trained on (``reward/mean``), a reward-model ensemble's disagreement on the rollouts
(``reward/ensemble_std``) and the KL per sequence (``kl/mean``), each as a mean over the last
``WINDOW`` steps. The gate fires when the disagreement passes ``ppo.stop_disagreement`` times its
mean over the run's first ``WINDOW`` steps (the SFT policy's own rollouts, where the reward model
was calibrated), or the KL passes ``ppo.stop_kl``. It keeps a copy of the actor at the step with the
best windowed reward (the weights that generated that step's rollouts), which the stage exports when
the gate fires. Without a gate, an ensemble's disagreement passing ``WARN_RATIO`` times its start is
said once in the log; so are, at the final evaluation, the policy's greedy held-out answers doing
worse by the reward model's own judgement than step 0's (``Gate.heldout``:
``ppo.warn_heldout_drop``, ``ppo.warn_greedy_changed``). State it owns: ``state_dict`` (trainer
state, step 0's held-out answers with it) and the copy (``actor_best.safetensors`` in a checkpoint).
"""

from __future__ import annotations

import logging
import math
from typing import List, Optional, Tuple

from rlhf.rl.snapshot import ActorCopy

log = logging.getLogger("rlhf")

WINDOW = 5  # steps each signal is averaged over
# an ensemble's disagreement this many times its start: a warning, gate or not
WARN_RATIO = 2.0
# the reward model's mean gain (normalised units) on the held-out greedy answers PPO changed, below
# which it "can hardly tell them from the old" (docs/ppo.md: measured on the embedded task)
CHANGED_GAIN = 0.5


def _mean(xs: list) -> float:
    return sum(xs) / len(xs)


class Gate:
    def __init__(
        self,
        stop_disagreement: Optional[float],
        stop_kl: Optional[float],
        actor=None,
        warn_heldout_drop: Optional[float] = None,
        warn_greedy_changed: Optional[float] = None,
    ):
        self.max_ratio, self.max_kl, self.max_drop = stop_disagreement, stop_kl, warn_heldout_drop
        self.max_changed = warn_greedy_changed
        self.heldout_start: Optional[float] = None  # eval/reward_greedy at step 0
        # step 0's [(digest, reward)] per held-out prompt
        self.heldout_answers: list = []
        self.heldout_warned = False
        # the disagreement of the run's first WINDOW steps
        self.first: list = []
        self.recent: dict = {"reward": [], "disagreement": [], "kl": []}  # the last WINDOW steps
        self.best_value, self.best_step, self.warned = -math.inf, None, False
        self.best = (
            ActorCopy(actor, "actor_best.safetensors") if self.on and actor is not None else None
        )

    @property
    def on(self) -> bool:
        return self.max_ratio is not None or self.max_kl is not None

    def ratio(self) -> Optional[float]:
        """The disagreement over the last WINDOW steps against the first WINDOW (None until
        known)."""
        d = self.recent["disagreement"]
        if len(self.first) < WINDOW or len(d) < WINDOW or _mean(self.first) <= 0:
            return None
        return _mean(d) / _mean(self.first)

    def observe(
        self, step: int, reward: float, disagreement: Optional[float], kl: float
    ) -> Optional[str]:
        """Step ``step``'s signals (1-based, before its update). Takes the actor's copy at a new
        best windowed reward; returns why the gate fires, or None."""
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
                "ppo: step %d: the reward models disagree %.1f× as much on the policy's "
                "samples as at the "
                "start (reward/ensemble_std): the policy may be exploiting their errors%s",
                step,
                ratio,
                "" if self.max_ratio else "; ppo.stop_disagreement stops the run at such a point",
            )
        if self.max_ratio is not None and ratio is not None and ratio > self.max_ratio:
            return (
                f"the ensemble's disagreement over the last {WINDOW} steps is {ratio:.2f}× "
                "its first "
                f"{WINDOW} steps' (ppo.stop_disagreement={self.max_ratio:g})"
            )
        kls = self.recent["kl"]
        if self.max_kl is not None and len(kls) == WINDOW and _mean(kls) > self.max_kl:
            return (
                f"the KL over the last {WINDOW} steps is {_mean(kls):.3f} per sequence "
                f"(ppo.stop_kl={self.max_kl:g})"
            )
        return None

    def heldout(
        self, step: int, reward: float, answers: List[Tuple[str, float]], final: bool = False
    ) -> Tuple[dict, Optional[str]]:
        """An evaluation's held-out greedy answers (``evaluate_reward``: their mean reward
        ``reward`` and one ``(digest, reward)`` per prompt); the first evaluation's are the
        reference. Returns the metrics ``eval/greedy_changed`` (the share of prompts whose greedy
        answer is no longer step 0's) and ``eval/reward_gain_changed`` (the reward model's mean gain
        on those), and, at the final evaluation, a warning (said once) when the reward fell more
        than ``warn_heldout_drop`` below step 0's, or when more than ``warn_greedy_changed`` of the
        answers changed while the reward model prefers the new ones by less than ``CHANGED_GAIN`` on
        average (it cannot tell them from the old: PPO moved answers among near-ties of the reward
        model, where it may lose right ones). Mid-run evaluations are not judged: on the embedded
        task they dip by 0.08–0.11 at 20–40 iterations on seeds that end within
        0.02 of the start (the greedy dip of docs/history.md), as much as on a seed that ends 0.065
           down."""
        if self.heldout_start is None:
            self.heldout_start, self.heldout_answers = reward, [list(a) for a in answers]
            return {"eval/greedy_changed": 0.0, "eval/reward_gain_changed": 0.0}, None
        ref = self.heldout_answers
        changed = [
            i for i, (digest, _) in enumerate(answers) if i < len(ref) and digest != ref[i][0]
        ]
        share = len(changed) / max(len(answers), 1)
        gain = _mean([answers[i][1] - ref[i][1] for i in changed]) if changed else 0.0
        metrics = {"eval/greedy_changed": share, "eval/reward_gain_changed": gain}
        if not final or self.heldout_warned:
            return metrics, None
        drop = self.heldout_start - reward
        why = None
        if self.max_drop is not None and drop > self.max_drop:
            why = (
                "the reward model scores the policy's greedy answers to held-out prompts "
                f"{drop:.3f} lower than "
                f"at the start ({reward:.3f} against {self.heldout_start:.3f}, eval/reward_greedy; "
                f"ppo.warn_heldout_drop={self.max_drop:g})"
            )
        elif self.max_changed is not None and share > self.max_changed and gain < CHANGED_GAIN:
            why = (
                f"the policy's greedy answer changed on {len(changed)} of {len(answers)} "
                "held-out prompts "
                f"(eval/greedy_changed={share:.3f}; "
                f"ppo.warn_greedy_changed={self.max_changed:g}) and the reward "
                f"model prefers the new answers by only {gain:+.3f} on average "
                "(eval/reward_gain_changed): it "
                f"can hardly tell them from the old"
            )
        if why is None:
            return metrics, None
        self.heldout_warned = True
        return metrics, (
            f"ppo: step {step}: {why}: the policy may be getting worse where it does not "
            "train (an SFT policy unsure "
            "of its answers, or a reward-model error it found; check them with a gold "
            "scorer: docs/ppo.md)"
        )

    def state_dict(self) -> dict:
        return {
            "heldout_start": self.heldout_start,
            "heldout_answers": self.heldout_answers,
            "heldout_warned": self.heldout_warned,
            "first": self.first,
            "recent": self.recent,
            "best_value": self.best_value if self.best_step is not None else None,
            "best_step": self.best_step,
            "warned": self.warned,
        }

    def load_state_dict(self, state: dict) -> None:
        self.first, self.recent = (
            list(state["first"]),
            {k: list(v) for k, v in state["recent"].items()},
        )
        self.best_step, self.warned = state["best_step"], state["warned"]
        self.heldout_start, self.heldout_warned = (
            state.get("heldout_start"),
            state.get("heldout_warned", False),
        )
        self.heldout_answers = state.get("heldout_answers") or []
        self.best_value = state["best_value"] if state["best_value"] is not None else -math.inf
