"""Padding-free (packed) training forwards: the real tokens of a padded batch run as one sequence.

A micro-batch [B, L] with an attention mask becomes one row [1, T] of its T real tokens, positions
restarting at 0 for every sequence, and attention that never crosses a sequence boundary: every GEMM
(projections, MLP, LM head) runs over real tokens only. The outputs come back in the padded layout
(zeros at the padding), so every loss, gather and mask downstream reads them as it reads the padded
forward's, and the numbers are the padded path's up to float order (docs/performance.md says how much).

Attention: ``ATTENTION`` is registered with Transformers' attention interface and installed on a model
by ``install``. Given the packed sequences' bounds (the ``cu_seq_lens_q`` keyword Transformers carries
to every attention call) it groups the sequences by length and, per group, lays the rotated q, k, v
out one sequence per row and runs one causal SDPA call (with the layer's sliding window); without them
it is Transformers' own SDPA attention (the padded path, unchanged). Sequences are contiguous runs of
real tokens (left- or right-padded rows); a mask with holes is not packed (the padded path runs).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

log = logging.getLogger("rlhf")

ATTENTION = "rlhf_packed"  # the attention implementation name a packable model runs under
_REGISTERED = False
_SAID: set = set()  # the reasons already logged
_LAYOUT = None  # (the bounds tensor of the forward running, its _Layout)
# what one attention call costs beyond its work, in query × key pairs (``length_groups``): measured on
# the CPU machine (an SDPA call forward + backward ≈ 1 ms ≈ 16K pairs at 8 heads of 64)
CALL_COST = 16384
# a batch with less padding than this share runs padded: packing's own cost (the layout moves in every
# layer, the output scattered back) outweighs what it saves (measured, docs/performance.md)
MIN_PADDING = 0.02


@dataclass
class Packed:
    """The real tokens of a padded batch as one row, and the way back to the padded layout."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 per sequence
    cu_seqlens: torch.Tensor  # [B + 1] int32: sequence b is tokens cu_seqlens[b]:cu_seqlens[b + 1]
    max_len: int
    flat: torch.Tensor  # [T] index of each packed token in the padded [B * L]
    shape: tuple  # (B, L)

    def model_kwargs(self) -> dict:
        """What a Transformers forward takes for this packed batch (no attention mask: the boundaries
        say it all; the keyword names are Transformers', which its flash-attention varlen path reads too)."""
        return dict(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            cu_seq_lens_q=self.cu_seqlens,
            cu_seq_lens_k=self.cu_seqlens,
            max_length_q=self.max_len,
            max_length_k=self.max_len,
        )

    def kept(self, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For the last ``last`` columns of the padded layout: (the packed positions that fall in them,
        their index in the padded [B * last])."""
        L = self.shape[1]
        col = self.flat % L
        keep = col >= L - last
        rows = self.flat[keep] // L
        return keep.nonzero().squeeze(1), rows * last + (col[keep] - (L - last))

    def unpack(self, x: torch.Tensor, last: Optional[int] = None, index: Optional[torch.Tensor] = None):
        """[1, K, ...] packed outputs → [B, L, ...] (or [B, last, ...] with the ``index`` of ``kept``),
        zeros at the padding. Differentiable."""
        B, L = self.shape
        cols = L if last is None else last
        flat = self.flat if index is None else index
        out = x.new_zeros((B * cols, *x.shape[2:]))
        out = out.index_put((flat,), x[0])
        return out.view(B, cols, *x.shape[2:])


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Optional[Packed]:
    """The packed form of a padded batch, or None when a row's real tokens are not one contiguous run."""
    mask = attention_mask.bool()
    B, L = mask.shape
    lengths = mask.sum(1)
    t = torch.arange(L, device=mask.device)
    first = torch.where(mask, t, L).min(1).values
    last = torch.where(mask, t, -1).max(1).values
    if bool(((last - first + 1).clamp(min=0) != lengths).any()):
        return None
    flat = mask.reshape(-1).nonzero().squeeze(1)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=mask.device)
    cu[1:] = lengths.cumsum(0)
    starts = torch.repeat_interleave(cu[:-1].long(), lengths)
    pos = torch.arange(flat.numel(), device=mask.device) - starts
    return Packed(
        input_ids=input_ids.reshape(-1)[flat][None],
        position_ids=pos[None],
        cu_seqlens=cu,
        max_len=int(lengths.max()) if B else 0,
        flat=flat,
        shape=(B, L),
    )


def _window_mask(n: int, window: Optional[int], device) -> Optional[torch.Tensor]:
    """Causal mask under a sliding window of ``window`` keys (None: plain causal, SDPA's is_causal)."""
    if not window or n <= window:
        return None
    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]
    return ((d >= 0) & (d < window))[None, None]


def length_groups(lengths: list, call_cost: int) -> list:
    """Sequence indices in groups of similar length, each group one batched attention call: the
    grouping of the length-sorted sequences that minimises sum over groups of (rows × longest²) +
    ``call_cost`` (dynamic programming; one call for many short rows, about one per row for a few
    long ones)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: the cost of grouping the j shortest
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]] ** 2
        for i in range(j):
            c = best[i] + (j - i) * longest + call_cost
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


@dataclass
class _Layout:
    """How a forward's packed tokens are laid out for attention (computed once per forward)."""

    perm: torch.Tensor  # [T] packed positions, group by group
    inverse: torch.Tensor  # [T] position in ``perm`` of each packed token
    groups: list  # per group: (rows, longest, tokens, index into its [rows * longest] layout)


def _layout(cu: torch.Tensor) -> _Layout:
    bounds = cu.tolist()
    lengths = [e - s for s, e in itertools.pairwise(bounds)]
    device = cu.device
    parts, groups = [], []
    for group in length_groups(lengths, CALL_COST):
        group = [i for i in group if lengths[i]]
        if not group:
            continue
        lens = [lengths[i] for i in group]
        longest = max(lens)
        # built on the host from the bounds (Python integers), moved once
        parts.append(torch.cat([torch.arange(bounds[i], bounds[i + 1], device="cpu") for i in group]))
        index = torch.cat([torch.arange(n, device="cpu") + r * longest for r, n in enumerate(lens)])
        groups.append((len(group), longest, sum(lens), index.to(device)))
    perm = torch.cat(parts).to(device)
    return _Layout(perm, torch.argsort(perm), groups)


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
):
    """Transformers' attention-function signature: q/k/v [1, heads, T, d] → ([1, T, heads, d], None).

    A packed batch: the sequences are grouped by length (``length_groups``); within a group q, k and v
    (already rotated at their own positions) are laid out one sequence per row from column 0 and one
    batched causal SDPA call runs over them (with the layer's sliding window): a row's real queries see
    only its own keys, which come first, so no padding mask is needed and no attention crosses a
    sequence. Only the attention runs on that layout; every projection runs packed."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    kwargs.pop("cu_seq_lens_k", None)
    if cu is None:  # a padded batch: Transformers' SDPA attention as it is
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    kwargs.pop("max_length_q", None)
    window = kwargs.pop("sliding_window", None)
    global _LAYOUT
    if _LAYOUT is None or _LAYOUT[0] is not cu:  # once per forward: every layer gets the same bounds
        _LAYOUT = (cu, _layout(cu))
    layout = _LAYOUT[1]
    q, k, v = (x[0][:, layout.perm] for x in (query, key, value))  # [h, T, d], group by group
    outs, start = [], 0
    for rows, longest, tokens, index in layout.groups:

        def aligned(x: torch.Tensor, rows=rows, longest=longest, index=index) -> torch.Tensor:
            h, d = x.shape[0], x.shape[2]  # [h, tokens, d] -> [rows, h, longest, d]
            out = x.new_zeros(h, rows * longest, d).index_copy(1, index, x)
            return out.view(h, rows, longest, d).transpose(0, 1)

        part = slice(start, start + tokens)
        mask = _window_mask(longest, window, query.device)
        out, _ = sdpa_attention_forward(
            module,
            aligned(q[:, part]),
            aligned(k[:, part]),
            aligned(v[:, part]),
            mask,
            dropout,
            scaling,
            is_causal=mask is None,
        )  # [rows, longest, h, d]
        outs.append(out.reshape(rows * longest, *out.shape[2:])[index])
        start += tokens
    return torch.cat(outs)[layout.inverse][None], None


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def mask(*args, **kwargs):  # padded batches get SDPA's mask; a packed one (no 2-D mask) none
        if kwargs.get("attention_mask") is None:
            return None
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION, packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, mask)
    _REGISTERED = True


def hf_config(model: nn.Module):
    """The Transformers config of ``model`` (a causal LM, a scalar-head model, a LoRA-wrapped one)."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            return cfg
    return None


def why_not(model: nn.Module) -> Optional[str]:
    """None when ``model`` can run packed, else why not (said once in the log by the caller)."""
    from rlhf.models.policies import family_of

    cfg = hf_config(model)
    if cfg is None:
        return f"{type(model).__name__} is not a Transformers model"
    family = family_of(getattr(cfg, "model_type", ""))
    if family is None or not family.packs:
        return f"model_type={getattr(cfg, 'model_type', '?')!r} has no packed attention here (families: see docs)"
    if cfg._attn_implementation not in (None, "sdpa", ATTENTION):
        return f"its attention implementation is {cfg._attn_implementation!r} (packing runs on SDPA)"
    return None


def install(model: nn.Module) -> bool:
    """Makes ``model`` run ``packed_attention`` (the padded path unchanged); False, said in one log line,
    when it cannot."""
    reason = why_not(model)
    if reason is not None:
        if reason not in _SAID:
            _SAID.add(reason)
            log.info("engine.packing: padded forwards for this model: %s", reason)
        return False
    _register()
    hf_config(model)._attn_implementation = ATTENTION
    return True


def select_logits(out, logits_at: Optional[torch.Tensor]):
    """A padded forward's output with ``logits`` cut to the positions ``logits_at`` ([B, L] bool):
    [K, V], row-major (the rows of the full logits, unchanged)."""
    if logits_at is not None:
        out.logits = out.logits[logits_at.to(out.logits.device)]
    return out


def forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_at: Optional[torch.Tensor] = None,
    **kwargs,
):
    """``model(input_ids=..., attention_mask=..., **kwargs)`` run packed, its output in the padded layout:
    a tensor of per-token values [B, L] (or [B, L, k]), or a model output whose ``logits`` are [B, L, V] (or
    [B, k, V] for ``logits_to_keep=k``: the last k columns; [K, V] for ``logits_at``, a [B, L] bool of real
    positions: theirs only, row-major, the LM head run over those K alone). The padded forward runs
    instead when the batch has less than ``MIN_PADDING`` padding or its mask is not packable (``pack``
    returns None)."""
    real = int(attention_mask.sum())
    packed = None
    if real <= (1.0 - MIN_PADDING) * attention_mask.numel():
        packed = pack(input_ids, attention_mask)
    if packed is None:
        return select_logits(model(input_ids=input_ids, attention_mask=attention_mask, **kwargs), logits_at)
    kwargs.pop("position_ids", None)  # the packed positions are the mask's (a contiguous run per row)
    keep = kwargs.pop("logits_to_keep", None)
    if logits_at is not None:
        if keep:
            raise ValueError("packing.forward: logits_at and logits_to_keep together")
        if bool((logits_at & ~attention_mask.bool()).any()):
            raise ValueError("packing.forward: logits_at asks for padding positions")
        positions = logits_at.reshape(-1)[packed.flat].nonzero().squeeze(1)  # packed order = row-major
        out = model(**packed.model_kwargs(), logits_to_keep=positions, **kwargs)  # every packing family takes it
        logits = out.logits[0]
        if logits.shape[0] != positions.numel():  # a wrapper that dropped the keyword: all T came back
            logits = logits[positions]
        out.logits = logits
        return out
    last = index = None
    if keep:
        positions, index = packed.kept(keep)
        kwargs["logits_to_keep"] = positions
        last = keep
    out = model(**packed.model_kwargs(), **kwargs)
    if isinstance(out, torch.Tensor):  # per-token values [1, T] (or an ensemble's [1, T, k])
        if out.dim() > 2:
            return packed.unpack(out, last, index)
        return packed.unpack(out[..., None], last, index)[..., 0]
    out.logits = packed.unpack(out.logits, last, index)
    return out
