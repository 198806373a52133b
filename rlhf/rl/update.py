"""The PPO update: epochs over global minibatches of the experience; within a minibatch, this
rank's rows in micro-batches with gradient accumulation, one optimizer step per minibatch.

Every loss term is a sum over the micro-batch's tokens divided by the token count of the whole
global minibatch (over ranks, before splitting), so the update does not depend on the micro-batch
size or the world size. A rank with fewer rows runs zero-weight rows so that every rank makes the
same number of (collective) forwards.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from rlhf.algorithms import ppo as ppo_math
from rlhf.engine.logprobs import response_stats
from rlhf.rl.experience import Experience, critic_values, micro_rows
from rlhf.rl.minibatch import global_rows, micro_batches, minibatches


class Diverged(Exception):
    """Too many updates in a row had a non-finite loss or gradient."""


class Stats:
    """Sums and counts per key, averaged over ranks at the end (``mean``)."""

    def __init__(self):
        self.acc: dict = {}

    def add(self, key: str, value: float, count: float = 1.0) -> None:
        s = self.acc.setdefault(key, [0.0, 0.0])
        s[0] += value
        s[1] += count

    def means(self, mesh) -> dict:
        return {k: mesh.sum(v[0]) / mesh.sum(v[1]) for k, v in self.acc.items()}


def ppo_update(exp: Experience, actor, critic, alg, ppo, kl_beta: float, generator: torch.Generator, mesh,
               ptx_loss: Optional[Callable[[int, int], torch.Tensor]] = None, first_update: int = 0,
               skipped_in_a_row: int = 0, on_epoch_end: Optional[Callable[[], None]] = None):
    """``ppo.ppo_epochs`` × ``ppo.minibatches_per_epoch`` updates of the actor (and critic) on ``exp``.
    ``ptx_loss(update, global_rows)``: the PPO-ptx language-model loss of that update, or None.
    Returns (stats: key -> mean over updates and ranks, skipped-in-a-row count). Raises ``Diverged``."""
    actor.train()
    if critic is not None:
        critic.train()
    stats = Stats()
    ids = global_rows(exp.rows, exp.samples_per_prompt, mesh.rank, mesh.world_size)
    total_rows = exp.rows * mesh.world_size
    # Training forwards compute the logits of every position: asking for the response positions only
    # (logits_to_keep) gives the same forward but sums the LM head's weight gradient in another
    # order, and fixed-seed numbers are a contract.
    keep = False
    micro = micro_rows(actor, exp.rows, exp.sequences.shape[1], ppo.micro_batch_per_rank)
    update = first_update
    for _ in range(ppo.ppo_epochs):
        for mb in minibatches(ids, total_rows, ppo.minibatches_per_epoch, exp.samples_per_prompt, mesh.world_size,
                              generator):
            parts = [(r, mb.weight) if len(r) else (mb.rows[:1], 0.0) for r in micro_batches(mb.rows, micro, mb.most)]
            normalizer, token_normalizer = _normalizer(exp, mb, alg, ppo, mesh)
            ptx = (lambda u=update, n=mb.global_size: ptx_loss(u, n)) if ptx_loss else None
            ok = _actor_step(exp, actor, parts, normalizer, alg, kl_beta, ppo.temperature, keep, stats, mesh, ptx)
            update += 1
            skipped_in_a_row = 0 if ok else skipped_in_a_row + 1
            if not ok:
                stats.acc["nonfinite_skipped"] = stats.acc.get("nonfinite_skipped", 0) + 1
            if critic is not None:
                _critic_step(exp, critic, parts, token_normalizer, alg, stats, mesh)
            if skipped_in_a_row >= ppo.max_nonfinite_in_a_row:
                raise Diverged(f"{skipped_in_a_row} updates in a row had a non-finite loss or gradient")
        if on_epoch_end is not None:
            on_epoch_end()
    means = stats.means(mesh)
    if "nonfinite_skipped" in stats.acc:  # a count, not a mean (the same on every rank)
        means["nonfinite_skipped"] = stats.acc["nonfinite_skipped"]
    return means, skipped_in_a_row


def _normalizer(exp, mb, alg, ppo, mesh) -> float:
    """The global minibatch's loss denominators over the world size (data-parallel ranks average their
    gradients), computed before the minibatch is split into micro-batches: the actor's
    (algorithm.loss_agg) and the critic's (a token mean)."""
    lm = exp.loss_mask[mb.rows] * mb.weight
    tokens = mesh.sum(float(lm.sum()))
    seqs = mesh.sum(float((lm.sum(1) > 0).sum())) if alg.loss_agg != "token_mean" else 0.0
    norm_tokens = alg.loss_norm_tokens or ppo.max_new_tokens
    return (ppo_math.loss_denominator(alg.loss_agg, tokens, seqs, norm_tokens) / mesh.world_size,
            tokens / mesh.world_size)


def clip_low(alg) -> float:
    return alg.clip_ratio if alg.clip_ratio_low is None else alg.clip_ratio_low


def _all_finite(x: torch.Tensor, mesh) -> bool:
    return mesh.sum(float(torch.isfinite(x))) == mesh.world_size


def _actor_step(exp, actor, parts, normalizer, alg, kl_beta, temp, keep, stats, mesh, ptx) -> bool:
    """Forward/backward of each micro-batch, then one optimizer step; False when skipped (non-finite)."""
    seq, att, prompt_len = exp.sequences, exp.attention_mask, exp.prompt_len
    loss_sum, sums, ok = 0.0, None, True  # sums: clipped tokens, Σ approx-KL, tokens, Σ entropy
    for i, (r, w) in enumerate(parts):
        mask = exp.loss_mask[r] * w
        weights = ppo_math.loss_weights(mask, alg.loss_agg)  # token_mean: the mask itself
        pg_weights = weights
        if alg.mismatch_correction != "none" and exp.rollout_logprobs is not None:
            correction = ppo_math.mismatch_weights(exp.old_logprobs[r], exp.rollout_logprobs[r], mask,
                                            alg.mismatch_correction, alg.tis_cap)
            pg_weights = weights * correction
            stats.add("rollout/correction_mean", float((correction * mask).sum()), float(mask.sum()))
        logp, ent = response_stats(actor.forward, seq[r], att[r], prompt_len, temp, keep_logits=keep,
                                   entropy="loss" if alg.entropy_coef else "metric")
        pl, st = ppo_math.policy_loss(logp, exp.old_logprobs[r], exp.advantages[r], mask, clip_low(alg), alg.dual_clip,
                               normalizer=normalizer, clip_high=alg.clip_ratio_high, weights=pg_weights)
        loss = pl
        if alg.estimator == "grpo" and kl_beta:  # GRPO keeps the KL out of the reward, as a loss term
            kl_term = ppo_math.kl_penalty(logp, exp.ref_logprobs[r], ppo_math.kl_kind(alg))
            loss = loss + kl_beta * (kl_term * weights).sum() / normalizer
        if alg.entropy_coef:
            loss = loss - alg.entropy_coef * (ent * weights).sum() / normalizer
        last = i == len(parts) - 1
        if last and ptx is not None:
            ptx_l = ptx()
            loss = loss + alg.ptx_coef * ptx_l
            stats.add("ptx/loss", float(ptx_l.detach()) / mesh.world_size)
        part = torch.cat([st["sums"], (ent.detach() * mask).sum()[None]])
        sums = part if sums is None else sums + part
        loss_sum += float(pl.detach())
        if ok:
            ok = _all_finite(loss, mesh)
            if ok:
                actor.backward(loss, sync=last)
    if ok:
        ok = math.isfinite(actor.step())
    else:
        actor.optimizer.zero_grad(set_to_none=True)
    clipped, akl, tokens, ent_sum = sums
    stats.add("actor/loss", loss_sum)
    stats.add("clipfrac", float(clipped / tokens.clamp(min=1)))
    stats.add("approx_kl", float(akl / tokens.clamp(min=1)))
    stats.add("entropy", float(ent_sum / max(float(tokens), 1)))
    return ok


def _critic_step(exp, critic, parts, normalizer, alg, stats, mesh) -> None:
    seq, att, prompt_len = exp.sequences, exp.attention_mask, exp.prompt_len
    total, ok = 0.0, True
    for i, (r, w) in enumerate(parts):  # the value loss is a token mean (algorithm.loss_agg is the actor's)
        v = critic_values(critic, seq[r], att[r], prompt_len)
        vl = ppo_math.value_loss(v, exp.values[r], exp.returns[r], exp.loss_mask[r] * w, alg.value_clip,
                                 normalizer=normalizer)
        total += float(vl.detach())
        if ok:
            ok = _all_finite(vl, mesh)
            if ok:
                critic.backward(vl, sync=i == len(parts) - 1)
    if ok:
        critic.step()
    else:
        critic.optimizer.zero_grad(set_to_none=True)
    stats.add("critic/loss", total)
