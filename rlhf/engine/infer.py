"""Inference mode: injected modules, a preallocated static KV cache, the decode loop and sampling.

The weights arrive as plain tensors laid out by an injection policy (``rlhf.models.policies``):
fused QKV and gate/up projections, this TP rank's slices when ``tp > 1`` (one all-reduce after the
attention output and one after the MLP), in the inference dtype (``engine.inference_dtype``). The
blocks are the policy's kinds: RMSNorm or LayerNorm (with bias), pre-norm, post-norm or parallel,
rotary positions (rotated q/k) or a learned table (added to the embeddings; the root's ``wpe``), a
SiLU-gated or plain MLP (``rlhf.ops.activation``), embedding-width projections in and out where the
root has them; the GEMM operands are laid out once here (``rlhf.ops.linear``: pre-transposed, or
oneDNN-packed bf16) and, for fp32 on an MKL CPU, packed again when a generation starts: the large
matrices in oneDNN's layout (any rows: the prefill's and the decode steps'), the small ones by MKL
for the decode batch (``engine.inference_kernels``: auto = those fast paths where they apply,
reference = plain GEMMs). The cache [layers, batch, max_len, 2 · kv_heads · head_dim] is allocated
once and written in place; a prompt's samples share its prefill (its keys and values copied to
their rows; not while MoE routing is recorded); rows whose sequence has ended leave the batch. Per
decode step the loop only looks things up and writes in place (rotations from a per-call table, an
additive key mask updated one slot a step); logits are cast to fp32 before log-softmax and sampling
whatever the dtype. ``decode``: "dynamic" is that loop (the CPU's, and ``engine.cuda_graphs=off``);
"static" the fixed-shape step without host synchronisation of ``rlhf.engine.decode_static``,
"graphs" the same replayed as CUDA graphs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf.engine.decode_static import SPAN_CHUNK, StaticDecoder, StaticKey
from rlhf.engine.draws import row_draws, row_keys
from rlhf.engine.rows import PAD, joined, per_row, take
from rlhf.errors import ConfigError
from rlhf.models.policies import InjectionPolicy
from rlhf.ops import (
    ACTIVATIONS,
    SamplingParams,
    attend,
    attend_varlen,
    layer_norm,
    rms_norm,
    rotary_cos_sin,
    sample,
    varlen_kernel_fits,
)
from rlhf.ops.linear import (
    can_pack,
    can_pack_onednn_fp32,
    can_pack_rows,
    linear,
    linear_rows,
    onednn_pays,
    pack_onednn,
    pack_rows,
    prepare_weight,
)
from rlhf.ops.rotary import apply_rotary_
from rlhf.ops.sampling import prompt_major

log = logging.getLogger("rlhf")


@dataclass
class Generation:
    """Prompts left-padded to one length P, responses right-padded to N (pad after EOS)."""

    # [B, P + N]
    sequences: torch.Tensor = field(metadata=per_row("sequence", pad=PAD))
    # [B, P + N] 1 on prompt and response tokens (EOS included)
    attention_mask: torch.Tensor = field(metadata=per_row("sequence"))
    # [B, N] 1 on response tokens (EOS included)
    response_mask: torch.Tensor = field(metadata=per_row("response"))
    # [B, N] log π(token) at the sampling temperature, 0 on padding; None from HF generate (which
    # would have to keep every step's full-vocabulary logits for them)
    logprobs: Optional[torch.Tensor] = field(metadata=per_row("response", pad=0.0))
    prompt_len: int = field(metadata=joined("max"))
    # seconds of the call that made it (HybridEngine.generate): switch_s, gather_s, generate_s,
    # release_s
    timings: Dict[str, float] = field(default_factory=dict, metadata=joined("sum"))
    # [B, N] long: the version of the weights that sampled each response token (-1 elsewhere), from
    # a rollout worker (rlhf/rl/rollout_worker.py); None: the trainer's weights of the moment
    versions: Optional[torch.Tensor] = field(default=None, metadata=per_row("response", pad=-1))
    # [B, P + N, MoE layers, k] int16: the experts each token was routed to in each MoE layer
    # (``InferenceModel.record_routing``; -1 where no forward routed it: the last token), for the
    # training forwards to replay (rlhf/models/moe.py); None: a dense model, or not recorded
    routing: Optional[torch.Tensor] = field(default=None, metadata=per_row("sequence", pad=-1))

    @property
    def responses(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_len :]

    def rows(self, start: int, stop: int) -> "Generation":
        return take(self, slice(start, stop))


@dataclass
class Packed:
    """The real tokens of left-padded rows, back to back (``InferenceModel.prefill``)."""

    # [total] their flat indices in the [B, P] prompt block
    tokens: torch.Tensor
    # [total] their flat indices in one layer's cache [B, S] (row b, slot s: b·S + s)
    slots: torch.Tensor
    # [B + 1] int32, row b = packed tokens cu[b]:cu[b+1]
    cu: torch.Tensor
    # [B] the packed index of each row's last token
    last: torch.Tensor
    max_len: int

    @staticmethod
    def of(pmask: torch.Tensor, cache_len: int) -> Optional["Packed"]:
        """None when a row has no token (nothing to attend from)."""
        P = pmask.shape[1]
        lengths = pmask.sum(-1)
        if not bool((lengths > 0).all()):
            return None
        tokens = pmask.reshape(-1).nonzero().squeeze(1)
        row, col = tokens // P, tokens % P
        cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        return Packed(tokens, row * cache_len + col, cu, cu[1:].long() - 1, int(lengths.max()))


def left_pad(prompts: List[List[int]], pad_id: int, device=None):
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(prompts), n), dtype=torch.long, device="cpu")
    for i, p in enumerate(prompts):
        if p:
            ids[i, n - len(p) :] = torch.tensor(p, dtype=torch.long, device="cpu")
            mask[i, n - len(p) :] = 1
    return ids.to(device), mask.to(device)


MATRICES = ("wqkv", "wo", "w_gate_up", "w_up", "w_down", "lm_head", "proj_in", "proj_out")
# a MoE layer's experts, [E, out, in]: kept as is, or (oneDNN on a CPU) a list of E packed operands
EXPERTS = ("experts_gate_up", "experts_down")


def _expert_linear(x: torch.Tensor, experts, e: int) -> torch.Tensor:
    """x [n, in] through expert ``e`` of ``experts`` (``InferenceModel._prepare_experts``: a list
    of packed operands, or the [E, out, in] tensor)."""
    if isinstance(experts, list):
        return linear(x, experts[e], None, packed=True)
    return F.linear(x, experts[e])


class InferenceModel:
    def __init__(
        self,
        root: Dict[str, torch.Tensor],
        layers: List[Dict[str, torch.Tensor]],
        policy: InjectionPolicy,
        tp: int = 1,
        tp_group=None,
        dtype: torch.dtype = torch.float32,
        kernels: str = "auto",
        decode: str = "dynamic",
        sync_every: int = 8,
    ):
        fast = kernels == "auto"
        self.packed = fast and can_pack(dtype, root["embed"].device)
        self.pack_rows = fast and can_pack_rows(dtype, root["embed"].device)
        # a generation's large matrices packed by oneDNN (any number of rows; about twice MKL's
        # packed sgemm at decode sizes on the CPU machine) where it exists, the others by MKL for
        # the decode batch
        self.onednn_rows = self.pack_rows and can_pack_onednn_fp32(dtype, root["embed"].device)
        try:
            self.root, self.layers = self._prepare(root), [self._prepare(w) for w in layers]
        except RuntimeError as e:
            # a oneDNN that cannot reorder: the plain layout gives the same numbers
            log.warning(
                "inference mode: packed %s weights unavailable (%s); using plain GEMMs", dtype, e
            )
            self.packed = False
            self.root, self.layers = self._prepare(root), [self._prepare(w) for w in layers]
        self.p, self.tp, self.tp_group, self.dtype = policy, tp, tp_group, dtype
        self.tp_rank = dist.get_rank(tp_group) if tp > 1 else 0
        self.hq, self.hk = policy.num_heads // tp, policy.num_kv_heads // tp
        self.d = policy.head_dim
        # learned positions (a table), else rotary
        self.learned = "wpe" in self.root
        # rotary: the attention scaling of the rotations, read once (not a host read per call)
        self.rope_scaling = 1.0 if self.learned else float(self.root["rope_scaling"])
        self.act = ACTIVATIONS.get(policy.activation)  # a plain MLP's
        # per layer, None = full
        self.windows = tuple(policy.window(i) for i in range(len(self.layers)))
        # the prefill of left-padded prompts: the real tokens packed into one sequence for the flash
        # kernel (varlen) where it fits, else every slot with an additive mask (the CPU's reference)
        self.packed_prefill = fast and varlen_kernel_fits(
            dtype, root["embed"].device, policy.head_dim
        )
        self.cache: Optional[torch.Tensor] = None
        self._kv: List[torch.Tensor] = []  # per-layer views of the cache
        if decode not in ("dynamic", "static", "graphs"):
            raise ValueError(f"decode={decode!r}: expected dynamic, static or graphs")
        self.decode, self.sync_every, self.span_chunk = decode, sync_every, SPAN_CHUNK
        # the dynamic loop: a prompt's samples share its prefill
        self.share_prefill = True
        # the static loop's state (its own cache) and CUDA graphs: kept between calls while the key
        # (batch bucket, cache length, sampling) stays, released with the weights
        self._static: Optional[StaticDecoder] = None
        self._drop_packs()
        # Mixture-of-Experts: the MoE layers' order among themselves; ``record_routing`` makes each
        # dynamic-loop generation return its routing (``Generation.routing``), written by
        # ``_route`` (set per forward: where this forward's tokens sit) from ``_moe``
        moe = [i for i, w in enumerate(layers) if "router" in w]
        self.moe_index = {li: j for j, li in enumerate(moe)}
        self.record_routing = False
        self._route: Optional[Callable[[int, torch.Tensor], None]] = None
        self._li = 0

    def _prepare(self, d: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        out = {}
        for k, v in d.items():
            if k in MATRICES:
                out[k] = prepare_weight(v, self.packed, for_rows=self.pack_rows)
            elif k in EXPERTS:
                out[k] = self._prepare_experts(v)
            else:
                out[k] = v
        return out

    def _prepare_experts(self, v: torch.Tensor):
        """A MoE layer's experts [E, out, in] → one oneDNN-packed operand per expert where oneDNN
        packs this dtype (bf16, or fp32 on an MKL CPU: the experts' decode GEMMs stream their
        weights about twice as fast as F.linear's, packed once per weight sync, not per
        generation), else ``v`` itself (``_expert_linear`` takes either)."""
        if not (self.packed or self.onednn_rows):
            return v
        try:
            return [pack_onednn(v[e].t()) for e in range(v.shape[0])]
        except RuntimeError as e:
            log.warning("inference mode: packed experts unavailable (%s); using plain GEMMs", e)
            return v

    # ---- cache: [layers, batch, max_len, 2 · kv_heads · head_dim], a slot's k and v side by side
    # (as the fused QKV output holds them: one write per layer and step) ----
    def allocate(self, batch: int, max_len: int, device) -> None:
        self.cache = torch.zeros(
            (len(self.layers), batch, max_len, 2 * self.hk * self.d),
            dtype=self.dtype,
            device=device,
        )
        self._kv = list(self.cache.unbind(0))

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Compacts the rows still decoding to the front of the cache, in place, one layer at a time
        (the transient copy is one layer's kept rows, never a second cache)."""
        idx = keep.nonzero().squeeze(1)
        k = idx.numel()
        for layer in self.cache.unbind(0):
            layer[:k] = layer[idx]
        self.cache = self.cache[:, :k]
        self._kv = list(self.cache.unbind(0))

    def release(self) -> None:
        """Drops the cache, the packed matrices, the static loop's state and its CUDA graphs."""
        self._end_call()
        if self._static is not None:
            self._static.release()
            self._static = None

    def _end_call(self) -> None:
        self.cache = None
        self._kv = []
        self._drop_packs()

    def _drop_packs(self) -> None:
        # while decoding (pack_rows): the matrices packed for ``_rows`` rows, per layer and the
        # root's
        self._rows = 0
        self._rw: List[Optional[Dict[str, torch.Tensor]]] = [None] * (len(self.layers) + 1)

    def pack_for_rows(self, rows: int) -> None:
        """Packs the GEMM operands for decode steps of at most ``rows`` rows (no-op unless
        pack_rows)."""
        if not self.pack_rows:
            return
        try:
            self._rw = [
                {k: self._pack(v, rows) for k, v in d.items() if k in MATRICES}
                for d in self.layers + [self.root]
            ]
            self._rows = rows
        except RuntimeError as e:
            # a library that cannot pack: MKL's packing, or the plain layout, instead
            self._drop_packs()
            if self.onednn_rows:
                log.warning(
                    "inference mode: oneDNN fp32 weights unavailable (%s); using MKL's packing", e
                )
                self.onednn_rows = False
                return self.pack_for_rows(rows)
            log.warning(
                "inference mode: packed fp32 weights unavailable (%s); using plain GEMMs", e
            )
            self.pack_rows = False

    def _pack(self, wt: torch.Tensor, rows: int) -> torch.Tensor:
        if self.onednn_rows and onednn_pays(wt):
            return pack_onednn(wt)
        return pack_rows(wt, rows)

    def _linear(
        self,
        x: torch.Tensor,
        w: Dict[str, torch.Tensor],
        rw: Optional[Dict[str, torch.Tensor]],
        name: str,
        bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if rw is not None and self.onednn_rows and onednn_pays(w[name]):
            # any number of rows (prefills too)
            return linear(x, rw[name], bias, packed=True)
        if rw is not None and x.shape[0] <= self._rows:
            return linear_rows(x, rw[name], w[name], self._rows, bias)
        return linear(x, w[name], bias, self.packed)

    # ---- forward ----
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def attention_bias(
        self, key_valid: torch.Tensor, start: int, end: int, window: Optional[int] = None
    ) -> torch.Tensor:
        """Additive mask [B, 1, T, end] (0 = attend, -inf = not) for queries at cache slots [start,
        end): causal, the sliding ``window`` if any, keys where ``key_valid`` [B, >=end] (bool); a
        query on left padding attends to itself (so that no NaN can reach a value vector)."""
        q_idx = torch.arange(start, end, device=key_valid.device)[:, None]
        k_idx = torch.arange(end, device=key_valid.device)[None, :]
        allowed = k_idx <= q_idx
        if window:
            allowed = allowed & (q_idx - k_idx < window)
        mask = (allowed[None, None] & key_valid[:, None, None, :end]) | (q_idx == k_idx)[None, None]
        return torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(
            ~mask, float("-inf")
        )

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Logits [B, T, V] of ``ids`` [B, T] at cache slots [start, start+T); ``key_valid`` [B,
        >=start+T]."""
        masks = self._masks(key_valid, start, start + ids.shape[1])
        return self._forward(ids, self.at_positions(positions), masks, start)

    def at_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """What ``_forward`` takes for integer ``positions`` [B, T]: complex rotations [B, T, r/2]
        (rotary), or the rows of the position table [B, T, hidden] (learned)."""
        if self.learned:
            return F.embedding(positions, self.root["wpe"])
        return rotary_cos_sin(self.root["inv_freq"], positions, self.rope_scaling, self.dtype)

    def _masks(
        self, key_valid: torch.Tensor, start: int, end: int
    ) -> Dict[Optional[int], torch.Tensor]:
        """``attention_bias`` for each window the layers use (None: full attention)."""
        return {w: self.attention_bias(key_valid, start, end, w) for w in set(self.windows)}

    def _forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        masks: Optional[Dict[Optional[int], torch.Tensor]],
        start: int,
        last_only: bool = False,
        slot: Optional[torch.Tensor] = None,
        span: int = 0,
        packed: Optional["Packed"] = None,
    ) -> torch.Tensor:
        """``pos``: the tokens' positions as ``at_positions`` gives them (rotary: [B, T, r/2]
        complex rotations, r = the rotated dimensions of a head; learned: [B, T, hidden] table
        rows); ``masks`` additive [B, 1, T, start+T] per layer window (None: causal, from slot 0, no
        padding, no window); ``last_only``: logits of the last position only [B, 1, V]. Activations
        stay 2-D [B·T, hidden] between GEMMs. A row-parallel output's bias (``bo``, ``b_down``) is
        on TP rank 0 only. The static step (rlhf/engine/decode_static.py): ``slot`` a [1] device
        tensor, the cache slot of the one new token (``start`` unused), keys over the first ``span``
        slots (``masks`` [B, 1, 1, span]). ``packed`` (the prefill of ``prefill``): ``ids`` [1,
        total] the real prompt tokens of every row back to back, written to their cache slots,
        attending within their own row (``masks`` unused)."""
        B, T = ids.shape
        end = start + T if slot is None else span
        hq, hk, d, eps, lin = self.hq, self.hk, self.d, self.p.eps, self._linear
        pre, parallel, norm = self.p.prenorm, self.p.parallel, self._norm
        x = F.embedding(ids.reshape(-1), self.root["embed"]).to(self.dtype)
        if "proj_in" in self.root:
            # embedding width → hidden width (OPT-350m)
            x = lin(x, self.root, self._rw[-1], "proj_in")
        rot = None
        if self.learned:
            # HF: token embeddings + position embeddings
            x.add_(pos.reshape(B * T, -1))
        else:
            rot = pos.reshape(B * T, 1, -1)
        for li, w in enumerate(self.layers):
            rw, self._li = self._rw[li], li
            h = norm(x, w, "ln1") if pre else x
            qkv = lin(h, w, rw, "wqkv", w.get("bqkv"))
            if "qk_norm" in w:
                # RMSNorm of each q and k head (Qwen3), in place, before the rotation
                qk = qkv[:, : (hq + hk) * d].unflatten(-1, (hq + hk, d))
                qk.copy_(F.rms_norm(qk, (d,), eps=eps).mul_(w["qk_norm"]))  # HF: weight · norm(x)
            if rot is not None:
                apply_rotary_(qkv[:, : (hq + hk) * d], rot, d)  # q and k heads in one op, in place
            kv = self._kv[li]
            if packed is not None:
                # each token to its own slot; attention within its own row
                kv.view(-1, kv.shape[-1]).index_copy_(0, packed.slots, qkv[:, hq * d :])
                a = attend_varlen(
                    qkv[:, : hq * d].view(-1, hq, d),
                    qkv[:, hq * d : (hq + hk) * d].view(-1, hk, d),
                    qkv[:, (hq + hk) * d :].view(-1, hk, d),
                    packed.cu,
                    packed.max_len,
                    self.windows[li],
                ).reshape(B * T, hq * d)
            else:
                if slot is None:
                    kv[:, start:end] = qkv[:, hq * d :].view(B, T, 2 * hk * d)
                else:
                    # a slot known on the device only: no host synchronisation
                    kv.index_copy_(1, slot, qkv[:, hq * d :].view(B, T, 2 * hk * d))
                k = kv[:, :end, : hk * d].unflatten(-1, (hk, d)).transpose(1, 2)
                v = kv[:, :end, hk * d :].unflatten(-1, (hk, d)).transpose(1, 2)
                mask = None if masks is None else masks[self.windows[li]]
                a = attend(qkv[:, : hq * d].view(B, T, hq, d).transpose(1, 2), k, v, mask)
                a = a.transpose(1, 2).reshape(B * T, hq * d)
            ao = self._all_reduce(lin(a, w, rw, "wo", w.get("bo")))
            if parallel:
                # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x)), added as HF does: (mlp + attn) + x
                x.add_(self._all_reduce(self._mlp(norm(x, w, "ln2"), w, rw)).add_(ao))
                continue
            x.add_(ao)
            if not pre:
                # post-norm (OPT-350m): the norm after the residual add
                x = norm(x, w, "ln1")
            h = norm(x, w, "ln2") if pre else x
            x.add_(self._all_reduce(self._mlp(h, w, rw)))
            if not pre:
                x = norm(x, w, "ln2")
        if packed is not None:
            x, B, T = x[packed.last], packed.last.shape[0], 1
        elif last_only:
            x, T = x.view(B, T, -1)[:, -1], 1
        if "norm" in self.root:  # (none in post-norm OPT)
            x = norm(x, self.root, "norm")
        if "proj_out" in self.root:
            x = lin(x, self.root, self._rw[-1], "proj_out")
        return lin(x, self.root, self._rw[-1], "lm_head").view(B, T, -1)

    def _norm(self, x: torch.Tensor, w: Dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """The norm ``name`` of ``w`` (a layer's or the root's): RMSNorm, or LayerNorm with
        ``<name>_b``."""
        if self.p.norm == "rms":
            return rms_norm(x, w[name], self.p.eps)
        return layer_norm(x, w[name], w[name + "_b"], self.p.eps)

    def _mlp(
        self, h: torch.Tensor, w: Dict[str, torch.Tensor], rw: Optional[Dict[str, torch.Tensor]]
    ) -> torch.Tensor:
        """down(SiLU(gate) · up), or down(act(up)) for a plain MLP (before the all-reduce); a MoE
        layer's routed experts (and shared expert) where it has a router."""
        if "router" in w:
            return self._moe(h, w, rw)
        lin = self._linear
        if self.p.mlp == "gated":
            gate, up = lin(h, w, rw, "w_gate_up", w.get("b_gate_up")).chunk(2, dim=-1)
            return lin(F.silu(gate, inplace=True).mul_(up), w, rw, "w_down", w.get("b_down"))
        return lin(self.act(lin(h, w, rw, "w_up", w.get("b_up"))), w, rw, "w_down", w.get("b_down"))

    def _moe(
        self, h: torch.Tensor, w: Dict[str, torch.Tensor], rw: Optional[Dict[str, torch.Tensor]]
    ) -> torch.Tensor:
        """A Mixture-of-Experts block on h [tokens, hidden], as HF's: softmax over the router's
        logits (fp32), each token's top k experts (their probabilities renormalised where the
        family does), Σ_k p_k · expert_k(h). The token-expert pairs sorted by expert, each expert
        runs one GEMM pair on its own tokens (none on the others: no dense all-experts compute, no
        loop over tokens), the results scaled and added back per token in expert order (HF's order
        of addition); a shared expert, sigmoid-gated, added after. Under TP each rank runs its
        E / tp experts (and its slice of the shared expert) on every token: the caller's
        all-reduce sums the ranks' parts."""
        p = self.p
        logits = F.linear(h, w["router"])
        top, idx = logits.float().softmax(-1).topk(p.top_k, dim=-1)
        if p.topk_norm:
            top = top / top.sum(-1, keepdim=True)
        if self._route is not None:
            self._route(self.moe_index[self._li], idx)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        # (one host read per layer: how many tokens each expert takes)
        counts = torch.bincount(flat, minlength=p.num_experts).tolist()
        # this TP rank's experts [lo, lo + mine) (all with TP 1): their pairs are one run of
        # ``order``; the other ranks' add theirs in the caller's all-reduce
        mine = p.num_experts // self.tp
        lo = self.tp_rank * mine
        first = sum(counts[:lo])
        order = order[first : first + sum(counts[lo : lo + mine])]
        token = order // p.top_k
        xs = h.index_select(0, token)
        out = torch.empty_like(xs)
        gate_up, down, start = w["experts_gate_up"], w["experts_down"], 0
        for e, n in enumerate(counts[lo : lo + mine]):
            if n:
                gate, up = _expert_linear(xs[start : start + n], gate_up, e).chunk(2, dim=-1)
                out[start : start + n] = _expert_linear(F.silu(gate).mul_(up), down, e)
                start += n
        out.mul_(top.to(out.dtype).reshape(-1)[order, None])
        y = torch.zeros_like(h).index_add_(0, token, out)
        if "shared_gate" in w:
            lin = self._linear
            gate, up = lin(h, w, rw, "w_gate_up").chunk(2, dim=-1)
            shared = lin(F.silu(gate, inplace=True).mul_(up), w, rw, "w_down")
            y.add_(shared.mul_(torch.sigmoid(F.linear(h, w["shared_gate"]))))
        return y

    def position_table(self, n: int, device) -> torch.Tensor:
        """What ``_forward`` takes for positions 0..n−1 (``at_positions``), looked up per step: [n,
        r/2] rotations, or [n, hidden] rows of the learned table (a copy; zero rows past its end,
        which no generation reaches: ``generate`` refuses one that would)."""
        if not self.learned:
            return self.at_positions(torch.arange(n, device=device)[None])[0]
        wpe = self.root["wpe"]
        out = wpe.new_zeros((n, wpe.shape[1]))
        rows = min(n, wpe.shape[0])
        out[:rows] = wpe[:rows]
        return out

    def prefill(
        self,
        ids: torch.Tensor,
        pmask: torch.Tensor,
        rot_table: torch.Tensor,
        routing: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits [B, V] at the last token of each left-padded prompt (``ids``, ``pmask`` [B, P]),
        the prompts' keys and values written to cache slots [0, P) (``rot_table``:
        ``position_table``). Unpadded rows with no sliding window on CUDA: plain causal attention
        (flash, no mask). Padded rows where ``packed_prefill``: the real tokens of every row packed
        back to back, so that no GEMM or attention computes padding and the flash kernel runs
        without a mask (varlen); the padding slots of the cache keep what they held (the decode step
        masks them). Else (the CPU): every slot, with an additive mask."""
        B, P = ids.shape
        positions = (pmask.cumsum(-1) - 1).clamp(min=0)
        k = self.p.top_k
        # (every slot's experts; a packed prefill's real tokens' alone, below)
        self._recording(routing, slice(None), slice(0, P), (B, P, k))
        if ids.device.type == "cuda" and not any(self.windows) and bool(pmask.all()):
            return self._forward(ids, rot_table[positions], None, 0, last_only=True)[:, -1]
        pk = Packed.of(pmask, self._kv[0].shape[1]) if self.packed_prefill else None
        if pk is not None:
            rot = rot_table[positions].reshape(B * P, -1)[pk.tokens][None]
            self._recording(routing, pk.tokens // P, pk.tokens % P, (-1, k))
            try:
                return self._forward(ids.reshape(-1)[pk.tokens][None], rot, None, 0, packed=pk)[
                    :, -1
                ]
            except RuntimeError as e:
                # a kernel that refuses these operands: the masked path, from now on
                log.warning(
                    "inference mode: packed prefill unavailable (%s); using the masked prefill", e
                )
                self.packed_prefill = False
                self._recording(routing, slice(None), slice(0, P), (B, P, k))
        return self._forward(
            ids, rot_table[positions], self._masks(pmask.bool(), 0, P), 0, last_only=True
        )[:, -1]

    def shared_prefill(
        self, ids: torch.Tensor, pmask: torch.Tensor, rot_table: torch.Tensor, shared: int
    ) -> torch.Tensor:
        """``prefill`` of rows that come in runs of ``shared`` copies of one prompt: each prompt's
        once, into the cache's first rows, then its keys and values copied to its run's rows in
        place (one layer's prompt slots at a time, as ``keep_rows``), and its logits to each."""
        B, P = ids.shape
        unique = B // shared
        full = self._kv
        self._kv = [layer[:unique] for layer in full]
        try:
            logits = self.prefill(ids[::shared], pmask[::shared], rot_table)
        finally:
            self._kv = full
        for layer in full:
            layer[:, :P] = layer[:unique, :P].repeat_interleave(shared, dim=0)
        return logits.repeat_interleave(shared, dim=0)

    # ---- decode loop ----
    @torch.no_grad()
    def generate(
        self,
        prompts: List[List[int]],
        sp: SamplingParams,
        *,
        eos_id: int,
        pad_id: int,
        keys: Optional[Sequence[int]] = None,
        device=None,
    ) -> Generation:
        """``sp.samples_per_prompt`` samples of every prompt (prompt-major order). ``keys``: each
        prompt's key (default: its index), whose samples draw from streams of their own
        (``row_draws``)."""
        device = device or self.root["embed"].device
        rows = prompt_major(prompts, sp.samples_per_prompt)
        # positions fed: 0 .. reach - 1
        reach = max(len(p) for p in prompts) + sp.max_new_tokens - 1
        if self.learned and reach > self.root["wpe"].shape[0]:
            raise ConfigError(
                f"inference mode: prompts of up to {reach + 1 - sp.max_new_tokens} tokens and "
                f"{sp.max_new_tokens} new ones reach position {reach - 1}; the model's "
                "position table "
                f"holds {self.root['wpe'].shape[0]} (max_position_embeddings): lower "
                "data.max_prompt_len "
                f"(eval.max_prompt_len for held-out prompts) or the new tokens"
            )
        ids, pmask = left_pad(rows, pad_id, device)
        # [rows, max_new_tokens]; none when greedy
        draws = None
        if sp.temperature > 0:
            keys = range(len(prompts)) if keys is None else keys
            draws = row_draws(
                row_keys(keys, sp.samples_per_prompt), sp.max_new_tokens, sp.seed, device
            )
        routing = None
        if self.record_routing and self.moe_index:
            k = self.p.top_k
            shape = (ids.shape[0], ids.shape[1] + sp.max_new_tokens, len(self.moe_index), k)
            routing = torch.full(shape, -1, dtype=torch.int16, device=device)
        try:
            with torch.inference_mode():
                # the loop's tensors never meet autograd; finish() copies out
                if self.decode == "dynamic":
                    # a prompt's samples share its prefill (none to share while recording routing)
                    shared = sp.samples_per_prompt if routing is None and self.share_prefill else 1
                    tokens, logprobs = self._decode(
                        ids, pmask, sp, eos_id, pad_id, draws, routing, shared
                    )
                else:
                    tokens, logprobs = self._decode_static(ids, pmask, sp, eos_id, pad_id, draws)
        finally:
            self._end_call()
            self._route = None
        return finish(ids, pmask, tokens, logprobs, eos_id, pad_id, routing)

    def _decode_static(self, ids, pmask, sp: SamplingParams, eos_id: int, pad_id: int, draws):
        key = StaticKey.of(ids.shape[0], ids.shape[1], sp, eos_id, pad_id, self.span_chunk)
        if self._static is None or self._static.key != key:
            # the previous key's state and graphs first
            self.release()
            self._static = StaticDecoder(self, key, ids.device, graphs=self.decode == "graphs")
        self.pack_for_rows(key.rows)
        return self._static.run(self, ids, pmask, sp, draws, self.sync_every)

    def _recording(self, routing: Optional[torch.Tensor], rows, slots, shape) -> None:
        """The next forwards' tokens are ``routing[rows, slots]`` (index expressions; ``shape``
        that of ``routing[rows, slots, j]``) for ``_moe`` to write their experts to; no
        recording when ``routing`` is None."""
        if routing is None:
            self._route = None
            return

        def route(j: int, idx: torch.Tensor) -> None:
            routing[rows, slots, j] = idx.view(shape).to(routing.dtype)

        self._route = route

    def _decode(
        self,
        ids,
        pmask,
        sp: SamplingParams,
        eos_id: int,
        pad_id: int,
        draws,
        routing=None,
        shared: int = 1,
    ):
        """``shared``: each run of ``shared`` consecutive rows holds one prompt (``prompt_major``):
        its prefill runs once and its keys, values and first logits are copied to the others."""
        device = ids.device
        B, P = ids.shape
        N = sp.max_new_tokens
        self.allocate(B, P + N, device)
        self.pack_for_rows(B)
        # the rotations (or table rows) of every position this call can reach, looked up per step
        rot_table = self.position_table(P + N, device)
        # additive key mask over the cache slots, kept up to date in place: 0 = a token, -inf =
        # padding / empty
        bias = torch.full((B, P + N), float("-inf"), dtype=self.dtype, device=device)
        bias[:, :P].masked_fill_(pmask.bool(), 0.0)
        windows = set(self.windows)
        positions = (pmask.cumsum(-1) - 1).clamp(min=0)
        out_tokens = torch.full((B, N), pad_id, dtype=torch.long, device=device)
        out_logp = torch.zeros((B, N), dtype=torch.float32, device=device)
        active: Optional[torch.Tensor] = None  # None = every row
        next_pos = positions[:, -1] + 1
        if shared > 1:
            logits = self.shared_prefill(ids, pmask, rot_table, shared)
        else:
            logits = self.prefill(ids, pmask, rot_table, routing)
        if routing is not None:
            # a masked prefill routed the padding slots too: no token of the sequence
            routing[:, :P].masked_fill_(~pmask.bool()[..., None, None], -1)
        for t in range(N):
            ban = eos_id if t < sp.min_new_tokens else None
            u = None  # greedy
            if draws is not None:
                u = draws[:, t, None] if active is None else draws[active, t, None]
            tok, logp = sample(logits, sp, u, ban=ban)
            if active is None:
                out_tokens[:, t] = tok
                out_logp[:, t] = logp
            else:
                out_tokens[active, t] = tok
                out_logp[active, t] = logp
            if t == N - 1:
                break
            keep = tok != eos_id
            if not bool(keep.all()):  # finished sequences leave the batch
                if active is None:
                    active = torch.arange(B, device=device)
                active, tok, next_pos, bias = active[keep], tok[keep], next_pos[keep], bias[keep]
                self.keep_rows(keep)
                if active.numel() == 0:
                    break
            end = P + t + 1
            rows = slice(None) if active is None else active
            self._recording(routing, rows, end - 1, (-1, self.p.top_k))
            bias[:, end - 1] = 0.0
            full = bias[:, None, None, :end]
            masks = {}
            for window in windows:
                masks[window] = full
                if window and end > window:
                    # keys at or before slot end-1-window are out of the window
                    masks[window] = full.clone()
                    masks[window][..., : end - window] = float("-inf")
            logits = self._forward(tok[:, None], rot_table[next_pos][:, None], masks, end - 1)[
                :, -1
            ]
            next_pos += 1
        return out_tokens, out_logp


def finish(
    prompt_ids, prompt_mask, tokens, logprobs, eos_id: int, pad_id: int, routing=None
) -> Generation:
    """Masks everything after the first EOS as padding and builds the full sequences."""
    is_eos = tokens == eos_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    response_mask = (~after_eos).long()
    tokens = tokens.masked_fill(after_eos, pad_id)
    logprobs = None if logprobs is None else logprobs.masked_fill(after_eos, 0.0)
    return Generation(
        sequences=torch.cat([prompt_ids, tokens], 1),
        attention_mask=torch.cat([prompt_mask, response_mask], 1),
        response_mask=response_mask,
        logprobs=logprobs,
        prompt_len=prompt_ids.shape[1],
        routing=routing,
    )
