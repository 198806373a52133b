"""Step 3: RLHF with PPO on the hybrid engine (or a critic-free estimator: GRPO, RLOO, REINFORCE++).

    python -m rlhf stage=ppo [run.dir=D] [algorithm.estimator=gae|grpo|rloo|reinforce_pp]

Setup (prompts, actor + hybrid engine, reference, critic, reward model, resume) → loop (generate
experience in inference mode; score; KL-shaped rewards; advantages; PPO epochs over minibatches in
ZeRO-3 training mode) → save (gold score, HF exports of actor, critic and EMA actor).
"""
from __future__ import annotations

import json
import logging
import time

from rlhf.config import Config
from rlhf.data.pipeline import load_stage_data
from rlhf.data.sampler import GlobalBatches
from rlhf.engine.checkpoint import export_hf, latest_checkpoint, save_checkpoint
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.mesh import shutdown
from rlhf.engine.train import FrozenModel, TrainEngine
from rlhf.errors import ConfigError, UserError
from rlhf.evaluation import gold_score
from rlhf.logging import progress
from rlhf.models import loading
from rlhf.runtime import check_writable, previous_output, resume, start_stage

log = logging.getLogger("rlhf")


class Diverged(UserError):
    pass


def run(cfg: Config) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf.algorithms import ppo as A
    from rlhf.models.value import ScalarHeadModel, head_module
    from rlhf.ops import SamplingParams
    from rlhf.rewards import resolve

    ctx = start_stage(cfg, "ppo")
    mesh, t, p, alg = ctx.mesh, cfg.train, cfg.ppo, cfg.algorithm
    check_writable(cfg.run.dir)

    # ---- setup: everything is validated before anything is written ----
    actor_src = cfg.model.path or previous_output(cfg.run.dir, "sft", "model")
    if actor_src is None:
        raise ConfigError(f"no SFT model in {cfg.run.dir}/sft/model: run stage=sft first or set model.path")
    needs_critic = alg.estimator == "gae"
    use_rm = p.use_reward_model
    rm_src = previous_output(cfg.run.dir, "reward", "model") if (use_rm or needs_critic) else None
    if (use_rm or needs_critic) and rm_src is None:
        raise ConfigError(f"no reward model in {cfg.run.dir}/reward/model: run stage=reward first "
                          f"(or use algorithm.estimator=grpo ppo.use_reward_model=false ppo.reward_fn=...)")
    if not use_rm and not p.reward_fn:
        raise ConfigError("ppo.use_reward_model=false needs a rule reward: set ppo.reward_fn (e.g. rlhf.rewards.gold)")
    rule = resolve(p.reward_fn) if p.reward_fn else None
    actor_src = str(actor_src)
    loading.check_model_path(actor_src)
    data = load_stage_data(cfg.data, "ppo", cfg.run.seed)
    if len(data.train) < p.prompts_per_step:
        raise UserError(f"data ({data.description}): {len(data.train)} prompts, fewer than one step "
                        f"(ppo.prompts_per_step={p.prompts_per_step})")
    if p.prompts_per_step % mesh.world_size:
        raise ConfigError(f"ppo.prompts_per_step={p.prompts_per_step} is not divisible by the world size "
                          f"{mesh.world_size}")
    tokenizer = loading.load_tokenizer(actor_src, cfg.model.trust_remote_code)
    prompt_ids = [x[-cfg.data.max_prompt_len:] for x in
                  tokenizer([e.prompt for e in data.train], add_special_tokens=True)["input_ids"]]
    ptx = None
    if alg.ptx_coef > 0:  # PPO-ptx: keep a language-model loss on the SFT share of the data
        from rlhf.data.tokenize import cached, tokenize_sft
        sft_data = load_stage_data(cfg.data, "sft", cfg.run.seed)
        if sft_data.train[0].response is None:
            raise ConfigError(f"algorithm.ptx_coef needs SFT responses, and data.format={fmt_name(cfg)} has none")
        lens = dict(max_prompt=cfg.data.max_prompt_len, max_response=cfg.data.max_response_len)
        ptx = cached("sft", sft_data.train, tokenizer, lens, ctx.cache_dir, mesh,
                     lambda: tokenize_sft(sft_data.train, tokenizer, **lens))
    stats = {"mean": 0.0, "std": 1.0}
    if rm_src is not None and (rm_src / "reward_stats.json").is_file():
        stats = json.loads((rm_src / "reward_stats.json").read_text())

    def causal_lm():
        cfg_ = loading.load_config(actor_src, cfg.model.trust_remote_code)
        return loading.build_model(AutoModelForCausalLM, config=cfg_, path=actor_src, on_meta=not mesh.is_main,
                                   trust_remote_code=cfg.model.trust_remote_code)

    def scalar_model(scale: float = 1.0):
        cfg_ = loading.load_config(str(rm_src), cfg.model.trust_remote_code)
        model = loading.build_model(AutoModelForSequenceClassification, config=cfg_, path=str(rm_src),
                                    on_meta=not mesh.is_main, trust_remote_code=cfg.model.trust_remote_code)
        if scale != 1.0 and mesh.is_main:
            with torch.no_grad():
                head_module(model).weight.mul_(scale)
        return ScalarHeadModel(model)

    updates_per_step = p.ppo_epochs * p.minibatches_per_epoch
    actor = TrainEngine(causal_lm(), mesh, cfg.engine, t, total_steps=t.max_steps * updates_per_step)
    hybrid = HybridEngine(actor, tokenizer, cfg.engine)
    ref = FrozenModel(causal_lm(), mesh, cfg.engine)
    # The critic starts as the reward model, rescaled to the normalised rewards it will predict.
    critic_scale = 1.0 / max(stats["std"], 1e-8) if alg.reward_norm == "stats" else 1.0
    critic = (TrainEngine(scalar_model(critic_scale), mesh, cfg.engine, t, total_steps=t.max_steps * updates_per_step,
                          lr=p.critic_lr) if needs_critic else None)
    reward_model = FrozenModel(scalar_model(), mesh, cfg.engine) if use_rm else None
    ema = EMA(actor, p.ema_decay) if p.ema_decay else None
    kl_ctl = A.AdaptiveKL(alg.kl_coef, alg.kl_target, alg.kl_horizon)
    running = A.RunningMoments()
    engines = {"actor": actor, **({"critic": critic} if critic is not None else {})}

    ckpt = latest_checkpoint(ctx.ckpt_dir) if cfg.run.resume else None
    start, state, metrics = resume(ctx, engines, ckpt)
    skipped_in_a_row = 0
    if ckpt is not None:
        kl_ctl.load_state_dict(state["kl"])
        running.load_state_dict(state["running"])
        if ema is not None:
            ema.load(ckpt)
    batches = GlobalBatches(len(prompt_ids), p.prompts_per_step, cfg.run.seed)
    n = p.samples_per_prompt
    fmt = cfg.data.source_list()[0].format
    temp = p.temperature if p.temperature > 0 else 1.0  # log-probs of greedy rollouts: temperature 1

    def evaluate(step):
        if data.gold is None:
            return {}
        res = gold_score(hybrid.generate, tokenizer, data.eval, data.gold, cfg.eval, mesh)
        metrics.log(step, **res)
        log.info("step %d: %s", step, " ".join(f"{k}={v:.4f}" for k, v in res.items()))
        return res

    log.info("ppo (%s): %d prompts (%s), %d steps × %d prompts × %d samples, %d epochs × %d minibatches",
             alg.estimator, len(prompt_ids), data.description, t.max_steps, p.prompts_per_step, n, p.ppo_epochs,
             p.minibatches_per_epoch)
    if start == 0:
        evaluate(0)
    bar = progress(t.max_steps, start, cfg.logger.progress and mesh.is_main, "ppo")
    for step in range(start, t.max_steps):
        # ---- experience: generate in inference mode, then score in training mode ----
        t0 = time.perf_counter()
        idx = batches.global_indices(step)[mesh.rank::mesh.world_size]
        sp = SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                            max_new_tokens=p.max_new_tokens, min_new_tokens=p.min_new_tokens, n=n,
                            seed=cfg.run.seed * 7919 + step)
        gen = hybrid.generate([prompt_ids[i] for i in idx], sp)
        timings = dict(hybrid.timings)
        t1 = time.perf_counter()
        seq, att, mask, P = gen.sequences, gen.attention_mask, gen.response_mask.float(), gen.prompt_len
        examples = [data.train[i] for i in idx for _ in range(n)]
        with torch.no_grad():
            old_logp = logprobs_of(actor, seq, att, P, temp)
            ref_logp = logprobs_of(ref, seq, att, P, temp)
            values = critic_values(critic, seq, att, P) * mask if critic is not None else None
            score = torch.zeros(seq.shape[0])
            if reward_model is not None:
                from rlhf.models.value import sequence_scores
                raw = sequence_scores(reward_model.forward(input_ids=seq, attention_mask=att), att)
                if alg.reward_norm == "stats":
                    raw = (raw - stats["mean"]) / max(stats["std"], 1e-8)
                elif alg.reward_norm == "running":
                    running.update(torch.tensor(mesh.all_gather_object(raw.tolist())).flatten())
                    raw = (raw - running.mean) / running.std
                score = score + raw
            if rule is not None:
                texts = tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(gen.responses, mask)],
                                               skip_special_tokens=True)
                score = score + p.reward_fn_weight * torch.tensor(rule(texts, examples, fmt), dtype=torch.float32)
            ended = (gen.responses == tokenizer.eos_token_id).any(1)
            score = score + alg.no_eos_penalty * (~ended).float()
            kl = A.kl_penalty(old_logp, ref_logp, alg.kl_estimator) * mask
            adv, returns = advantages(A, alg, score, kl, values, mask, n, kl_ctl.beta, mesh)
        t2 = time.perf_counter()

        # ---- updates: PPO epochs over minibatches in training mode ----
        actor.train()
        if critic is not None:
            critic.train()
        stats_acc = {}
        g = torch.Generator().manual_seed(cfg.run.seed + 31 * step)
        update = step * updates_per_step
        rows = seq.shape[0]
        global_ids = global_rows(rows, n, mesh)
        for _ in range(p.ppo_epochs):
            for mb, weight in minibatches(global_ids, p.prompts_per_step * n, p.minibatches_per_epoch, g):
                mask_mb = mask[mb] * weight  # a rank with no row here runs one zero-weight row (collectives)
                tokens = mesh.sum(float(mask_mb.sum()))
                logits = actor.forward(input_ids=seq[mb], attention_mask=att[mb],
                                       position_ids=_positions(att[mb])).logits[:, P - 1:-1].float()
                logp = torch.log_softmax(logits / temp, -1).gather(-1, seq[mb, P:, None]).squeeze(-1)
                pl, st = A.policy_loss(logp, old_logp[mb], adv[mb], mask_mb, alg.clip_ratio, alg.dual_clip,
                                       normalizer=tokens / mesh.world_size)
                loss = pl
                if alg.estimator == "grpo":  # GRPO keeps the KL out of the reward, as a loss term
                    kl_term = A.kl_penalty(logp, ref_logp[mb], "k3")
                    loss = loss + kl_ctl.beta * (kl_term * mask_mb).sum() / (tokens / mesh.world_size)
                ent = (A.entropy_from_logits(logits.detach()) * mask_mb).sum() / max(float(mask_mb.sum()), 1)
                if alg.entropy_coef:
                    loss = loss - alg.entropy_coef * (A.entropy_from_logits(logits) * mask_mb).sum() / (
                        tokens / mesh.world_size)
                if ptx is not None:
                    ptx_loss = ptx_term(actor, ptx, update, len(mb) * mesh.world_size, cfg.run.seed, tokenizer, mesh)
                    loss = loss + alg.ptx_coef * ptx_loss
                    _acc(stats_acc, {"ptx/loss": float(ptx_loss.detach()) / mesh.world_size})
                update += 1
                ok = mesh.sum(float(torch.isfinite(loss))) == mesh.world_size
                if ok:
                    actor.backward(loss)
                    ok = _finite(actor.step())
                _acc(stats_acc, {"actor/loss": float(pl.detach()), "clipfrac": float(st["clipfrac"]),
                                 "approx_kl": float(st["approx_kl"]), "entropy": float(ent)})
                skipped_in_a_row = 0 if ok else skipped_in_a_row + 1
                if not ok:
                    stats_acc["nonfinite_skipped"] = stats_acc.get("nonfinite_skipped", 0) + 1
                if critic is not None:
                    v = critic_values(critic, seq[mb], att[mb], P)
                    vl = A.value_loss(v, values[mb], returns[mb], mask_mb, alg.value_clip,
                                      normalizer=tokens / mesh.world_size)
                    if mesh.sum(float(torch.isfinite(vl))) == mesh.world_size:
                        critic.backward(vl)
                        critic.step()
                    _acc(stats_acc, {"critic/loss": float(vl.detach())})
                if skipped_in_a_row >= p.max_nonfinite_in_a_row:
                    raise Diverged(f"ppo: {skipped_in_a_row} updates in a row had a non-finite loss or gradient "
                                   f"at step {step + 1}; stopping (the last good checkpoint is kept)")
            if ema is not None:
                ema.update()
        t3 = time.perf_counter()

        # ---- log, evaluate, checkpoint ----
        done = step + 1
        kl_seq = mesh.sum(float(kl.sum(1).sum())) / mesh.sum(rows) if alg.kl_estimator == "k1" else \
            mesh.sum(float((A.kl_penalty(old_logp, ref_logp, "k1") * mask).sum())) / mesh.sum(rows)
        kl_ctl.update(kl_seq, p.prompts_per_step * n)
        gen_tokens = mesh.sum(float(mask.sum()))
        row = {"reward/mean": mesh.sum(float(score.sum())) / mesh.sum(rows), "kl/mean": kl_seq,
               "kl/beta": kl_ctl.beta, "response/length": gen_tokens / mesh.sum(rows),
               "time/generate_s": timings.get("generate_s", t1 - t0), "time/switch_s": timings.get("switch_s", 0.0),
               "time/score_s": t2 - t1, "time/train_s": t3 - t2,
               "gen/tokens_per_s": gen_tokens / max(timings.get("generate_s", t1 - t0), 1e-9),
               **{k: mesh.sum(v[0]) / mesh.sum(v[1]) if isinstance(v, list) else v for k, v in stats_acc.items()}}
        if critic is not None:
            row["values/explained_var"] = float(A.explained_variance(values, returns, mask))
        if done % t.log_every == 0 or step == start or done == t.max_steps:
            metrics.log(done, **row)
        bar.update(1)
        bar.set_postfix(reward=f"{row['reward/mean']:.3f}", kl=f"{kl_seq:.3f}")
        if t.eval_every and done % t.eval_every == 0 and done != t.max_steps:
            evaluate(done)
        if t.save_every and done % t.save_every == 0:
            path = save_checkpoint(ctx.ckpt_dir, done, engines,
                                   {"stage": "ppo", "kl": kl_ctl.state_dict(), "running": running.state_dict()},
                                   mesh, keep=t.keep_checkpoints)
            if ema is not None:
                ema.save(path)
    bar.close()

    # ---- save ----
    evaluate(t.max_steps)
    export_hf(actor, ctx.out / "actor", mesh, tokenizer=tokenizer)
    if critic is not None:
        export_hf(critic, ctx.out / "critic", mesh, tokenizer=tokenizer)
    if ema is not None:
        ema.export(ctx.out / "actor_ema", tokenizer)
    metrics.close()
    log.info("ppo done: %s", ctx.out / "actor")
    shutdown(mesh)


def fmt_name(cfg) -> str:
    return cfg.data.source_list()[0].format


def ptx_term(actor, cols, update: int, batch: int, seed: int, tokenizer, mesh):
    """The SFT loss on this update's global batch of SFT records (token-weighted over all ranks,
    scaled for the data-parallel average)."""
    from rlhf.algorithms.logprobs import shifted_nll_sum
    from rlhf.data.sampler import GlobalBatches
    from rlhf.data.tokenize import collate_sft
    ix = GlobalBatches(len(cols["ids"]), batch, seed + 17).global_indices(update)[mesh.rank::mesh.world_size]
    b = collate_sft([cols["ids"][i] for i in ix], [cols["prompt_len"][i] for i in ix], tokenizer.pad_token_id, True)
    n_tokens = mesh.sum(int((b["labels"][:, 1:] != -100).sum()))
    logits = actor.forward(input_ids=b["input_ids"].to(mesh.device),
                           attention_mask=b["attention_mask"].to(mesh.device)).logits
    nll, _ = shifted_nll_sum(logits, b["labels"].to(mesh.device))
    return nll / max(n_tokens, 1) * mesh.world_size


def global_rows(rows: int, n: int, mesh):
    """Global index of each local experience row: rank r holds prompts r, r+W, r+2W, ... (n rows each)."""
    import torch
    j = torch.arange(rows)
    return ((j // n) * mesh.world_size + mesh.rank) * n + j % n


def minibatches(global_ids, total_rows: int, count: int, generator):
    """This rank's rows of each global minibatch of a seeded shuffle of all rows, so that N ranks
    update on exactly the minibatches one process would. Yields (local row indices, weight)."""
    import torch
    perm = torch.randperm(total_rows, generator=generator)
    where = {int(gid): i for i, gid in enumerate(global_ids)}
    for chunk in perm.chunk(count):
        local = [where[int(x)] for x in chunk if int(x) in where]
        if local:
            yield torch.tensor(local), 1.0
        else:
            yield torch.tensor([0]), 0.0


def _positions(att):
    from rlhf.models.value import position_ids
    return position_ids(att)


def _finite(x: float) -> bool:
    import math
    return math.isfinite(x)


def _acc(acc: dict, vals: dict) -> None:
    for k, v in vals.items():
        s = acc.setdefault(k, [0.0, 0.0])
        s[0] += v
        s[1] += 1.0


def logprobs_of(model, seq, att, P, temperature):
    from rlhf.engine.logprobs import response_logprobs
    return response_logprobs(model.forward, seq, att, P, temperature)


def critic_values(critic, seq, att, P):
    """V(s_t) for each response token t: the value at the position just before it."""
    return critic.forward(input_ids=seq, attention_mask=att)[:, P - 1:-1]


def advantages(A, alg, score, kl, values, mask, n, beta, mesh):
    """(advantages, returns) for the configured estimator; whitening uses global statistics."""
    if alg.estimator == "gae":
        rewards = A.token_rewards(score, kl, mask, beta, alg.reward_clip)
        adv, returns = A.gae(rewards, values, mask, alg.gamma, alg.lam)
    elif alg.estimator == "grpo":
        clip = alg.reward_clip
        adv = A.grpo_advantages(score.clamp(-clip, clip) if clip else score, n, mask)
        return adv, None
    elif alg.estimator == "rloo":
        adv = A.rloo_advantages(score - beta * kl.sum(1), n, mask)
        return (global_whiten(adv, mask, mesh) if alg.whiten_advantages else adv), None
    else:  # reinforce_pp: token-level KL-shaped returns, whitened over the global batch
        rewards = A.token_rewards(score, kl, mask, beta, alg.reward_clip)
        return global_whiten(A.discounted_returns(rewards, mask, alg.gamma), mask, mesh), None
    if alg.whiten_advantages:
        adv = global_whiten(adv, mask, mesh)
    return adv, returns


def global_whiten(x, mask, mesh, eps: float = 1e-8):
    """Whitening with the mean and variance of the whole global batch (so N ranks ≡ 1)."""
    import torch
    s = torch.tensor([float((x * mask).sum()), float(mask.sum())], dtype=torch.float64)
    s = mesh.all_reduce(s)
    mean = s[0] / s[1].clamp(min=1)
    v = torch.tensor([float((((x - mean) ** 2) * mask).sum())], dtype=torch.float64)
    var = mesh.all_reduce(v)[0] / s[1].clamp(min=1)
    return ((x - mean.float()) * torch.rsqrt(var.float() + eps)) * mask


class EMA:
    """Exponential moving average of the actor's (possibly sharded) parameters."""

    def __init__(self, engine, decay: float):
        self.engine, self.decay = engine, decay
        self.shadow = {n: p.detach().clone() for n, p in engine.model.named_parameters()}

    def update(self) -> None:
        import torch
        with torch.no_grad():
            for n, p in self.engine.model.named_parameters():
                self.shadow[n].lerp_(p.detach(), 1.0 - self.decay)

    def _full(self) -> dict:
        out = {}
        for n, t in self.shadow.items():
            out[n] = t.full_tensor() if hasattr(t, "full_tensor") else t
        return out

    def save(self, ckpt_path) -> None:
        from safetensors.torch import save_file
        full = {k: v.contiguous() for k, v in self._full().items()}
        if self.engine.mesh.is_main:
            save_file(full, str(ckpt_path / "actor_ema.safetensors"))
        self.engine.mesh.barrier()

    def load(self, ckpt_path) -> None:
        from safetensors.torch import load_file
        f = ckpt_path / "actor_ema.safetensors"
        if not f.is_file():
            return
        full = load_file(str(f))
        for n, t in self.shadow.items():
            src = full[n].to(t.device if not hasattr(t, "to_local") else t.to_local().device)
            if hasattr(t, "to_local"):
                from torch.distributed.tensor import distribute_tensor
                t.copy_(distribute_tensor(src, t.device_mesh, t.placements))
            else:
                t.copy_(src)

    def export(self, out_dir, tokenizer) -> None:
        from rlhf.fileio import replace_dir, temp_dir_for
        full = self._full()
        mesh = self.engine.mesh
        if mesh.is_main:
            module = self.engine.module
            tmp = temp_dir_for(out_dir)
            sd = {k.removeprefix("module."): v for k, v in full.items()}
            module.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            replace_dir(tmp, out_dir)
        mesh.barrier()
