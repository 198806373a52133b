"""Checkpoints with torch.distributed.checkpoint (resumable, resharding-capable) and HF export.

A checkpoint is ``<stage>/checkpoints/step_<N>/``: the DCP shards of every trained model and
optimizer, one ``rng_rank<r>.pt`` per rank (tensors only, loaded with ``weights_only=True``) and
``trainer_state.json`` (step, schedulers, data position, anything else the stage keeps), with what
the stage adds (SFT's ``tokenizer/``, PPO's EMA actor). It is written under a temporary name, the
state file last, and renamed when complete, so the newest complete one always wins.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import warnings
from pathlib import Path
from typing import Callable, Dict, Optional

import torch
import torch.distributed.checkpoint as dcp

from rlhf.engine.mesh import Mesh
from rlhf.models import lora
from rlhf.outputs.fileio import atomic_write_json, remove_stale_temps, replace_dir, temp_dir_for

log = logging.getLogger("rlhf")
STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"


def latest_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None
    done = [
        (int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()
    ]
    return max(done)[1] if done else None


def _rng_state() -> Dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _state_dicts(engines: Dict[str, "object"]) -> dict:
    """``<engine name>.<model|optim>`` → that engine's sharded state dict (what dcp saves and loads into)."""
    return {f"{name}.{part}": value for name, eng in engines.items() for part, value in eng.state_dicts().items()}


def save_checkpoint(
    ckpt_dir: Path,
    step: int,
    engines: Dict[str, "object"],
    state: dict,
    mesh: Mesh,
    keep: int = 2,
    tokenizer=None,
    extra: Optional[Callable[[Path], None]] = None,
) -> Path:
    """``engines``: name → TrainEngine. ``state``: JSON-able trainer state (data position, ...).
    ``tokenizer``: saved as ``tokenizer/`` (a run that trained its own tokenizer resumes with it).
    ``extra``: called on every rank with the checkpoint's directory to write more files into it
    (the EMA actor). Both are written before the checkpoint is complete: a kill never leaves a
    complete checkpoint without them."""
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / f"step_{step:08d}"
    if mesh.is_main:
        remove_stale_temps(ckpt_dir)
    tmp = temp_dir_for(final) if mesh.is_main else None
    tmp = Path(mesh.broadcast_object(str(tmp)))
    sd = _state_dicts(engines)
    with _quiet_single_process():
        dcp.save(sd, checkpoint_id=str(tmp))
    for name, eng in engines.items():
        if getattr(eng, "zero1", False):
            eng.save_zero1_optimizer(tmp / f"{name}.optim_zero1.pt")
    torch.save(_rng_state(), tmp / f"rng_rank{mesh.rank}.pt")
    if extra is not None:
        extra(tmp)
    full_state = dict(
        state,
        step=step,
        schedulers={n: e.scheduler.state_dict() for n, e in engines.items()},
        world_size=mesh.world_size,
    )
    mesh.barrier()
    if mesh.is_main:
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "tokenizer")
        atomic_write_json(tmp / STATE_FILE, full_state)
        replace_dir(tmp, final)
        olds = sorted((int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := STEP_DIR.match(p.name)))
        for _, p in olds[:-keep]:
            shutil.rmtree(p, ignore_errors=True)
    mesh.barrier()
    return final


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every save and load without a process group that it assumes a single process,
    which is what a one-process run is: the warning is noise in the main job's log."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
        )
        yield


def load_checkpoint(path: Path, engines: Dict[str, "object"], mesh: Mesh) -> dict:
    """Restores every engine's model/optimizer/scheduler and this rank's RNG; returns trainer state."""
    path = Path(path)
    state = json.loads((path / STATE_FILE).read_text())
    sd = _state_dicts(engines)
    with _quiet_single_process():
        dcp.load(sd, checkpoint_id=str(path))
    for name, eng in engines.items():
        eng.load_state_dicts({part: sd[f"{name}.{part}"] for part in ("model", "optim") if f"{name}.{part}" in sd})
        if getattr(eng, "zero1", False):
            eng.load_zero1_optimizer(path / f"{name}.optim_zero1.pt")
        eng.scheduler.load_state_dict(state["schedulers"][name])
        eng.weights_version += 1  # the weights changed: cached inference weights are stale
    rng_file = path / f"rng_rank{mesh.rank}.pt"
    if rng_file.is_file() and state.get("world_size") == mesh.world_size:
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return state


def export_hf(
    engine,
    out_dir: Path,
    mesh: Mesh,
    tokenizer=None,
    extra_files: Optional[dict] = None,
    adapter_dir: Optional[Path] = None,
) -> None:
    """Writes the unsharded model in Hugging Face format (safetensors) to ``out_dir``, atomically; a
    LoRA model merged (W + B·A·α/r), and its adapter alone to ``adapter_dir`` (PEFT format) when given."""
    sd = engine.full_state_dict()  # collective; full tensors on rank 0
    if mesh.is_main:
        write_hf(engine.module, sd, out_dir, tokenizer, extra_files, adapter_dir)
    mesh.barrier()


def write_hf(
    module,
    sd: dict,
    out_dir: Path,
    tokenizer=None,
    extra_files: Optional[dict] = None,
    adapter_dir: Optional[Path] = None,
) -> None:
    """``module``'s full state dict ``sd`` as a Hugging Face model directory (one process writes)."""
    inner = getattr(module, "hf", None)  # ScalarHeadModel wraps the HF model it saves
    if inner is not None:
        module, sd = inner, {k.removeprefix("hf."): v for k, v in sd.items()}
    if lora.is_peft(module):
        if adapter_dir is not None:
            tmp = temp_dir_for(Path(adapter_dir))
            lora.save_adapter(module, sd, tmp)
            replace_dir(tmp, Path(adapter_dir))
        sd = lora.merged_state_dict(sd, lora.scaling(module), lora.fan_in_fan_out(module))
        module = lora.plain_model(module)
    out_dir = Path(out_dir)
    tmp = temp_dir_for(out_dir)
    module.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    for name, obj in (extra_files or {}).items():
        atomic_write_json(tmp / name, obj)
    replace_dir(tmp, out_dir)
