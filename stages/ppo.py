"""Step 3: RLHF with PPO on the hybrid engine (or a critic-free estimator: GRPO, RLOO, REINFORCE++).

    python -m rlhf stage=ppo [run.dir=D] [algorithm.estimator=gae|grpo|rloo|reinforce_pp]

Setup (prompts, actor + hybrid engine, reference, critic, reward model, resume) → loop (collect
experience: generate in inference mode, score in training mode; PPO epochs over minibatches in
ZeRO-3 training mode; log, evaluate, save) → export (actor, critic, EMA actor). The parts live in
``rlhf/rl``: ``experience.collect``, ``update.ppo_update``, ``ema.EMA``.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification

from rlhf import seeding
from rlhf.algorithms import ppo as ppo_math
from rlhf.config import Config
from rlhf.data.chat import resolve_template
from rlhf.data.pipeline import load_stage_data
from rlhf.data.sampler import GlobalBatches
from rlhf.data.tokenize import tokenize_prompts
from rlhf.engine.checkpoint import export_hf, save_checkpoint
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.mesh import shutdown
from rlhf.engine.train import FrozenModel, TrainEngine, reference_for
from rlhf.errors import ConfigError, UserError
from rlhf.launcher import interrupt
from rlhf.models import loading, lora
from rlhf.models.value import REWARD_STATS_FILE, ScalarHeadModel, head_module, head_name
from rlhf.ops import SamplingParams
from rlhf.rewards import check as check_reward_fn
from rlhf.rewards import resolve
from rlhf.rl import experience, ptx
from rlhf.rl.ema import EMA
from rlhf.rl.update import Diverged, ppo_update
from rlhf.rundir.log import progress
from rlhf.runtime.evaluation import evaluate_gold
from rlhf.runtime.stage import (
    check_writable, checkpoint_to_resume, end_of_step, finished, mark_finished, previous_output, resolve_steps,
    resume, run_fingerprint,
    stage_input, start_stage)

log = logging.getLogger("rlhf")


# the default ppo.min_rm_accuracy: on the embedded task, and on any other data
MIN_RM_ACCURACY_EMBEDDED, MIN_RM_ACCURACY_OTHER = 0.9, 0.55


def check_reward_model(stats: dict, rm_src, threshold, data_format) -> None:
    """Exit 2 before any work when the reward model ranks too few held-out pairs right: PPO would train
    the policy towards its errors (on the embedded task RMs at 0.65–0.87 lowered the gold score)."""
    acc = stats.get("eval/accuracy")
    if threshold is None:
        threshold = MIN_RM_ACCURACY_EMBEDDED if data_format == "synthetic" else MIN_RM_ACCURACY_OTHER
    if acc is None or acc >= threshold:
        return
    raise ConfigError(f"reward model {rm_src}: held-out accuracy {acc:.3f} (reward_stats.json) is below "
                      f"ppo.min_rm_accuracy={threshold:g}; PPO would optimise its errors: train it better "
                      f"(more reward steps or data), or set ppo.min_rm_accuracy=0 to go on anyway")


def run(cfg: Config) -> None:
    # the user's reward function imports before anything else: an import error is the run's one line
    rule = resolve(cfg.ppo.reward_fn) if cfg.ppo.reward_fn else None
    ctx = start_stage(cfg, "ppo")
    mesh, train, ppo, alg = ctx.mesh, cfg.train, cfg.ppo, cfg.algorithm
    check_writable(cfg.run.dir)
    # (every recipe opens with these lines and then reads top to bottom, setup → loop → export: a
    # deliberate repetition, docs/architecture.md habit 4)

    # ---- setup: everything is validated before anything is written ----
    actor_src, rm_src, critic_src = inputs(cfg)
    data = load_stage_data(cfg.data, "ppo", cfg.run.seed)
    if rule is not None:
        check_reward_fn(rule, ppo.reward_fn, data.train[0], cfg.data.source_list()[0].format)
    if len(data.train) < ppo.prompts_per_step:
        raise UserError(f"data ({data.description}): {len(data.train)} prompts, fewer than one step "
                        f"(ppo.prompts_per_step={ppo.prompts_per_step})")
    if ppo.prompts_per_step % mesh.world_size:
        raise ConfigError(f"ppo.prompts_per_step={ppo.prompts_per_step} is not divisible by the world size "
                          f"{mesh.world_size}")
    tokenizer = loading.load_tokenizer(actor_src, cfg.model.trust_remote_code)
    for key, src in (("ppo.reward_model_path", rm_src), ("ppo.critic_path", critic_src)):
        if src is not None:  # the reward model and critic read the actor's token ids
            loading.check_same_tokenizer(str(src), key, tokenizer, actor_src, cfg.model.trust_remote_code)
    chat = resolve_template(tokenizer, cfg.data.chat_template)  # as in SFT: prompts through the chat template
    prompt_ids = tokenize_prompts(data.train, tokenizer, cfg.data.max_prompt_len, chat,
                                  max_new_tokens=ppo.max_new_tokens)["prompt"]
    ptx_data = ptx.load_data(cfg, tokenizer, ctx) if alg.ptx_coef > 0 else None
    stats = {"mean": 0.0, "std": 1.0}
    if rm_src is not None and (rm_src / REWARD_STATS_FILE).is_file():
        stats = json.loads((rm_src / REWARD_STATS_FILE).read_text())
    if ppo.use_reward_model:
        check_reward_model(stats, rm_src, ppo.min_rm_accuracy, cfg.data.source_list()[0].format)

    updates_per_step = ppo.ppo_epochs * ppo.minibatches_per_epoch
    resolve_steps(ctx, len(prompt_ids), ppo.prompts_per_step, "prompts", updates_per_step)
    total_updates = train.max_steps * updates_per_step
    lcfg = cfg.model.lora  # model.lora.r > 0: adapters on the actor (and the critic with model.lora.critic)
    actor_model = lora.adapt(loading.causal_lm(actor_src, mesh, tokenizer, cfg.model.trust_remote_code, cfg.model.disable_dropout, "actor"), lcfg, cfg.run.seed, what="actor")
    place = cfg.engine.placement  # engine.<role>.* over engine.*: each model's ZeRO stage, offload, precision
    actor = TrainEngine(actor_model, mesh, place("actor"), train, total_steps=total_updates)
    hybrid = HybridEngine(actor, tokenizer, place("actor"))
    # The critic starts as the reward model, rescaled to the normalised rewards it will predict (a
    # critic of its own, ppo.critic_path, is taken as it is).
    critic_scale = 1.0 / max(stats["std"], 1e-8) if alg.reward_norm == "stats" and not ppo.critic_path else 1.0
    critic = (TrainEngine(scalar_model(cfg, critic_src, mesh, tokenizer, critic_scale, lcfg if lcfg.critic else None, "critic"),
                          mesh, place("critic"), train, total_steps=total_updates, lr=ppo.critic_lr)
              if alg.estimator == "gae" else None)
    # the reference: the actor with its adapters off under LoRA, else a second copy of the SFT model;
    # algorithm.kl_coef=0: no reference model at all (its KL term is 0)
    ref = (reference_for(actor, lambda: loading.causal_lm(actor_src, mesh, tokenizer, cfg.model.trust_remote_code, cfg.model.disable_dropout, "reference"), mesh, place("reference"))
           if alg.kl_coef > 0 else None)
    scorers = experience.Scorers(
        ref=ref,
        critic=critic,
        reward_model=FrozenModel(scalar_model(cfg, rm_src, mesh, tokenizer), mesh, place("reward_model")) if ppo.use_reward_model else None,
        reward_stats=stats, running=ppo_math.RunningMoments(), rule=rule, rule_weight=ppo.reward_fn_weight,
        data_format=cfg.data.source_list()[0].format, gold=data.gold)
    ema = EMA(actor, ppo.ema_decay) if ppo.ema_decay else None
    kl_ctl = ppo_math.AdaptiveKL(alg.kl_coef, alg.kl_target, alg.kl_horizon)
    engines = {"actor": actor, **({"critic": critic} if critic is not None else {})}

    ckpt = checkpoint_to_resume(ctx)
    # what a checkpoint must have been written with to be resumed (rank 0's view of it)
    ctx.fingerprint = mesh.broadcast_object(run_fingerprint(actor.module.config, tokenizer, data.description, cfg,
                                                                f"actor={actor_src} reward_model={rm_src} critic={critic_src}"))
    if finished(ctx):  # a rerun of a finished stage: said in one line, nothing touched
        return shutdown(mesh)
    start, state, metrics = resume(ctx, engines, ckpt)
    if ckpt is not None:
        kl_ctl.load_state_dict(state["kl"])
        scorers.running.load_state_dict(state["running"])
        if ema is not None:
            ema.load(ckpt)
    batches = GlobalBatches(len(prompt_ids), ppo.prompts_per_step, cfg.run.seed)
    extra = GlobalBatches(len(prompt_ids), ppo.prompts_per_step, cfg.run.seed + 1)  # dynamic sampling's refills

    def extra_prompts(step, round_):
        ix = extra.global_indices(step * ppo.dynamic_sampling_max_rounds + round_ - 1)[mesh.rank::mesh.world_size]
        return [prompt_ids[i] for i in ix], [data.train[i] for i in ix]

    def evaluate(step):
        if data.gold is None:
            return
        res = evaluate_gold(hybrid.generate, tokenizer, data.eval, data.gold, cfg.eval, mesh, chat, cfg.logger.progress)
        if not res:  # eval.gold_prompts=0
            return
        metrics.log(step, **res)
        log.info("step %d: %s", step, " ".join(f"{k}={v:.4f}" for k, v in res.items()))

    log.info("ppo (%s): %d prompts (%s), %d steps × %d prompts × %d samples, %d epochs × %d minibatches",
             alg.estimator, len(prompt_ids), data.description, train.max_steps, ppo.prompts_per_step,
             ppo.samples_per_prompt,
             ppo.ppo_epochs, ppo.minibatches_per_epoch)
    if start == 0:
        evaluate(0)
    def checkpoint(step):
        return save_checkpoint(ctx.ckpt_dir, step, engines, {"stage": "ppo", "fingerprint": ctx.fingerprint,
                                                             "kl": kl_ctl.state_dict(),
                                                             "running": scorers.running.state_dict()},
                               mesh, keep=train.keep_checkpoints, extra=ema.save if ema is not None else None)

    skipped = 0
    bar = progress(train.max_steps, start, cfg.logger.progress, "ppo", mesh.is_main)
    stop = interrupt.listen()  # a first Ctrl-C / SIGTERM: checkpoint at the end of the step, then exit
    for step in range(start, train.max_steps):
        # ---- experience: generate in inference mode, then score in training mode ----
        t0 = time.perf_counter()
        idx = batches.global_indices(step)[mesh.rank::mesh.world_size]
        sp = SamplingParams(temperature=ppo.temperature, top_k=ppo.top_k, top_p=ppo.top_p,
                            max_new_tokens=ppo.max_new_tokens, min_new_tokens=ppo.min_new_tokens,
                            samples_per_prompt=ppo.samples_per_prompt,
                            seed=seeding.nested(cfg.run.seed, step, seeding.ROLLOUT))
        exp = experience.collect(hybrid, actor, scorers, [prompt_ids[i] for i in idx], [data.train[i] for i in idx],
                                 sp, alg, ppo, kl_ctl.beta, tokenizer, mesh, more=lambda r: extra_prompts(step, r))
        t1 = time.perf_counter()

        # ---- updates: PPO epochs over minibatches in training mode ----
        ptx_term = (lambda update, rows: ptx.loss(actor, ptx_data, update, rows, cfg.run.seed, tokenizer, mesh)
                    ) if ptx_data is not None else None
        minibatch_order = seeding.offset(cfg.run.seed, step, seeding.MINIBATCH)
        shuffle = torch.Generator(device="cpu").manual_seed(minibatch_order)
        try:
            train_stats, skipped = ppo_update(
                exp, actor, critic, alg, ppo, kl_ctl.beta, shuffle, mesh, ptx_loss=ptx_term,
                first_update=step * updates_per_step, skipped_in_a_row=skipped,
                on_epoch_end=ema.update if ema is not None else None)
        except Diverged as e:
            raise UserError(f"ppo: {e} at step {step + 1}; stopping (the last good checkpoint is kept)") from None
        t2 = time.perf_counter()

        # ---- log, evaluate, checkpoint ----
        done = step + 1
        row = step_metrics(exp, alg, exp.timings, t1 - t0, t2 - t1, mesh)
        kl_ctl.update(row["kl/mean"], ppo.prompts_per_step * ppo.samples_per_prompt)
        row.update({"kl/beta": kl_ctl.beta, **train_stats})
        if done % train.log_every == 0 or step == start or done == train.max_steps:
            metrics.log(done, **row)
        bar.step(reward=f"{row['reward/mean']:.3f}", kl=f"{row['kl/mean']:.3f}")
        end_of_step(done, train, stop, mesh, checkpoint, evaluate)
    bar.close()
    stop.close()

    # ---- export ----
    evaluate(train.max_steps)
    export_hf(actor, ctx.out / "actor", mesh, tokenizer=tokenizer, adapter_dir=ctx.out / "adapter")
    if critic is not None:
        export_hf(critic, ctx.out / "critic", mesh, tokenizer=tokenizer, adapter_dir=ctx.out / "critic_adapter")
    if ema is not None:
        ema.export(ctx.out / "actor_ema", tokenizer)
    metrics.close()
    mark_finished(ctx, train.max_steps)
    log.info("ppo done: %s", ctx.out / "actor")
    shutdown(mesh)


def inputs(cfg: Config):
    """(actor source, reward-model dir or None, critic dir or None): the SFT output (or model.path or
    ppo.actor_path), the reward model (ppo.reward_model_path or the reward stage's output) and the
    critic's start (ppo.critic_path or the reward model)."""
    ppo, alg = cfg.ppo, cfg.algorithm
    actor_src = stage_input(cfg, ppo.actor_path, "ppo.actor_path", "ppo")
    gae = alg.estimator == "gae"
    if not ppo.use_reward_model and not ppo.reward_fn:
        raise ConfigError("ppo.use_reward_model=false needs a rule reward: set ppo.reward_fn (e.g. rlhf.rewards.gold)")
    if ppo.critic_path and not gae:
        raise ConfigError(f"ppo.critic_path={ppo.critic_path} is set but algorithm.estimator={alg.estimator} "
                          f"has no critic (only gae does)")
    # GAE's critic starts as the reward model unless it has a start of its own
    needs_rm = ppo.use_reward_model or (gae and not ppo.critic_path)
    rm_src = None
    if ppo.reward_model_path and not needs_rm:
        raise ConfigError(f"ppo.reward_model_path={ppo.reward_model_path} is set but nothing uses it "
                          f"(ppo.use_reward_model=false, and the critic starts from ppo.critic_path or there is none)")
    if ppo.reward_model_path:
        loading.check_scalar_model(ppo.reward_model_path, "ppo.reward_model_path")
        rm_src = Path(ppo.reward_model_path).expanduser()
    elif needs_rm:
        rm_src = previous_output(cfg.run.dir, "reward", "model")
        if rm_src is None:
            raise ConfigError(f"no reward model in {cfg.run.dir}/reward/model: run stage=reward first, set "
                              f"ppo.reward_model_path, or use algorithm.estimator=grpo ppo.use_reward_model=false "
                              f"ppo.reward_fn=...")
    critic_src = None
    if ppo.critic_path:
        loading.check_scalar_model(ppo.critic_path, "ppo.critic_path")
        critic_src = Path(ppo.critic_path).expanduser()
    elif gae:
        critic_src = rm_src
    loading.check_model_path(str(actor_src), "ppo.actor_path" if ppo.actor_path else "model.path")
    if needs_rm:
        log.info("ppo: reward model %s%s", rm_src, "" if ppo.use_reward_model else " (ppo.use_reward_model=false: the critic's start only)")
    if critic_src is not None:
        log.info("ppo: critic starts from %s", critic_src)
    return str(actor_src), rm_src, critic_src


def scalar_model(cfg: Config, src, mesh, tokenizer, scale: float = 1.0, lcfg=None,
                 role: str = "reward model") -> ScalarHeadModel:
    """The reward model's architecture and weights as a scalar-head model (the critic's head scaled;
    ``lcfg``: LoRA adapters on its backbone, the head fully trained; dropout per model.disable_dropout)."""
    model_cfg = loading.load_model_config(str(src), cfg.model.trust_remote_code)
    model = loading.build_model(AutoModelForSequenceClassification, config=model_cfg, path=str(src),
                                on_meta=not mesh.is_main, trust_remote_code=cfg.model.trust_remote_code,
                                tokenizer=tokenizer, disable_dropout=cfg.model.disable_dropout, role=role)
    if scale != 1.0 and mesh.is_main:
        with torch.no_grad():
            head_module(model).weight.mul_(scale)
    if lcfg is not None:
        model = lora.adapt(model, lcfg, cfg.run.seed + 1, head=head_name(model), what="critic")
    return ScalarHeadModel(model)


def step_metrics(exp, alg, timings: dict, collect_s: float, train_s: float, mesh) -> dict:
    """The step's metrics.jsonl line (global means over ranks), before the KL controller's β and
    the update statistics."""
    rows = mesh.sum(exp.rows)
    # the k1 estimate whatever the penalty uses
    kl = (exp.kl if ppo_math.kl_kind(alg) == "k1"
          else ppo_math.kl_penalty(exp.old_logprobs, exp.ref_logprobs, "k1") * exp.mask)
    kl_seq = mesh.sum(float(kl.sum(1).sum())) / rows
    gen_s = timings.get("generate_s", collect_s)
    gen_tokens = mesh.sum(float(exp.mask.sum()))
    row = {"reward/mean": mesh.sum(float(exp.scores.sum())) / rows, "kl/mean": kl_seq,
           "response/length": gen_tokens / rows, "time/generate_s": gen_s,
           "time/switch_s": timings.get("switch_s", 0.0), "time/score_s": exp.score_s,
           "time/train_s": train_s, "gen/tokens_per_s": gen_tokens / max(gen_s, 1e-9)}
    for name, part in exp.score_parts.items():
        row[f"reward/{name}"] = mesh.sum(float(part.sum())) / rows
    row.update(exp.extra_metrics or {})
    if exp.gold is not None:  # how the reward the policy optimises tracks the truth (reward hacking shows here)
        row["reward/gold"] = mesh.sum(float(exp.gold.sum())) / rows
        if "model" in exp.score_parts:
            row["reward/gold_corr"] = global_corr(exp.score_parts["model"], exp.gold, mesh)
    if exp.rollout_logprobs is not None:  # what the inference mode sampled with vs the training recompute
        tokens = max(gen_tokens, 1.0)
        diff = (exp.old_logprobs - exp.rollout_logprobs).abs() * exp.mask
        row["rollout/logprob_abs_diff_mean"] = mesh.sum(float(diff.sum())) / tokens
        row["rollout/logprob_abs_diff_max"] = max(mesh.all_gather_object(float(diff.max())))
        k3 = ppo_math.kl_penalty(exp.rollout_logprobs, exp.old_logprobs, "k3") * exp.mask  # KL(rollout ‖ train)
        row["rollout/kl"] = mesh.sum(float(k3.sum())) / tokens
    if exp.values is not None:
        row["values/explained_var"] = float(ppo_math.explained_variance(exp.values, exp.returns, exp.mask))
    return row


def global_corr(x, y, mesh) -> float:
    """Pearson correlation of x and y over every rank's rows (0 when either is constant)."""
    sums = [mesh.sum(float(v)) for v in (x.numel(), x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum())]
    n, sx, sy, sxx, syy, sxy = sums
    cov, vx, vy = sxy - sx * sy / n, sxx - sx * sx / n, syy - sy * sy / n
    return cov / (vx * vy) ** 0.5 if vx > 1e-12 and vy > 1e-12 else 0.0
