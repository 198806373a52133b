"""Experience: one step's rollouts, scored. ``Collector.collect`` pulls the step's prompts from the
``PromptSource``, plays their episodes (rlhf/rl/episodes.py: one generation for single-turn PPO) in
inference mode and scores in training mode (actor and reference log-probs, critic values, reward
model and rule rewards, KL, advantages), every forward in micro-batches of a bounded number of rows
(or real tokens: ppo.max_tokens_per_micro_batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch

from rlhf import rewards, seeding
from rlhf.algorithms import ppo as ppo_math
from rlhf.algorithms.estimators import advantages, kl_kind
from rlhf.algorithms.tokens import last_index
from rlhf.config import AlgorithmConfig, PPOConfig
from rlhf.data.records import Example
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.infer import Generation
from rlhf.engine.logprobs import (
    keeps_logits,
    response_logprobs,
    response_logprobs_top1,
    token_logprobs,
)
from rlhf.engine.mesh import Mesh
from rlhf.engine.rows import join, joined, per_row, take
from rlhf.engine.train import TrainEngine
from rlhf.errors import ConfigError, UserError
from rlhf.models.lora import unwrap
from rlhf.models.moe import ReplayStats, replay_rows
from rlhf.ops import SamplingParams
from rlhf.ops.sampling import prompt_major
from rlhf.rl.async_rollouts import staleness
from rlhf.rl.episodes import EpisodeRunner, Episodes, merge_stats
from rlhf.rl.minibatch import (
    in_micro_batches,
    in_subset,
    live_rows,
    micro_rows,
    row_groups,
    subset_groups,
)
from rlhf.rl.prompts import PromptBatch, PromptSource
from rlhf.rl.scorers import Model, Scorers
from rlhf.rl.shaping import distillation, fill_failed, length_debiased


@dataclass
class Experience:
    """This rank's rows of one step: a prompt's ``samples_per_prompt`` samples in consecutive rows,
    prompts left-padded to ``prompt_len``, responses right-padded (0 in ``mask`` after EOS)."""

    sequences: torch.Tensor  # [B, P + N]
    attention_mask: torch.Tensor  # [B, P + N]
    # [B, N] float, 1 on response tokens (EOS included)
    mask: torch.Tensor
    prompt_len: int
    samples_per_prompt: int
    # [B, N] what the inference mode sampled with (None: HF generate)
    rollout_logprobs: Optional[torch.Tensor]
    # [B, N] the actor in training mode, before the update
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor  # [B, N] the reference policy
    # [B, N] the critic's V(s_t) (GAE only), masked
    values: Optional[torch.Tensor]
    # [B] total sequence reward: reward model + rule + no-EOS penalty
    scores: torch.Tensor
    # name -> [B]: "model", "rule", "penalty", "overlong" (those in use)
    score_parts: Dict[str, torch.Tensor]
    # [B, N] per-token KL estimate (algorithm.kl_estimator), masked
    kl: torch.Tensor
    # the k1 KL per sequence, mean over every rank's rows (what the KL controller reads)
    kl_mean: float
    global_rows: int  # rows over every rank
    advantages: torch.Tensor  # [B, N]
    returns: Optional[torch.Tensor]  # [B, N] value targets (GAE only)
    # [B, N] tokens that carry loss (mask less overlong-filtered and failed rows)
    loss_mask: torch.Tensor
    # [B] gold score of each rollout (a metric, never a reward)
    gold: Optional[torch.Tensor]
    # generate_s, switch_s, ... summed over the step's generations
    timings: Dict[str, float]
    extra_metrics: Dict[str, float]  # e.g. dynamic sampling's counts
    # seconds spent scoring (after generation)
    score_s: float
    # multi-turn episodes: their statistics' sums on this rank (rlhf/rl/episodes.py, Episodes.stats)
    env_stats: Dict[str, float] = field(default_factory=dict)
    # [B, N] the environment's turn rewards at their turns' last tokens
    turn_rewards: Optional[torch.Tensor] = None
    # name -> [B]: figures of each row logged beside the rewards, never part of them (a reward-model
    # ensemble's members' mean and disagreement, the share of its members clipped)
    watch: Dict[str, torch.Tensor] = field(default_factory=dict)
    # each row's (last) response, decoded (samples.jsonl)
    texts: List[str] = field(default_factory=list)
    examples: List[Example] = field(default_factory=list)  # each row's record
    # [B, N] asynchronous rollouts: how many updates old the weights that sampled each policy token
    # were (rlhf/rl/async_rollouts.py); None: sampled by the weights being updated
    staleness: Optional[torch.Tensor] = None
    # [B, P + N, MoE layers, k] the rollout's experts, replayed in the actor's training forwards
    # (ppo.routing_replay; rlhf/models/moe.py); None: a dense actor, or replay off
    routing: Optional[torch.Tensor] = None
    # [B] bool: the rows whose ``old_logprobs`` the training mode recomputed (the others hold the
    # rollout's, or 0 after HF generate: the update leaves them out, Collector.rows_to_score); None:
    # every row
    scored_rows: Optional[torch.Tensor] = None
    # one update a step (ppo_epochs × minibatches_per_epoch = 1) with rows_to_score's lean scoring:
    # the update's own forward, before its optimizer step, gives the old log-probs
    old_from_update: bool = False

    @property
    def rows(self) -> int:
        return self.sequences.shape[0]

    @property
    def responses(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_len :]


@dataclass
class Rollouts:
    """Generated rows (their episodes) and their sequence rewards, before the model scoring."""

    ep: Episodes
    # one per row
    examples: List[Example] = field(metadata=per_row())
    # [B]
    scores: torch.Tensor = field(metadata=per_row())
    # name -> [B]
    parts: Dict[str, torch.Tensor] = field(metadata=per_row())
    # [B] the gold rule's score of each row, when the data has one
    gold: Optional[torch.Tensor] = field(default=None, metadata=per_row())
    # name -> [B] (``Experience.watch``)
    watch: Dict[str, torch.Tensor] = field(default_factory=dict, metadata=per_row())
    # the episodes' statistics (multi-turn) of every generation these rows were chosen from
    env_stats: List[Dict[str, float]] = field(default_factory=list, metadata=joined("concat"))

    @property
    def gen(self) -> Generation:
        return self.ep.gen


def concat_groups(
    chosen: List[Tuple[Rollouts, int]], samples_per_prompt: int, pad_id: int
) -> Rollouts:
    """One ``Rollouts`` of the (rollouts, prompt index) pairs in ``chosen`` (a prompt's
    ``samples_per_prompt`` rows are consecutive: ``prompt_major``), prompts re-padded on the left
    to the longest prompt length among them and responses on the right to the longest
    (``rlhf.engine.rows``); the generations' seconds and the episodes' statistics are the caller's
    to set (a batch's appear once per prompt chosen from it)."""
    n = samples_per_prompt
    out = join([take(b, slice(i * n, (i + 1) * n)) for b, i in chosen], pad_id)
    out.gen.timings, out.ep.stats, out.ep.errors, out.env_stats = {}, {}, [], []
    return out


class Collector:
    """One step's experience: this rank's prompts of the step (from the ``PromptSource``), generated
    in inference mode (dynamic sampling's extra rounds included), rewarded, then scored in training
    mode (log-probs of the actor and the reference, critic values, KL, advantages)."""

    def __init__(
        self,
        hybrid: HybridEngine,
        actor: TrainEngine,
        scorers: Scorers,
        prompts: PromptSource,
        alg: AlgorithmConfig,
        ppo: PPOConfig,
        tokenizer,
        mesh: Mesh,
        seed: int,
        runner: Optional[EpisodeRunner] = None,
    ):
        self.hybrid, self.actor, self.scorers, self.prompts = hybrid, actor, scorers, prompts
        self.alg, self.ppo, self.tokenizer, self.mesh, self.seed = alg, ppo, tokenizer, mesh, seed
        self.runner = runner or EpisodeRunner.single(tokenizer, mesh)  # (None: single-turn PPO)
        # ppo.rollout_workers=1: the rollout worker's client (AsyncRollouts), set by the stage
        self.remote = None
        # a Mixture-of-Experts actor's rollouts record their routing for its forwards to replay
        policy = hybrid.policy if hybrid.inject else None
        self.replay = ppo.routing_replay and policy is not None and policy.num_experts > 0
        if self.replay and actor.ecfg.activation_checkpointing:
            raise ConfigError(
                "ppo.routing_replay does not yet replay the experts in the forwards that "
                "activation checkpointing recomputes: set engine.actor.activation_checkpointing="
                "false, or ppo.routing_replay=false"
            )
        hybrid.record_routing = self.replay
        # the update leaves out the rows without an advantage (Updater.live_only: set by the stage)
        self.update_live_rows = False
        # one update a step: no second look at the rows' log-probs under the same weights
        self.one_update = ppo.ppo_epochs * ppo.minibatches_per_epoch == 1

    def sampling(self, step: int) -> SamplingParams:
        ppo = self.ppo
        return SamplingParams(
            temperature=ppo.temperature,
            top_k=ppo.top_k,
            top_p=ppo.top_p,
            max_new_tokens=ppo.max_new_tokens,
            min_new_tokens=ppo.min_new_tokens,
            samples_per_prompt=ppo.samples_per_prompt,
            seed=seeding.nested(self.seed, step, seeding.ROLLOUT),
        )

    @torch.no_grad()
    def collect(self, step: int, kl_beta: float) -> Experience:
        """The experience of step ``step`` with KL coefficient ``kl_beta``."""
        alg, ppo, mesh, sp = self.alg, self.ppo, self.mesh, self.sampling(step)
        t0 = time.perf_counter()
        ro = self.rollout(self.prompts.step(step), sp, step)
        timings = dict(ro.gen.timings)
        dyn = {} if self.remote is None else dict(self.remote.metrics)
        if ppo.dynamic_sampling:
            ro, dyn = self.dynamic_sampling(ro, step, sp, timings)
        gen = ro.gen
        seq, att, prompt_len = gen.sequences, gen.attention_mask, gen.prompt_len
        mask = gen.response_mask.float()
        rows = seq.shape[0]
        keep, groups = self.scoring_groups(gen)
        routing, flips = (gen.routing if self.replay else None), ReplayStats()
        # the rows whose old log-probs are recomputed and their advantages (None: every row's)
        lean = self.rows_to_score(ro, mask, sp.samples_per_prompt, kl_beta)
        scored = None if lean is None else lean[0]

        def logprobs(model: Model, top1=False, replay=False, over=None) -> torch.Tensor:
            """Over every row, or ``over`` (``subset_groups``): the others' the rollout's (0 after
            HF generate)."""

            def one(r):
                with replay_rows(model.module, routing if replay else None, r, flips):
                    if top1:
                        return response_logprobs_top1(
                            model.forward, seq[r], att[r], prompt_len, sp.temperature, keep
                        )
                    return self.sampled_logprobs(
                        model.forward, seq[r], att[r], prompt_len, mask[r], sp.temperature, keep
                    )

            if over is None:
                return in_micro_batches(one, groups)
            fill = gen.logprobs if gen.logprobs is not None else torch.zeros_like(mask)
            return in_subset(one, over, fill)

        teacher = self.scorers.teacher
        if teacher is None:
            over = None if scored is None else self.scoring_groups(gen, scored.nonzero()[:, 0])[1]
            old_logp = logprobs(self.actor, replay=True, over=over)
        else:
            # with the greedy tokens, compared with the teacher's
            actor_top1 = logprobs(self.actor, top1=True, replay=True)
            old_logp = actor_top1[..., 0]
        if self.replay:  # (collective: on every rank, whether or not its rows carry a routing)
            dyn["moe/routing_flips"] = flips.share(mesh)
        # algorithm.kl_coef=0 loads no reference: its log-probs are the actor's (KL 0)
        ref_logp = old_logp
        if self.scorers.ref is not None:
            ref_logp = logprobs(self.scorers.ref)
        turn_rewards, scores, parts = ro.ep.turn_rewards, ro.scores, ro.parts
        if teacher is not None:
            # on-policy distillation: a reward at every policy token
            turn_rewards, scores, parts = self.distilled(
                (old_logp, logprobs(teacher, top1=True), actor_top1),
                mask,
                (turn_rewards, scores, parts),
                dyn,
            )
        values = self.values(gen, mask, groups)
        kl, kl_mean = self.kl(old_logp, ref_logp, mask)
        global_rows = rows * mesh.world_size  # every rank holds as many rows
        all_reduce = mesh.all_reduce if mesh.distributed else None
        if lean is None:
            adv, returns = advantages(
                alg,
                scores,
                kl,
                values,
                mask,
                sp.samples_per_prompt,
                kl_beta,
                all_reduce,
                turn_rewards,
            )
        else:  # (the scores' alone: no KL, no values)
            adv, returns = lean[1], None
        loss_mask = self.loss_mask(ro, mask)
        stale = staleness(gen.versions, step, mask)
        waited = timings.get("generate_s", 0.0) + timings.get("switch_s", 0.0)
        if stale is not None:
            # the worker's episodes: the trainer waited for them only
            waited, loss_mask = self.remote.last_wait_s, self.within_bound(stale, loss_mask, dyn)
        return Experience(
            sequences=seq,
            attention_mask=att,
            mask=mask,
            prompt_len=prompt_len,
            samples_per_prompt=sp.samples_per_prompt,
            rollout_logprobs=gen.logprobs,
            old_logprobs=old_logp,
            ref_logprobs=ref_logp,
            values=values,
            scores=scores,
            score_parts=parts,
            kl=kl,
            kl_mean=kl_mean,
            global_rows=global_rows,
            advantages=adv,
            returns=returns,
            loss_mask=loss_mask,
            gold=ro.gold,
            timings=timings,
            extra_metrics=dyn,
            score_s=time.perf_counter() - t0 - waited,
            env_stats=merge_stats(ro.env_stats),
            turn_rewards=turn_rewards,
            watch=ro.watch,
            texts=ro.ep.texts,
            examples=ro.examples,
            staleness=stale,
            routing=routing,
            scored_rows=scored,
            old_from_update=lean is not None and self.one_update,
        )

    def distilled(self, logps: tuple, mask: torch.Tensor, rewards: tuple, dyn: dict) -> tuple:
        """On-policy distillation's reward at every policy token added to the step's
        ``(turn_rewards, scores, parts)``; ``logps``: the actor's log-probs and the teacher's and
        the actor's top-1 (its metrics into ``dyn``)."""
        old_logp, teacher_top1, actor_top1 = logps
        turn_rewards, scores, parts = rewards
        distill, dyn_d = distillation(
            old_logp, teacher_top1, actor_top1, mask, self.scorers.distill_coef, self.mesh
        )
        dyn.update(dyn_d)
        turn_rewards = distill if turn_rewards is None else turn_rewards + distill
        parts = {**parts, "distill": distill.sum(1)}
        return turn_rewards, scores + parts["distill"], parts

    def values(self, gen, mask: torch.Tensor, groups) -> Optional[torch.Tensor]:
        """The critic's values of the policy tokens ([B, N]; None without a critic)."""
        if self.scorers.critic is None:
            return None
        seq, att, prompt_len = gen.sequences, gen.attention_mask, gen.prompt_len
        return (
            in_micro_batches(
                lambda r: critic_values(self.scorers.critic, seq[r], att[r], prompt_len), groups
            )
            * mask
        )

    def rows_to_score(
        self, ro: Rollouts, mask: torch.Tensor, group_size: int, kl_beta: float
    ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """([B] bool: the rows whose old log-probs are recomputed, [B, N] the advantages) where
        the update leaves out the rows without an advantage (ppo.update_rows=live) and nothing else
        reads their log-probs — no reference (the KL), teacher or critic, no rollout worker, no
        routing replay — else None (every row). The advantages then come from the scores alone;
        the rows recomputed are those with one (none with one update a step: ``one_update``) and
        each rank's first row (the parity guard always has tokens to judge)."""
        sc = self.scorers
        if not self.update_live_rows or kl_beta or self.remote is not None or self.replay:
            return None
        if sc.ref is not None or sc.teacher is not None or sc.critic is not None:
            return None
        all_reduce = self.mesh.all_reduce if self.mesh.distributed else None
        adv, _ = advantages(
            self.alg,
            ro.scores,
            torch.zeros_like(mask),
            None,
            mask,
            group_size,
            0.0,
            all_reduce,
            ro.ep.turn_rewards,
        )
        scored = live_rows(adv, self.loss_mask(ro, mask))
        if self.one_update:
            # the update's forward, before its one optimizer step, is the policy that sampled
            # them: it gives their old log-probs (Updater._actor_step)
            scored.zero_()
        scored[0] = True
        return scored, adv

    def sampled_logprobs(self, forward, seq, att, prompt_len: int, mask, temperature, keep):
        """[b, N] the sampled tokens' log-probs (``response_logprobs``); ``ppo.lm_head=response``:
        the logits of the response tokens alone (``token_logprobs``, 0 at the padding)."""
        if self.ppo.lm_head == "response":
            return token_logprobs(forward, seq, att, prompt_len, mask, temperature, keep)
        return response_logprobs(forward, seq, att, prompt_len, temperature, keep_logits=keep)

    def scoring_groups(self, gen: Generation, rows=None) -> Tuple[bool, list]:
        """(whether the actor computes the response's logits only, the micro-batches of the
        step's scoring forwards: over every row, or ``rows`` alone as ``subset_groups``)."""
        seq, ppo = gen.sequences, self.ppo
        keep = keeps_logits(unwrap(self.actor.module))
        logits_len = seq.shape[1]
        if keep:
            # the model computes logits for the response (and the token before it) only
            logits_len = seq.shape[1] - gen.prompt_len + 1
        micro = micro_rows(self.actor, seq.shape[0], logits_len, ppo.micro_batch_per_rank)
        if rows is not None:
            return keep, subset_groups(
                rows, gen.attention_mask, micro, ppo.max_tokens_per_micro_batch, self.mesh
            )
        return keep, row_groups(
            gen.attention_mask, micro, ppo.max_tokens_per_micro_batch, self.mesh
        )

    def kl(
        self, old_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor
    ) -> Tuple[torch.Tensor, float]:
        """([B, N] the penalty's KL estimate per token (algorithm.kl_estimator), the k1 KL per
        sequence over every rank's rows: what the adaptive KL controller reads)."""
        kind = kl_kind(self.alg)
        kl = ppo_math.kl_penalty(old_logp, ref_logp, kind) * mask
        k1 = kl
        if kind != "k1":
            k1 = ppo_math.kl_penalty(old_logp, ref_logp, "k1") * mask
        global_rows = mask.shape[0] * self.mesh.world_size  # every rank holds as many rows
        return kl, self.mesh.sum(float(k1.sum(1).sum())) / global_rows

    def loss_mask(self, ro: Rollouts, mask: torch.Tensor) -> torch.Tensor:
        """The response tokens that carry loss: not those of a response cut at max_new_tokens
        (ppo.overlong_filter), nor of an episode whose environment raised or timed out."""
        loss_mask = mask
        if self.ppo.overlong_filter:
            loss_mask = mask * ended(ro.gen, self.tokenizer.eos_token_id)[:, None].float()
        if ro.ep.failed.any():
            loss_mask = loss_mask * (~ro.ep.failed)[:, None].float()
        return loss_mask

    def within_bound(
        self, stale: torch.Tensor, loss_mask: torch.Tensor, dyn: Dict[str, float]
    ) -> torch.Tensor:
        """``loss_mask`` less the rows sampled by weights older than ppo.max_staleness (never
        trained on; the requests rule them out), counted in ``async/dropped``."""
        too_old = stale.amax(1) > self.ppo.max_staleness
        dyn["async/dropped"] = self.mesh.sum(float(too_old.sum()))
        return loss_mask * (~too_old)[:, None].float()

    def dynamic_sampling(
        self, first: Rollouts, step: int, sp: SamplingParams, timings: Dict[str, float]
    ) -> Tuple[Rollouts, Dict[str, float]]:
        """DAPO's dynamic sampling: keep the prompt groups whose rewards differ; while a rank has
        fewer than its share of prompts with a signal, generate for the prompt source's refills
        (each round sampling with a seed of its own), at most ``ppo.dynamic_sampling_max_rounds``
        times, adding their generation times to ``timings``. Every rank takes part in every round
        (generation is collective). A rank still short at the end tops up with groups it dropped, so
        every rank keeps as many rows as it started with."""
        mesh, max_rounds = self.mesh, self.ppo.dynamic_sampling_max_rounds
        samples, quota = sp.samples_per_prompt, first.scores.numel() // sp.samples_per_prompt
        kept, dropped, rounds, n_dropped = [], [], 0, 0
        batch, env_stats = first, list(first.env_stats)
        while True:
            zero = ppo_math.zero_variance_groups(batch.scores, samples).tolist()
            n_dropped += sum(zero)
            kept += [(batch, prompt_ix) for prompt_ix, flat in enumerate(zero) if not flat]
            dropped += [(batch, prompt_ix) for prompt_ix, flat in enumerate(zero) if flat]
            short = mesh.sum(float(len(kept) < quota))
            if not short or rounds == max_rounds:
                break
            rounds += 1
            sp_round = replace(sp, seed=seeding.offset(sp.seed, rounds, seeding.REFILL))
            batch = self.rollout(self.prompts.refill(step, rounds), sp_round)
            env_stats += batch.env_stats
            for k, v in batch.gen.timings.items():
                timings[k] = timings.get(k, 0.0) + v
        topped = max(quota - len(kept), 0)
        chosen = (kept + dropped)[:quota]
        stats = {
            "dynamic/dropped_groups": mesh.sum(n_dropped),
            "dynamic/rounds": float(rounds),
            "dynamic/topped_up_groups": mesh.sum(topped),
        }
        out = concat_groups(chosen, samples, self.tokenizer.pad_token_id)
        out.env_stats = env_stats  # every round's, the dropped groups' too
        return out, stats

    def rollout(
        self, batch: PromptBatch, sp: SamplingParams, step: Optional[int] = None
    ) -> Rollouts:
        """Play ``sp.samples_per_prompt`` episodes of each prompt (inference mode; one turn each
        with the single-turn environment; the rollout worker's of step ``step`` when there is one)
        and reward them: the environment's turn rewards, reward model (normalised), rule reward on
        the final turn, no-EOS penalty, soft overlong penalty."""
        scorers, alg, ppo, tokenizer = self.scorers, self.alg, self.ppo, self.tokenizer
        if self.remote is not None and step is not None:  # the same prompts, played by the worker
            ep = self.remote.episodes(step)
        else:
            with self.hybrid.holding():
                # the turns of a rollout share one inference model
                ep = self.runner.run(
                    self.hybrid.generate,
                    batch.ids,
                    batch.examples,
                    sp,
                    positions=self.hybrid.positions,
                )
        self.check_failures(ep)
        gen = ep.gen
        seq, att = gen.sequences, gen.attention_mask
        mask = gen.response_mask.float()
        examples = prompt_major(batch.examples, sp.samples_per_prompt)
        rows = seq.shape[0]
        score = torch.zeros(rows, device=seq.device)
        parts, watch = {}, {}
        if not self.runner.single_turn:  # an environment with rewards of its own
            parts["env"] = ep.env_rewards
            score = score + parts["env"]
        if scorers.reward_model is not None:
            parts["model"], watch = scorers.model_reward(seq, att, ppo, self.mesh)
            if ppo.reward_length_debias:
                # no reward for answering longer or shorter
                parts["model"], slope = length_debiased(parts["model"], mask.sum(1), self.mesh)
                watch["length_slope"] = slope.expand(rows)
            score = score + parts["model"]
        texts = ep.texts  # the final turn of each episode
        if scorers.judge is not None:  # P(the good verdict), or the parsed score, of each response
            micro = ppo.micro_batch_per_rank or rows
            judged = scorers.judge(texts, examples, micro, seq.device).to(score.dtype)
            parts["judge"] = scorers.judge_weight * judged
            score = score + parts["judge"]
            if scorers.judge.pattern is not None:
                # the answers whose score could not be read (judge/parse_failures)
                watch["judge_failed"] = scorers.judge.failed.to(score.dtype)
            gen.timings["judge_s"] = gen.timings.get("judge_s", 0.0) + scorers.judge.seconds
        if scorers.rule is not None:
            # checked on every call: one number per response, or exit 2 naming it
            rule = torch.tensor(
                rewards.call(scorers.rule, texts, examples, scorers.data_format),
                dtype=torch.float32,
                device=seq.device,
            )
            parts["rule"] = scorers.rule_weight * rule
            score = score + parts["rule"]
        if alg.no_eos_penalty:
            parts["penalty"] = alg.no_eos_penalty * (~ended(gen, tokenizer.eos_token_id)).float()
            score = score + parts["penalty"]
        if ppo.overlong_buffer:
            parts["overlong"] = ppo_math.overlong_penalty(
                mask.sum(1), sp.max_new_tokens, ppo.overlong_buffer, ppo.overlong_penalty
            )
            score = score + parts["overlong"]
        if ep.failed.any():
            # a failed episode: its group's mean (no signal, no shift of the baseline)
            score = fill_failed(score, ep.failed, sp.samples_per_prompt)
        gold = None
        if scorers.gold is not None and all(e.reference is not None for e in examples):
            gold = torch.tensor(
                [scorers.gold(t, e.reference) for t, e in zip(texts, examples)],
                dtype=torch.float32,
                device=seq.device,
            )
        return Rollouts(
            ep, examples, score, parts, gold, watch, [ep.stats] if self.runner.multi_turn else []
        )

    def check_failures(self, ep: Episodes) -> None:
        """Exit 2, naming the environment and an error, when more than ``env.max_failed_share``
        of a generation's episodes (every rank's) failed. Collective."""
        if self.runner.single_turn:
            # the built-in single-turn environment never fails (no collective)
            return
        failed, rows = (
            self.mesh.sum(float(ep.failed.sum())),
            self.mesh.sum(float(ep.failed.numel())),
        )
        share = self.runner.max_failed_share
        if not failed or failed <= share * rows:
            return
        errors = [e for errs in self.mesh.all_gather_object(ep.errors[:1]) for e in errs]
        raise UserError(
            f"env.name={self.runner.env_name}: {failed:.0f} of {rows:.0f} episodes failed in one "
            f"generation (more than env.max_failed_share={share:g}); "
            f"first: {errors[0]}"
        )


def ended(gen: Generation, eos_id: int) -> torch.Tensor:
    """[B] bool: the episode's last policy token is EOS (it ended, rather than being cut)."""
    mask = gen.response_mask
    last = last_index(mask)
    return gen.responses.gather(1, last[:, None])[:, 0].eq(eos_id) & mask.any(1)


def critic_values(
    critic: TrainEngine, seq: torch.Tensor, att: torch.Tensor, prompt_len: int
) -> torch.Tensor:
    """V(s_t) for each response token t: the value at the position just before it."""
    return critic.forward(input_ids=seq, attention_mask=att)[:, prompt_len - 1 : -1]
