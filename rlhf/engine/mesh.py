"""Ranks, device, process groups and device meshes: one validated object.

cuda + nccl when there is a GPU for every process of the node (``engine.device``), else cpu + gloo.
A single process (no torchrun) runs without a process group at all; every collective helper here is
then the identity.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from rlhf import host_memory
from rlhf.config import ROLES, EngineConfig
from rlhf.errors import ConfigError
from rlhf.launcher.watchdog import start_heartbeat, stop_heartbeat
from rlhf.threads import default_threads

log = logging.getLogger("rlhf")


@dataclass
class Mesh:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: Optional[str] = None
    inference_tp_size: int = 1
    # one process with a process group of its own: FSDP2 can wrap a model there (CPU offload on a
    # GPU)
    single_group: bool = False
    # the CPU threads a rank uses and why (empty on a GPU)
    threads_why: str = ""
    # engine.threads_per_rank=0 on the CPU: the usable cores' share (threads.fit_to_model)
    auto_threads: int = 0
    _device_mesh: Any = None
    _dp_mesh: Any = None
    _expert_meshes: dict = field(default_factory=dict)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- the job's one DeviceMesh, 2-D: ("replica", "tp") ---- Inference TP group g is ranks
    # [g·tp, (g+1)·tp) (mesh["tp"]); the groups ("replica") generate different prompts. Training
    # (FSDP2 / DDP) shards or replicates over every rank: the same mesh flattened to one dimension,
    # "dp". Degrees are checked once, where the mesh is made (init_mesh).
    @property
    def device_mesh(self):
        if self._device_mesh is None and (self.distributed or self.single_group):
            tp = self.inference_tp_size
            self._device_mesh = init_device_mesh(
                self.device.type, (self.world_size // tp, tp), mesh_dim_names=("replica", "tp")
            )
        return self._device_mesh

    @property
    def dp_mesh(self):
        """The 1-D DeviceMesh ("dp", every rank) FSDP2 shards over: the 2-D mesh flattened."""
        if self._dp_mesh is None and (self.distributed or self.single_group):
            self._dp_mesh = self.device_mesh._flatten("dp")
        return self._dp_mesh

    def expert_mesh(self, ep: int):
        """The 2-D DeviceMesh ("edp", "ep") of shape (W / ep, ep) over the training ranks, for
        expert parallelism of degree ``ep`` < W (rlhf/engine/experts.py): expert group g is ranks
        [g·ep, (g+1)·ep) (``["ep"]``), the ranks holding the same experts ``["edp"]``. Made once
        per degree (collective: every rank asks)."""
        if ep not in self._expert_meshes:
            self._expert_meshes[ep] = init_device_mesh(
                self.device.type, (self.world_size // ep, ep), mesh_dim_names=("edp", "ep")
            )
        return self._expert_meshes[ep]

    @property
    def tp_rank(self) -> int:
        return self.rank % self.inference_tp_size

    @property
    def tp_index(self) -> int:
        """Which TP group this rank belongs to (the groups generate different prompts)."""
        return self.rank // self.inference_tp_size

    @property
    def tp_group(self):
        return None if self.inference_tp_size == 1 else self.device_mesh["tp"].get_group()

    def set_inference_tp(self, tp: int) -> None:
        """Another inference TP degree for this job (a new 2-D mesh; training's "dp" mesh stays)."""
        check_tp(tp, self.world_size)
        self.dp_mesh  # noqa: B018 (made from the first 2-D mesh before it is replaced)
        self.inference_tp_size, self._device_mesh = tp, None

    def tp_all_gather_object(self, obj: Any) -> list:
        if self.inference_tp_size == 1:
            return [obj]
        out = [None] * self.inference_tp_size
        dist.all_gather_object(out, obj, group=self.tp_group)
        return out

    # ---- collectives (identity in a single process) ----
    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if t.device.type != self.device.type:
            # NCCL takes CUDA tensors only: say where, not deep in c10d
            raise RuntimeError(f"all_reduce of a {t.device} tensor in a job on {self.device}")
        if self.distributed:
            dist.all_reduce(t, op=op)
        return t

    def sum(self, x: float) -> float:
        """Sum of a Python number over ranks (float64)."""
        if not self.distributed:
            return float(x)
        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        return float(self.all_reduce(t).item())

    def max(self, x: int) -> int:
        """Max of a Python integer over ranks (e.g. a count every rank must agree on)."""
        if not self.distributed:
            return int(x)
        t = torch.tensor([int(x)], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, op=dist.ReduceOp.MAX).item())

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def choose_device(requested: str, local_rank: int, local_world: int) -> torch.device:
    """The device of this process for ``engine.device`` (auto | cpu | cuda).

    auto: ``$RLHF_DEVICE`` when set (the test suite pins cpu this way), else CUDA when this node has
    a GPU for each of its processes, else the CPU — two ranks on one GPU is what NCCL refuses, so
    auto never does it and says why in the log; cuda: CUDA, or exit 2 saying what is missing."""
    if requested == "auto":
        requested = os.environ.get("RLHF_DEVICE", "auto") or "auto"
        if requested not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"RLHF_DEVICE={requested!r} is invalid: expected cpu or cuda")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda":
        if gpus == 0:
            raise ConfigError(
                "engine.device=cuda: this machine has no CUDA device (torch sees none)"
            )
        if local_world > gpus:
            raise ConfigError(
                f"engine.device=cuda: {local_world} processes on this node but {gpus} GPU(s); "
                f"NCCL cannot put two ranks on one GPU (use at most {gpus} processes per node, "
                f"or engine.device=cpu)"
            )
        return torch.device("cuda", local_rank)
    if gpus and local_world > gpus:
        log.warning(
            "engine.device=auto: %d processes on this node but %d GPU(s), and two ranks "
            "cannot share "
            "a GPU under NCCL; running on the CPU (set engine.device=cuda to make this an error)",
            local_world,
            gpus,
        )
        return torch.device("cpu")
    return torch.device("cuda", local_rank) if gpus else torch.device("cpu")


# the torch dtype of each engine.precision / engine.inference_dtype name
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def name_of(dtype: torch.dtype) -> str:
    """The precision name of a torch dtype (``DTYPES`` reversed)."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def native_bf16(device: torch.device) -> bool:
    """Whether a CUDA device computes in bf16 natively (Ampere and later, ROCm): torch's
    ``is_bf16_supported()`` also says yes where bf16 is only emulated (V100, T4), slowly."""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device)[0] >= 8


def precision_of(ecfg: EngineConfig, device: torch.device) -> str:
    """``engine.precision`` with auto resolved: bf16 on a CUDA device with native bf16, fp16 (with
    loss scaling) on an older CUDA device — what DeepSpeed-Chat's ``--dtype fp16`` default runs
    there —, fp32 on the CPU."""
    if ecfg.precision != "auto":
        return ecfg.precision
    if device.type == "cuda":
        return "bf16" if native_bf16(device) else "fp16"
    return "fp32"


def inference_dtype_of(ecfg: EngineConfig, device: torch.device) -> str:
    """``engine.inference_dtype`` with auto resolved: the training precision, except fp16 training
    on the CPU, whose inference copy is fp32: x86 CPUs without AVX512-FP16 run fp16 GEMMs 10-60x
    slower than fp32 (docs/architecture.md, measured), and the rollouts' log-probs are then
    exact."""
    if ecfg.inference_dtype != "auto":
        return ecfg.inference_dtype
    precision = precision_of(ecfg, device)
    if precision == "fp16" and device.type == "cpu":
        return "fp32"
    return precision


def check_tp(tp: int, world_size: int) -> None:
    """The inference TP degree must split the world into whole groups (exit 2 otherwise)."""
    if tp < 1 or world_size % tp != 0:
        raise ConfigError(
            f"engine.inference_tp_size={tp} does not divide the world size {world_size}"
        )


def init_mesh(engine: EngineConfig, roles=ROLES) -> Mesh:
    """Reads torchrun's environment, picks the device, initialises the process group and validates
    degrees. Resolves ``engine.precision=auto`` in place once the device is known. ``roles``: the
    models the stage places (engine.<role>.*), for whether one of them offloads."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    device = choose_device(engine.device, local_rank, local_world)
    use_cuda = device.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(device)
    engine.precision = precision_of(engine, device)
    offload = use_cuda and engine.offloads(roles)
    # FSDP2's CPU offload keeps parameters and gradients on the host: their collectives (the
    # gradient norm, the EMA's full tensors) need a CPU backend beside NCCL
    backend = engine.backend
    if not backend:
        if not use_cuda:
            backend = "gloo"
        elif offload:
            backend = "cuda:nccl,cpu:gloo"
        else:
            backend = "nccl"
    if "nccl" in backend and not use_cuda:
        raise ConfigError(
            f"engine.backend=nccl needs CUDA tensors, and this run is on the {device.type} "
            f"(use gloo, or engine.device=cuda on a machine with GPUs)"
        )
    check_tp(engine.inference_tp_size, world_size)
    threads_why, auto_threads = "", 0
    if not use_cuda:
        threads = engine.threads_per_rank
        threads_why = "engine.threads_per_rank"
        if not threads:
            threads, cores = default_threads(local_world)
            auto_threads = threads
            threads_why = f"{cores}; engine.threads_per_rank sets it"
        torch.set_num_threads(threads)
        threads_why = f"{threads} CPU threads per rank ({threads_why})"
        said = host_memory.configure(engine.host_malloc)
        if said:
            threads_why += f"; {said}"
    if world_size > 1 and not dist.is_initialized():
        device_id = device if use_cuda else None
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=engine.timeout_s),
            device_id=device_id,
        )
        # Lets the rank that sees a collective time out name the peer that went silent.
        start_heartbeat(rank, world_size)
    single_group = world_size == 1 and offload
    mesh_backend = None  # no process group
    if world_size > 1 or single_group:
        mesh_backend = backend
    if single_group and not dist.is_initialized():
        # FSDP2's CPU offload needs a (one-rank) process group
        dist.init_process_group(
            backend=backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=engine.timeout_s),
            device_id=device,
        )
    return Mesh(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world,
        device=device,
        backend=mesh_backend,
        inference_tp_size=engine.inference_tp_size,
        single_group=single_group,
        threads_why=threads_why,
        auto_threads=auto_threads,
    )


def shutdown(mesh: Mesh) -> None:
    stop_heartbeat()
    if (mesh.distributed or mesh.single_group) and dist.is_initialized():
        dist.destroy_process_group()


def end_process() -> None:
    """The last call of a torchrun worker that finished its work: flushes the logs and output, then
    ends the process (exit 0) without the interpreter's finalization. ``shutdown`` leaves the gloo
    backends' C++ threads alive while the models still reference their process groups (measured:
    2 loop and 4 worker threads per rank after ``destroy_process_group``); finalization then tears
    the groups down under a dying interpreter, and a thread that needs the GIL there aborts the
    process ("terminate called without an active exception", exit -6) after its work is done (seen
    once in CI, on a 2-rank PPO run). A plain process (no ``LOCAL_RANK``) returns and ends as
    usual."""
    if "LOCAL_RANK" not in os.environ:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
