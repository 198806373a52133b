"""Experience: one step's rollouts, scored. ``collect`` generates in inference mode and scores in
training mode (actor and reference log-probs, critic values, reward model and rule rewards, KL,
advantages), every forward in micro-batches of a bounded number of rows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from rlhf.algorithms import ppo as A
from rlhf.engine.logprobs import keeps_logits, response_logprobs
from rlhf.models.value import sequence_scores
from rlhf.ops import SamplingParams
from rlhf.rl.minibatch import auto_micro_batch


@dataclass
class Experience:
    """This rank's rows of one step: a prompt's ``group_size`` samples in consecutive rows,
    prompts left-padded to ``prompt_len``, responses right-padded (0 in ``mask`` after EOS)."""
    sequences: torch.Tensor  # [B, P + N]
    attention_mask: torch.Tensor  # [B, P + N]
    mask: torch.Tensor  # [B, N] float, 1 on response tokens (EOS included)
    prompt_len: int
    group_size: int
    rollout_logprobs: Optional[torch.Tensor]  # [B, N] what the inference mode sampled with (None: HF generate)
    old_logprobs: torch.Tensor  # [B, N] the actor in training mode, before the update
    ref_logprobs: torch.Tensor  # [B, N] the reference policy
    values: Optional[torch.Tensor]  # [B, N] the critic's V(s_t) (GAE only), masked
    scores: torch.Tensor  # [B] total sequence reward: reward model + rule + no-EOS penalty
    score_parts: dict  # name -> [B]: "model", "rule", "penalty" (those in use)
    kl: torch.Tensor  # [B, N] per-token KL estimate (algorithm.kl_estimator), masked
    advantages: torch.Tensor  # [B, N]
    returns: Optional[torch.Tensor]  # [B, N] value targets (GAE only)
    score_s: float = 0.0  # seconds spent scoring (after generation)

    @property
    def rows(self) -> int:
        return self.sequences.shape[0]

    @property
    def responses(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_len:]


@dataclass
class Scorers:
    """What scores a rollout: the models (reference, critic, reward model: None when not used), the
    reward model's normalisation and the rule reward."""
    ref: object
    critic: Optional[object]
    reward_model: Optional[object]
    reward_stats: dict  # {"mean", "std"} of the reward stage's held-out scores
    running: A.RunningMoments
    rule: Optional[Callable]  # rule(responses, examples, fmt) -> [float]
    rule_weight: float
    data_format: str


def micro_rows(engine, rows: int, tokens: int, micro: int) -> int:
    """Rows per forward: ``micro`` (ppo.micro_batch_per_rank) or, when 0, as many as keep a
    micro-batch's fp32 logits within budget for this model's vocabulary."""
    if micro:
        return micro
    vocab = getattr(engine.module.config, "vocab_size", 0) or 1
    return min(rows, auto_micro_batch(tokens, vocab))


def in_micro_batches(fn, rows: int, micro: int) -> torch.Tensor:
    """``fn(slice)`` over consecutive row slices of at most ``micro`` rows, concatenated (every rank
    has the same number of rows, hence the same number of collective forwards)."""
    return torch.cat([fn(slice(s, s + micro)) for s in range(0, rows, micro)])


@torch.no_grad()
def collect(hybrid, actor, scorers: Scorers, prompts: List[List[int]], examples: list, sp: SamplingParams,
            alg, micro_batch: int, kl_beta: float, tokenizer, mesh) -> Experience:
    """Generate ``sp.n`` samples of each prompt (inference mode), then score them (training mode)."""
    gen = hybrid.generate(prompts, sp)
    t0 = time.perf_counter()
    seq, att, P = gen.sequences, gen.attention_mask, gen.prompt_len
    mask = gen.response_mask.float()
    examples = [e for e in examples for _ in range(sp.n)]
    temp = sp.temperature if sp.temperature > 0 else 1.0  # log-probs of greedy rollouts: temperature 1
    rows, n_resp = seq.shape[0], seq.shape[1] - P
    keep = keeps_logits(actor.module)
    micro = micro_rows(actor, rows, (n_resp + 1) if keep else seq.shape[1], micro_batch)

    def logprobs(model):
        return in_micro_batches(lambda r: response_logprobs(model.forward, seq[r], att[r], P, temp, keep_logits=keep),
                                rows, micro)

    old_logp = logprobs(actor)
    ref_logp = logprobs(scorers.ref)
    values = (in_micro_batches(lambda r: critic_values(scorers.critic, seq[r], att[r], P), rows, micro) * mask
              if scorers.critic is not None else None)
    score = torch.zeros(rows, device=seq.device)
    parts = {}
    if scorers.reward_model is not None:
        raw = in_micro_batches(lambda r: sequence_scores(scorers.reward_model.forward(
            input_ids=seq[r], attention_mask=att[r]), att[r]), rows, micro)
        raw = normalise_rewards(raw, alg.reward_norm, scorers, mesh)
        parts["model"] = raw
        score = score + raw
    if scorers.rule is not None:
        texts = tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(gen.responses, mask)],
                                       skip_special_tokens=True)
        rule = torch.tensor(scorers.rule(texts, examples, scorers.data_format), dtype=torch.float32,
                            device=seq.device)
        parts["rule"] = scorers.rule_weight * rule
        score = score + parts["rule"]
    if alg.no_eos_penalty:
        ended = (gen.responses == tokenizer.eos_token_id).any(1)
        parts["penalty"] = alg.no_eos_penalty * (~ended).float()
        score = score + parts["penalty"]
    kl = A.kl_penalty(old_logp, ref_logp, alg.kl_estimator) * mask
    all_reduce = mesh.all_reduce if mesh.distributed else None
    adv, returns = A.advantages(alg, score, kl, values, mask, sp.n, kl_beta, all_reduce)
    return Experience(sequences=seq, attention_mask=att, mask=mask, prompt_len=P, group_size=sp.n,
                      rollout_logprobs=gen.logprobs, old_logprobs=old_logp, ref_logprobs=ref_logp, values=values,
                      scores=score, score_parts=parts, kl=kl, advantages=adv, returns=returns,
                      score_s=time.perf_counter() - t0)


def critic_values(critic, seq: torch.Tensor, att: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """V(s_t) for each response token t: the value at the position just before it."""
    return critic.forward(input_ids=seq, attention_mask=att)[:, prompt_len - 1:-1]


def normalise_rewards(raw: torch.Tensor, how: str, scorers: Scorers, mesh) -> torch.Tensor:
    """The reward model's score, normalised: ``stats`` by the reward stage's held-out mean/std,
    ``running`` by running moments over every rank's scores so far, ``none`` as is."""
    if how == "stats":
        stats = scorers.reward_stats
        return (raw - stats["mean"]) / max(stats["std"], 1e-8)
    if how == "running":
        every = torch.tensor(mesh.all_gather_object(raw.tolist()), device="cpu").flatten()
        scorers.running.update(every)
        return (raw - scorers.running.mean) / scorers.running.std
    return raw
