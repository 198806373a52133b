"""Mixture-of-Experts models in training: routing replay and the load-balancing loss.

Routing replay (R3): the experts the inference mode chose for each
token in the rollout (``Generation.routing``, recorded by ``InferenceModel.record_routing``) are
the ones a training forward uses, so that a router that would flip an expert between the two
(float order, bf16 rollouts, stale weights) cannot make the PPO ratio compare two different
networks. The router's gradient still flows: the replayed experts' weights are the training
forward's own softmax probabilities at those experts (renormalised where the family does).

    with replaying(model, routing) as stats:
        out = model(input_ids=..., attention_mask=...)
    stats.flipped / stats.compared   # (token, layer) pairs whose own top k differed

HF's MoE blocks (Qwen3-MoE, Mixtral, Qwen2-MoE in Transformers 5) call their router module and use
what it returns, ``(logits, weights, experts)``; a forward hook on each MoE layer's router returns
the replayed pair instead. ``routing`` is [B, T, MoE layers, k] for the forward's [B, T] tokens;
entries of -1 (a token no rollout forward routed) keep the training forward's own choice.

The load-balancing loss (Switch Transformer; HF's ``load_balancing_loss_func`` per layer):
``balancing(model, mask, balance)`` watches each MoE layer's router in the forwards inside and adds
E · Σ_e f_e · P_e to ``balance`` (f_e: the routed (token, slot) pairs of expert e per real token, so
Σ_e f_e = k; P_e: the mean router probability of e, differentiable), with each layer's load
(max ÷ mean tokens per expert). Both are over the real tokens of the batch and, given ``reduce``,
of every rank's forward: the term of a step that runs one micro-batch per rank is the same on any
number of ranks.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional

import torch

from rlhf.models.lora import base_of, unwrap
from rlhf.models.policies import family_of, module_at, policy_for


@dataclass
class ReplayStats:
    """Over the forwards inside ``replaying``: (token, MoE layer) pairs with a recorded routing,
    and those whose training forward would have chosen another set of experts."""

    compared: int = 0
    flipped: int = 0

    @property
    def flip_share(self) -> float:
        return self.flipped / max(self.compared, 1)

    def share(self, mesh) -> float:
        """``flip_share`` over every rank's forwards (collective)."""
        return mesh.sum(self.flipped) / max(mesh.sum(self.compared), 1)


def moe_blocks(model) -> List[tuple]:
    """``(router, experts)`` modules of each MoE layer of ``model`` (an HF causal LM, LoRA-wrapped
    or not), in layer order; [] for a dense model or a family without a policy."""
    base = unwrap(model)
    # (a reward model's or critic's scalar head keeps the causal LM's model under ``hf``)
    base = unwrap(getattr(base, "hf", base))
    family = family_of(getattr(getattr(base, "config", None), "model_type", ""))
    if family is None or not family.experts_key:
        return []
    n = family.modules
    stack = module_at(base, n.base)
    if stack is None:
        return []
    layers = stack.layers
    # (Transformers 5's layout: 3-D experts, a router returning (logits, weights, experts))
    # (LoRA on the experts: under PEFT's parameter wrappers)
    experts = [base_of(module_at(layer, n.experts)) for layer in layers]
    return [
        (module_at(layer, n.router), e)
        for layer, e in zip(layers, experts)
        if hasattr(e, "gate_up_proj")
    ]


def routers(model) -> List[torch.nn.Module]:
    """The router module of each MoE layer of ``model`` (``moe_blocks``)."""
    return [router for router, _ in moe_blocks(model)]


@contextmanager
def _on_routers(model, hook_of: Callable[[int], Callable]) -> Iterator[None]:
    """Forwards of ``model`` inside run ``hook_of(j)`` as a forward hook on the j-th MoE layer's
    router (the replay, balancing and capacity hooks)."""
    handles = [r.register_forward_hook(hook_of(j)) for j, r in enumerate(routers(model))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def replay_rows(model, routing: Optional[torch.Tensor], rows, stats: Optional[ReplayStats] = None):
    """``replaying(model, routing[rows], stats)``, or a context that does nothing when ``routing``
    is None (a dense model, replay off, or rows no rollout recorded)."""
    if routing is None:
        return nullcontext(stats)
    return replaying(model, routing[rows], stats)


@contextmanager
def replaying(
    model, routing: torch.Tensor, stats: Optional[ReplayStats] = None
) -> Iterator[ReplayStats]:
    """Forwards of ``model`` inside use the experts of ``routing`` [B, T, MoE layers, k] (int;
    -1: the forward's own) for their [B, T] tokens; ``stats`` (a new one by default) counts the
    flips."""
    policy, _ = policy_for(unwrap(model).config)
    stats = stats or ReplayStats()

    def hook(j: int):
        def replay(_module, _inputs, output):
            logits, weights, experts = output
            want = routing[:, :, j].reshape(-1, experts.shape[-1]).to(experts.device).long()
            if want.shape[0] != experts.shape[0]:
                raise RuntimeError(
                    f"routing replay: {want.shape[0]} recorded tokens for a forward of "
                    f"{experts.shape[0]}"
                )
            recorded = (want >= 0).all(-1, keepdim=True)
            chosen = torch.where(recorded, want, experts)
            same = chosen.sort(-1).values.eq(experts.sort(-1).values).all(-1)
            stats.compared += int(recorded.sum())
            stats.flipped += int((recorded[:, 0] & ~same).sum())
            probs = logits.float().softmax(-1).gather(-1, chosen)
            if policy.topk_norm:
                probs = probs / probs.sum(-1, keepdim=True)
            return logits, probs.to(weights.dtype), chosen

        return replay

    with _on_routers(model, hook):
        yield stats


@dataclass
class Balance:
    """The load-balancing terms of the MoE layers' forwards inside ``balancing``."""

    # one per MoE layer and forward: this rank's share of E · Σ_e f_e · P_e (with its gradient;
    # summed over the ranks, the term of the forward's tokens on all of them)
    losses: List[torch.Tensor] = field(default_factory=list)
    # one per MoE layer and forward: max ÷ mean tokens per expert over the ranks (1 = balanced)
    loads: List[float] = field(default_factory=list)
    # one per MoE layer and forward: this rank's share of the router z-loss (ST-MoE: the mean over
    # tokens of logsumexp(router logits)², with its gradient)
    z_losses: List[torch.Tensor] = field(default_factory=list)

    def mean_loss(self, start: int = 0) -> torch.Tensor:
        """The mean of the balancing terms from the ``start``-th on."""
        return torch.stack(self.losses[start:]).mean()

    def mean_z(self, start: int = 0) -> torch.Tensor:
        """The mean of the z-loss terms from the ``start``-th on."""
        return torch.stack(self.z_losses[start:]).mean()


def _token_weights(probs: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """1 for each routed row that is a real token of the padded batch, 0 for padding. (MoE
    families run their training forwards padded: their rows' ``packs`` is off.)"""
    n = probs.shape[0]
    if mask is not None and mask.numel() == n:
        return mask.reshape(-1).to(probs)
    return probs.new_ones(n)


@contextmanager
def balancing(
    model,
    mask: Optional[torch.Tensor],
    balance: Balance,
    reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Iterator[Balance]:
    """Forwards of ``model`` inside add their MoE layers' load-balancing terms to ``balance``, over
    the real tokens of the batch (``mask`` [B, T], 1 = real). ``reduce``: a
    sum over the ranks (each rank runs the same forwards): f_e and the token count are then those
    of the forward's tokens on all ranks, and each rank's term its tokens' share of the global one
    (the ranks' terms add up to the term of one process running them all)."""

    def watch(_module, _inputs, output):
        # (its tensors saved as usual, not by activation checkpointing, whose recompute of the
        # layer runs without this hook)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            terms(output)

    def terms(output):
        logits, _, experts = output
        probs = logits.float().softmax(-1)
        w = _token_weights(probs, mask)
        E, k = probs.shape[-1], experts.shape[-1]
        slots = w.repeat_interleave(k)
        counts = probs.new_zeros(E).index_add_(0, experts.reshape(-1), slots.to(probs.dtype))
        stats = torch.cat([counts, w.sum()[None]]).detach()
        if reduce is not None:
            stats = reduce(stats)
        counts, n = stats[:E], stats[E].clamp(min=1e-9)
        share = (w[:, None] * probs).sum(0)
        balance.losses.append(E * (counts / n * share / n).sum())
        balance.z_losses.append((w * torch.logsumexp(logits.float(), -1).square()).sum() / n)
        balance.loads.append(float(counts.max() / counts.mean().clamp(min=1e-9)))

    with _on_routers(model, lambda _j: watch):
        yield balance


@dataclass
class Dropped:
    """Over the forwards inside ``capacity``: the real tokens' (token, slot) pairs routed, and
    those dropped for a full expert."""

    routed: int = 0
    dropped: int = 0

    def share(self, mesh) -> float:
        """The dropped share over every rank's forwards (collective)."""
        return mesh.sum(self.dropped) / max(mesh.sum(self.routed), 1)


def kept_slots(experts: torch.Tensor, real: torch.Tensor, E: int, factor: float, least: int):
    """[N, k] bool: which (token, slot) pairs of ``experts`` [N, k] fit their expert's capacity,
    max(``least``, ⌈``factor`` · real tokens · k / E⌉) pairs — GShard's and DeepSpeed's order: every
    token's first choice before any second one, tokens in order within a slot; padding (``real``
    [N] false) takes no room and is kept (it is never read)."""
    N, k = experts.shape
    cap = max(least, math.ceil(factor * int(real.sum()) * k / E))
    slots = experts.t().reshape(-1)  # slot-major
    valid = real.repeat(k)
    onehot = torch.nn.functional.one_hot(slots, E) * valid[:, None]
    place = (onehot.cumsum(0) * onehot).sum(-1)  # 1-based place in its expert's queue
    return ((place <= cap) | ~valid).reshape(k, N).t()


@contextmanager
def capacity(
    model, mask: Optional[torch.Tensor], factor: float, least: int, dropped: Dropped
) -> Iterator[Dropped]:
    """Forwards of ``model`` inside route each expert at most its capacity (``kept_slots``): a
    dropped (token, slot) pair's weight is 0 — the token skips that expert (the residual carries
    it; the kept weights are not renormalised, unlike DeepSpeed's top-2 gate); ``dropped`` counts
    them. ``factor`` 0: no capacity (nothing inside changes)."""
    if not factor:
        yield dropped
        return

    def limit(_module, _inputs, output):
        logits, weights, experts = output
        n = experts.shape[0]
        real = mask.reshape(-1).bool() if mask is not None and mask.numel() == n else None
        real = real.to(experts.device) if real is not None else experts.new_ones(n, dtype=bool)
        keep = kept_slots(experts, real, logits.shape[-1], factor, least)
        dropped.routed += int(real.sum()) * experts.shape[-1]
        dropped.dropped += int((~keep & real[:, None]).sum())
        return logits, weights * keep.to(weights.dtype), experts

    with _on_routers(model, lambda _j: limit):
        yield dropped


def aux_loss_coef(model, coef: Optional[float]) -> float:
    """The load-balancing loss's weight for ``model``: ``coef``, or (None) its config's
    ``router_aux_loss_coef``; 0 for a dense model."""
    if not routers(model):
        return 0.0
    if coef is None:
        return float(getattr(unwrap(model).config, "router_aux_loss_coef", 0.0) or 0.0)
    return coef


@dataclass(frozen=True)
class RouterTerms:
    """What a training stage does to a MoE model's routing (all off for a dense model): the
    balancing and z-loss weights, the capacity factor in training and evaluation forwards (0 =
    none) and the least capacity."""

    aux_coef: float = 0.0
    z_coef: float = 0.0
    capacity_factor: float = 0.0
    eval_capacity_factor: float = 0.0
    min_capacity: int = 4

    @classmethod
    def of(cls, model, train) -> "RouterTerms":
        """From ``train.*`` (router_aux_loss_coef, router_z_loss_coef, capacity_factor,
        eval_capacity_factor, min_capacity) for ``model``."""
        if not routers(model):
            return cls()
        return cls(
            aux_coef=aux_loss_coef(model, train.router_aux_loss_coef),
            z_coef=train.router_z_loss_coef,
            capacity_factor=train.capacity_factor,
            eval_capacity_factor=train.eval_capacity_factor,
            min_capacity=train.min_capacity,
        )

    @property
    def losses(self) -> bool:
        return bool(self.aux_coef or self.z_coef)


class RouterLosses:
    """The load-balancing loss and router z-loss of one optimizer step's micro-batches (both
    training paths: SFT's step and the PPO family's update). Each micro-batch's forward runs inside
    ``micro_batch(mask)``; ``loss()`` then gives the term to add to that micro-batch's loss: the
    means of its MoE layers' terms over the ranks' i-th micro-batches taken together (each rank its
    share), ÷ the step's micro-batches, weighted, × the world size (FSDP/DDP average gradients over
    the ranks). ``last`` holds the last micro-batch's unweighted terms (÷ the micro-batches) and
    ``aux``, ``z`` their sums over the step (the metrics); ``balance`` every layer's load. Off (no
    hooks, no term) unless ``terms.losses``."""

    def __init__(self, model, terms: RouterTerms, mesh, micro_batches: int):
        self.model, self.terms, self.mesh, self.n = model, terms, mesh, micro_batches
        self.balance = Balance()
        self.aux = self.z = 0.0
        self.last = (0.0, 0.0)
        self._seen = 0

    def micro_batch(self, mask: Optional[torch.Tensor]):
        """The context a micro-batch's forward runs in (``mask`` [B, T], 1 = a real token)."""
        if not self.terms.losses:
            return nullcontext()
        self._seen = len(self.balance.losses)
        return balancing(self.model, mask, self.balance, lambda t: self.mesh.all_reduce(t.clone()))

    def loss(self) -> Optional[torch.Tensor]:
        """The last micro-batch's term (None when off)."""
        if not self.terms.losses:
            return None
        aux = self.balance.mean_loss(self._seen) / self.n
        z = self.balance.mean_z(self._seen) / self.n
        self.last = float(aux.detach()), float(z.detach())
        self.aux, self.z = self.aux + self.last[0], self.z + self.last[1]
        term = self.terms.aux_coef * aux
        if self.terms.z_coef:
            term = term + self.terms.z_coef * z
        return term * self.mesh.world_size
