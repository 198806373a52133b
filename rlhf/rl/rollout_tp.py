"""A rollout worker at tensor-parallel degree > 1 (``ppo.rollout_tp_size``): one worker over that
many rollout ranks, each holding its TP slices of the weights (the trainer sends each its own).

The worker's first rank, the leader, is the worker as at TP 1 (rlhf/rl/rollout_worker.py): it
hears the requests, plays the episodes and their environments, and decides — under the model's
``Gate``, one at a time — which weights each generation uses and when an inference model is built
or released. The others follow: before each of those acts the leader says it to them (``Mirror``,
a broadcast over the worker's TP group), and they do the same with their slices, in the same
order, so that the TP all-reduces inside each forward meet. What is said: ``("build", version)``,
``("release", version)``, ``("generate", version, prompts, sampling, keys)`` (a generation's whole
input: the samples are the leader's), and None (stop). Messages are ``torch.save`` bytes read back
weights-only, as on the link (rlhf/rl/rollout_link.py).

The rollout ranks get a process group of their own (the trainers have theirs): the world of the R
rollout ranks, made from the job's store, and one TP group per worker in it.
"""

from __future__ import annotations

import datetime
import logging
import signal
from typing import Dict, List

import torch
import torch.distributed as dist

log = logging.getLogger("rlhf")


def tp_groups(store, name: str, rank: int, size: int, tp: int, timeout_s: float) -> List:
    """The rollout ranks' own world (this is its rank ``rank`` of ``size``) and a TP group per
    worker of ``tp`` consecutive ranks in it; every rollout rank calls it (a collective)."""
    prefixed = dist.PrefixStore(f"rlhf/rollout_world/{name}", store)
    dist.init_process_group(
        "gloo",
        store=prefixed,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return [dist.new_group(list(range(w * tp, (w + 1) * tp))) for w in range(size // tp)]


class Mirror:
    """The leader's side: each act said to the worker's other TP ranks before the leader does it."""

    def __init__(self, group, src: int):
        self.group, self.src = group, src

    def say(self, act) -> None:
        from rlhf.rl.link_messages import encode

        payload = encode(act)
        dist.broadcast(torch.tensor([payload.numel()]), self.src, group=self.group)
        dist.broadcast(payload, self.src, group=self.group)

    def stop(self) -> None:
        try:
            self.say(None)
        except Exception:  # (a follower already gone: torchrun ends the job)
            pass


def heard(group, src: int):
    """The leader's next act."""
    from rlhf.rl.link_messages import decode

    n = torch.zeros(1, dtype=torch.long)
    dist.broadcast(n, src, group=group)
    payload = torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(payload, src, group=group)
    return decode(payload)


class _Shards:
    """A follower's slices of the weights by version, from its trainer's queue: a build takes the
    version named and drops the older ones (builds come in version order)."""

    def __init__(self, weights):
        self.weights = weights
        self.held: Dict[int, object] = {}

    def take(self, version: int):
        while version not in self.held:
            w = self.weights.get()
            if w is None:
                raise RuntimeError(f"the trainer stopped before sending version {version}")
            self.held[w.version] = w
        for old in [v for v in self.held if v < version]:
            del self.held[old]
        return self.held[version]


def follow(spec, weights, src: int) -> None:
    """A follower rank's life: the leader's acts, done with this rank's slices, until it stops."""
    from rlhf import host_memory
    from rlhf.models.policies import policy_for
    from rlhf.rl.rollout_worker import _build

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(spec.threads)
    if spec.device == "cpu":
        host_memory.configure(spec.cfg.engine.host_malloc)
    policy = policy_for(spec.model_config)[0]
    eos, pad = spec.tokenizer.eos_token_id, spec.tokenizer.pad_token_id
    shards, models = _Shards(weights), {}
    with torch.no_grad():
        while True:
            act = heard(spec.tp_group, src)
            if act is None:
                break
            if act[0] == "build":
                models[act[1]] = _build(spec, policy, shards.take(act[1]))
            elif act[0] == "release":
                models.pop(act[1]).release()
            else:
                _, version, prompts, sp, keys = act
                models[version].generate(
                    prompts, sp, eos_id=eos, pad_id=pad, keys=keys, device=torch.device(spec.device)
                )
    for m in models.values():
        m.release()
