"""Loading a checkpoint where the engine shards it: each rank reads from the safetensors files the
rows it holds, so that no process holds the whole model at load (what DeepSpeed's ``zero.Init``
does).

In a job of several processes, ``build_model`` (rlhf/models/loading.py) runs Transformers' own
``from_pretrained`` on rank 0 with its safetensors reader swapped for one that hands out
*placeholders* (``load_deferred``): a tensor of the checkpoint tensor's shape over one NaN element
(stride 0), remembered with the file and the name it stands for. Everything else from_pretrained
does happens as before, on the same random draws: the config and generation config, the key renames,
the initialisation of weights the checkpoint lacks (a new score head), weight tying, eval mode. The
placeholders of the decoder blocks' weights and of the embeddings (the bulk of a model) stay
unloaded, each tagged with its ``Source``; every other weight (final norm, score head: what a stage
may read or change before the model is wrapped, e.g. the critic's scaled head) is read from the file
at once. The tokenizer-driven resize loads the embeddings for the time of the resize only
(``loaded_for_resize``: Transformers' mean-resizing needs the old rows) and leaves them unloaded
again, their new rows kept.

When the engine wraps the model (rlhf/engine/train.py), ``plan`` tells every rank which weights rank
0 left unloaded, and ``fill`` has each rank read its part of each: its FSDP2 shard's rows
(ZeRO-2/3), or the whole tensor (ZeRO-0/1, where every rank holds a full copy anyway: read from the
files rather than broadcast from rank 0). Rank 0's other weights are broadcast as before.

Where this cannot apply, rank 0 loads the model whole, as before, and one log line says why: a
checkpoint that is not safetensors (``.bin``), one whose tensors Transformers transforms on load
beyond renaming them (fused or split projections, stacked experts: the file's tensors are not the
model's), or files some rank cannot read. One process loads as before (it holds the whole model
anyway).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger("rlhf")

# False: rank 0 loads whole, as before (the reference of bench/memory.py and of the tests; no
# setting)
ENABLED = True
# the attribute of an unloaded parameter: its Source
TAG = "_rlhf_source"
# "file:key" -> bytes this process read of it (through Source.read)
_READ: Dict[str, int] = {}


@dataclass
class Source:
    """Where an unloaded parameter's values are: tensor ``key`` of safetensors ``file`` (its first
    ``file_rows`` rows), then ``tail`` (rows computed on rank 0: an embedding's new tokens)."""

    file: str
    key: str
    file_rows: int
    tail: Optional[torch.Tensor] = None

    def read(self, handle, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[start, stop)`` (dim 0) as ``dtype``; ``handle``: the open file."""
        parts = []
        if start < self.file_rows:
            part = handle.get_slice(self.key)[start : min(stop, self.file_rows)]
            name = f"{os.path.basename(self.file)}:{self.key}"
            _READ[name] = _READ.get(name, 0) + part.numel() * part.element_size()
            parts.append(part.to(dtype))
        if stop > self.file_rows:
            parts.append(
                self.tail[max(start - self.file_rows, 0) : stop - self.file_rows].to(dtype)
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def read_counts() -> Dict[str, int]:
    """{"file:key": bytes} this process has read of each checkpoint tensor so far (bench/memory.py
    and the tests: which rank read what)."""
    return dict(_READ)


def wanted() -> bool:
    """Streaming applies: a job of several processes (one process holds the whole model anyway)."""
    return ENABLED and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((), math.nan, dtype=dtype).expand(shape)


def _is_placeholder(t: torch.Tensor) -> bool:
    return t.numel() > 1 and t.untyped_storage().nbytes() <= t.element_size()


def unloaded(p: torch.Tensor) -> Optional[Source]:
    """The Source of a parameter left unloaded, else None."""
    return getattr(p, TAG, None)


class _Reader:
    """Stands in for ``safe_open`` inside ``from_pretrained``: floating-point tensors come out as
    placeholders, each remembered with its file and name (by the storage it is the only user of)."""

    def __init__(self):
        # storage address -> (Source, the placeholder: kept alive)
        self.sources: Dict[int, tuple] = {}

    def open(self, file, framework="pt", device="cpu", **_):
        from safetensors import safe_open

        reader, handle = self, safe_open(file, framework=framework)

        class _Slice:
            def __init__(self, key):
                self.key, self.slice = key, handle.get_slice(key)

            def get_shape(self):
                return self.slice.get_shape()

            def get_dtype(self):
                return self.slice.get_dtype()

            def __getitem__(self, index):
                shape = self.slice.get_shape()
                if (
                    index is not Ellipsis
                    or math.prod(shape) < 2
                    or not self.slice.get_dtype().startswith(("F", "BF"))
                ):
                    # a part, a scalar, an integer tensor: read as it is
                    return self.slice[index]
                t = _placeholder(shape, torch.float32)  # the dtype build_model loads in
                source = Source(str(file), self.key, shape[0])
                reader.sources[t.untyped_storage().data_ptr()] = (source, t)
                return t

        class _File:
            def keys(self):
                return handle.keys()

            def metadata(self):
                return handle.metadata()

            def get_slice(self, key):
                return _Slice(key)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        return _File()

    def source(self, t: torch.Tensor) -> Optional[Source]:
        if t is None or t.device.type != "cpu" or not _is_placeholder(t):
            return None
        entry = self.sources.get(t.untyped_storage().data_ptr())
        return entry[0] if entry is not None else None


def load_deferred(load: Callable[[], nn.Module], what: str) -> nn.Module:
    """``load()`` (a ``from_pretrained``) with the bulk of the weights left unloaded; where that
    cannot apply, ``load()`` as it is (one log line naming ``what`` and why), on the same random
    draws."""
    import transformers.modeling_utils as hf

    rng = torch.get_rng_state()
    reader = _Reader()
    real_open = hf.safe_open
    hf.safe_open = reader.open
    try:
        model = load()
    except Exception as e:
        # e.g. model code writing into a weight at load: not on placeholders
        model, why = (
            None,
            f"loading on placeholders failed ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]})",
        )
    finally:
        hf.safe_open = real_open
    if model is not None:
        if not reader.sources:
            # Transformers did not read safetensors slices: the model is whole
            log.info("%s: not a safetensors checkpoint: rank 0 loaded it whole, as before", what)
            return model
        why = _not_streamable(model, reader)
    if why is None:
        _keep_bulk_unloaded(model, reader)
        return model
    log.info("%s: %s: rank 0 loads it whole, as before", what, why)
    del model
    torch.set_rng_state(rng)
    return load()


def _not_streamable(model: nn.Module, reader: _Reader) -> Optional[str]:
    """Why the model's tensors are not the checkpoint's as read (a transform beyond a rename), or
    None."""
    try:
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        # another Transformers: any conversion counts
        WeightRenaming = ()
    converted = [
        c
        for c in getattr(model, "_weight_conversions", None) or []
        if not isinstance(c, WeightRenaming)
    ]
    if converted:
        return (
            "Transformers converts this family's checkpoint tensors on load "
            f"({type(converted[0]).__name__})"
        )
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers()
    ):
        source = reader.source(t)
        if source is not None:
            read = reader.sources[t.untyped_storage().data_ptr()][1]
            if t.storage_offset() != 0 or t.shape != read.shape or any(t.stride()):
                return f"{name} is a part of checkpoint tensor {source.key}"
        elif t.is_floating_point() and t.device.type != "meta" and bool(torch.isnan(t).any()):
            return f"{name} is computed from checkpoint tensors on load"
    return None


def _bulk(model: nn.Module) -> set:
    """ids of the parameters left unloaded: the decoder blocks' and the embeddings' weights."""
    from rlhf.models.loading import decoder_layers

    try:
        params = {id(p) for p in decoder_layers(model).parameters()}
    except ValueError:
        # no decoder blocks found: the embeddings only
        params = set()
    return params | {id(p) for p in _embedding_weights(model).values()}


def _keep_bulk_unloaded(model: nn.Module, reader: _Reader) -> None:
    """Tags the bulk's placeholders with their Source; reads every other one from its file now."""
    bulk = _bulk(model)
    todo = []
    for module in model.modules():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            source = reader.source(t)
            if source is None:
                continue
            if isinstance(t, nn.Parameter) and id(t) in bulk:
                setattr(t, TAG, source)
            else:
                todo.append((t, source))
    for t, source in todo:
        if reader.source(t) is not None:  # (a tensor held twice is read once)
            _load(t, source)


def _open(files) -> contextlib.ExitStack:
    from safetensors import safe_open

    stack = contextlib.ExitStack()
    stack.handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in sorted(files)}
    return stack


def _load(p: torch.Tensor, source: Source, device=None) -> None:
    """``p`` (a placeholder or an empty tensor) holds its whole value from now on."""
    with _open([source.file]) as files:
        value = source.read(files.handles[source.file], 0, p.shape[0], p.dtype)
    p.data = value.to(device or p.device)
    if unloaded(p) is not None:
        delattr(p, TAG)


def _defer(p: torch.Tensor, source: Source) -> None:
    """``p``'s values are ``source``'s: it drops them (a placeholder) and is tagged."""
    p.data = _placeholder(p.shape, p.dtype)
    setattr(p, TAG, source)


def materialise(model: nn.Module) -> None:
    """Every unloaded parameter of ``model`` read whole (a model used without the engine's
    wrapping)."""
    for p in model.parameters():
        source = unloaded(p)
        if source is not None:
            _load(p, source)


@contextlib.contextmanager
def loaded_for_resize(model: nn.Module) -> Iterator[None]:
    """The embeddings (input and output) loaded for the body (a resize reads their rows); unloaded
    again after it, the rows it added (computed on this rank) kept in their Source."""
    before = {}
    for which, p in _embedding_weights(model).items():
        source = unloaded(p)
        if source is not None:
            _load(p, source)
            before[which] = source
    yield
    # the resize may have made new modules (an untied LM head)
    after = _embedding_weights(model)
    for which, source in before.items():
        p = after[which]
        if unloaded(p) is None and p.shape[0] >= source.file_rows and p.device.type == "cpu":
            _defer(
                p,
                Source(
                    source.file,
                    source.key,
                    source.file_rows,
                    p.detach()[source.file_rows :].clone(),
                ),
            )


def _embedding_weights(model: nn.Module) -> Dict[str, torch.Tensor]:
    out = {}
    for which, emb in (
        ("input", model.get_input_embeddings()),
        ("output", model.get_output_embeddings()),
    ):
        if emb is not None and getattr(emb, "weight", None) is not None:
            out[which] = emb.weight
    return out


def _adopt_saved_copies(model: nn.Module) -> None:
    """PEFT's trained copy of a module (modules_to_save, a deep copy made before any training) takes
    the Source of the original's unloaded weights: the copy holds the placeholders' NaN."""
    for module in model.modules():
        if not (hasattr(module, "original_module") and hasattr(module, "modules_to_save")):
            continue
        for copy in module.modules_to_save.values():
            for name, p in module.original_module.named_parameters():
                source = unloaded(p)
                q = copy.get_parameter(name)
                if source is not None and q is not p and unloaded(q) is None:
                    _defer(q, source)


def plan(model: nn.Module, mesh) -> Dict[str, Source]:
    """Collective (at wrapping): {parameter name: Source} of the weights rank 0 left unloaded, the
    same on every rank ({} when none: everything comes from rank 0, as before). Another rank's own
    placeholders (a model every rank built from the path) go to the meta device: its values arrive
    like any other rank's. Files a rank cannot read: rank 0 loads the weights whole, as before."""
    local: Dict[str, Source] = {}
    if mesh.is_main:
        _adopt_saved_copies(model)
        local = {
            n: unloaded(p)
            for n, p in model.named_parameters(remove_duplicate=False)
            if unloaded(p) is not None
        }
    else:
        unload(model)
    out = mesh.broadcast_object(local)
    if not out:
        return out
    files = {s.file for s in out.values()}
    unreadable = [f for f in files if not os.access(f, os.R_OK)]
    if mesh.sum(len(unreadable)) > 0:
        if mesh.is_main:
            materialise(model)
            log.info(
                "%s: not every rank can read the checkpoint files: rank 0 loaded the "
                "weights whole, as before",
                os.path.dirname(next(iter(files))),
            )
        return {}
    if mesh.is_main:
        log.info(
            "%s: streamed load: each rank reads its part of %d weights from the files",
            os.path.dirname(next(iter(files))),
            len({(s.file, s.key) for s in out.values()}),
        )
    return out


def unload(model: nn.Module) -> None:
    """Each unloaded parameter onto the meta device, the same object (ties kept): FSDP2 shards a
    meta parameter (or a contiguous one; a placeholder is neither)."""
    for p in model.parameters():
        if unloaded(p) is not None and p.device.type != "meta":
            torch.utils.swap_tensors(
                p, nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            )


def fill(model: nn.Module, plan: Dict[str, Source], device=None) -> None:
    """Each parameter of ``plan`` reads its part from the files: a DTensor (FSDP2, dim-0 shards) its
    local rows, a plain tensor the whole (onto ``device``, default its own). One file open at a
    time: the file pages a rank has read are mapped (resident) until its file is closed."""
    if not plan:
        return
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    by_file: Dict[str, list] = {}
    done = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        source = plan.get(name)
        if source is not None and id(p) not in done:
            done.add(id(p))
            by_file.setdefault(source.file, []).append((name, p, source))
    for file in sorted(by_file):
        with _open([file]) as files, torch.no_grad():
            handle = files.handles[file]
            for name, p, source in by_file[file]:
                if not isinstance(p, DTensor):
                    p.data = source.read(handle, 0, p.shape[0], p.dtype).to(device or p.device)
                    if unloaded(p) is not None:
                        delattr(p, TAG)
                    continue
                if any(
                    not isinstance(x, (Shard, Replicate)) or (isinstance(x, Shard) and x.dim)
                    for x in p.placements
                ):
                    raise RuntimeError(
                        f"{name}: placements {p.placements} (a streamed load reads dim-0 shards)"
                    )
                shape, offset = compute_local_shape_and_global_offset(
                    p.shape, p.device_mesh, p.placements
                )
                if shape and shape[0]:
                    local = p.to_local()
                    local.copy_(
                        source.read(handle, offset[0], offset[0] + shape[0], p.dtype).to(
                            local.device
                        )
                    )
