"""What scores a step's rows besides the actor: the reward model(s) and their normalisation, an
ensemble's members combined, the rule reward, the distillation teacher and the judge (``Scorers``,
built by rlhf/rl/models.py, read by the collector in rlhf/rl/experience.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from rlhf.algorithms import ppo as ppo_math
from rlhf.algorithms.ensemble import combine, disagreement
from rlhf.config import PPOConfig
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import FrozenModel, TrainEngine
from rlhf.models.value import end_pad, sequence_scores
from rlhf.rl.minibatch import in_micro_batches, row_groups

# what scores: ``forward(**batch)`` in training or frozen mode
Model = Union[TrainEngine, FrozenModel]


class RewardNormaliser:
    """The reward model's score, normalised (``algorithm.reward_norm``): ``stats`` by the reward
    stage's held-out mean/std (its reward_stats.json), ``running`` by running moments over every
    rank's scores so far (state it owns and checkpoints: ``state_dict``), ``none`` as is. An
    ensemble's scores ([B, k]) are normalised member by member (each by its own statistics,
    ``stats["members"]``). ``clip``: each score first clipped to the range of its member's held-out
    scores (``min``/``max``). ``members``: how many the reward model has."""

    def __init__(self, how: str, stats: dict, clip: bool = False, members: int = 1):
        self.how, self.clip_on = how, clip
        # one reward model: its statistics alone; an ensemble without statistics of its members (not
        # from stage=reward): the one set for each of them
        self.members = stats.get("members") or [stats] * max(members, 1)
        self.running = [ppo_math.RunningMoments() for _ in self.members]

    def clip(self, raw: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(``raw`` clipped to each member's held-out range, [B] the share of the row's members
        clipped)."""
        cols = raw if raw.dim() > 1 else raw[:, None]
        if not self.clip_on:
            return raw, cols.new_zeros(cols.shape[0])
        lo = torch.tensor([m["min"] for m in self.members], dtype=cols.dtype, device=cols.device)
        hi = torch.tensor([m["max"] for m in self.members], dtype=cols.dtype, device=cols.device)
        clipped = torch.minimum(torch.maximum(cols, lo), hi)
        share = (clipped != cols).float().mean(1)
        return (clipped if raw.dim() > 1 else clipped[:, 0]), share

    def __call__(self, raw: torch.Tensor, mesh: Mesh, update: bool = True) -> torch.Tensor:
        """``update=False``: the running moments as they are (an evaluation does not move them)."""
        if raw.dim() > 1:  # an ensemble: member by member
            return torch.stack(
                [self._one(raw[:, i], i, mesh, update) for i in range(raw.shape[1])], 1
            )
        return self._one(raw, 0, mesh, update)

    def _one(self, raw: torch.Tensor, i: int, mesh: Mesh, update: bool) -> torch.Tensor:
        if self.how == "stats":
            return (raw - self.members[i]["mean"]) / max(self.members[i]["std"], 1e-8)
        if self.how == "running":
            if update:
                every = torch.tensor(mesh.all_gather_object(raw.tolist()), device="cpu").flatten()
                self.running[i].update(every)
            return (raw - self.running[i].mean) / self.running[i].std
        return raw

    def state_dict(self) -> dict:
        if len(self.running) == 1:
            # one reward model: the state as it has always been saved
            return self.running[0].state_dict()
        return {"members": [r.state_dict() for r in self.running]}

    def load_state_dict(self, state: dict) -> None:
        for r, s in zip(self.running, state.get("members", [state])):
            r.load_state_dict(s)


class RewardModels:
    """Several reward models (``ppo.reward_model_path=a,b,...``) scored as one ensemble: their
    scores side by side, [B, K] with K their members in all (a model's own members in order)."""

    def __init__(self, models: List[Model]):
        self.models = models


def reward_scores(
    model: Union[Model, RewardModels], seq: torch.Tensor, att: torch.Tensor
) -> torch.Tensor:
    """Each row's score by a reward model: its value at the row's last real token (before a trailing
    EOS for a model whose pad is its EOS: ``end_pad``); several models' (``RewardModels``) side by
    side."""
    if isinstance(model, RewardModels):
        outs = [reward_scores(m, seq, att) for m in model.models]
        return torch.cat([o if o.dim() > 1 else o[:, None] for o in outs], -1)
    values = model.forward(input_ids=seq, attention_mask=att)
    return sequence_scores(values, att, seq, end_pad(model.module.config))


@dataclass
class Scorers:
    """What scores a rollout: the models (reference, critic, reward model, distillation teacher,
    judge: None when not used), the reward model's normalisation, the rule reward and the weights of
    the distillation and the judge's rewards."""

    ref: Optional[Model]
    critic: Optional[TrainEngine]
    reward_model: Optional[Model]
    normalise: RewardNormaliser
    # rule(responses, examples, fmt) -> [float]
    rule: Optional[Callable]
    rule_weight: float
    data_format: str
    # gold(response, reference): watches the reward, never is one
    gold: Optional[Callable[[str, str], float]] = None
    # ppo.teacher_path: its log-probs of the sampled tokens
    teacher: Optional[Model] = None
    distill_coef: float = 1.0
    # ppo.judge_path: a Judge (rlhf/rl/judge.py)
    judge: Optional[Callable] = None
    judge_weight: float = 1.0

    def model_reward(
        self, seq: torch.Tensor, att: torch.Tensor, ppo: PPOConfig, mesh: Mesh, update: bool = True
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """The reward model's part of each row's reward (clipped, normalised, an ensemble's members
        combined) and what is watched beside it (``Experience.watch``). Collective (sharded
        forwards). ``update=False``: the running normalisation is read, not moved (an
        evaluation)."""
        rows, watch = seq.shape[0], {}
        # a scalar head: no vocabulary-sized logits
        micro = ppo.micro_batch_per_rank or rows
        raw = in_micro_batches(
            lambda r: reward_scores(self.reward_model, seq[r], att[r]),
            row_groups(att, micro, ppo.max_tokens_per_micro_batch, mesh),
        )
        raw, clipped = self.normalise.clip(raw)
        if self.normalise.clip_on:
            watch["clipped"] = clipped
        norm = self.normalise(raw, mesh, update)
        if norm.dim() > 1:
            # an ensemble: its members combined (ppo.reward_combine), their disagreement watched
            watch["ensemble_mean"], watch["ensemble_std"] = norm.mean(1), disagreement(norm)
            norm = combine(norm, ppo.reward_combine, ppo.reward_lcb_coef)
        return norm, watch
