"""Training mode: the model wrapped for ``engine.zero_stage``, its optimizer, schedule and step.

ZeRO on FSDP2 (docs/architecture.md): ``fully_shard`` per decoder block and at the root.
  3: parameters, gradients, optimizer state sharded; parameters resharded after forward.
  2: as 3 but parameters stay gathered from forward to backward (``reshard_after_forward=False``).
  1: DDP with the optimizer state sharded (torch's ZeroRedundancyOptimizer). 0: DDP.
``engine.offload=cpu``: FSDP2's CPUOffloadPolicy (on a GPU; in one process over a one-rank process
group; refused with exit 2 where it cannot apply: on the CPU, and with ZeRO-0/1 on several
processes). ``engine.precision=bf16`` / ``fp16``: bf16 / fp16 compute with fp32 master weights and
fp32 gradient reduction (FSDP2's MixedPrecisionPolicy; autocast for a bare or DDP model); fp16 with
loss scaling (``rlhf/engine/loss_scale.py``: ``backward`` scales the loss, ``step`` unscales, skips
an overflow and updates the scale).

The stages never branch on any of this: they call ``forward``, ``backward``, ``step``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from rlhf.config import EngineConfig, TrainConfig
from rlhf.engine import experts, packing
from rlhf.engine.loss_scale import LossScaler
from rlhf.engine.mesh import DTYPES, Mesh, precision_of
from rlhf.engine.schedule import make_scheduler
from rlhf.errors import ConfigError
from rlhf.models import streaming
from rlhf.models.loading import decoder_layers
from rlhf.models.lora import adapters_disabled, is_param_wrapper, is_peft
from rlhf.models.moe import moe_blocks
from rlhf.ops import train_gemm
from rlhf.threads import fit_to_model

log = logging.getLogger("rlhf")


def _broadcast_buffers(model: nn.Module, device: torch.device, kept: Optional[list] = None) -> None:
    # Non-persistent buffers (rotary inv_freq) are in no state dict; after meta init they are
    # garbage. They live on the compute device (a rank > 0 under CPU offload materialised them on
    # the host). ``kept``: rank 0's buffers from before its own to_empty (``_buffers_of``), put back
    # first.
    for module, name, buf in kept or []:
        module._buffers[name] = buf
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            if buf.device != device:
                buf = module._buffers[name] = buf.to(device)
            dist.broadcast(buf.data, src=0)


def _buffers_of(model: nn.Module) -> list:
    return [
        (m, name, buf)
        for m in model.modules()
        for name, buf in m._buffers.items()
        if buf is not None
    ]


def wrap_model(
    model: nn.Module, mesh: Mesh, ecfg: EngineConfig, trainable: bool = True
) -> nn.Module:
    """Applies activation checkpointing and the ZeRO stage; on ranks > 0 ``model`` may be on the
    meta device (weights come from rank 0). A new parallelism is one more ``apply_*`` function
    here."""
    check_offload(ecfg, mesh)
    expert_parallel = experts.applies(model, ecfg, mesh.world_size)
    apply_ac(model, ecfg)
    apply_training_gemm(model, ecfg, mesh)
    offload = ecfg.offload == "cpu"
    if not mesh.distributed and not offload:
        _say_once_single_process(ecfg, mesh)
        return model.to(mesh.device)
    if mesh.distributed and ecfg.zero_stage in (
        0,
        1,
        # replicated weights (DDP); ZeRO-1 shards only the optimizer state
    ):
        return apply_ddp(model, mesh, trainable)
    # one process with offload: FSDP2 over its one-rank group
    return apply_fsdp(model, mesh, ecfg, expert_parallel)


def apply_training_gemm(model: nn.Module, ecfg: EngineConfig, mesh: Mesh) -> None:
    """``engine.training_gemm=onednn``: the model's fp32 Linear GEMMs through oneDNN on the CPU
    (rlhf/ops/train_gemm.py); one line in the log. Unavailable in this build: exit 2 (``auto``:
    torch's GEMMs)."""
    if ecfg.training_gemm == "torch" or mesh.device.type != "cpu":
        return
    if not train_gemm.available():
        if ecfg.training_gemm == "auto":
            return
        raise ConfigError(
            "engine.training_gemm=onednn: this torch build has no oneDNN (mkldnn) linear op on "
            "the CPU; set engine.training_gemm=torch"
        )
    n = train_gemm.install(model)
    if mesh.is_main and n:
        log.info(
            "engine.training_gemm=%s: %d linear layers%s train through oneDNN's GEMMs",
            ecfg.training_gemm,
            n,
            f" of the {ecfg.role}" if ecfg.role else "",
        )


def check_offload(ecfg: EngineConfig, mesh: Mesh) -> None:
    """``engine.offload=cpu`` (or ``engine.<role>.offload``) applies or stops the run (exit 2)
    saying why: never silently ignored."""
    if ecfg.offload != "cpu":
        return
    key = ecfg.key("offload")
    if mesh.device.type == "cpu":
        raise ConfigError(
            f"{key}=cpu: this run trains on the CPU, where the model is in host memory already: "
            f"there is nothing to offload (set {key}=none)"
        )
    if mesh.distributed and ecfg.zero_stage in (0, 1):
        raise ConfigError(
            f"{key}=cpu needs ZeRO-2 or 3, not {ecfg.key('zero_stage')}={ecfg.zero_stage}: the "
            f"offload is FSDP2's, of the sharded parameters, gradients and optimizer state"
        )


def apply_ac(model: nn.Module, ecfg: EngineConfig) -> None:
    """``engine.activation_checkpointing``: recompute the decoder blocks' activations in backward
    (Transformers' non-reentrant gradient checkpointing)."""
    if ecfg.activation_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_ddp(model: nn.Module, mesh: Mesh, trainable: bool) -> nn.Module:
    """ZeRO-0/1: replicated weights, rank 0's everywhere; DDP reduces the gradients of a trained
    model. The weights rank 0 left unloaded (rlhf/models/streaming.py) every rank reads whole from
    the files."""
    plan = streaming.plan(model, mesh)
    if not mesh.is_main:
        model = model.to_empty(device=mesh.device)
        if hasattr(model, "tie_weights"):  # to_empty unties shared parameters
            model.tie_weights()
    streaming.fill(model, plan, mesh.device)
    model = model.to(mesh.device)
    if not trainable or plan:
        # replicate rank 0's weights (but those read from the files)
        read = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in plan}
        for t in [p for p in model.parameters() if id(p) not in read] + list(model.buffers()):
            dist.broadcast(t.data, src=0)
        if not trainable:  # nothing to reduce
            return model
    # DDP broadcasts rank 0's parameters and buffers at construction (done above with a plan).
    device_ids = None  # a CPU module
    if mesh.device.type == "cuda":
        device_ids = [mesh.device.index]
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, init_sync=not plan)


def apply_fsdp(
    model: nn.Module, mesh: Mesh, ecfg: EngineConfig, expert_parallel: bool = False
) -> nn.Module:
    """ZeRO-2/3: FSDP2 ``fully_shard`` per decoder block and at the root (ZeRO-3 reshards the
    parameters after forward), bf16 / fp16 through its mixed-precision policy, optional CPU
    offload."""
    # Rank 0's full weights, by reference: fully_shard copies its shard out of each parameter and
    # leaves the original tensor alone, so no second full copy is needed (the originals are freed
    # once they are broadcast below). A new dict: set_model_state_dict replaces its entries. Those
    # rank 0 left unloaded (rlhf/models/streaming.py) each rank reads its shard of from the files.
    plan = streaming.plan(model, mesh)
    full_sd = (
        {k: v.detach() for k, v in model.state_dict().items() if k not in plan}
        if mesh.is_main
        else {}
    )
    kept = _buffers_of(model) if plan and mesh.is_main else None  # rank 0 empties its model too
    streaming.unload(model)
    kwargs = dict(
        mesh=mesh.dp_mesh, reshard_after_forward=ecfg.zero_stage == 3 or not mesh.distributed
    )
    if precision_of(ecfg, mesh.device) != "fp32":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute_dtype(ecfg, mesh), reduce_dtype=torch.float32
        )
    if ecfg.offload == "cpu":  # a GPU run (check_offload)
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if expert_parallel:
        # the experts sharded over their expert group (rlhf/engine/experts.py): beside FSDP2's
        # shards and never gathered (the group is the whole mesh), or FSDP2's over the groups
        ep = ecfg.expert_parallel
        ignored = experts.shard(model, mesh, ep, kwargs)
        if ignored:
            kwargs["ignored_params"] = ignored
        if mesh.is_main:
            _say_once(
                f"ep{ep}",
                "expert parallelism: %s experts per rank in groups of %d ranks%s",
                experts.per_rank(model, ep),
                ep,
                "" if ignored else f" (FSDP2 over the {mesh.world_size // ep} groups)",
            )
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if plan or not mesh.is_main:
        if ecfg.offload == "cpu":
            model.to_empty(device="cpu")
        else:
            model.to_empty(device=mesh.device)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not plan)
    set_model_state_dict(model, full_sd, options=opts)
    streaming.fill(model, plan)
    _broadcast_buffers(model, mesh.device, kept)
    return model


def compute_dtype(ecfg: EngineConfig, mesh: Mesh) -> torch.dtype:
    """The dtype the model computes in: ``engine.precision`` (auto resolved) as a torch dtype."""
    return DTYPES[precision_of(ecfg, mesh.device)]


def autocast(mesh: Mesh, ecfg: EngineConfig, is_fsdp: bool):
    """bf16 / fp16 compute for a bare or DDP model (FSDP2 casts through its MixedPrecisionPolicy
    instead)."""
    dtype = compute_dtype(ecfg, mesh)
    if dtype != torch.float32 and not is_fsdp:
        return torch.autocast(mesh.device.type, dtype=dtype)
    return contextlib.nullcontext()


def loss_scaler(ecfg: EngineConfig, mesh: Mesh) -> Optional[LossScaler]:
    """The loss scaler of a model trained in fp16 (None otherwise), its settings said in the log."""
    if compute_dtype(ecfg, mesh) != torch.float16:
        return None
    scaler = LossScaler(ecfg.fp16, ecfg.role, mesh.is_main)
    log.info("%s", scaler.describe())
    if mesh.device.type == "cpu":
        _say_once(
            "fp16_cpu",
            "fp16 on the CPU: correct but slow (no fp16 GEMM units on x86: 10-60x fp32's "
            "time, measured)",
        )
    return scaler


_SAID: set = set()


def _say_once(key: str, message: str, *args) -> None:
    if key not in _SAID:
        _SAID.add(key)
        log.info(message, *args)


def _say_once_single_process(ecfg: EngineConfig, mesh: Mesh) -> None:
    """In one process there is nothing to shard: ZeRO stages and offload do not apply. Said once."""
    _say_once(
        "single",
        "one process: the model trains unwrapped on %s (engine.zero_stage=%d applies from "
        "2 processes on)",
        mesh.device,
        ecfg.zero_stage,
    )


def param_groups(model: nn.Module, tcfg: TrainConfig, lr: float):
    """AdamW groups: no decay on norms and biases (every parameter with fewer than 2 dims); a
    Mixture-of-Experts model's experts in a group of their own (DeepSpeed's MoE parameter groups),
    at ``train.expert_lr_scale`` × the learning rate with ``train.expert_weight_decay`` (unset:
    train.weight_decay)."""
    base = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    experts = {
        id(getattr(e, n)) for _, e in moe_blocks(base) for n in ("gate_up_proj", "down_proj")
    }
    # (and their LoRA adapters: model.lora.experts)
    experts |= {id(p) for m in base.modules() if is_param_wrapper(m) for p in m.parameters()}
    decay, no_decay, routed = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in experts:
            routed.append(p)
        elif p.ndim >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [
        {"params": decay, "weight_decay": tcfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if routed:
        wd = tcfg.weight_decay if tcfg.expert_weight_decay is None else tcfg.expert_weight_decay
        groups.append({"params": routed, "weight_decay": wd, "lr": lr * tcfg.expert_lr_scale})
    return groups


def adam_kernel(model: nn.Module) -> dict:
    """AdamW's implementation: the fused kernel (one pass over each parameter; on the CPU machine
    3-8x the foreach step, docs/performance.md) where every trainable parameter is a floating-point
    tensor on a CPU or CUDA device, else foreach."""
    params = [p for p in model.parameters() if p.requires_grad]
    if params and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params):
        return {"fused": True}
    return {"foreach": True}


def run_forward(model: nn.Module, packs: bool, batch: dict):
    """``model(**batch)``, packed (padding-free, rlhf/engine/packing.py) when ``packs`` and the
    batch has an attention mask; the output in the padded layout either way. ``logits_at`` ([B, L]
    bool, real tokens only) asks for the logits of those positions alone: ``logits`` is then [K, V]
    in row-major order (the packed path runs the LM head over those K positions only)."""
    if packs and batch.get("attention_mask") is not None:
        return packing.forward(model, **batch)
    at = batch.pop("logits_at", None)
    return packing.select_logits(model(**batch), at)


class FrozenModel:
    """A model that only runs forward (reference policy, reward model), sharded like the trainee."""

    def __init__(self, model: nn.Module, mesh: Mesh, ecfg: EngineConfig):
        for p in model.parameters():
            p.requires_grad_(False)
        self.mesh, self.ecfg = mesh, ecfg
        self.packs = ecfg.packing and packing.install(model)
        self.model = wrap_model(model, mesh, ecfg, trainable=False).eval()
        self.is_fsdp = isinstance(self.model, FSDPModule)
        # never updated: a hybrid engine over it (a judge's decoding, rlhf.generate) reuses the
        # inference weights it kept
        self.weights_version = 0

    @property
    def module(self) -> nn.Module:
        if isinstance(self.model, nn.parallel.DistributedDataParallel):
            return self.model.module
        return self.model

    @torch.no_grad()
    def forward(self, **batch):
        with autocast(self.mesh, self.ecfg, self.is_fsdp):
            return run_forward(self.model, self.packs, batch)


class AdaptersOff:
    """A LoRA engine's base model, frozen: the same modules run with the adapters off (PPO's and
    DPO's reference policy without a second copy of the weights; equal to the base model loaded
    apart)."""

    def __init__(self, engine: "TrainEngine"):
        self.engine = engine

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @torch.no_grad()
    def forward(self, **batch):
        with adapters_disabled(self.engine.module):
            return self.engine.forward(**batch)


def reference_for(engine: "TrainEngine", build, mesh: Mesh, ecfg: EngineConfig):
    """The frozen reference of a trained policy: its own base when it has LoRA adapters, else a
    second model from ``build()`` (the same starting weights), sharded like the trainee."""
    if is_peft(engine.module):
        return AdaptersOff(engine)
    return FrozenModel(build(), mesh, ecfg)


class TrainEngine:
    """A trainable model in training mode: forward/backward/step, state for checkpoints, full
    weights."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        ecfg: EngineConfig,
        tcfg: TrainConfig,
        total_steps: Optional[int] = None,
        lr: Optional[float] = None,
    ):
        self.mesh, self.ecfg, self.tcfg = mesh, ecfg, tcfg
        if mesh.auto_threads:
            # a small model trains on one thread (rlhf/threads.py)
            said = fit_to_model(sum(p.numel() for p in model.parameters()), mesh.auto_threads)
            if said and mesh.is_main:
                log.info("%s", said)
        self.packs = ecfg.packing and packing.install(model)
        self.model = wrap_model(model, mesh, ecfg)
        self.is_fsdp = isinstance(self.model, FSDPModule)
        self.is_ddp = isinstance(self.model, nn.parallel.DistributedDataParallel)
        self.zero1 = self.is_ddp and ecfg.zero_stage == 1
        lr = lr or tcfg.lr
        adam = dict(lr=lr, betas=tuple(tcfg.betas), eps=tcfg.eps, **adam_kernel(self.model))
        if self.zero1:
            # ZeRO-1: each rank keeps the AdamW state of its share of the parameters
            groups = [g for g in param_groups(self.model, tcfg, lr) if g["params"]]
            self.optimizer = ZeroRedundancyOptimizer(
                groups, optimizer_class=torch.optim.AdamW, **adam
            )
        else:
            self.optimizer = torch.optim.AdamW(param_groups(self.model, tcfg, lr), **adam)
        self.scheduler = make_scheduler(self.optimizer, tcfg, total_steps or tcfg.max_steps)
        # bumped whenever the weights change (step, checkpoint load)
        self.weights_version = 0
        self.scaler = loss_scaler(ecfg, mesh)  # fp16: the loss scale (checkpointed)
        # the last step() was skipped for an fp16 overflow (the scaler's to handle)
        self.overflowed = False

    # ---- the model as HF code knows it ----
    @property
    def module(self) -> nn.Module:
        return self.model.module if self.is_ddp else self.model

    def forward(self, **batch):
        with autocast(self.mesh, self.ecfg, self.is_fsdp):
            return run_forward(self.model, self.packs, batch)

    def train(self):
        self.model.train()
        return self

    def eval(self):
        self.model.eval()
        return self

    def backward(self, loss: torch.Tensor, sync: bool = True) -> None:
        """``sync=False`` on all but the last micro-batch of an accumulation window. fp16: the loss
        is multiplied by the loss scale first."""
        if self.scaler is not None:
            loss = loss * self.scaler.scale
        if self.is_fsdp:
            self.model.set_requires_gradient_sync(sync)
            loss.backward()
        elif self.is_ddp and not sync:
            with self.model.no_sync():
                loss.backward()
        else:
            loss.backward()

    def step(self) -> float:
        """Clips, steps optimizer and schedule; returns the gradient norm before clipping. A
        non-finite norm skips the update (gradients dropped, weights and schedule unchanged). fp16:
        the gradients are unscaled first, the ranks agree on whether any of them overflowed (the
        FSDP2 norm's all-reduce, or one of its own over DDP), and the loss scaler takes a skip as an
        overflow (``overflowed``) and updates the scale."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale([p.grad for p in params])
        max_norm = self.tcfg.grad_clip if self.tcfg.grad_clip > 0 else float("inf")
        norm = clip_grad_norm(params, max_norm)
        finite = bool(torch.isfinite(norm))
        if self.scaler is not None:
            if self.mesh.distributed and not self.is_fsdp:  # (FSDP2's norm is all-reduced already)
                # one rank's overflow skips the step on all
                finite = self.mesh.max(int(not finite)) == 0
            self.overflowed = not finite
            self.scaler.update(overflow=not finite)  # (raises at the minimum scale)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            return float(norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.weights_version += 1
        return float(norm)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def scale_metrics(self, prefix: str) -> dict:
        """fp16: ``<prefix>/loss_scale`` and ``<prefix>/skipped_steps`` for the step's line; else
        nothing."""
        return self.scaler.metrics(prefix) if self.scaler is not None else {}

    # ---- state ----
    def state_dicts(self):
        """Sharded model and optimizer state (DTensors under FSDP2) for torch.distributed.checkpoint
        (ZeRO-1: the model only; its optimizer state is saved apart, ``save_zero1_optimizer``)."""
        if self.zero1:
            return {"model": get_model_state_dict(self.model)}
        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optimizer),
        }

    def load_state_dicts(self, sd) -> None:
        set_model_state_dict(self.model, sd["model"])
        if not self.zero1:
            set_optimizer_state_dict(self.model, self.optimizer, sd["optim"])

    def save_zero1_optimizer(self, path) -> None:
        """ZeRO-1: gathers every rank's share of the AdamW state on rank 0, which writes it
        (collective); the file loads on any world size (``load_zero1_optimizer`` re-partitions
        it)."""
        self.optimizer.consolidate_state_dict(to=0)
        if self.mesh.is_main:
            torch.save(self.optimizer.state_dict(), path)

    def load_zero1_optimizer(self, path) -> None:
        self.optimizer.load_state_dict(
            torch.load(path, weights_only=True, map_location=self.mesh.device)
        )

    def full_state_dict(self, all_ranks: bool = False) -> dict:
        """Unsharded weights: on rank 0 only, on CPU (default), or on every rank (``all_ranks``)."""
        if not self.is_fsdp:
            sd = self.module.state_dict()
            if not (all_ranks or self.mesh.is_main):
                return {}
            return {k: v.detach().cpu() for k, v in sd.items()}
        opts = StateDictOptions(full_state_dict=True, cpu_offload=not all_ranks)
        return retie(self.model, get_model_state_dict(self.model, options=opts))


def clip_grad_norm(params: list, max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` over ``params`` (the total norm before clipping, a full tensor);
    gradients on several device meshes (expert parallelism of degree < W: the experts' sharded over
    their own mesh) get the norm of all of them, each mesh's part reduced on its own."""
    meshes: dict = {}
    for p in params:
        # (DeviceMesh compares by layout: FSDP2 makes one object per parameter)
        meshes.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if len(meshes) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    squares = []
    for group in meshes.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group])
        squares.append((n.full_tensor() if hasattr(n, "full_tensor") else n).float().square())
    total = torch.stack(squares).sum().sqrt()
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1:
        for p in params:
            p.grad.mul_(coef)
    return total


def retie(module: torch.nn.Module, sd: dict) -> dict:
    """``sd`` with each weight the module shares under several names (tied embeddings) as ONE tensor
    under all of them, as ``module.state_dict()`` has it: gathered from shards, they come back as
    separate copies, which ``save_pretrained`` would write twice (a 2-rank export with an
    ``lm_head.weight`` the 1-process one does not have)."""
    first: dict = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if name in sd:
            owner = first.setdefault(id(param), name)
            if owner != name:
                sd[name] = sd[owner]
    return sd
