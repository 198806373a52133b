"""A step's rows: some of them taken, or several batches of them joined into one, written once for
every container of rows (``Generation``, ``Episodes``, ``Rollouts``) from its dataclass's fields.

Each field says what it holds in its metadata (``per_row``, ``joined``):

- ``per_row("row")``: one entry per row along the first dimension — a [B, ...] tensor, a list of B,
  or a dict of them (a name → [B] table): taken and concatenated as they are;
- ``per_row("sequence", pad=PAD)``: [B, P + N] behind a left-padded prompt of the container's
  ``prompt_len``: joined with each batch's prompt left-padded to the longest prompt and its response
  right-padded to the longest response;
- ``per_row("response", pad=...)``: [B, N]: joined right-padded to the longest response;
- a field holding a container of its own (``Episodes.gen``): the same, field by field;
- ``joined(how)``: not per row (a batch's prompt length, seconds, sums): taken as it is, joined by
  ``how`` — ``"max"``, ``"sum"`` (a dict of floats, key by key), ``"concat"`` (lists one after the
  other), or a function of the batches' values.

A per-row field that is None in every batch stays None; None in some: ``fill`` (what a missing one
stands for: ``"zeros"``, zeros shaped as the batch's response mask) or, by default, None for the
whole (log-probs that not every batch has).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, TypeVar, Union

import torch

T = TypeVar("T")
# a sequence's pad value: the pad id the join is given
PAD = "pad_id"
Rows = Union[slice, torch.Tensor, Sequence[int]]


def per_row(kind: str = "row", pad=0, fill: Optional[str] = None) -> dict:
    """Metadata of a per-row field: ``kind`` row, sequence or response; ``pad`` the value padding
    adds (``PAD``: the join's pad id); ``fill``: what a batch without the field stands for."""
    assert kind in ("row", "sequence", "response"), kind
    return {"rows": kind, "pad": pad, "fill": fill}


def joined(how: Union[str, Callable]) -> dict:
    """Metadata of a field that is not per row: how batches' values join (module docstring)."""
    return {"rows": None, "join": how}


def take(batch: T, rows: Rows) -> T:
    """The container with only ``rows`` (a slice, or indices in the order wanted) of its rows; the
    fields that are not per row as they are."""
    out = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = take(value, rows)
        elif f.metadata.get("rows"):
            out[f.name] = _take(value, rows)
        else:
            out[f.name] = value
    return type(batch)(**out)


def join(batches: List[T], pad_id: int) -> T:
    """One container of ``batches``' rows, one batch after the other (module docstring)."""
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    prompt = _most(batches, "prompt_len")
    response = _most(batches, "response_mask", lambda m: m.shape[1])
    out = {}
    for f in dataclasses.fields(first):
        values = [getattr(b, f.name) for b in batches]
        if dataclasses.is_dataclass(values[0]):
            out[f.name] = join(values, pad_id)
        elif f.metadata.get("rows"):
            out[f.name] = _join_rows(f.metadata, values, batches, prompt, response, pad_id)
        else:
            out[f.name] = _join_other(f.metadata.get("join", "first"), values)
    return type(first)(**out)


def _take(value, rows: Rows):
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: _take(v, rows) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        if not isinstance(rows, slice):
            rows = torch.as_tensor(rows, dtype=torch.long, device=value.device)
        return value[rows]
    if isinstance(rows, slice):
        return value[rows]
    return [value[int(i)] for i in rows]


def _most(batches: list, name: str, size: Callable = lambda v: v) -> int:
    """The largest ``size`` of a field of the batches' (or of the containers they hold)."""
    return max(size(_field(b, name)) for b in batches)


def _join_rows(meta, values, batches, prompt, response, pad_id):
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        if meta["fill"] is None:
            return None
        # a batch without it: zeros shaped as its response mask (turn rewards all 0)
        masks = [_field(b, "response_mask") for b in batches]
        values = [
            torch.zeros_like(m, dtype=torch.float32) if v is None else v
            for v, m in zip(values, masks)
        ]
    if isinstance(values[0], dict):
        return {k: torch.cat([v[k] for v in values]) for k in values[0]}
    if not isinstance(values[0], torch.Tensor):
        return [x for v in values for x in v]
    kind, pad = meta["rows"], pad_id if meta["pad"] == PAD else meta["pad"]
    if kind == "row":
        return torch.cat(values)
    out = []
    for b, v in zip(batches, values):
        n = _field(b, "response_mask").shape[1]
        left = prompt - _field(b, "prompt_len") if kind == "sequence" else 0
        out.append(_pad_columns(v, left, response - n, pad))
    return torch.cat(out)


def _pad_columns(v: torch.Tensor, left: int, right: int, pad) -> torch.Tensor:
    """``v`` [B, T, ...] with ``left`` and ``right`` columns of ``pad`` added along T."""
    if v.dim() == 2:
        return torch.nn.functional.pad(v, (left, right), value=pad)
    out = v.new_full((v.shape[0], left + v.shape[1] + right, *v.shape[2:]), pad)
    out[:, left : left + v.shape[1]] = v
    return out


def _join_other(how, values):
    if callable(how):
        return how(values)
    if how == "max":
        return max(values)
    if how == "concat":
        return [x for v in values for x in v]
    if how == "sum":
        out: Dict[str, float] = {}
        for v in values:
            for k, x in v.items():
                out[k] = out.get(k, 0.0) + x
        return out
    assert how == "first", how
    return values[0]


def _field(batch, name: str):
    """A field of the batch or of the container it holds (an ``Episodes``' generation's mask)."""
    while not hasattr(batch, name):
        batch = next(v for v in vars(batch).values() if dataclasses.is_dataclass(v))
    return getattr(batch, name)
