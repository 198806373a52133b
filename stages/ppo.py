"""Step 3: RLHF with PPO on the hybrid engine (or a critic-free estimator: GRPO, RLOO, REINFORCE++).

    python -m rlhf stage=ppo [run.dir=D] [algorithm.estimator=gae|grpo|rloo|reinforce_pp]

Setup (prompts, actor + hybrid engine, reference, critic, reward model, resume) → loop (collect
experience: generate in inference mode, score in training mode; PPO epochs over minibatches in
ZeRO-3 training mode; log, evaluate, save) → export (actor, critic, EMA actor). The parts live in
``rlhf/rl``: ``prompts.PromptSource`` (the step's prompts), ``experience.Collector`` (generate and
score), ``update.Updater`` (the PPO epochs; PPO-ptx's ``ptx.PtxTerm`` and the ``ema.EMA`` inside),
``metrics.step_metrics``.
"""

from __future__ import annotations

import json
import logging
import time
from copy import deepcopy
from pathlib import Path
from typing import List, Optional, Tuple, Union

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase

from rlhf.algorithms.estimators import estimator
from rlhf.algorithms.ppo import AdaptiveKL
from rlhf.config import ENV_BUILTINS, Config, LoraConfig
from rlhf.data.chat import resolve_template
from rlhf.data.formats import FORMATS
from rlhf.data.pipeline import load_stage_data
from rlhf.data.tokenize import tokenize_prompts
from rlhf.engine.checkpoint import export_hf, save_checkpoint
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.mesh import Mesh, precision_of, shutdown
from rlhf.engine.train import FrozenModel, TrainEngine, reference_for
from rlhf.envs.base import check as check_env
from rlhf.envs.builtin import environment, say_sandbox
from rlhf.errors import ConfigError, UserError
from rlhf.launcher import interrupt
from rlhf.models import dschat, loading, lora
from rlhf.models.value import REWARD_STATS_FILE, ScalarHeadModel, head_module, head_name, mean_head, members
from rlhf.outputs.log import progress
from rlhf.rewards import check as check_reward_fn
from rlhf.rewards import resolve
from rlhf.rl.ema import EMA
from rlhf.rl.episodes import EpisodeRunner
from rlhf.rl.experience import Collector, RewardModels, RewardNormaliser, Scorers
from rlhf.rl.gate import Gate
from rlhf.rl.metrics import reward_line, rollout_samples, step_metrics
from rlhf.rl.prompts import PromptSource
from rlhf.rl.ptx import PtxTerm
from rlhf.rl.rollout_guard import RolloutGuard
from rlhf.rl.update import Diverged, Updater
from rlhf.runtime.evaluation import evaluate_reward, stage_gold
from rlhf.runtime.stage import (
    check_writable,
    checkpoint_to_resume,
    end_of_step,
    finished,
    mark_finished,
    previous_output,
    resolve_steps,
    resume,
    run_fingerprint,
    show_samples,
    stage_input,
    start_stage,
)

log = logging.getLogger("rlhf")


# the default ppo.min_rm_accuracy: on the embedded task, and on any other data
MIN_RM_ACCURACY_EMBEDDED, MIN_RM_ACCURACY_OTHER = 0.9, 0.55


def check_reward_model(stats: dict, rm_src: Optional[Path], threshold: Optional[float], data_format: str) -> None:
    """Exit 2 before any work when the reward model ranks too few held-out pairs right: PPO would train
    the policy towards its errors (on the embedded task RMs at 0.65–0.87 lowered the gold score)."""
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
    disagreement needs an ensemble (``n_members`` ≥ 2), ppo.reward_clip its held-out score range."""
    if ppo.stop_disagreement is not None and n_members < 2:
        what = f"reward model {rm_src} has {n_members} member" if n_members else "run scores with no reward model"
        raise ConfigError(
            f"ppo.stop_disagreement={ppo.stop_disagreement:g} reads a reward-model ensemble's disagreement, but the "
            f"{what}: train one with reward.ensemble=k (k ≥ 2), or gate on ppo.stop_kl"
        )
    if ppo.reward_clip and n_members and any("min" not in m for m in stats.get("members") or [stats]):
        raise ConfigError(
            f"ppo.reward_clip=true needs the reward model's held-out score range (min, max in {rm_src}/"
            f"{REWARD_STATS_FILE}, written by stage=reward): retrain it with this version, or set ppo.reward_clip=false"
        )


def run(cfg: Config) -> None:
    # the user's reward function imports before anything else: an import error is the run's one line
    rule = resolve(cfg.ppo.reward_fn) if cfg.ppo.reward_fn else None
    env = environment(cfg.ppo)  # (a maker of the environment, its class): imported, tools and parser built
    ctx = start_stage(cfg, "ppo")
    say_sandbox(cfg.ppo, log)
    mesh, train, ppo, alg = ctx.mesh, cfg.train, cfg.ppo, cfg.algorithm
    check_writable(cfg.run.dir)
    # (every recipe opens with these lines and then reads top to bottom, setup → loop → export: a
    # deliberate repetition, docs/architecture.md habit 4)

    # ---- setup: everything is validated before anything is written ----
    actor_src, rm_srcs, critic_src = inputs(cfg, mesh)
    data = load_stage_data(cfg.data, "ppo", cfg.run.seed)
    if rule is not None:
        check_reward_fn(rule, ppo.reward_fn, data.train[0], cfg.data.source_list()[0].format)
    check_env(env[0], data.train[0], ppo.env)
    if len(data.train) < ppo.prompts_per_step:
        raise UserError(
            f"data ({data.description}): {len(data.train)} prompts, fewer than one step "
            f"(ppo.prompts_per_step={ppo.prompts_per_step})"
        )
    if ppo.prompts_per_step % mesh.world_size:
        raise ConfigError(
            f"ppo.prompts_per_step={ppo.prompts_per_step} is not divisible by the world size {mesh.world_size}"
        )
    tokenizer = loading.load_tokenizer(actor_src, cfg.model.trust_remote_code)
    for key, src in [("ppo.reward_model_path", r) for r in rm_srcs] + [("ppo.critic_path", critic_src)]:
        if src is not None:  # the reward model and critic read the actor's token ids
            loading.check_same_tokenizer(str(src), key, tokenizer, actor_src, cfg.model.trust_remote_code)
    chat = resolve_template(
        tokenizer, cfg.data.chat_template, records=data.train
    )  # as in SFT: prompts through the chat template
    runner = EpisodeRunner.of(ppo, env, tokenizer, chat, mesh)  # (refuses a template that drops observations)
    data.train, data.eval = runner.with_tools(data.train), runner.with_tools(data.eval)
    prompt_ids = tokenize_prompts(
        data.train, tokenizer, cfg.data.max_prompt_len, chat, max_new_tokens=ppo.max_new_tokens
    )["prompt"]
    ptx = None  # PPO-ptx: the SFT records and their loss
    if alg.ptx_coef > 0:
        ptx = PtxTerm.load(cfg, tokenizer, ctx.cache_dir, mesh)
    all_stats = [reward_stats(src) for src in rm_srcs]
    stats = all_stats[0] if all_stats else {"mean": 0.0, "std": 1.0}  # the first's: the critic's scale
    n_members = 0
    if ppo.use_reward_model:
        for src, st in zip(rm_srcs, all_stats):
            check_reward_model(st, src, ppo.min_rm_accuracy, cfg.data.source_list()[0].format)
        n_members = sum(members(loading.load_model_config(str(src), cfg.model.trust_remote_code)) for src in rm_srcs)
    # what normalises the scores: one reward model's statistics, or every member's of several
    member_stats = (
        stats if len(all_stats) <= 1 else {"members": [m for st in all_stats for m in st.get("members") or [st]]}
    )
    check_ensemble_keys(ppo, member_stats, n_members, ", ".join(map(str, rm_srcs)))

    updates_per_step = ppo.ppo_epochs * ppo.minibatches_per_epoch
    resolve_steps(ctx, len(prompt_ids), ppo.prompts_per_step, "prompts", updates_per_step)
    total_updates = train.max_steps * updates_per_step
    lcfg = cfg.model.lora  # model.lora.r > 0: adapters on the actor (and the critic with model.lora.critic)
    remote = cfg.model.trust_remote_code

    def policy_model(role: str):  # the SFT model, once as the actor and once as the reference
        return loading.causal_lm(actor_src, mesh, tokenizer, remote, cfg.model.disable_dropout, role)

    place = cfg.engine.placement  # engine.<role>.* over engine.*: each model's ZeRO stage, offload, precision
    actor = TrainEngine(
        lora.adapt(policy_model("actor"), lcfg, cfg.run.seed, what="actor"),
        mesh,
        place("actor"),
        train,
        total_steps=total_updates,
    )
    hybrid = HybridEngine(actor, tokenizer, place("actor"))
    critic = None
    if estimator(alg).critic:
        # The critic starts as the reward model, rescaled to the normalised rewards it will predict (a
        # critic of its own, ppo.critic_path, is taken as it is).
        critic_scale = 1.0
        if alg.reward_norm == "stats" and not ppo.critic_path:
            critic_scale = [1.0 / max(m["std"], 1e-8) for m in stats.get("members") or [stats]]
            if len(critic_scale) == 1:
                critic_scale = critic_scale[0]
        critic_lora = None  # model.lora.critic: adapters on the critic too
        if lcfg.critic:
            critic_lora = lcfg
        critic_model = scalar_model(cfg, critic_src, mesh, tokenizer, critic_scale, critic_lora, "critic")
        critic = TrainEngine(critic_model, mesh, place("critic"), train, total_steps=total_updates, lr=ppo.critic_lr)
    # the reference: the actor with its adapters off under LoRA, else a second copy of the SFT model;
    # algorithm.kl_coef=0: no reference model at all (its KL term is 0)
    ref = None
    if alg.kl_coef > 0:
        ref = reference_for(actor, lambda: policy_model("reference"), mesh, place("reference"))
    reward_model = None
    if ppo.use_reward_model:
        models = [FrozenModel(scalar_model(cfg, src, mesh, tokenizer), mesh, place("reward_model")) for src in rm_srcs]
        reward_model = models[0] if len(models) == 1 else RewardModels(models)
    scorers = Scorers(
        ref=ref,
        critic=critic,
        reward_model=reward_model,
        normalise=RewardNormaliser(alg.reward_norm, member_stats, ppo.reward_clip, n_members),
        rule=rule,
        rule_weight=ppo.reward_fn_weight,
        data_format=cfg.data.source_list()[0].format,
        gold=data.gold,
    )
    ema = EMA(actor, ppo.ema_decay) if ppo.ema_decay else None
    # the over-optimisation gate (and its warnings)
    gate = Gate(ppo.stop_disagreement, ppo.stop_kl, actor, ppo.warn_heldout_drop, ppo.warn_greedy_changed)
    kl_ctl = AdaptiveKL(alg.kl_coef, alg.kl_target, alg.kl_horizon)
    # the rollout-parity guard: the inference mode's log-probs against the training recompute, every step
    guard = RolloutGuard.of(ppo, hybrid, precision_of(place("actor"), mesh.device))
    engines = {"actor": actor}  # what checkpoints save and resume restores
    if critic is not None:
        engines["critic"] = critic
    prompts = PromptSource(
        prompt_ids, data.train, ppo.prompts_per_step, cfg.run.seed, mesh, ppo.dynamic_sampling_max_rounds
    )
    collector = Collector(hybrid, actor, scorers, prompts, alg, ppo, tokenizer, mesh, cfg.run.seed, runner)
    updater = Updater(actor, critic, alg, ppo, mesh, cfg.run.seed, ptx=ptx, ema=ema)

    ckpt = checkpoint_to_resume(ctx)
    # what a checkpoint must have been written with to be resumed (rank 0's view of it)
    fingerprint = run_fingerprint(
        actor.module.config,
        tokenizer,
        data,
        cfg,
        f"actor={actor_src} reward_model={','.join(map(str, rm_srcs)) or None} critic={critic_src}",
        [actor_src, *rm_srcs, critic_src],
    )
    if ptx is not None:  # PPO-ptx trains on the SFT records too
        fingerprint["ptx_records"] = ptx.digest
    ctx.fingerprint = mesh.broadcast_object(fingerprint)
    if finished(ctx):  # a rerun of a finished stage: said in one line, nothing touched
        return shutdown(mesh)
    start, state, metrics = resume(ctx, engines, ckpt)
    if ckpt is not None:
        kl_ctl.load_state_dict(state["kl"])
        scorers.normalise.load_state_dict(state["running"])
        if "gate" in state:  # (checkpoints written before the gate have none)
            gate.load_state_dict(state["gate"])
        for copy in (ema, gate.best):
            if copy is not None:
                copy.load(ckpt)

    def evaluate(step: int, final: bool = False) -> None:
        res, kept = {}, []
        if data.gold is not None:
            play = runner.player(hybrid) if runner.multi_turn else None  # episodes: the tools are used
            res = stage_gold(cfg, hybrid, tokenizer, data.eval, data.gold, mesh, chat, kept, play)
        if reward_model is not None and not runner.multi_turn:  # the reward model's view, no gold needed
            mean, answers = evaluate_reward(
                hybrid.generate, tokenizer, data.eval, held_out_reward, cfg.eval, mesh, chat
            )
            if answers:
                changes, warning = gate.heldout(step, mean["eval/reward_greedy"], answers, final)
                res.update(mean, **changes)
                if warning:
                    log.warning("%s", warning)
        if not res:  # eval.gold_prompts=0
            return
        metrics.log(step, **res)
        log.info("step %d: %s", step, " ".join(f"{k}={v:.4f}" for k, v in res.items()))
        show_samples(metrics, step, kept)

    def held_out_reward(gen) -> torch.Tensor:  # the reward model's part of the reward, normalisation unmoved
        return scorers.model_reward(gen.sequences, gen.attention_mask, ppo, mesh, update=False)[0]

    tokens_note = ""  # ppo.max_tokens_per_micro_batch: forwards grouped by real tokens
    if ppo.max_tokens_per_micro_batch:
        tokens_note = f", micro-batches of at most {ppo.max_tokens_per_micro_batch} tokens (as many on every rank)"
    log.info(
        "ppo (%s): %d prompts (%s), %d steps × %d prompts × %d samples, %d epochs × %d minibatches%s",
        alg.estimator,
        len(prompt_ids),
        data.description,
        train.max_steps,
        ppo.prompts_per_step,
        ppo.samples_per_prompt,
        ppo.ppo_epochs,
        ppo.minibatches_per_epoch,
        tokens_note,
    )
    log.info("%s", guard.describe())
    if start == 0:
        evaluate(0)

    copies = [c for c in (ema, gate.best) if c is not None]  # actor copies saved beside the checkpoint

    def experience(step: int):  # the step's experience and its metrics line (time/train_s once updated)
        exp = collector.collect(step, kl_ctl.beta)
        return exp, step_metrics(exp, 0.0, mesh)

    def checked_experience(step: int):  # ... checked by the rollout guard before any update
        moments = deepcopy(scorers.normalise.state_dict())  # (a few floats)

        def rebuild() -> None:  # fresh inference weights; the regeneration starts from the same reward moments
            hybrid.rebuild_inference()
            scorers.normalise.load_state_dict(moments)

        return guard.checked(step + 1, lambda: experience(step), rebuild)

    def save_copies(path: Path) -> None:
        for c in copies:
            c.save(path)

    def checkpoint(step: int) -> Path:
        return save_checkpoint(
            ctx.ckpt_dir,
            step,
            engines,
            {
                "stage": "ppo",
                "fingerprint": ctx.fingerprint,
                "kl": kl_ctl.state_dict(),
                "running": scorers.normalise.state_dict(),
                "gate": gate.state_dict(),
            },
            mesh,
            keep=train.keep_checkpoints,
            extra=save_copies if copies else None,
        )

    bar = progress(train.max_steps, start, cfg.logger.progress, "ppo", mesh.is_main)
    stop = interrupt.listen()  # a first Ctrl-C / SIGTERM: checkpoint at the end of the step, then exit
    last, stopped = train.max_steps, None  # the exported actor's step; the gate's record when it fires
    for step in range(start, train.max_steps):
        # ---- experience: generate in inference mode, then score in training mode ----
        exp, row = checked_experience(step)  # (the rollout guard stops the run here: exit 2)
        done = step + 1
        why = gate.observe(done, row["reward/mean"], row.get("reward/ensemble_std"), row["kl/mean"])
        if why is not None:  # the gate: no update on these rollouts; the best step's actor is exported
            last, stopped = gate.best_step, {"gate": {"stopped_at": done, "best_step": gate.best_step, "why": why}}
            row.pop("time/train_s")
            metrics.log(done, **row, **{"gate/stopped": 1.0, "gate/best_step": float(last)})
            log.warning("ppo: step %d: the gate stops the run: %s; exporting the actor of step %d", done, why, last)
            gate.best.restore()
            break

        # ---- updates: PPO epochs over minibatches in training mode ----
        t1 = time.perf_counter()
        try:
            train_stats = updater.update(exp, step, kl_ctl.beta)
        except Diverged as e:
            raise UserError(f"ppo: {e} at step {step + 1}; stopping (the last good checkpoint is kept)") from None
        row["time/train_s"] = time.perf_counter() - t1

        # ---- log, evaluate, checkpoint ----
        kl_ctl.update(exp.kl_mean, exp.global_rows)
        row.update({"kl/beta": kl_ctl.beta, **train_stats})
        if done % train.log_every == 0 or step == start or done == train.max_steps:
            metrics.log(done, **row)
        if cfg.logger.samples and cfg.logger.samples_every and (done % cfg.logger.samples_every == 0 or step == start):
            metrics.samples(done, "rollout", rollout_samples(exp, cfg.logger.samples))
        bar.step(reward=reward_line(row, list(exp.score_parts)), kl=f"{row['kl/mean']:.3f}")
        end_of_step(done, train, stop, mesh, checkpoint, evaluate)
    bar.close()
    stop.close()

    # ---- export ----
    evaluate(last, final=True)
    export_hf(actor, ctx.out / "actor", mesh, tokenizer=tokenizer, adapter_dir=ctx.out / "adapter")
    if critic is not None:
        export_hf(critic, ctx.out / "critic", mesh, tokenizer=tokenizer, adapter_dir=ctx.out / "critic_adapter")
    if ema is not None:
        ema.export(ctx.out / "actor_ema", tokenizer)
    metrics.close()
    mark_finished(ctx, train.max_steps, stopped)  # (a stopped run is finished: a rerun leaves it so)
    log.info("ppo done: %s", ctx.out / "actor")
    shutdown(mesh)


def inputs(cfg: Config, mesh: Mesh) -> Tuple[str, List[Path], Optional[Path]]:
    """(actor source, reward-model dirs, critic dir or None): the SFT output (or model.path or
    ppo.actor_path), the reward models (ppo.reward_model_path, comma-separated for several, or the
    reward stage's output; none when unused) and the critic's start (ppo.critic_path or the first
    reward model). A DeepSpeed-Chat reward model (or critic) given by path is converted into
    <run.dir>/converted/ first (rank 0; rlhf/models/dschat.py)."""
    ppo, alg = cfg.ppo, cfg.algorithm
    actor_src = stage_input(cfg, ppo.actor_path, "ppo.actor_path", "ppo")
    gae = estimator(alg).critic  # (GAE: the critic's start is needed)
    if not ppo.use_reward_model and not ppo.reward_fn and ppo.env in ENV_BUILTINS:
        raise ConfigError(
            f"ppo.use_reward_model=false needs another reward: a rule (ppo.reward_fn, e.g. rlhf.rewards.gold) or "
            f"an environment that gives rewards (ppo.env=module.Class; the built-in ppo.env={ppo.env} gives none)"
        )
    if not ppo.use_reward_model and not ppo.reward_fn:
        log.info("ppo: the rewards are ppo.env=%s's alone (no reward model, no ppo.reward_fn)", ppo.env)
    if ppo.critic_path and not gae:
        raise ConfigError(
            f"ppo.critic_path={ppo.critic_path} is set but algorithm.estimator={alg.estimator} "
            f"has no critic (only gae does)"
        )
    # GAE's critic starts as the reward model unless it has a start of its own
    needs_rm = ppo.use_reward_model or (gae and not ppo.critic_path)
    rm_srcs: List[Path] = []
    if ppo.reward_model_path and not needs_rm:
        raise ConfigError(
            f"ppo.reward_model_path={ppo.reward_model_path} is set but nothing uses it "
            f"(ppo.use_reward_model=false, and the critic starts from ppo.critic_path or there is none)"
        )
    if ppo.reward_model_path:  # several, comma-separated: their members together are one ensemble
        for given in [x.strip() for x in str(ppo.reward_model_path).split(",") if x.strip()]:
            path = dschat.reward_model_input(given, "ppo.reward_model_path", cfg.run.dir, mesh)
            loading.check_scalar_model(path, "ppo.reward_model_path")
            rm_srcs.append(Path(path).expanduser())
    elif needs_rm:
        rm_srcs = [previous_output(cfg.run.dir, "reward", "model")]
        if rm_srcs[0] is None:
            raise ConfigError(
                f"no reward model in {cfg.run.dir}/reward/model: run stage=reward first, set "
                f"ppo.reward_model_path, or use algorithm.estimator=grpo ppo.use_reward_model=false "
                f"ppo.reward_fn=..."
            )
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
        log.info("ppo: reward model%s %s%s", "s" if len(rm_srcs) > 1 else "", ", ".join(map(str, rm_srcs)), note)
    if critic_src is not None:
        log.info("ppo: critic starts from %s", critic_src)
    return str(actor_src), rm_srcs, critic_src


def scalar_model(
    cfg: Config,
    src: Path,
    mesh: Mesh,
    tokenizer: PreTrainedTokenizerBase,
    scale: Union[float, List[float]] = 1.0,
    lcfg: Optional[LoraConfig] = None,
    role: str = "reward model",
) -> ScalarHeadModel:
    """The reward model's architecture and weights as a scalar-head model (the critic's head scaled, per
    member of an ensemble by ``scale[i]``, and the members averaged into one head;
    ``lcfg``: LoRA adapters on its backbone, the head fully trained; dropout per model.disable_dropout)."""
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
    if role == "critic" and members(model.config) > 1:  # from an ensemble: its one head, the members' mean
        scales = scale if isinstance(scale, list) else [scale] * members(model.config)
        mean_head(model, scales)
    elif scale != 1.0 and mesh.is_main:
        with torch.no_grad():
            head_module(model).weight.mul_(scale)
    if lcfg is not None:
        model = lora.adapt(model, lcfg, cfg.run.seed + 1, head=head_name(model), what="critic")
    return ScalarHeadModel(model)
