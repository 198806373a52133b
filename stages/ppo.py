"""Step 3: RLHF with PPO on the hybrid engine (or a critic-free estimator: GRPO, RLOO, REINFORCE++).

    python -m rlhf stage=ppo [run.dir=D] [algorithm.estimator=gae|grpo|rloo|reinforce_pp]

Setup (prompts, actor + hybrid engine, reference, critic, reward model, resume) → loop (collect
experience: generate in inference mode, score in training mode; PPO epochs over minibatches in
ZeRO-3 training mode; log, evaluate, save) → export (actor, critic, EMA actor). The parts live in
``rlhf/rl``: ``prompts.PromptSource`` (the step's prompts), ``experience.Collector`` (generate and
score), ``update.Updater`` (the PPO epochs; PPO-ptx's and GKD's ``sft_records.SftRecords`` and the
``ema.EMA`` inside), ``metrics.step_metrics``.
"""

from __future__ import annotations

import logging
import time
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import torch

from rlhf.algorithms.ppo import AdaptiveKL
from rlhf.config import Config
from rlhf.data.chat import resolve_template
from rlhf.data.pipeline import StageData, load_stage_data
from rlhf.data.tokenize import tokenize_prompts
from rlhf.engine.checkpoint import export_hf, save_checkpoint
from rlhf.engine.mesh import precision_of, shutdown
from rlhf.envs.base import check as check_env
from rlhf.envs.builtin import environment, say_sandbox
from rlhf.errors import ConfigError, UserError
from rlhf.launcher import interrupt
from rlhf.models import loading
from rlhf.outputs.log import progress
from rlhf.rewards import check as check_reward_fn
from rlhf.rewards import resolve
from rlhf.rl.async_rollouts import AsyncRollouts, worker_spec
from rlhf.rl.episodes import EpisodeRunner
from rlhf.rl.experience import Collector
from rlhf.rl.gate import Gate
from rlhf.rl.metrics import reward_line, rollout_samples, step_metrics
from rlhf.rl.models import Models, RewardStats, Sources, build_models, inputs
from rlhf.rl.prompts import PromptSource
from rlhf.rl.rollout_guard import RolloutGuard
from rlhf.rl.rollout_link import on_rollout_rank, serve_rank, split_world
from rlhf.rl.sft_records import SftRecords
from rlhf.rl.update import Diverged, Updater
from rlhf.runtime.evaluation import evaluate_reward, stage_gold
from rlhf.runtime.stage import (
    StageContext,
    check_writable,
    checkpoint_to_resume,
    end_of_step,
    finished,
    mark_finished,
    resolve_steps,
    resume,
    run_fingerprint,
    show_samples,
    start_stage,
)

log = logging.getLogger("rlhf")


def run(cfg: Config) -> None:
    # the user's reward function imports before anything else: an import error is the run's one line
    rule = resolve(cfg.ppo.reward_fn) if cfg.ppo.reward_fn else None
    # (a maker of the environment, its class): imported, tools and parser built
    env = environment(cfg.env)
    if on_rollout_rank(cfg.ppo):
        # ppo.rollout_ranks: this rank plays episodes for trainer ranks (rlhf/rl/rollout_link.py)
        return serve_rank(cfg)
    if cfg.ppo.rollout_ranks:
        # ... and the trainers' world is the other ranks
        split_world(cfg.ppo)
    ctx = start_stage(cfg, "ppo")
    say_sandbox(cfg.env, log)
    mesh, train, ppo = ctx.mesh, cfg.train, cfg.ppo
    check_writable(cfg.run.dir)
    # (every recipe opens with these lines and then reads top to bottom, setup → loop → export: a
    # deliberate repetition, docs/architecture.md habit 4)

    # ---- 1. setup: everything is validated before anything is written ----
    # where the actor, reward models, critic, teacher and judge come from
    sources = inputs(cfg, mesh)
    prep = prepare(cfg, ctx, sources, rule, env)
    updates_per_step = ppo.ppo_epochs * ppo.minibatches_per_epoch
    resolve_steps(ctx, len(prep.prompt_ids), ppo.prompts_per_step, "prompts", updates_per_step)
    models = build_models(
        cfg,
        mesh,
        prep.tokenizer,
        sources,
        prep.stats,
        rule,
        prep.data.gold,
        train.max_steps * updates_per_step,
    )
    loop = Loop(cfg, ctx, prep, models)
    ckpt = checkpoint_to_resume(ctx)
    ctx.fingerprint = mesh.broadcast_object(fingerprint(cfg, prep, models, sources))
    if finished(ctx):
        # a rerun of a finished stage: said in one line, nothing touched
        return shutdown(mesh)
    start, state, loop.metrics = resume(ctx, models.engines, ckpt)
    if ckpt is not None:
        loop.load_state_dict(state, ckpt)
    loop.say_plan()
    if start == 0:
        loop.evaluate(0)

    # ---- 2. the loop ----
    metrics, kl_ctl, gate = loop.metrics, loop.kl_ctl, loop.gate
    bar = progress(train.max_steps, start, cfg.logger.progress, "ppo", mesh.is_main)
    # a first Ctrl-C / SIGTERM: checkpoint at the end of the step, then exit
    stop = interrupt.listen()
    # ppo.rollout_workers / rollout_ranks: the worker starts with the weights of step `start`
    loop.start_rollouts(start)
    # the exported actor's step; the gate's record when it fires
    last, stopped = train.max_steps, None
    for step in range(start, train.max_steps):
        t0 = time.perf_counter()
        # experience: generate in inference mode, then score in training mode
        # (the rollout guard stops the run here: exit 2)
        exp, row = loop.checked_experience(step)
        done = step + 1
        why = gate.observe(done, row["reward/mean"], row.get("reward/ensemble_std"), row["kl/mean"])
        if why is not None:
            # the gate: no update on these rollouts; the best step's actor is exported
            last, stopped = loop.stop_at_gate(done, row, why)
            break

        # updates: PPO epochs over minibatches in training mode
        t1 = time.perf_counter()
        try:
            train_stats = loop.updater.update(exp, step, kl_ctl.beta)
        except Diverged as e:
            raise UserError(
                f"ppo: {e} at step {step + 1}; stopping (the last good checkpoint is kept)"
            ) from None
        row["time/train_s"] = time.perf_counter() - t1
        # asynchronous rollouts: the new weights go to the worker
        loop.updated(step)

        # log, evaluate, checkpoint
        kl_ctl.update(exp.kl_mean, exp.global_rows)
        row.update({"kl/beta": kl_ctl.beta, **train_stats, "time/step_s": time.perf_counter() - t0})
        if done % train.log_every == 0 or step == start or done == train.max_steps:
            metrics.log(done, **row)
        loop.log_samples(done, exp, first=step == start)
        bar.step(reward=reward_line(row, list(exp.score_parts)), kl=f"{row['kl/mean']:.3f}")
        end_of_step(done, train, stop, mesh, loop.checkpoint, loop.evaluate)
    bar.close()
    stop.close()
    loop.stop_rollouts()

    # ---- 3. export ----
    loop.evaluate(last, final=True)
    export_models(models, ctx.out, prep.tokenizer, mesh)
    metrics.close()
    # (a stopped run is finished: a rerun leaves it so)
    mark_finished(ctx, train.max_steps, stopped)
    log.info("ppo done: %s", ctx.out / "actor")
    shutdown(mesh)


def export_models(models: Models, out: Path, tokenizer, mesh) -> None:
    """The actor (its adapter too under LoRA), the critic and the EMA copy in HF format."""
    export_hf(models.actor, out / "actor", mesh, tokenizer=tokenizer, adapter_dir=out / "adapter")
    if models.critic is not None:
        adapter = out / "critic_adapter"
        export_hf(models.critic, out / "critic", mesh, tokenizer=tokenizer, adapter_dir=adapter)
    if models.ema is not None:
        models.ema.export(out / "actor_ema", tokenizer)


@dataclass
class Prepared:
    """What the setup read and checked before any model loads."""

    data: StageData
    tokenizer: object
    chat: Optional[str]  # the chat template prompts go through
    runner: EpisodeRunner
    prompt_ids: list
    # the SFT records of PPO-ptx and of GKD's dataset share
    records: Optional[SftRecords]
    stats: RewardStats


def prepare(cfg: Config, ctx: StageContext, sources: Sources, rule, env) -> Prepared:
    """The data, the reward function and environment tried on a record, the tokenizer (the reward
    models' and the critic's the same), the chat template, the episodes' runner, the prompts' ids,
    the SFT records (PPO-ptx, GKD's dataset share) and the reward models' statistics: exit 2 on the
    first that does not fit."""
    mesh, ppo = ctx.mesh, cfg.ppo
    actor_src = sources.actor
    data = load_stage_data(cfg.data, "ppo", cfg.run.seed)
    if rule is not None:
        check_reward_fn(rule, ppo.reward_fn, data.train[0], cfg.data.source_list()[0].format)
    check_env(env[0], data.train[0], cfg.env.name)
    if len(data.train) < ppo.prompts_per_step:
        raise UserError(
            f"data ({data.description}): {len(data.train)} prompts, fewer than one step "
            f"(ppo.prompts_per_step={ppo.prompts_per_step})"
        )
    if ppo.prompts_per_step % mesh.world_size:
        raise ConfigError(
            f"ppo.prompts_per_step={ppo.prompts_per_step} is not divisible by the world "
            f"size {mesh.world_size}"
        )
    tokenizer = loading.load_tokenizer(actor_src, cfg.model.trust_remote_code)
    for key, src in sources.named():
        if src is not None and key != "ppo.judge_path":
            # they read the actor's token ids (the judge: text)
            loading.check_same_tokenizer(
                str(src), key, tokenizer, actor_src, cfg.model.trust_remote_code
            )
    chat = resolve_template(tokenizer, cfg.data.chat_template, records=data.train)  # as in SFT
    # (refuses a template that drops observations)
    runner = EpisodeRunner.of(cfg.env, env, tokenizer, chat, mesh)
    data.train, data.eval = runner.with_tools(data.train), runner.with_tools(data.eval)
    prompt_ids = tokenize_prompts(
        data.train, tokenizer, cfg.data.max_prompt_len, chat, max_new_tokens=ppo.max_new_tokens
    )["prompt"]
    alg, records = cfg.algorithm, None
    if alg.ptx_coef > 0 or alg.gkd_data_share > 0:
        why = "algorithm.ptx_coef" if alg.ptx_coef > 0 else "algorithm.gkd_data_share"
        records = SftRecords.load(cfg, tokenizer, ctx.cache_dir, mesh, why)
    stats = RewardStats.of(cfg, sources.reward_models)
    return Prepared(data, tokenizer, chat, runner, prompt_ids, records, stats)


def fingerprint(cfg: Config, prep: Prepared, models: Models, sources: Sources) -> dict:
    """What a checkpoint must have been written with to be resumed (rank 0's view of it)."""
    rms = ",".join(map(str, sources.reward_models)) or None
    named = f"actor={sources.actor} reward_model={rms} critic={sources.critic}"
    for key, src in (("teacher", sources.teacher), ("judge", sources.judge)):
        if src is not None:
            # (runs without them keep the fingerprint they had)
            named += f" {key}={src}"
    models_read = [sources.actor] + [src for _, src in sources.named()]
    found = run_fingerprint(
        models.actor.module.config, prep.tokenizer, prep.data, cfg, named, models_read
    )
    if prep.records is not None:  # PPO-ptx or GKD train on the SFT records too
        found["ptx_records"] = prep.records.digest
    return found


class Loop:
    """The loop's parts and the state a checkpoint carries beside the engines: the adaptive KL, the
    reward normaliser's moments, the gate, and the actor copies (EMA, the gate's best step)."""

    def __init__(self, cfg: Config, ctx: StageContext, prep: Prepared, models: Models):
        ppo, alg, mesh = cfg.ppo, cfg.algorithm, ctx.mesh
        self.cfg, self.ctx, self.prep, self.models = cfg, ctx, prep, models
        # the over-optimisation gate (and its warnings)
        self.gate = Gate(
            ppo.stop_disagreement,
            ppo.stop_kl,
            models.actor,
            ppo.warn_heldout_drop,
            ppo.warn_greedy_changed,
        )
        self.kl_ctl = AdaptiveKL(alg.kl_coef, alg.kl_target, alg.kl_horizon)
        # the rollout-parity guard: the inference mode's log-probs against the training recompute,
        # every step
        self.guard = RolloutGuard.of(
            ppo, models.hybrid, precision_of(cfg.engine.placement("actor"), mesh.device)
        )
        prompts = PromptSource(
            prep.prompt_ids,
            prep.data.train,
            ppo.prompts_per_step,
            cfg.run.seed,
            mesh,
            ppo.dynamic_sampling_max_rounds,
        )
        self.collector = Collector(
            models.hybrid,
            models.actor,
            models.scorers,
            prompts,
            alg,
            ppo,
            prep.tokenizer,
            mesh,
            cfg.run.seed,
            prep.runner,
        )
        self.updater = Updater(
            models.actor,
            models.critic,
            alg,
            ppo,
            mesh,
            cfg.run.seed,
            prep.records,
            models.ema,
            models.scorers.teacher,
        )
        self.collector.update_live_rows = self.updater.live_only
        # saved beside the checkpoint
        self.copies = [c for c in (models.ema, self.gate.best) if c is not None]
        self.metrics = None  # resume's
        if ppo.max_staleness and alg.mismatch_correction == "none":
            log.warning(
                "ppo.max_staleness=%d with algorithm.mismatch_correction=none: stale "
                "tokens train at weight 1; "
                "tis or mis weighs them by π_proximal / π_behaviour "
                "(docs/ppo.md#asynchronous-rollouts)",
                ppo.max_staleness,
            )
        if ppo.remote:
            # the episodes played by a worker process or rank, up to ppo.max_staleness steps ahead
            self.collector.remote = AsyncRollouts(
                models.hybrid,
                worker_spec(cfg, prep, models),
                prompts,
                self.collector.sampling,
                mesh,
                ppo.max_staleness,
                cfg.train.max_steps,
                cfg.engine.timeout_s,
            )
            self.collector.remote.spawn()

    def start_rollouts(self, step: int) -> None:
        if self.collector.remote is not None:
            self.collector.remote.start(step)

    def updated(self, step: int) -> None:
        if self.collector.remote is not None:
            self.collector.remote.updated(step)

    def stop_rollouts(self) -> None:
        if self.collector.remote is not None:
            self.collector.remote.close()

    def state_dict(self) -> dict:
        return {
            "stage": "ppo",
            "fingerprint": self.ctx.fingerprint,
            "kl": self.kl_ctl.state_dict(),
            "running": self.models.scorers.normalise.state_dict(),
            "gate": self.gate.state_dict(),
        }

    def load_state_dict(self, state: dict, ckpt: Path) -> None:
        self.kl_ctl.load_state_dict(state["kl"])
        self.models.scorers.normalise.load_state_dict(state["running"])
        if "gate" in state:
            # (checkpoints written before the gate have none)
            self.gate.load_state_dict(state["gate"])
        for copy in (self.models.ema, self.gate.best):
            if copy is not None:
                copy.load(ckpt)
        if self.collector.remote is not None:
            # ppo.staleness_policy=fixed: the steps in flight when it was saved
            self.collector.remote.restore(ckpt, int(state["step"]))

    def checkpoint(self, step: int) -> Path:
        remote = self.collector.remote

        def extra(path: Path) -> None:
            for c in self.copies:
                c.save(path)
            if remote is not None:
                remote.save(path, step)

        return save_checkpoint(
            self.ctx.ckpt_dir,
            step,
            self.models.engines,
            self.state_dict(),
            self.ctx.mesh,
            keep=self.cfg.train.keep_checkpoints,
            extra=extra if self.copies or remote is not None else None,
        )

    def say_plan(self) -> None:
        """The run's shape in one line, and the rollout guard's."""
        ppo, prep = self.cfg.ppo, self.prep
        # ppo.max_tokens_per_micro_batch: forwards grouped by real tokens
        tokens_note = ""
        if ppo.max_tokens_per_micro_batch:
            tokens_note = (
                f", micro-batches of at most {ppo.max_tokens_per_micro_batch} tokens (as many on "
                "every rank)"
            )
        log.info(
            "ppo (%s): %d prompts (%s), %d steps × %d prompts × %d samples, %d epochs × %d "
            "minibatches%s",
            self.cfg.algorithm.estimator,
            len(prep.prompt_ids),
            prep.data.description,
            self.cfg.train.max_steps,
            ppo.prompts_per_step,
            ppo.samples_per_prompt,
            ppo.ppo_epochs,
            ppo.minibatches_per_epoch,
            tokens_note,
        )
        log.info("%s", self.guard.describe())

    def stop_at_gate(self, done: int, row: dict, why: str) -> Tuple[int, dict]:
        """The gate fired at step ``done``: its line logged (no update on these rollouts) and the
        best step's actor restored for the export; (that step, the record done.json keeps)."""
        best = self.gate.best_step
        row.pop("time/train_s")
        self.metrics.log(done, **row, **{"gate/stopped": 1.0, "gate/best_step": float(best)})
        log.warning(
            "ppo: step %d: the gate stops the run: %s; exporting the actor of step %d",
            done,
            why,
            best,
        )
        self.gate.best.restore()
        return best, {"gate": {"stopped_at": done, "best_step": best, "why": why}}

    def log_samples(self, done: int, exp, first: bool) -> None:
        """``logger.samples`` rollouts into samples.jsonl every ``logger.samples_every`` steps."""
        every, n = self.cfg.logger.samples_every, self.cfg.logger.samples
        if n and every and (done % every == 0 or first):
            self.metrics.samples(done, "rollout", rollout_samples(exp, n, self.prep.chat))

    def experience(self, step: int):
        """The step's experience and its metrics line (time/train_s once updated)."""
        exp = self.collector.collect(step, self.kl_ctl.beta)
        return exp, step_metrics(exp, 0.0, self.ctx.mesh)

    def checked_experience(self, step: int):
        """... checked by the rollout guard before any update; a rebuild regenerates from fresh
        inference weights and the same reward moments."""
        normalise = self.models.scorers.normalise
        moments = deepcopy(normalise.state_dict())  # (a few floats)

        def rebuild() -> None:
            self.models.hybrid.rebuild_inference()
            normalise.load_state_dict(moments)

        return self.guard.checked(step + 1, lambda: self.experience(step), rebuild)

    def held_out_reward(self, gen) -> torch.Tensor:
        """The reward model's part of the reward, the normalisation unmoved."""
        return self.models.scorers.model_reward(
            gen.sequences, gen.attention_mask, self.cfg.ppo, self.ctx.mesh, update=False
        )[0]

    def evaluate(self, step: int, final: bool = False) -> None:
        """Gold on the held-out prompts (episodes where the run plays them) and the reward model's
        held-out view (the gate's drop and changed-answer warnings)."""
        cfg, prep, hybrid, mesh = self.cfg, self.prep, self.models.hybrid, self.ctx.mesh
        res, kept = {}, []
        if prep.data.gold is not None:
            # episodes: the tools are used
            play = prep.runner.player(hybrid) if prep.runner.multi_turn else None
            res = stage_gold(
                cfg,
                hybrid,
                prep.tokenizer,
                prep.data.eval,
                prep.data.gold,
                mesh,
                prep.chat,
                kept,
                play,
            )
        if self.models.reward_model is not None and not prep.runner.multi_turn:  # no gold needed
            mean, answers = evaluate_reward(
                hybrid.generate,
                prep.tokenizer,
                prep.data.eval,
                self.held_out_reward,
                cfg.eval,
                mesh,
                prep.chat,
                kept=kept,
                show=cfg.logger.samples,
                even=bool(cfg.ppo.micro_batch_per_rank),
            )
            if answers:
                changes, warning = self.gate.heldout(
                    step, mean["eval/reward_greedy"], answers, final
                )
                res.update(mean, **changes)
                if warning:
                    log.warning("%s", warning)
        if not res:  # eval.gold_prompts=0
            return
        self.metrics.log(step, **res)
        log.info("step %d: %s", step, " ".join(f"{k}={v:.4f}" for k, v in res.items()))
        show_samples(self.metrics, step, kept)
