"""Padding-free (packed) training forwards: the real tokens of a padded batch run as one sequence.

A micro-batch [B, L] with an attention mask becomes one row [1, T] of its T real tokens, positions
counted from each sequence's first token, and attention that never crosses a sequence boundary:
every GEMM (projections, MLP, LM head) runs over real tokens only. The outputs come back in the
padded layout (zeros at the padding), so every loss, gather and mask downstream reads them as it
reads the padded forward's, and the numbers are the padded path's up to float order
(docs/performance.md says how much).

Shared prefixes: rows that begin with the same tokens (a preference pair's chosen and rejected
sequences share their prompt, a GRPO group its prompt) pack their common prefix once: the rows are
taken in the lexicographic order of their tokens, and each row's own tokens continue what it has in
common with the row before (positions from there on); its attention reads that prefix's keys and
values. Every layer computes the prefix once for all the rows that share it. Exact up to float
order: in a causal model a token's hidden states depend on the tokens before it alone (with dropout
on, rows that share a prefix share its dropout draw there).

Attention: ``ATTENTION`` is registered with Transformers' attention interface and installed on a
model by ``install``. Given the packed blocks' bounds (the ``cu_seq_lens_q`` keyword Transformers
carries to every attention call) and the layout ``pack`` records on them (which tokens each row
reads), it groups the rows by length and, per group, lays the rotated q, k, v out one row per SDPA
row and runs one causal SDPA call (with the layer's sliding window); without bounds it is
Transformers' own SDPA attention (the padded path, unchanged). Sequences are contiguous runs of real
tokens (left- or right-padded rows); a mask with holes is not packed (the padded path runs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

log = logging.getLogger("rlhf")

# the attention implementation name a packable model runs under
ATTENTION = "rlhf_packed"
_REGISTERED = False
_SAID: set = set()  # the reasons already logged
# what one attention call costs beyond its work, in query × key pairs (``length_groups``): measured
# on the CPU machine (an SDPA call forward + backward ≈ 1 ms ≈ 16K pairs at 8 heads of 64)
CALL_COST = 16384
# a batch with less padding than this share runs padded: packing's own cost (the layout moves in
# every layer, the output scattered back) outweighs what it saves (measured, docs/history.md)
MIN_PADDING = 0.02
# no positions (host-side, moved with the rest)
_EMPTY = torch.zeros(0, dtype=torch.long, device="cpu")
# rows that begin alike pack their common prefix once (``pack``); False packs every row whole
# (bench/stages.py's ``packed_whole`` variant measures what sharing adds)
SHARE_PREFIXES = True


@dataclass
class Packed:
    """The real tokens of a padded batch as one row, and the way back to the padded layout."""

    input_ids: torch.Tensor  # [1, T]
    # [1, T], restarting at 0 per sequence (at its shared prefix's end)
    position_ids: torch.Tensor
    # [n + 1] int32, the packed blocks' bounds: a row's real tokens (its own, after a shared
    # prefix); its ``layout`` attribute says how attention reads them (``packed_attention``)
    cu_seqlens: torch.Tensor
    max_len: int
    # [R] for each real position of the padded batch (row-major), its packed token
    src: torch.Tensor
    # [R] that position's index in the padded [B * L]
    dst: torch.Tensor
    shape: tuple  # (B, L)

    def model_kwargs(self) -> dict:
        """What a Transformers forward takes for this packed batch (no attention mask: the
        boundaries say it all; the keyword names are Transformers', which its flash-attention varlen
        path reads too)."""
        return dict(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            cu_seq_lens_q=self.cu_seqlens,
            cu_seq_lens_k=self.cu_seqlens,
            max_length_q=self.max_len,
            max_length_k=self.max_len,
        )

    def kept(self, last: int) -> tuple[torch.Tensor, tuple]:
        """For the last ``last`` columns of the padded layout: (the packed positions to compute
        there, sorted and unique, and the ``index`` of ``unpack`` that lays them out as [B,
        last])."""
        L = self.shape[1]
        col = self.dst % L
        keep = col >= L - last
        positions, which = torch.unique(self.src[keep], return_inverse=True)
        return positions, (which, (self.dst[keep] // L) * last + (col[keep] - (L - last)))

    def unpack(self, x: torch.Tensor, last: Optional[int] = None, index: Optional[tuple] = None):
        """[1, K, ...] packed outputs → [B, L, ...] (or [B, last, ...] with the ``index`` of
        ``kept``), zeros at the padding; a shared prefix's outputs go to every row it begins.
        Differentiable (a shared token's gradients add up)."""
        B, L = self.shape
        cols = L if last is None else last
        src, dst = (self.src, self.dst) if index is None else index
        out = x.new_zeros((B * cols, *x.shape[2:]))
        out = out.index_put((dst,), x[0].index_select(0, src))  # (see ``packed_attention``)
        return out.view(B, cols, *x.shape[2:])

    def logit_positions(self, logits_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For ``logits_at`` ([B, L] bool, real positions): (the packed positions to compute, sorted
        and unique; for each asked position in row-major order, its index among them)."""
        asked = logits_at.reshape(-1)[self.dst]
        return torch.unique(self.src[asked], return_inverse=True)


def _shared_prefixes(
    input_ids: torch.Tensor, first: torch.Tensor, lengths: torch.Tensor
) -> tuple[list, list]:
    """The rows' order by their real tokens (lexicographic) and, per row, how many of its first
    tokens it has in common with the row before it in that order: the most it has in common with any
    row before it."""
    B, L = input_ids.shape
    j = torch.arange(L, device=input_ids.device)
    real = input_ids.gather(1, (first[:, None] + j).clamp(max=L - 1))
    real = real.masked_fill(j >= lengths[:, None], -1)  # real tokens from column 0, then −1
    rows = real.tolist()
    order = sorted(range(B), key=rows.__getitem__)
    shared = [0] * B
    if B > 1:
        s = real[order]
        same = (s[1:] == s[:-1]) & (s[1:] >= 0)
        for b, k in zip(order[1:], same.int().cumprod(1).sum(1).tolist()):
            shared[b] = k
    return order, shared


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    share: bool = True,
    min_saved: float = 0.0,
) -> Optional[Packed]:
    """The packed form of a padded batch, or None when a row's real tokens are not one contiguous
    run or packing would leave more than 1 − ``min_saved`` of the batch's positions (padding and
    shared tokens saved). ``share``: rows that begin alike (a pair's prompt, a group's) pack their
    common prefix once."""
    mask = attention_mask.bool()
    B, L = mask.shape
    lengths = mask.sum(1)
    t = torch.arange(L, device=mask.device)
    first = torch.where(mask, t, L).min(1).values
    last = torch.where(mask, t, -1).max(1).values
    if bool(((last - first + 1).clamp(min=0) != lengths).any()):
        return None
    n, starts = lengths.tolist(), first.tolist()
    order, shared = list(range(B)), [0] * B
    if share:
        order, shared = _shared_prefixes(input_ids, first, lengths)
    if sum(n) - sum(shared) > (1.0 - min_saved) * B * L:
        return None
    # rows in ``order``, each its own tokens (after what it shares with the row before) as one
    # block; a row's tokens (packed indices, in order): the first ``shared`` of the row before's,
    # then its block
    tokens: list = [_EMPTY] * B
    bounds, pos, seqs, prev = [0], [], [], None
    for b in order:
        own = n[b] - shared[b]
        row = torch.arange(bounds[-1], bounds[-1] + own, device="cpu")
        if shared[b]:
            row = torch.cat([tokens[prev][: shared[b]], row])
        tokens[b] = row
        if own:
            seqs.append((row, shared[b]))
        bounds.append(bounds[-1] + own)
        pos.append(torch.arange(shared[b], n[b], device="cpu"))
        prev = b
    device = mask.device
    dst = [torch.arange(n[b], device="cpu") + (b * L + starts[b]) for b in range(B)]  # row-major
    dst_t = torch.cat(dst).to(device) if B else torch.zeros(0, dtype=torch.long, device=device)
    src_t = torch.cat(tokens).to(device) if B else torch.zeros(0, dtype=torch.long, device=device)
    # each packed token's id, from the padded positions that map to it (a shared one's are all
    # equal)
    ids = input_ids.new_zeros(bounds[-1]).index_put((src_t,), input_ids.reshape(-1)[dst_t])
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    # what packed_attention reads (the bounds cannot say it all)
    cu.rlhf_layout = _layout(seqs, device)
    return Packed(
        input_ids=ids[None],
        position_ids=(torch.cat(pos) if B else _EMPTY).to(device)[None],
        cu_seqlens=cu,
        max_len=max((len(row) for row, _ in seqs), default=0),
        src=src_t,
        dst=dst_t,
        shape=(B, L),
    )


def _window_mask(n: int, window: Optional[int], device) -> Optional[torch.Tensor]:
    """Causal mask under a sliding window of ``window`` keys (None: plain causal, SDPA's
    is_causal)."""
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
    # best[j]: the cost of grouping the j shortest
    best = [0.0] + [float("inf")] * n
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
    """How a forward's packed tokens are laid out for attention (computed once per forward).

    Attention runs over sequences (a row's real tokens: a shared prefix's, then its own), grouped by
    length; a group is [rows, longest] slots, a sequence per row from column 0."""

    # per group: (rows, longest, the packed token of each slot [rows * longest])
    groups: list
    # [T]: the slot (in the groups' slots, one after the other) of each packed token
    take: torch.Tensor


def _layout(seqs: list, device) -> _Layout:
    """``seqs``: per attention sequence, (its packed tokens in order [n], how many of its first
    tokens are another row's — a shared prefix, whose outputs that row's sequence gives)."""
    lengths = [len(tokens) for tokens, _ in seqs]
    groups, take_parts, offset = [], [], 0
    for group in length_groups(lengths, CALL_COST):
        longest = max(lengths[i] for i in group)
        # padding slots: token 0
        src = torch.zeros(len(group) * longest, dtype=torch.long, device="cpu")
        for r, i in enumerate(group):
            # attention keeps real queries off them, their outputs unread
            tokens, borrowed = seqs[i]
            src[r * longest : r * longest + lengths[i]] = tokens
            slots = torch.arange(
                offset + r * longest + borrowed, offset + r * longest + lengths[i], device="cpu"
            )
            take_parts.append((tokens[borrowed:], slots))
        groups.append((len(group), longest, src.to(device)))
        offset += len(group) * longest
    total = sum(len(t) for t, _ in take_parts)
    take = torch.zeros(total, dtype=torch.long, device="cpu")
    for tokens, slots in take_parts:
        take[tokens] = slots
    return _Layout(groups, take.to(device))


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
    """Transformers' attention-function signature: q/k/v [1, heads, T, d] → ([1, T, heads, d],
    None).

    A packed batch: the sequences are grouped by length (``length_groups``); within a group q, k and
    v (already rotated at their own positions) are laid out one sequence per row from column 0 (a
    shared prefix's tokens, then the row's own) and one batched causal SDPA call runs over them
    (with the layer's sliding window): a row's real queries see only its own keys, which come first,
    so no padding mask is needed and no attention crosses a sequence. Only the attention runs on
    that layout; every projection runs packed. The gathers are ``index_select``s: a shared token's
    gradients add up in index order (``index_add_``), where advanced indexing's backward (an
    accumulating ``index_put_``) adds them in a different order run to run on the CPU."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    kwargs.pop("cu_seq_lens_k", None)
    if cu is None:
        # a padded batch: Transformers' SDPA attention as it is
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    kwargs.pop("max_length_q", None)
    window = kwargs.pop("sliding_window", None)
    layout = getattr(cu, "rlhf_layout", None)
    if layout is None:
        # the bounds alone cannot say which rows share a prefix: never guess
        raise RuntimeError(
            "packed attention: sequence bounds without their layout (a wrapper copied "
            "cu_seq_lens_q?); "
            "set engine.packing=false to run padded"
        )
    q, k, v = (x[0] for x in (query, key, value))  # [h, T, d]
    outs = []
    for rows, longest, src in layout.groups:

        def aligned(x: torch.Tensor, rows=rows, longest=longest, src=src) -> torch.Tensor:
            h, d = x.shape[0], x.shape[2]  # [h, T, d] -> [rows, h, longest, d]
            return x.index_select(1, src).view(h, rows, longest, d).transpose(0, 1)

        mask = _window_mask(longest, window, query.device)
        out, _ = sdpa_attention_forward(
            module,
            aligned(q),
            aligned(k),
            aligned(v),
            mask,
            dropout,
            scaling,
            is_causal=mask is None,
        )  # [rows, longest, h, d]
        outs.append(out.reshape(rows * longest, *out.shape[2:]))
    return torch.cat(outs).index_select(0, layout.take)[None], None


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def mask(*args, **kwargs):
        # padded batches get SDPA's mask; a packed one (no 2-D mask) none
        if kwargs.get("attention_mask") is None:
            return None
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION, packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, mask)
    _REGISTERED = True


def hf_config(model: nn.Module):
    """The Transformers config of ``model`` (a causal LM, a scalar-head model, a LoRA-wrapped
    one)."""
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
        return (
            f"model_type={getattr(cfg, 'model_type', '?')!r} has no packed attention here "
            "(families: see docs)"
        )
    if cfg._attn_implementation not in (None, "sdpa", ATTENTION):
        return (
            f"its attention implementation is {cfg._attn_implementation!r} (packing runs on SDPA)"
        )
    return None


def install(model: nn.Module) -> bool:
    """Makes ``model`` run ``packed_attention`` (the padded path unchanged); False, said in one log
    line, when it cannot."""
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
    [K, V], row-major (the rows of the full logits, unchanged). Logits of the last k columns only
    (``logits_to_keep=k`` beside ``logits_at``): ``logits_at`` asks for none before them."""
    if logits_at is not None:
        k = out.logits.shape[1]
        if k < logits_at.shape[1]:
            if bool(logits_at[:, :-k].any()):
                raise ValueError("logits_at asks for positions before the logits_to_keep kept")
            logits_at = logits_at[:, -k:]
        out.logits = out.logits[logits_at.to(out.logits.device)]
    return out


def forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_at: Optional[torch.Tensor] = None,
    **kwargs,
):
    """``model(input_ids=..., attention_mask=..., **kwargs)`` run packed, its output in the padded
    layout: a tensor of per-token values [B, L] (or [B, L, k]), or a model output whose ``logits``
    are [B, L, V] (or [B, k, V] for ``logits_to_keep=k``: the last k columns; [K, V] for
    ``logits_at``, a [B, L] bool of real positions: theirs only, row-major, the LM head run over
    those K alone; a ``logits_to_keep`` beside it applies to the padded forward only, whose LM head
    then runs over the last k columns, which hold every position asked for). Rows that begin alike
    run their common prefix once (``pack``). The padded forward runs instead when packing would
    save less than ``MIN_PADDING`` of the batch's positions or its mask is not packable (``pack``
    returns None)."""
    # little padding and little in common: packing's own cost would not pay (None)
    packed = pack(input_ids, attention_mask, SHARE_PREFIXES, MIN_PADDING)
    if packed is None:
        return select_logits(
            model(input_ids=input_ids, attention_mask=attention_mask, **kwargs), logits_at
        )
    # the packed positions are the mask's (a contiguous run per row)
    kwargs.pop("position_ids", None)
    keep = kwargs.pop("logits_to_keep", None)
    if logits_at is not None:
        if bool((logits_at & ~attention_mask.bool()).any()):
            raise ValueError("packing.forward: logits_at asks for padding positions")
        positions, which = packed.logit_positions(logits_at)
        # every packing family takes it
        out = model(**packed.model_kwargs(), logits_to_keep=positions, **kwargs)
        logits = out.logits[0]
        if logits.shape[0] != positions.numel():
            # a wrapper that dropped the keyword: all T came back
            logits = logits[positions]
        out.logits = logits.index_select(0, which)
        return out
    last = index = None
    if keep:
        positions, index = packed.kept(keep)
        kwargs["logits_to_keep"] = positions
        last = keep
    out = model(**packed.model_kwargs(), **kwargs)
    if isinstance(out, torch.Tensor):
        # per-token values [1, T] (or an ensemble's [1, T, k])
        if out.dim() > 2:
            return packed.unpack(out, last, index)
        return packed.unpack(out[..., None], last, index)[..., 0]
    out.logits = packed.unpack(out.logits, last, index)
    return out
