"""Expert parallelism (``engine.expert_parallel=ep``): each rank holds E / ep of a MoE layer's
experts and the tokens routed to them travel there and back with all-to-all inside an expert group
of ep consecutive ranks.

Under FSDP2 (ZeRO-2/3) the experts' 3-D weights ``gate_up_proj`` [E, 2·I, hidden] and
``down_proj`` [E, hidden, I] become DTensors sharded on dim 0 over the expert group. With ep = W
that is the training mesh, the layout FSDP2 would give them, so checkpoints, the exported weights,
gradient clipping and the optimizer see no difference — but FSDP2 leaves them alone
(``ignored_params``): they are never all-gathered. With ep < W the W / ep groups hold the same
experts and FSDP2 shards them over the ranks that hold them (a 2-D mesh ("edp", "ep"),
``Mesh.expert_mesh``), gathering a group's experts before the layer's forward as it gathers the
dense weights; the gradient norm then adds the two meshes' parts (``train.clip_grad_norm``).
A MoE layer's forward on a rank (its tokens [N, hidden], each token's top k experts and weights,
from the router as before):

  1. the (token, slot) pairs sorted by expert, hence by the rank of the group that holds it; each
     rank's count exchanged, then the tokens' hidden states (all-to-all, differentiable);
  2. each local expert runs one GEMM pair on the rows it received (grouped by expert);
  3. the results go back by the reverse all-to-all, are scaled by the routing weights and summed
     per token (``index_add``) — the per-token sum HF's loop over experts makes.

The group's tokens reach an expert's copy, so its gradient there is the sum over the group's
ranks of their losses' gradients: divided by ep (a hook on the local weights) and averaged by
FSDP2 over the W / ep groups, it is the average over the W ranks FSDP2 takes of the other weights'.
All ranks must run the same forwards in the same order (the FSDP2 collectives already make them).
ep must divide W and E.
"""

from __future__ import annotations

import types
from typing import List, Set

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from rlhf.errors import ConfigError
from rlhf.models.lora import has_param_adapters
from rlhf.models.moe import moe_blocks

WEIGHTS = ("gate_up_proj", "down_proj")


def applies(model, ecfg, world: int) -> bool:
    """Whether ``engine.expert_parallel`` shards ``model``'s experts, or exit 2 saying why not. The
    trained policy (``engine.actor``, or a stage's one model) must be able to take it; another
    model of the job (a reference, reward model, critic, teacher, judge) takes it where it is a
    MoE model under ZeRO-2/3 and is otherwise left as it is."""
    ep, key = ecfg.expert_parallel, "engine.expert_parallel"
    if ep == 1:
        return False
    if world % ep:
        raise ConfigError(f"{key}={ep} does not divide the world size ({world})")
    blocks = moe_blocks(model)
    if ecfg.role not in ("", "actor") and (not blocks or ecfg.zero_stage < 2):
        return False
    if ecfg.zero_stage < 2:
        raise ConfigError(
            f"{key}={ep} needs ZeRO-2 or 3 (FSDP2), not {ecfg.key('zero_stage')}="
            f"{ecfg.zero_stage}: the experts are sharded beside FSDP2's shards"
        )
    if ecfg.offload == "cpu":
        raise ConfigError(
            f"{key}={ep} with {ecfg.key('offload')}=cpu: the experts are not FSDP2's to offload "
            f"(set one of them off)"
        )
    if has_param_adapters(model):
        raise ConfigError(
            f"{key}={ep} with model.lora.experts=true: LoRA on expert-parallel experts is not "
            f"built (set one of them off)"
        )
    if not blocks:
        raise ConfigError(
            f"{key}={ep}: {type(model).__name__} has no Mixture-of-Experts layers of a family this "
            f"project knows (Qwen3-MoE, Mixtral, Qwen2-MoE)"
        )
    experts = blocks[0][1].gate_up_proj.shape[0]
    if experts % ep:
        raise ConfigError(f"{key}={ep} does not divide the model's {experts} experts")
    return True


def shard(model, mesh, ep: int, fsdp: dict) -> Set[torch.nn.Parameter]:
    """Makes each MoE layer's expert weights DTensors sharded on dim 0 over the expert group (ep
    consecutive ranks of the training mesh; rank j of the group keeps experts [j·E/ep,
    (j+1)·E/ep); values as they are, meta ones stay meta for the caller to fill) and their forward
    expert-parallel. ep = W: the group is the whole mesh, FSDP2's own layout; returns the new
    parameters for FSDP2's ``ignored_params``. ep < W: the W / ep groups hold the same experts, and
    FSDP2 (``fsdp``: its keyword arguments) shards each group's experts over the ranks that hold
    them (``mesh.expert_mesh(ep)["edp"]``), gathering them before the layer's forward (as it does
    the dense weights over every rank); returns nothing to ignore."""
    if ep == mesh.world_size:
        ep_mesh, edp_mesh = mesh.dp_mesh, None
    else:
        two = mesh.expert_mesh(ep)
        ep_mesh, edp_mesh = two["ep"], two["edp"]
    rank, group = ep_mesh.get_local_rank(), ep_mesh.get_group()
    params: Set[torch.nn.Parameter] = set()
    for _, experts in moe_blocks(model):
        for name in WEIGHTS:
            full = getattr(experts, name)
            local = full.detach().chunk(ep, dim=0)[rank].clone()
            p = torch.nn.Parameter(
                DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False),
                requires_grad=full.requires_grad,
            )
            setattr(experts, name, p)
            params.add(p)
        # (the gradient of a rank's experts sums its group's tokens: divided by ep here, by W / ep
        # in FSDP2's average over the groups)
        experts.ep_group, experts.ep_world = group, ep
        experts.forward = types.MethodType(forward, experts)
        if edp_mesh is not None:
            fully_shard(experts, **{**fsdp, "mesh": edp_mesh})
    return params if edp_mesh is None else set()


def per_rank(model, ep: int) -> int:
    """The experts of each MoE layer a rank holds at expert parallelism ``ep``."""
    blocks = moe_blocks(model)
    return blocks[0][1].gate_up_proj.shape[0] // ep if blocks else 0


def _local(weight: torch.Tensor, world: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's experts of a sharded weight, in the compute dtype; their gradient divided by the
    world size (FSDP2's average over the ranks' losses)."""
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    local = local.to(dtype)
    if local.requires_grad and world > 1:
        local.register_hook(lambda g: g / world)
    return local


def _exchange(x: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:
    """Rows of ``x`` to the ranks (``in_splits`` rows to each, in rank order), rows from them
    (``out_splits``); differentiable."""
    if not x.requires_grad:
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out
    out = funcol.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)
    return funcol.wait_tensor(out)


def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """An HF experts module's forward (``hidden`` [N, H], ``top_k_index`` / ``top_k_weights``
    [N, k]) with this rank's experts and all-to-all to the others' (the module's docstring)."""
    world, group = self.ep_world, self.ep_group
    n_local = self.gate_up_proj.shape[0] // world
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    # (token, slot) pairs in expert order: the experts of rank 0 first, then rank 1's, ...
    order = flat.argsort(stable=True)
    token = order // k
    sent = torch.bincount(flat // n_local, minlength=world)
    got = torch.empty_like(sent)
    dist.all_to_all_single(got, sent, group=group)
    send, recv = sent.tolist(), got.tolist()
    rows = _exchange(hidden.index_select(0, token), recv, send, group)
    # each received row's local expert
    which = _exchange((flat[order] % n_local)[:, None], recv, send, group)[:, 0]
    by_expert = which.argsort(stable=True)
    counts = torch.bincount(which, minlength=n_local).tolist()
    gate_up = _local(self.gate_up_proj, world, hidden.dtype)
    down = _local(self.down_proj, world, hidden.dtype)
    xs = rows.index_select(0, by_expert)
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            gate, up = torch.nn.functional.linear(xs[start : start + n], gate_up[e]).chunk(2, -1)
            outs.append(torch.nn.functional.linear(self.act_fn(gate) * up, down[e]))
            start += n
    if outs:
        ys = torch.cat(outs)
    else:
        # no rows here: the received rows and the weights still take part in backward (zero
        # gradients), as every rank's must for the all-to-alls and the gradient norm to line up
        ys = xs * 0 + 0 * (gate_up.sum() + down.sum())
    # back to the received order, then to the ranks the rows came from
    back = ys.new_empty(ys.shape).index_copy(0, by_expert, ys)
    back = _exchange(back, send, recv, group)
    back = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
    return torch.zeros_like(hidden).index_add(0, token, back.to(hidden.dtype))
