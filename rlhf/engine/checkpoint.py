"""Checkpoints with torch.distributed.checkpoint (resumable, resharding-capable) and HF export.

A checkpoint is ``<stage>/checkpoints/step_<N>/``: the DCP shards of every trained model and
optimizer, one ``rng_rank<r>.pt`` per rank (tensors only, loaded with ``weights_only=True``) and
``trainer_state.json`` (step, schedulers, data position, anything else the stage keeps), with what
the stage adds (SFT's ``tokenizer/``, PPO's EMA actor). It is written under a temporary name, the
state file last, and renamed when complete, so the newest complete one always wins.

The state file also holds the checkpoint's ``manifest``: every other file's size and sha256, so a
resume can prove the files are the ones written (a truncated shard or a flipped bit on the way back
from storage is found before it is loaded, ``verify_checkpoint``). A save that cannot write (disk
full, quota, I/O error) removes its temporary directory and raises ``SaveError`` (exit 4): the
previous checkpoints and exports are untouched, since old checkpoints are rotated out only once the
new one is complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp

from rlhf.engine.mesh import Mesh
from rlhf.errors import SaveError, first_line
from rlhf.models import lora
from rlhf.outputs.fileio import atomic_write_json, remove_stale_temps, replace_dir, temp_dir_for

log = logging.getLogger("rlhf")
STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"
# in the state file: {relative path: {"size": bytes, "sha256": hex}} of every other file
MANIFEST = "manifest"
# suffix of a checkpoint that failed verification, moved out of the step_<N> pattern
DAMAGED = ".damaged"
# files are hashed in 1 MiB reads: a shard of many GiB never sits in memory
CHUNK = 1 << 20


def complete_checkpoints(ckpt_dir: Path) -> List[Path]:
    """The complete checkpoints (``step_<N>/`` with its state file) of ``ckpt_dir``, oldest
    first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    done = [
        (int(m.group(1)), p)
        for p in ckpt_dir.iterdir()
        if (m := STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()
    ]
    return [p for _, p in sorted(done)]


def latest_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    done = complete_checkpoints(ckpt_dir)
    return done[-1] if done else None


# ---- integrity: the manifest written with each checkpoint, checked before a resume ----


def file_digest(path: Path) -> Tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in ``CHUNK`` pieces."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _files(root: Path) -> List[str]:
    """Every file under ``root`` but the state file, as sorted relative POSIX paths."""
    root = Path(root)
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p != root / STATE_FILE
    )


def _gathered(mesh: Mesh, mine: dict) -> dict:
    out: dict = {}
    for part in mesh.all_gather_object(mine):
        out.update(part)
    return out


def build_manifest(root: Path, mesh: Mesh) -> Dict[str, dict]:
    """The manifest of the checkpoint being written in ``root`` (every rank's files are there: the
    run directory is shared). Collective: rank 0 lists the files, each rank hashes its share of them
    (a big sharded checkpoint is read in parallel, not by rank 0 alone) and every rank gets the
    whole."""
    names = mesh.broadcast_object(_files(root) if mesh.is_main else None)
    mine = {}
    for name in names[mesh.rank :: mesh.world_size]:
        size, sha = file_digest(Path(root) / name)
        mine[name] = {"size": size, "sha256": sha}
    return _gathered(mesh, mine)


# in an export: {"files": {name: {"size", "sha256"}}} of the files written with it
EXPORT_MANIFEST = "export.json"


def export_identity(model_dir: Path) -> Optional[str]:
    """A short digest of an export's files (its ``export.json``), or None for a directory this
    project did not export (a user's model, a hub id): what a later stage's fingerprint holds of the
    model it starts from, so that an export written again (a rerun of the stage before) is another
    input."""
    try:
        files = json.loads((Path(model_dir) / EXPORT_MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:12]


def _read_manifest(ckpt: Path) -> Tuple[Optional[dict], Optional[str]]:
    """(manifest, None); (None, None) for a checkpoint written before manifests; (None, problem)
    when the state file itself cannot be read."""
    try:
        state = json.loads((Path(ckpt) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return None, f"{STATE_FILE}: unreadable ({first_line(e)})"
    manifest = state.get(MANIFEST) if isinstance(state, dict) else None
    return (manifest if isinstance(manifest, dict) else None), None


def _check_file(path: Path, want: dict) -> Optional[str]:
    """What is wrong with one file against its manifest entry (None: nothing). The size is compared
    first, without reading the file."""
    try:
        size = path.stat().st_size
        if size != want["size"]:
            return f"size {size} bytes, expected {want['size']}"
        if file_digest(path)[1] != want["sha256"]:
            return "sha256 differs from the one recorded at save (same size: the content changed)"
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return None


def verify_checkpoint(ckpt: Path, mesh: Mesh) -> Optional[str]:
    """None when the checkpoint's files are those its manifest recorded (or it predates manifests:
    it is accepted as it always was), else the first problem as ``<file>: <check that failed>``.
    Collective: each rank checks its share of the files, rank 0 decides and broadcasts the
    verdict."""
    manifest, problem = mesh.broadcast_object(_read_manifest(ckpt) if mesh.is_main else None)
    if manifest is None:
        return problem
    names = sorted(manifest)
    found = _gathered(
        mesh,
        {n: _check_file(Path(ckpt) / n, manifest[n]) for n in names[mesh.rank :: mesh.world_size]},
    )
    verdict = next((f"{n}: {found[n]}" for n in names if found.get(n)), None)
    return mesh.broadcast_object(verdict if mesh.is_main else None)


def newest_intact_checkpoint(
    ckpt_dir: Path, mesh: Mesh
) -> Tuple[Optional[Path], List[Tuple[Path, str]]]:
    """(the newest complete checkpoint that verifies or None, [(each newer one that did not, its
    problem)], newest first). Reads only: the caller moves the damaged ones aside (``set_aside``)
    once the run starts writing, so a rerun of a finished stage still touches nothing."""
    candidates = mesh.broadcast_object(complete_checkpoints(ckpt_dir) if mesh.is_main else None)
    damaged = []
    for ckpt in reversed(candidates):
        problem = verify_checkpoint(ckpt, mesh)
        if problem is None:
            return ckpt, damaged
        damaged.append((ckpt, problem))
    return None, damaged


def set_aside(ckpt: Path) -> Path:
    """Renames a damaged checkpoint out of the ``step_<N>`` pattern (``step_<N>.damaged``, then
    ``.damaged-2``, ...): neither rotation nor a later resume sees it, and nothing in it is
    deleted."""
    ckpt = Path(ckpt)
    aside, n = ckpt.with_name(ckpt.name + DAMAGED), 1
    while aside.exists():
        n += 1
        aside = ckpt.with_name(f"{ckpt.name}{DAMAGED}-{n}")
    os.replace(ckpt, aside)
    return aside


# ---- a save that cannot write ----

# std::io::Error as safetensors and tokenizers print it
_RUST_IO = re.compile(r"\(os error \d+\)")
_SHORT_WRITE = re.compile(
    r"inline_container\.cc.*unexpected pos|PytorchStreamWriter failed|file write failed"
)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and what a DCP ``CheckpointException`` carries from each
    rank."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]
        todo += [e.__cause__, e.__context__]


def write_failure(exc: BaseException) -> Optional[str]:
    """The storage error behind a failed write, as one line; None when ``exc`` is something else (a
    bug). An ``OSError`` anywhere in the chain wins; then the forms a full disk takes where no
    OSError reaches Python: safetensors' and tokenizers' Rust ``... (os error 28)``, and
    torch.save's C++ writer that finds its file short (``unexpected pos``)."""
    causes = list(_causes(exc))
    if any(type(e).__name__.startswith("Dist") for e in causes):
        # a collective that failed (a peer died: exit 3, rlhf.launcher.watchdog), not storage
        return None
    for e in causes:
        # a lost connection or a timeout is an OSError too, and no storage error
        if isinstance(e, OSError) and not isinstance(e, (ConnectionError, TimeoutError)):
            return first_line(e)
    for e in causes:
        text = first_line(e)
        if _RUST_IO.search(text):
            return text
        if _SHORT_WRITE.search(text):
            return f"a file came out short ({text}): the disk is full or failing"
    return None


def _save_error(
    what: str, exc: BaseException, ckpt_dir: Path, mesh: Optional[Mesh] = None
) -> Optional[SaveError]:
    """``SaveError`` for a save of ``what`` that failed with ``exc`` (None when ``exc`` is no
    storage error), naming the checkpoint a rerun resumes from."""
    error = write_failure(exc)
    if error is None:
        return None
    where = ""
    if mesh is not None and mesh.world_size > 1:
        where = f" on rank {_failed_rank(exc, mesh.rank)}"
    last = latest_checkpoint(ckpt_dir)
    rerun = (
        f"it resumes from {last}"
        if last
        else "it starts the stage over (no complete checkpoint yet)"
    )
    return SaveError(
        f"saving {what} failed{where}: {error}. The partial save is discarded; earlier "
        "checkpoints and exports "
        f"are intact. Free space or fix the storage, then rerun: {rerun}"
    )


def _failed_rank(exc: BaseException, default: int) -> int:
    """The rank whose write failed: the lowest one a DCP ``CheckpointException`` names (it reaches
    every rank), else this rank."""
    for e in _causes(exc):
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and failures:
            return min(failures)
    return default


def _rng_state() -> Dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _state_dicts(engines: Dict[str, "object"]) -> dict:
    """``<engine name>.<model|optim>`` → that engine's sharded state dict (what dcp saves and loads
    into)."""
    return {
        f"{name}.{part}": value
        for name, eng in engines.items()
        for part, value in eng.state_dicts().items()
    }


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
    full_state = dict(
        state,
        step=step,
        schedulers={n: e.scheduler.state_dict() for n, e in engines.items()},
        world_size=mesh.world_size,
    )
    scalers = {
        n: e.scaler.state_dict()
        for n, e in engines.items()
        if getattr(e, "scaler", None) is not None
    }
    if scalers:
        # fp16's loss scales (none otherwise: an fp32/bf16 state file is as it was)
        full_state["loss_scalers"] = scalers
    tmp = None
    try:
        if mesh.is_main:
            remove_stale_temps(ckpt_dir)
            tmp = temp_dir_for(final)
        tmp = Path(mesh.broadcast_object(str(tmp)))
        _write_files(tmp, engines, mesh, extra)
        mesh.barrier()
        if mesh.is_main and tokenizer is not None:
            tokenizer.save_pretrained(tmp / "tokenizer")
        # after the barrier: every rank's files are complete
        manifest = build_manifest(tmp, mesh)
        if mesh.is_main:
            atomic_write_json(tmp / STATE_FILE, dict(full_state, **{MANIFEST: manifest}))
            replace_dir(tmp, final)
    except BaseException as e:
        # No barrier from here on: a rank that failed alone leaves now (its peers then see it gone).
        if mesh.is_main and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        error = _save_error(f"checkpoint {final.name}", e, ckpt_dir, mesh)
        if error is None:
            raise
        raise error from e
    if mesh.is_main:
        # only now that the new one is complete: the oldest beyond ``keep`` go
        olds = sorted(
            (int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := STEP_DIR.match(p.name))
        )
        for _, p in olds[:-keep]:
            shutil.rmtree(p, ignore_errors=True)
    mesh.barrier()
    return final


def _write_files(
    tmp: Path, engines: Dict[str, "object"], mesh: Mesh, extra: Optional[Callable[[Path], None]]
) -> None:
    """Every rank's part of a checkpoint: the DCP shards, ZeRO-1 optimizer state, its RNG,
    ``extra``."""
    sd = _state_dicts(engines)
    with _quiet_single_process():
        dcp.save(sd, checkpoint_id=str(tmp))
    for name, eng in engines.items():
        if getattr(eng, "zero1", False):
            eng.save_zero1_optimizer(tmp / f"{name}.optim_zero1.pt")
    torch.save(_rng_state(), tmp / f"rng_rank{mesh.rank}.pt")
    if extra is not None:
        extra(tmp)


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every save and load without a process group that it assumes a single process,
    which is what a one-process run is: the warning is noise in the main job's log."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="torch.distributed is disabled, unavailable or uninitialized",
            category=UserWarning,
        )
        yield


def load_checkpoint(path: Path, engines: Dict[str, "object"], mesh: Mesh) -> dict:
    """Restores every engine's model/optimizer/scheduler and this rank's RNG; returns trainer
    state."""
    path = Path(path)
    state = json.loads((path / STATE_FILE).read_text())
    state.pop(MANIFEST, None)  # the files' record, not trainer state
    sd = _state_dicts(engines)
    with _quiet_single_process():
        dcp.load(sd, checkpoint_id=str(path))
    for name, eng in engines.items():
        eng.load_state_dicts(
            {part: sd[f"{name}.{part}"] for part in ("model", "optim") if f"{name}.{part}" in sd}
        )
        if getattr(eng, "zero1", False):
            eng.load_zero1_optimizer(path / f"{name}.optim_zero1.pt")
        eng.scheduler.load_state_dict(state["schedulers"][name])
        _load_loss_scale(name, eng, state.get("loss_scalers", {}).get(name))
        # the weights changed: cached inference weights are stale
        eng.weights_version += 1
    rng_file = path / f"rng_rank{mesh.rank}.pt"
    if rng_file.is_file() and state.get("world_size") == mesh.world_size:
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return state


def _load_loss_scale(name: str, engine, saved: Optional[dict]) -> None:
    """An fp16 engine's loss scale from the checkpoint; one written without fp16 has none: the scale
    then starts afresh (said in the log). Saved state an engine without loss scaling does not use is
    ignored."""
    scaler = getattr(engine, "scaler", None)
    if scaler is None:
        return
    if saved is None:
        log.info(
            "%s: the checkpoint holds no fp16 loss scale (written without fp16): starting at %g",
            name,
            scaler.scale,
        )
        return
    scaler.load_state_dict(saved)


def export_hf(
    engine,
    out_dir: Path,
    mesh: Mesh,
    tokenizer=None,
    extra_files: Optional[dict] = None,
    adapter_dir: Optional[Path] = None,
) -> None:
    """Writes the unsharded model in Hugging Face format (safetensors) to ``out_dir``, atomically; a
    LoRA model merged (W + B·A·α/r), and its adapter alone to ``adapter_dir`` (PEFT format) when
    given. A write that fails raises ``SaveError`` on every rank (rank 0 says so in place of the
    barrier)."""
    sd = engine.full_state_dict()  # collective; full tensors on rank 0
    error = None
    if mesh.is_main:
        try:
            write_hf(engine.module, sd, out_dir, tokenizer, extra_files, adapter_dir)
        except SaveError as e:
            error = e
    message = mesh.broadcast_object(str(error) if error is not None else None)
    if error is not None:
        raise error
    if message is not None:
        raise SaveError(message)


def write_hf(
    module,
    sd: dict,
    out_dir: Path,
    tokenizer=None,
    extra_files: Optional[dict] = None,
    adapter_dir: Optional[Path] = None,
) -> None:
    """``module``'s full state dict ``sd`` as a Hugging Face model directory (one process writes). A
    write that fails removes what it was writing and raises ``SaveError``; the previous export (and
    adapter) stays."""
    # ScalarHeadModel wraps the HF model it saves
    inner = getattr(module, "hf", None)
    if inner is not None:
        module, sd = inner, {k.removeprefix("hf."): v for k, v in sd.items()}
    peft = lora.is_peft(module)
    finals = [Path(out_dir)]
    if peft and adapter_dir is not None:
        finals.append(Path(adapter_dir))
    with _export(finals) as tmps:
        if peft:
            if len(tmps) > 1:
                lora.save_adapter(module, sd, tmps[1])
            sd = lora.merged_state_dict(sd, lora.scaling(module), lora.fan_in_fan_out(module))
            module = lora.plain_model(module)
        module.save_pretrained(tmps[0], state_dict=sd, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmps[0])
        for name, obj in (extra_files or {}).items():
            atomic_write_json(tmps[0] / name, obj)
        files = {}
        for name in _files(tmps[0]):
            size, sha = file_digest(tmps[0] / name)
            files[name] = {"size": size, "sha256": sha}
        atomic_write_json(tmps[0] / EXPORT_MANIFEST, {"files": files})


@contextlib.contextmanager
def _export(finals: List[Path]):
    """Temporary directories to fill, put in place of ``finals`` when the block ends, together (a
    LoRA model and its adapter are replaced as a pair); removed instead when it fails, a storage
    error then raised as ``SaveError`` (the stage's checkpoints are in ``<stage>/checkpoints``,
    beside its exports)."""
    tmps: List[Path] = []
    try:
        for final in finals:
            tmps.append(temp_dir_for(final))
        yield tmps
        for tmp, final in zip(tmps, finals):
            replace_dir(tmp, final)
    except BaseException as e:
        for tmp in tmps:
            shutil.rmtree(tmp, ignore_errors=True)
        error = _save_error(f"the export {finals[0]}", e, finals[0].parent / "checkpoints")
        if error is None:
            raise
        raise error from e
