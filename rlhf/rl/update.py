"""The PPO update: epochs over global minibatches of the experience; within a minibatch, this
rank's rows in micro-batches with gradient accumulation, one optimizer step per minibatch.

Every loss term is a sum over the micro-batch's tokens divided by the token count of the whole
global minibatch (over ranks, before splitting), so the update does not depend on the micro-batch
size (rows, or real tokens: ppo.max_tokens_per_micro_batch) or the world size. A rank with fewer
rows runs zero-weight rows so that every rank makes the same number of (collective) forwards.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from rlhf import seeding
from rlhf.algorithms import ppo as ppo_math
from rlhf.algorithms.estimators import estimator, kl_kind
from rlhf.algorithms.tokens import chunked_divergence, position_ids
from rlhf.config import AlgorithmConfig, PPOConfig
from rlhf.engine.logprobs import (
    keeps_logits,
    logits_stats,
    response_logits,
    scoring_temperature,
    spread,
    token_logits,
)
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import TrainEngine
from rlhf.models.lora import unwrap
from rlhf.models.moe import RouterLosses, RouterTerms, aux_loss_coef, replay_rows, routers
from rlhf.rl.ema import EMA
from rlhf.rl.experience import Experience, critic_values
from rlhf.rl.minibatch import (
    Minibatch,
    global_rows,
    live_rows,
    micro_batches,
    micro_rows,
    minibatches,
)
from rlhf.rl.sft_records import SftRecords

# a micro-batch: this rank's local rows and their weight (0: a stand-in row)
Part = Tuple[torch.Tensor, float]


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


class Updater:
    """The PPO update of each step: ``ppo.ppo_epochs`` × ``ppo.minibatches_per_epoch`` optimizer
    steps of the actor (and critic) on the step's experience, the PPO-ptx term on the last
    micro-batch of each, the EMA after each epoch. Owns what carries from step to step: the count of
    updates in a row that were skipped for a non-finite loss or gradient (``Diverged`` past
    ``ppo.max_nonfinite_in_a_row``)."""

    def __init__(
        self,
        actor: TrainEngine,
        critic: Optional[TrainEngine],
        alg: AlgorithmConfig,
        ppo: PPOConfig,
        mesh: Mesh,
        seed: int,
        records: Optional[SftRecords] = None,
        ema: Optional[EMA] = None,
        teacher=None,
    ):
        self.actor, self.critic, self.alg, self.ppo, self.mesh = actor, critic, alg, ppo, mesh
        # the SFT records of PPO-ptx (algorithm.ptx_coef) and GKD's dataset share
        self.seed, self.records, self.ema = seed, records, ema
        # GKD's (algorithm.gkd_coef > 0): a FrozenModel
        self.teacher = teacher
        self.kl_in_loss = estimator(alg).kl_in_loss
        self.updates_per_step = ppo.ppo_epochs * ppo.minibatches_per_epoch
        # ppo.lm_head=response: a padded forward's LM head over the response columns (the teacher
        # has the student's tokenizer and, in practice, its family)
        self.keep = keeps_logits(unwrap(actor.module))
        self.skipped_in_a_row = 0
        # a MoE actor's router terms in the update (none for a dense one)
        self.router = RouterTerms()
        if routers(actor.module):
            self.router = RouterTerms(
                aux_coef=aux_loss_coef(actor.module, alg.router_aux_loss_coef),
                z_coef=alg.router_z_loss_coef,
            )
        # ppo.update_rows=live: rows without an advantage are left out where no other term of the
        # loss reads every row (a MoE actor's routing depends on its micro-batch: all run)
        self.live_only = (
            ppo.update_rows == "live"
            and critic is None
            and not alg.entropy_coef
            and not alg.gkd_coef
            and not routers(actor.module)
        )

    def update(self, exp: Experience, step: int, kl_beta: float) -> Dict[str, float]:
        """The updates of step ``step`` (minibatches in a seeded order of their own); returns each
        statistic's mean over the updates and ranks. Raises ``Diverged``."""
        actor, critic, ppo, mesh = self.actor, self.critic, self.ppo, self.mesh
        actor.train()
        if critic is not None:
            critic.train()
        stats = Stats()
        order = torch.Generator(device="cpu").manual_seed(
            seeding.offset(self.seed, step, seeding.MINIBATCH)
        )
        ids = global_rows(exp.rows, exp.samples_per_prompt, mesh.rank, mesh.world_size)
        total_rows = exp.rows * mesh.world_size
        micro = micro_rows(actor, exp.rows, exp.sequences.shape[1], ppo.micro_batch_per_rank)
        # each row's real tokens (ppo.max_tokens_per_micro_batch)
        tokens = exp.attention_mask.sum(1).tolist()
        update = step * self.updates_per_step
        skipped = 0
        # the rows whose loss has a gradient (ppo.update_rows=live; None: every row)
        live = None
        if self.live_only and not (self.kl_in_loss and kl_beta):
            live = live_rows(exp.advantages, exp.loss_mask).cpu()  # (indexes CPU row ids)
            lean = exp.scored_rows is not None and not exp.old_from_update
            if lean and bool((live & ~exp.scored_rows.cpu()).any()):
                raise RuntimeError("a row with an advantage has no recomputed old log-probs")
        for _ in range(ppo.ppo_epochs):
            for mb in minibatches(
                ids,
                total_rows,
                ppo.minibatches_per_epoch,
                exp.samples_per_prompt,
                mesh.world_size,
                order,
            ):
                # (rows, weight); a rank out of rows runs one at weight 0, as many passes as the
                # others
                rows, most = (mb.rows, mb.most) if live is None else self._live(mb, live, stats)
                parts = []
                for r in micro_batches(
                    rows, micro, most, tokens, ppo.max_tokens_per_micro_batch, mesh
                ):
                    if len(r):
                        parts.append((r, mb.weight))
                    else:
                        parts.append((mb.rows[:1], 0.0))
                normalizer, token_normalizer = _normalizer(exp, mb, self.alg, ppo, mesh)
                ok = self._actor_step(
                    exp, parts, normalizer, kl_beta, stats, update, mb.global_size
                )
                update += 1
                if ok:
                    self.skipped_in_a_row = 0
                else:
                    self.skipped_in_a_row += 1
                    skipped += 1
                if critic is not None:
                    self._critic_step(exp, parts, token_normalizer, stats)
                if self.skipped_in_a_row >= ppo.max_nonfinite_in_a_row:
                    raise Diverged(
                        f"{self.skipped_in_a_row} updates in a row had a non-finite loss "
                        "or gradient"
                    )
            if self.ema is not None:
                self.ema.update()
        means = stats.means(mesh)
        if skipped:
            # a count, not a mean (the same on every rank)
            means["nonfinite_skipped"] = skipped
        # fp16: the loss scales and their skipped updates
        means.update(actor.scale_metrics("actor"))
        if critic is not None:
            means.update(critic.scale_metrics("critic"))
        return means

    def _live(self, mb: Minibatch, live: torch.Tensor, stats: Stats) -> Tuple[torch.Tensor, int]:
        """ppo.update_rows=live: (this rank's rows of ``mb`` with an advantage, the most any rank
        holds: a collective, the ranks' micro-batch count), and the share left out in the stats."""
        rows, most = mb.rows[live[mb.rows]] if mb.weight else mb.rows[:0], mb.most
        if not self.ppo.max_tokens_per_micro_batch:  # (that path agrees on its own)
            most = self.mesh.max(len(rows))
        left = float(len(mb.rows) - len(rows))
        stats.add("actor/rows_skipped", left * mb.weight, float(len(mb.rows)) * mb.weight)
        return rows, most

    def _actor_step(
        self,
        exp: Experience,
        parts: List[Part],
        normalizer: float,
        kl_beta: float,
        stats: Stats,
        update: int,
        global_size: int,
    ) -> bool:
        """Forward/backward of each micro-batch, then one optimizer step; False when skipped
        (non-finite)."""
        actor, alg, mesh = self.actor, self.alg, self.mesh
        seq, att, prompt_len = exp.sequences, exp.attention_mask, exp.prompt_len
        # sums: clipped tokens, Σ approx-KL, tokens, Σ entropy
        loss_sum, sums, ok = 0.0, None, True
        # Σ GKD's divergence over the policy tokens (algorithm.gkd_coef > 0)
        gkd_sum = 0.0
        # a MoE actor's load-balancing loss and router z-loss (algorithm.router_aux_loss_coef,
        # router_z_loss_coef), over the ranks' i-th micro-batches together (each rank's share)
        router = RouterLosses(actor.module, self.router, mesh, len(parts))
        for i, (r, w) in enumerate(parts):
            mask = exp.loss_mask[r] * w
            weights = ppo_math.loss_weights(mask, alg.loss_agg)  # token_mean: the mask itself
            entropy = "loss" if alg.entropy_coef else "metric"
            # (a MoE actor: the rollout's experts, ppo.routing_replay; a stand-in micro-batch,
            # weight 0: its tokens take no part in the router terms)
            with replay_rows(actor.module, exp.routing, r), router.micro_batch(att[r] * (w > 0)):
                logp, ent, logits, sel = self._forward(exp, r, entropy)
            # (one update a step: this forward precedes its optimizer step)
            old = logp.detach() if exp.old_from_update else exp.old_logprobs[r]
            pg_weights = weights
            if alg.mismatch_correction != "none" and exp.rollout_logprobs is not None:
                correction = ppo_math.mismatch_weights(
                    old, exp.rollout_logprobs[r], mask, alg.mismatch_correction, alg.tis_cap
                )
                pg_weights = weights * correction
                stats.add(
                    "rollout/correction_mean", float((correction * mask).sum()), float(mask.sum())
                )
            pl, st = ppo_math.policy_loss(
                logp,
                old,
                exp.advantages[r],
                mask,
                clip_low(alg),
                alg.dual_clip,
                normalizer=normalizer,
                clip_high=alg.clip_ratio_high,
                weights=pg_weights,
            )
            loss = pl
            if self.kl_in_loss and kl_beta:
                # (GRPO) the KL as a loss term, not in the reward
                kl_term = ppo_math.kl_penalty(logp, exp.ref_logprobs[r], kl_kind(alg))
                loss = loss + kl_beta * (kl_term * weights).sum() / normalizer
            if alg.entropy_coef:
                loss = loss - alg.entropy_coef * (ent * weights).sum() / normalizer
            if alg.gkd_coef:
                # GKD: the teacher's whole next-token distribution, not the sampled token's
                gkd = self.divergence(logits, seq[r], att[r], prompt_len, sel)
                on_samples = alg.gkd_coef * (1 - alg.gkd_data_share)
                loss = loss + on_samples * (gkd * weights).sum() / normalizer
                gkd_sum += float((gkd.detach() * mask).sum())
            term = self._router_term(router, stats)
            if term is not None:
                loss = loss + term
            last = i == len(parts) - 1
            if last and alg.ptx_coef:
                ptx_l = self.records.ptx_loss(actor, update, global_size)
                loss = loss + alg.ptx_coef * ptx_l
                stats.add("ptx/loss", float(ptx_l.detach()) / mesh.world_size)
            if last and alg.gkd_data_share:
                data_l = self.data_divergence(update, global_size)
                loss = loss + alg.gkd_coef * alg.gkd_data_share * data_l
                stats.add("distill/gkd_data", float(data_l.detach()) / mesh.world_size)
            part = torch.cat([st["sums"], (ent.detach() * mask).sum()[None]])
            sums = part if sums is None else sums + part
            loss_sum += float(pl.detach())
            if ok:
                ok = _all_finite(loss, mesh)
                if ok:
                    actor.backward(loss, sync=last)
        if ok:
            # (an fp16 overflow is the loss scaler's to handle: skipped there, not counted here)
            norm = actor.step()
            ok = math.isfinite(norm) or actor.overflowed
            if math.isfinite(norm):
                # the gradient's norm before clipping (the same on every rank)
                stats.add("actor/grad_norm", norm)
        else:
            actor.optimizer.zero_grad(set_to_none=True)
        # the update's token means over every rank's tokens (each rank adds the same: any world size
        # logs what one process would)
        clipped, akl, tokens, ent_sum = mesh.all_reduce(sums)
        stats.add("actor/loss", loss_sum)
        if tokens > 0:  # (an update of stand-in rows alone, ppo.update_rows=live: none to average)
            stats.add("clipfrac", float(clipped / tokens))
            stats.add("approx_kl", float(akl / tokens))
            stats.add("entropy", float(ent_sum / tokens))
        if alg.gkd_coef:
            stats.add("distill/gkd", mesh.sum(gkd_sum) / max(float(tokens), 1))
        return ok

    def _forward(self, exp: Experience, r, entropy: str):
        """The actor's forward on rows ``r``: ([b, N] log-probs, [b, N] entropy, the logits, the
        [b, N] bool of the tokens they predict or None). ``ppo.lm_head=all`` computes the logits of
        every position ([b, N, V] returned): asking for the response positions only gives the same
        forward but sums the LM head's weight gradient in another order, and fixed-seed numbers are
        a contract. ``response``: the logits of the loss's tokens alone ([K, V]; elsewhere the
        log-probs are the old ones, the entropy 0)."""
        seq, att, prompt_len, t = (
            exp.sequences[r],
            exp.attention_mask[r],
            exp.prompt_len,
            self.ppo.temperature,
        )
        if self.ppo.lm_head == "all":
            logits = response_logits(self.actor.forward, seq, att, prompt_len, False)
            logp, ent = logits_stats(logits, seq[:, prompt_len:], t, entropy)
            return logp, ent, logits, None
        logits, sel = token_logits(
            self.actor.forward, seq, att, prompt_len, exp.loss_mask[r], self.keep
        )
        lp, ent = logits_stats(logits[None], seq[:, prompt_len:][sel][None], t, entropy)
        logp = spread(lp[0], sel, exp.old_logprobs[r])
        return logp, spread(ent[0], sel, torch.zeros_like(logp)), logits, sel

    def _router_term(self, router: RouterLosses, stats: Stats) -> Optional[torch.Tensor]:
        """A micro-batch's MoE router term (None: none) and its metrics: each micro-batch's term is
        its share ÷ the micro-batches, so summed over them and the ranks, the step's."""
        term = router.loss()
        if term is not None:
            share = 1.0 / router.n / self.mesh.world_size
            stats.add("moe/aux_loss", router.last[0], share)
            if self.router.z_coef:
                stats.add("moe/z_loss", router.last[1], share)
        return term

    def data_divergence(self, update: int, size: int) -> torch.Tensor:
        """GKD's divergence on the dataset's responses: the token mean, over every rank's tokens,
        of ``chunked_divergence`` between the teacher and the actor at each response token of update
        ``update``'s ``size`` SFT records (a forward with gradients), scaled for the data-parallel
        average."""
        mesh, alg, t = self.mesh, self.alg, scoring_temperature(self.ppo.temperature)
        b = self.records.batch(update, size, seeding.GKD_DATA)
        ids, att = b["input_ids"].to(mesh.device), b["attention_mask"].to(mesh.device)
        # position i's logits predict token i + 1
        targets = (b["labels"][:, 1:] != -100).to(mesh.device)
        pos = position_ids(att)
        logits = self.actor.forward(input_ids=ids, attention_mask=att, position_ids=pos).logits
        with torch.no_grad():
            teacher = self.teacher.forward(input_ids=ids, attention_mask=att, position_ids=pos)
        div = chunked_divergence(
            logits[:, :-1], teacher.logits[:, :-1], alg.gkd_beta, t, alg.gkd_top_k
        )
        n_tokens = mesh.sum(int(targets.sum()))
        return (div * targets).sum() / max(n_tokens, 1) * mesh.world_size

    def divergence(self, logits, seq, att, prompt_len: int, sel=None):
        """[b, N] GKD's divergence (``chunked_divergence``) between the teacher's and the actor's
        next-token distributions at each response position (``sel``'s alone when given: the
        actor's ``logits`` are then theirs, [K, V]; 0 elsewhere); differentiable in the actor's
        ``logits``."""
        alg, t = self.alg, scoring_temperature(self.ppo.temperature)
        if sel is None:
            with torch.no_grad():
                teacher = response_logits(self.teacher.forward, seq, att, prompt_len, False)
            return chunked_divergence(logits, teacher, alg.gkd_beta, t, alg.gkd_top_k)
        with torch.no_grad():
            teacher, _ = token_logits(self.teacher.forward, seq, att, prompt_len, sel, self.keep)
        div = chunked_divergence(logits[None], teacher[None], alg.gkd_beta, t, alg.gkd_top_k)
        return spread(div[0], sel, torch.zeros(sel.shape, device=div.device))

    def _critic_step(
        self, exp: Experience, parts: List[Part], normalizer: float, stats: Stats
    ) -> None:
        critic, alg, mesh = self.critic, self.alg, self.mesh
        seq, att, prompt_len = exp.sequences, exp.attention_mask, exp.prompt_len
        total, ok = 0.0, True
        for i, (r, w) in enumerate(parts):
            # the value loss is a token mean (algorithm.loss_agg is the actor's)
            v = critic_values(critic, seq[r], att[r], prompt_len)
            vl = ppo_math.value_loss(
                v,
                exp.values[r],
                exp.returns[r],
                exp.loss_mask[r] * w,
                alg.value_clip,
                normalizer=normalizer,
            )
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


def _normalizer(
    exp: Experience, mb: Minibatch, alg: AlgorithmConfig, ppo: PPOConfig, mesh: Mesh
) -> Tuple[float, float]:
    """The global minibatch's loss denominators over the world size (data-parallel ranks average
    their gradients), computed before the minibatch is split into micro-batches: the actor's
    (algorithm.loss_agg) and the critic's (a token mean)."""
    lm = exp.loss_mask[mb.rows] * mb.weight
    tokens = mesh.sum(float(lm.sum()))
    seqs = 0.0  # token_mean counts tokens only
    if alg.loss_agg != "token_mean":
        seqs = mesh.sum(float((lm.sum(1) > 0).sum()))
    norm_tokens = alg.loss_norm_tokens or ppo.max_new_tokens
    return (
        ppo_math.loss_denominator(alg.loss_agg, tokens, seqs, norm_tokens) / mesh.world_size,
        tokens / mesh.world_size,
    )


def clip_low(alg: AlgorithmConfig) -> float:
    return alg.clip_ratio if alg.clip_ratio_low is None else alg.clip_ratio_low


def _all_finite(x: torch.Tensor, mesh: Mesh) -> bool:
    return mesh.sum(float(torch.isfinite(x))) == mesh.world_size
