"""Routing replay for Mixture-of-Experts models (R3): the experts the inference mode chose for each
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
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List

import torch

from rlhf.models.lora import unwrap
from rlhf.models.policies import module_at, policy_for


@dataclass
class ReplayStats:
    """Over the forwards inside ``replaying``: (token, MoE layer) pairs with a recorded routing,
    and those whose training forward would have chosen another set of experts."""

    compared: int = 0
    flipped: int = 0

    @property
    def flip_share(self) -> float:
        return self.flipped / max(self.compared, 1)


def routers(model) -> List[torch.nn.Module]:
    """The router module of each MoE layer of ``model`` (an HF causal LM, LoRA-wrapped or not), in
    layer order; [] for a dense model or a family without a policy."""
    base = unwrap(model)
    policy, _ = policy_for(base.config)
    if policy is None or not policy.num_experts:
        return []
    n = policy.modules
    layers = module_at(base, n.base).layers
    return [module_at(layer, n.router) for layer in layers if module_at(layer, n.experts)]


@contextmanager
def replaying(model, routing: torch.Tensor) -> Iterator[ReplayStats]:
    """Forwards of ``model`` inside use the experts of ``routing`` [B, T, MoE layers, k] (int;
    -1: the forward's own) for their [B, T] tokens."""
    policy, _ = policy_for(unwrap(model).config)
    stats, handles = ReplayStats(), []

    def hook(j: int):
        def replay(_module, _inputs, output):
            logits, weights, experts = output
            want = routing[:, :, j].reshape(-1, experts.shape[-1]).to(experts.device).long()
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

    try:
        for j, router in enumerate(routers(model)):
            handles.append(router.register_forward_hook(hook(j)))
        yield stats
    finally:
        for h in handles:
            h.remove()
