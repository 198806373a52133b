"""PPO's models: which ones a run uses (``inputs``), the reward models' held-out statistics
(``RewardStats``), and the set built from them (``build_models``: actor and its hybrid engine,
critic, reference, reward models, the scorers over them, the EMA copy). stages/ppo.py reads top to
bottom on these."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase

from rlhf.algorithms.estimators import estimator
from rlhf.config import (
    ENV_BUILTINS,
    MIN_RM_ACCURACY_EMBEDDED,
    MIN_RM_ACCURACY_OTHER,
    Config,
    LoraConfig,
)
from rlhf.data.formats import FORMATS
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import FrozenModel, TrainEngine, reference_for
from rlhf.errors import ConfigError
from rlhf.models import dschat, loading, lora
from rlhf.models.value import (
    REWARD_STATS_FILE,
    ScalarHeadModel,
    head_module,
    head_name,
    mean_head,
    members,
)
from rlhf.rl.ema import EMA
from rlhf.rl.judge import Judge, read_template, verdict_ids
from rlhf.rl.scorers import RewardModels, RewardNormaliser, Scorers
from rlhf.runtime.stage import previous_output, stage_input

log = logging.getLogger("rlhf")


def check_reward_model(
    stats: dict, rm_src: Optional[Path], threshold: Optional[float], data_format: str
) -> None:
    """Exit 2 before any work when the reward model ranks too few held-out pairs right: PPO would
    train the policy towards its errors (on the embedded task RMs at 0.65–0.87 lowered the gold
    score)."""
    acc = stats.get("eval/accuracy")
    if threshold is None:
        threshold = MIN_RM_ACCURACY_OTHER
        if FORMATS[data_format].generated:
            threshold = MIN_RM_ACCURACY_EMBEDDED
    if acc is None or acc >= threshold:
        return
    raise ConfigError(
        f"reward model {rm_src}: held-out accuracy {acc:.3f} (reward_stats.json) is below "
        f"ppo.min_rm_accuracy={threshold:g}; PPO would optimise its errors: train it better "
        f"(more reward steps or data), or set ppo.min_rm_accuracy=0 to go on anyway"
    )


def reward_stats(src: Path) -> dict:
    """A reward model's held-out statistics (its reward_stats.json; none: unnormalised)."""
    if (src / REWARD_STATS_FILE).is_file():
        return json.loads((src / REWARD_STATS_FILE).read_text())
    return {"mean": 0.0, "std": 1.0}


def check_ensemble_keys(ppo, stats: dict, n_members: int, rm_src: str) -> None:
    """Exit 2 before any model loads when a key needs what the reward model lacks: the gate's
    disagreement needs an ensemble (``n_members`` ≥ 2), ppo.reward_clip_to_heldout its held-out
    score range."""
    if ppo.stop_disagreement is not None and n_members < 2:
        what = (
            f"reward model {rm_src} has {n_members} member"
            if n_members
            else "run scores with no reward model"
        )
        raise ConfigError(
            f"ppo.stop_disagreement={ppo.stop_disagreement:g} reads a reward-model "
            "ensemble's disagreement, but the "
            f"{what}: train one with reward.ensemble=k (k ≥ 2), or gate on ppo.stop_kl"
        )
    if (
        ppo.reward_clip_to_heldout
        and n_members
        and any("min" not in m for m in stats.get("members") or [stats])
    ):
        raise ConfigError(
            "ppo.reward_clip_to_heldout=true needs the reward model's held-out score range (min, "
            f"max in {rm_src}/{REWARD_STATS_FILE}, written by stage=reward): retrain it with this "
            "version, "
            "or set ppo.reward_clip_to_heldout=false"
        )


@dataclass
class RewardStats:
    """The reward models' held-out statistics: ``first`` (the first model's: the critic's scale),
    ``members`` (what normalises the scores: one model's statistics, or every member's of several)
    and ``n_members`` (the ensemble's size; 0 without a reward model)."""

    first: dict = field(default_factory=lambda: {"mean": 0.0, "std": 1.0})
    members: dict = field(default_factory=lambda: {"mean": 0.0, "std": 1.0})
    n_members: int = 0

    @classmethod
    def of(cls, cfg: Config, rm_srcs: List[Path]) -> "RewardStats":
        """Read from ``rm_srcs`` and checked (ppo.min_rm_accuracy, the ensemble's keys): exit 2
        before any model loads."""
        ppo = cfg.ppo
        every = [reward_stats(src) for src in rm_srcs]
        first = every[0] if every else {"mean": 0.0, "std": 1.0}
        n_members = 0
        if ppo.use_reward_model:
            for src, st in zip(rm_srcs, every):
                check_reward_model(st, src, ppo.min_rm_accuracy, cfg.data.source_list()[0].format)
            n_members = sum(
                members(loading.load_model_config(str(s), cfg.model.trust_remote_code))
                for s in rm_srcs
            )
        merged = (
            first
            if len(every) <= 1
            else {"members": [m for st in every for m in st.get("members") or [st]]}
        )
        check_ensemble_keys(ppo, merged, n_members, ", ".join(map(str, rm_srcs)))
        return cls(first, merged, n_members)

    def critic_scale(self, cfg: Config) -> Union[float, List[float]]:
        """The critic starts as the reward model, its head divided by the held-out std of each
        member (under algorithm.reward_norm=stats) so that it predicts the normalised rewards; a
        critic of its own (ppo.critic_path) is taken as it is."""
        if cfg.algorithm.reward_norm != "stats" or cfg.ppo.critic_path:
            return 1.0
        scale = [1.0 / max(m["std"], 1e-8) for m in self.first.get("members") or [self.first]]
        return scale[0] if len(scale) == 1 else scale


@dataclass
class Sources:
    """Where PPO's models come from (``inputs``): the actor (the SFT output, model.path or
    ppo.actor_path), the reward models' directories (none when unused), the critic's start, the
    distillation teacher and the judge (hub ids or directories)."""

    actor: str
    reward_models: List[Path]
    critic: Optional[Path]
    teacher: Optional[str] = None
    judge: Optional[str] = None

    def named(self) -> List[Tuple[str, Optional[str]]]:
        """(the key that names it, source) of each model read besides the actor."""
        rms = [("ppo.reward_model_path", str(r)) for r in self.reward_models]
        critic = None if self.critic is None else str(self.critic)
        return rms + [
            ("ppo.critic_path", critic),
            ("ppo.teacher_path", self.teacher),
            ("ppo.judge_path", self.judge),
        ]


@dataclass
class Models:
    """What a PPO run trains and scores with; ``engines``: what checkpoints save and resume
    restores."""

    actor: TrainEngine
    hybrid: HybridEngine
    critic: Optional[TrainEngine]
    reward_model: object  # FrozenModel, RewardModels or None
    scorers: Scorers
    ema: Optional[EMA]
    engines: Dict[str, TrainEngine]


def build_models(
    cfg: Config,
    mesh: Mesh,
    tokenizer,
    sources: Sources,
    stats: RewardStats,
    rule,
    gold,
    total_updates: int,
) -> Models:
    """The actor (LoRA adapters with model.lora.r > 0) and its hybrid engine, the critic (GAE), the
    reference (algorithm.kl_coef > 0: the actor with adapters off under LoRA, else a second copy),
    the reward models, the distillation teacher (ppo.teacher_path), the judge (ppo.judge_path) and
    the scorers over them, the EMA copy; ``sources``: ``inputs``'. Each model placed by
    engine.<role>.*."""
    actor_src, rm_srcs, critic_src, teacher_src = (
        sources.actor,
        sources.reward_models,
        sources.critic,
        sources.teacher,
    )
    train, ppo, alg, lcfg = cfg.train, cfg.ppo, cfg.algorithm, cfg.model.lora
    remote, place = cfg.model.trust_remote_code, cfg.engine.placement

    def policy_model(role: str):
        # the SFT model, once as the actor and once as the reference
        return loading.causal_lm(
            actor_src, mesh, tokenizer, remote, cfg.model.disable_dropout, role
        )

    adapted = lora.adapt(policy_model("actor"), lcfg, cfg.run.seed, what="actor")
    actor = TrainEngine(adapted, mesh, place("actor"), train, total_steps=total_updates)
    hybrid = HybridEngine(actor, tokenizer, place("actor"))
    critic = None
    if estimator(alg).critic:
        # model.lora.critic: adapters on the critic too
        critic_lora = lcfg if lcfg.critic else None
        model = scalar_model(
            cfg, critic_src, mesh, tokenizer, stats.critic_scale(cfg), critic_lora, "critic"
        )
        critic = TrainEngine(
            model, mesh, place("critic"), train, total_steps=total_updates, lr=ppo.critic_lr
        )
    ref = None
    if alg.kl_coef > 0:
        # algorithm.kl_coef=0: no reference model at all (its KL term is 0)
        ref = reference_for(actor, lambda: policy_model("reference"), mesh, place("reference"))
    reward_model = None
    if ppo.use_reward_model:
        models = [
            FrozenModel(scalar_model(cfg, src, mesh, tokenizer), mesh, place("reward_model"))
            for src in rm_srcs
        ]
        reward_model = models[0] if len(models) == 1 else RewardModels(models)
    teacher = None
    if teacher_src is not None:
        # frozen, scored in the pass that scores the reference
        model = loading.causal_lm(teacher_src, mesh, tokenizer, remote, True, "teacher")
        teacher = FrozenModel(model, mesh, place("teacher"))
    judge = None
    if sources.judge is not None:
        judge = build_judge(cfg, sources.judge, mesh, remote, place("judge"))
    scorers = Scorers(
        ref=ref,
        critic=critic,
        reward_model=reward_model,
        normalise=RewardNormaliser(
            alg.reward_norm, stats.members, ppo.reward_clip_to_heldout, stats.n_members
        ),
        rule=rule,
        rule_weight=ppo.reward_fn_weight,
        data_format=cfg.data.source_list()[0].format,
        gold=gold,
        teacher=teacher,
        distill_coef=ppo.distill_coef,
        judge=judge,
        judge_weight=ppo.judge_weight,
    )
    ema = EMA(actor, ppo.ema_decay) if ppo.ema_decay else None
    engines = {"actor": actor, **({"critic": critic} if critic is not None else {})}
    return Models(actor, hybrid, critic, reward_model, scorers, ema, engines)


def build_judge(cfg, src: str, mesh: Mesh, remote: bool, ecfg) -> Judge:
    """PPO's generative judge (ppo.judge_*): frozen, its own tokenizer (it reads the responses'
    text); the score form decodes in the inference mode (the actor's TP layout: the TP groups
    generate together), or without it where the judge's shape does not split so."""
    ppo = cfg.ppo
    judge_tok = loading.load_tokenizer(src, cfg.model.trust_remote_code)
    model = loading.causal_lm(src, mesh, judge_tok, remote, True, "judge")
    frozen = FrozenModel(model, mesh, ecfg)
    decoder = None
    if ppo.judge_score_pattern is not None:
        try:
            decoder = HybridEngine(frozen, judge_tok, ecfg)
        except ConfigError as e:
            log.warning("ppo: the judge's answers decoded without the inference mode: %s", e)
    return Judge(
        frozen,
        judge_tok,
        read_template(ppo.judge_template),
        ppo.judge_verdicts,
        ppo.judge_max_tokens,
        src,
        score=ppo.judge_score_pattern,
        score_range=ppo.judge_score_range,
        max_new_tokens=ppo.judge_max_new_tokens,
        failure_reward=ppo.judge_failure_reward,
        mesh=mesh,
        decoder=decoder,
    )


def inputs(cfg: Config, mesh: Mesh) -> Sources:
    """Where the models come from, checked: the SFT output (or model.path or ppo.actor_path), the
    reward models (ppo.reward_model_path, comma-separated for several, or the reward stage's output;
    none when unused), the critic's start (ppo.critic_path or the first reward model), the
    distillation teacher (ppo.teacher_path) and the judge (ppo.judge_path, its template read). A
    DeepSpeed-Chat reward model (or critic) given by path is converted into <run.dir>/converted/
    first (rank 0; rlhf/models/dschat.py)."""
    ppo, alg, env = cfg.ppo, cfg.algorithm, cfg.env.name
    actor_src = stage_input(cfg, ppo.actor_path, "ppo.actor_path", "ppo")
    gae = estimator(alg).critic  # (GAE: the critic's start is needed)
    taught = ppo.teacher_path and (ppo.distill_coef or alg.gkd_coef)
    others = ppo.reward_fn or taught or ppo.judge_path
    if not ppo.use_reward_model and not others and env in ENV_BUILTINS:
        raise ConfigError(
            "ppo.use_reward_model=false needs another reward: a rule (ppo.reward_fn, e.g. "
            "rlhf.rewards.gold), "
            "a teacher to distill (ppo.teacher_path), a judge (ppo.judge_path) or an "
            "environment that gives "
            f"rewards (env.name=module.Class; the built-in env.name={env} gives none)"
        )
    if not ppo.use_reward_model and not others and env not in ENV_BUILTINS:
        log.info("ppo: the rewards are env.name=%s's alone (no reward model, no reward_fn)", env)
    if ppo.critic_path and not gae:
        raise ConfigError(
            f"ppo.critic_path={ppo.critic_path} is set but algorithm.estimator={alg.estimator} "
            f"has no critic (only gae does)"
        )
    # GAE's critic starts as the reward model unless it has a start of its own
    needs_rm = ppo.use_reward_model or (gae and not ppo.critic_path)
    rm_srcs = _reward_models(cfg, mesh, needs_rm)
    critic_src = None
    if ppo.critic_path:
        critic = dschat.reward_model_input(ppo.critic_path, "ppo.critic_path", cfg.run.dir, mesh)
        loading.check_scalar_model(critic, "ppo.critic_path")
        critic_src = Path(critic).expanduser()
    elif gae:
        critic_src = rm_srcs[0]
    if ppo.actor_path:
        loading.check_model_path(str(actor_src), "ppo.actor_path")
    else:
        loading.check_model_path(str(actor_src), "model.path")
    if needs_rm:
        note = ""
        if not ppo.use_reward_model:
            note = " (ppo.use_reward_model=false: the critic's start only)"
        log.info(
            "ppo: reward model%s %s%s",
            "s" if len(rm_srcs) > 1 else "",
            ", ".join(map(str, rm_srcs)),
            note,
        )
    if critic_src is not None:
        log.info("ppo: critic starts from %s", critic_src)
    return Sources(str(actor_src), rm_srcs, critic_src, _teacher(cfg), _judge(cfg))


def _reward_models(cfg: Config, mesh: Mesh, needs_rm: bool) -> List[Path]:
    """ppo.reward_model_path's models (comma-separated: one ensemble; a DeepSpeed-Chat one
    converted), or the reward stage's output where one is needed, checked."""
    ppo = cfg.ppo
    if ppo.reward_model_path and not needs_rm:
        raise ConfigError(
            f"ppo.reward_model_path={ppo.reward_model_path} is set but nothing uses it "
            "(ppo.use_reward_model=false, and the critic starts from ppo.critic_path or "
            "there is none)"
        )
    if ppo.reward_model_path:
        rm_srcs = []
        # several, comma-separated: their members together are one ensemble
        for given in [x.strip() for x in str(ppo.reward_model_path).split(",") if x.strip()]:
            path = dschat.reward_model_input(given, "ppo.reward_model_path", cfg.run.dir, mesh)
            loading.check_scalar_model(path, "ppo.reward_model_path")
            rm_srcs.append(Path(path).expanduser())
        return rm_srcs
    if not needs_rm:
        return []
    found = previous_output(cfg.run.dir, "reward", "model")
    if found is None:
        raise ConfigError(
            f"no reward model in {cfg.run.dir}/reward/model: run stage=reward first, set "
            "ppo.reward_model_path, or use algorithm.estimator=grpo "
            "ppo.use_reward_model=false "
            f"ppo.reward_fn=..."
        )
    return [found]


def _teacher(cfg: Config) -> Optional[str]:
    """ppo.teacher_path checked, and what it is used for said."""
    ppo, alg = cfg.ppo, cfg.algorithm
    if not ppo.teacher_path:
        return None
    loading.check_model_path(ppo.teacher_path, "ppo.teacher_path")
    teacher_src = os.path.expanduser(ppo.teacher_path)
    if ppo.distill_coef:
        log.info(
            "ppo: distilling from teacher %s (ppo.distill_coef=%g)", teacher_src, ppo.distill_coef
        )
    elif alg.gkd_coef:
        log.info(
            "ppo: distilling from teacher %s by GKD, without the per-token reward "
            "(ppo.distill_coef=0, algorithm.gkd_coef=%g)",
            teacher_src,
            alg.gkd_coef,
        )
    else:
        log.info(
            "ppo: teacher %s watched only (ppo.distill_coef=0: distill/* logged, no reward)",
            teacher_src,
        )
    return teacher_src


def _judge(cfg: Config) -> Optional[str]:
    """ppo.judge_path checked with its template (and, in the verdict form, its verdicts' tokens)
    before any model loads."""
    ppo = cfg.ppo
    if not ppo.judge_path:
        return None
    loading.check_model_path(ppo.judge_path, "ppo.judge_path")
    read_template(ppo.judge_template)  # exit 2 now, not after the models load
    if ppo.judge_score_pattern is None:
        # the verdict form: each verdict one token of the judge's
        verdict_ids(
            loading.load_tokenizer(ppo.judge_path, cfg.model.trust_remote_code),
            ppo.judge_verdicts,
            ppo.judge_path,
        )
    judge_src = os.path.expanduser(ppo.judge_path)
    log.info(
        "ppo: judge %s with %s (ppo.judge_weight=%g)",
        judge_src,
        ppo.judge_template,
        ppo.judge_weight,
    )
    return judge_src


def scalar_model(
    cfg: Config,
    src: Path,
    mesh: Mesh,
    tokenizer: PreTrainedTokenizerBase,
    scale: Union[float, List[float]] = 1.0,
    lcfg: Optional[LoraConfig] = None,
    role: str = "reward model",
) -> ScalarHeadModel:
    """The reward model's architecture and weights as a scalar-head model (the critic's head scaled,
    per member of an ensemble by ``scale[i]``, and the members averaged into one head; ``lcfg``:
    LoRA adapters on its backbone, the head fully trained; dropout per model.disable_dropout)."""
    model_cfg = loading.load_model_config(str(src), cfg.model.trust_remote_code)
    model = loading.build_model(
        AutoModelForSequenceClassification,
        config=model_cfg,
        path=str(src),
        on_meta=not mesh.is_main,
        trust_remote_code=cfg.model.trust_remote_code,
        tokenizer=tokenizer,
        disable_dropout=cfg.model.disable_dropout,
        role=role,
    )
    if role == "critic" and members(model.config) > 1:
        # from an ensemble: its one head, the members' mean
        scales = scale if isinstance(scale, list) else [scale] * members(model.config)
        mean_head(model, scales)
    elif scale != 1.0 and mesh.is_main:
        with torch.no_grad():
            head_module(model).weight.mul_(scale)
    if lcfg is not None:
        model = lora.adapt(model, lcfg, cfg.run.seed + 1, head=head_name(model), what="critic")
    return ScalarHeadModel(model)
