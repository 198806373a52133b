"""The static decode step: fixed shapes, no host synchronisation (the CUDA decode loop,
docs/gpu.md).

The row-removing loop of ``InferenceModel._decode`` asks the host every step whether a row has
ended, and shrinks the batch; on a GPU that synchronisation and the launches around it, not the
bytes, set the time. Here instead:

- rows are padded to a bucket (``bucket``) and every row runs every step; a finished row is masked
  (its tokens are pad, its log-probs 0), never removed;
- positions, the cache slot and the step counter live on the device, and the step writes only
  tensors allocated once per ``StaticDecoder`` (batch bucket, cache length, sampling): the step can
  be captured as a CUDA graph (``rlhf/engine/graphs.py``) and replayed;
- keys span a fixed number of slots (the filled ones rounded up to a multiple of ``SPAN_CHUNK``, the
  rest masked): one graph per span;
- the host asks "have all rows finished?" every ``sync_every`` steps only.

Sampling takes row i's draw of column t from the rows' draws (``rlhf.engine.draws.row_draws``, made
before the loop), as the row-removing loop does: the same rollouts from the same seed on either path
and any device. Greedy tokens and log-probs equal the row-removing loop's to fp32 rounding (GEMMs
over more rows, attention over more, masked keys), not bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from rlhf.engine.graphs import StepGraphs
from rlhf.ops import SamplingParams
from rlhf.ops.sampling import sample

log = logging.getLogger("rlhf")

# key spans are multiples of this many cache slots (one CUDA graph each)
SPAN_CHUNK = 128


def bucket(rows: int) -> int:
    """The padded batch: 1, 2, 4, then multiples of 8 (at most 7 rows of waste; few graphs)."""
    if rows <= 4:
        return 1 << (rows - 1).bit_length()
    return -(-rows // 8) * 8


def round_up(n: int, chunk: int) -> int:
    return -(-n // chunk) * chunk


@dataclass(frozen=True)
class StaticKey:
    """What a captured step bakes in: shapes and the sampling constants."""

    rows: int  # the batch bucket
    # cache slots (a multiple of the span chunk)
    length: int
    temperature: float
    top_k: int
    top_p: float
    min_new_tokens: int
    eos_id: int
    pad_id: int
    chunk: int  # key spans are multiples of this

    @staticmethod
    def of(
        rows: int,
        prompt_len: int,
        sp: SamplingParams,
        eos_id: int,
        pad_id: int,
        chunk: int = SPAN_CHUNK,
    ) -> "StaticKey":
        return StaticKey(
            bucket(rows),
            round_up(prompt_len + sp.max_new_tokens, chunk),
            sp.temperature,
            sp.top_k,
            sp.top_p,
            sp.min_new_tokens,
            eos_id,
            pad_id,
            chunk,
        )


class StaticDecoder:
    """The state of the static decode loop and its step, for one ``StaticKey``; ``graphs``: replay
    the step as CUDA graphs (else it runs eagerly). Owned by one InferenceModel (the graphs read its
    weights by address)."""

    def __init__(self, model, key: StaticKey, device: torch.device, graphs: bool = False):
        self.key, self.device = key, device
        self.sp = SamplingParams(
            temperature=key.temperature,
            top_k=key.top_k,
            top_p=key.top_p,
            min_new_tokens=key.min_new_tokens,
        )
        R, L = key.rows, key.length
        self.cache = torch.zeros(
            (len(model.layers), R, L, 2 * model.hk * model.d), dtype=model.dtype, device=device
        )
        # additive key mask
        self.bias = torch.full((R, L), float("-inf"), dtype=model.dtype, device=device)
        self.slots = torch.arange(L, device=device)
        # rotations (or learned table rows) of every position, looked up per step
        # (model.position_table)
        self.rot = model.position_table(L, device)
        # the last sampled token
        self.tok = torch.full((R,), key.pad_id, dtype=torch.long, device=device)
        self.pos = torch.zeros((R,), dtype=torch.long, device=device)  # its position
        self.slot = torch.zeros((1,), dtype=torch.long, device=device)  # its cache slot
        # the response column sampled next
        self.t = torch.zeros((), dtype=torch.long, device=device)
        self.active = torch.zeros((R,), dtype=torch.bool, device=device)
        # row i's draw of column t
        self.draws = torch.zeros((R, L), dtype=torch.float32, device=device)
        self.out_tok = torch.full((R, L), key.pad_id, dtype=torch.long, device=device)
        self.out_logp = torch.zeros((R, L), dtype=torch.float32, device=device)
        self.graphs: Optional[StepGraphs] = StepGraphs(device) if graphs else None

    def release(self) -> None:
        """Frees the CUDA graphs and their pool (the state goes with this object)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def span(self, end: int) -> int:
        """Key slots a step attends to when slots [0, end) are filled."""
        return min(self.key.length, round_up(end, self.key.chunk))

    # ---- what a step does, on the device only ----
    def take(self, logits: torch.Tensor) -> None:
        """Samples column ``t`` from ``logits`` [rows, V] for the running rows; pad and 0
        elsewhere."""
        key, a = self.key, self.active
        u = None
        if key.temperature > 0:
            u = self.draws.index_select(1, self.t.view(1))
        # EOS, while the step is under min_new_tokens (ban_now)
        ban = None
        if key.min_new_tokens:
            ban = key.eos_id
        tok, logp = sample(logits, self.sp, u, ban=ban, ban_now=self.t < key.min_new_tokens)
        col = self.t.view(1)
        self.out_tok.index_copy_(1, col, torch.where(a, tok, key.pad_id)[:, None])
        self.out_logp.index_copy_(1, col, torch.where(a, logp, 0.0)[:, None])
        a.logical_and_(tok != key.eos_id)
        self.tok.copy_(tok)
        self.t += 1

    def step(self, model, span: int) -> None:
        """One token for every row: the last sampled token at ``slot`` → the next one sampled."""
        self.bias.index_fill_(1, self.slot, 0.0)
        full = self.bias[:, None, None, :span]
        masks = {window: full for window in model.windows}
        for window in {w for w in model.windows if w}:
            # keys at or before slot - window: out of the window
            masks[window] = full.masked_fill(self.slots[:span] <= self.slot - window, float("-inf"))
        logits = model._forward(
            self.tok[:, None], self.rot[self.pos][:, None], masks, 0, slot=self.slot, span=span
        )[:, -1]
        self.pos += 1
        self.slot += 1
        self.take(logits)

    def park(self) -> None:
        """Counters at the start (a warm-up step before a capture then stays within the buffers)."""
        self.slot.zero_()
        self.t.zero_()

    # ---- one generation ----
    def run(
        self,
        model,
        ids: torch.Tensor,
        pmask: torch.Tensor,
        sp: SamplingParams,
        draws,
        sync_every: int,
    ):
        """Tokens [B, N] and log-probs [B, N] (pad / 0 after a row's EOS) of ``ids`` [B, P]
        left-padded; ``draws`` [B, N]: the rows' uniform draws (None when greedy)."""
        B, P = ids.shape
        N, R = sp.max_new_tokens, self.key.rows
        model._kv = list(self.cache.unbind(0))
        if self.graphs is not None:
            spans = sorted({self.span(P + t) for t in range(1, N)})
            try:
                # before the state is set: the warm-up steps write into it
                self.graphs.capture(lambda span: self.step(model, span), self.park, spans)
            except RuntimeError as e:
                # an op the capture refuses: the same step, eagerly
                log.warning(
                    "CUDA graph capture failed (%s); decoding with the eager static step", e
                )
                self.release()
        self._start(model, ids, pmask, sp, draws)
        # the prefill: the real rows only, as the row-removing loop does it
        model._kv = list(self.cache[:, :B].unbind(0))
        logits = model.prefill(ids, pmask, self.rot)
        model._kv = list(self.cache.unbind(0))
        if R > B:
            logits = torch.cat([logits, logits.new_zeros((R - B, logits.shape[-1]))])
        self.take(logits)
        for t in range(1, N):
            span = self.span(P + t)
            if self.graphs is not None:
                self.graphs.replay(span)
            else:
                self.step(model, span)
            if t % sync_every == 0 and t < N - 1 and not bool(self.active.any()):
                # the one host sync
                break
        return self.out_tok[:B, :N].clone(), self.out_logp[:B, :N].clone()

    def _start(
        self, model, ids: torch.Tensor, pmask: torch.Tensor, sp: SamplingParams, draws
    ) -> None:
        """The state for a new generation, written in place (the graphs read these very tensors)."""
        B, P = ids.shape
        N = sp.max_new_tokens
        # finite everywhere: a masked key's value still meets a zero weight
        self.cache.zero_()
        self.bias.fill_(float("-inf"))
        self.bias[:B, :P].masked_fill_(pmask.bool(), 0.0)
        # the row-removing loop's table for P + N positions, bit for bit
        self.rot[: P + N].copy_(model.position_table(P + N, self.device))
        self.tok.fill_(self.key.pad_id)
        self.pos.zero_()
        # the position after the prompt's last token
        self.pos[:B].copy_(pmask.sum(-1).clamp(min=1))
        self.slot.fill_(P)
        self.t.zero_()
        self.active.zero_()
        self.active[:B] = True
        self.out_tok.fill_(self.key.pad_id)
        self.out_logp.zero_()
        if draws is not None:
            self.draws[:B, :N].copy_(draws)
