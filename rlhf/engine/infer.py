"""Inference mode: injected modules, a preallocated static KV cache, the decode loop and sampling.

The weights arrive as plain tensors laid out by an injection policy (``rlhf.models.policies``):
fused QKV and gate/up projections, this TP rank's slices when ``tp > 1`` (one all-reduce after the
attention output and one after the MLP). The cache [layers, batch, kv_heads, max_len, head_dim] is
allocated once and written in place; rows whose sequence has ended leave the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf.models.policies import Policy
from rlhf.ops import SamplingParams, apply_rotary, attend, rms_norm, rotary_cos_sin, sample


@dataclass
class Generation:
    """Prompts left-padded to one length P, responses right-padded to N (pad after EOS)."""
    sequences: torch.Tensor  # [B, P + N]
    attention_mask: torch.Tensor  # [B, P + N] 1 on prompt and response tokens (EOS included)
    response_mask: torch.Tensor  # [B, N] 1 on response tokens (EOS included)
    logprobs: torch.Tensor  # [B, N] log π(token) at the sampling temperature, 0 on padding
    prompt_len: int

    @property
    def responses(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_len:]

    def rows(self, start: int, stop: int) -> "Generation":
        return Generation(self.sequences[start:stop], self.attention_mask[start:stop],
                          self.response_mask[start:stop], self.logprobs[start:stop], self.prompt_len)


def left_pad(prompts: List[List[int]], pad_id: int, device=None):
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, n - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, n - len(p):] = 1
    return ids.to(device), mask.to(device)


MATRICES = ("wqkv", "wo", "w_gate_up", "w_down", "lm_head")


def _mm(x: torch.Tensor, w_t: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., in] @ w_t [in, out] (+ bias) as one 2-D GEMM (pre-transposed weights: no packing
    of a transposed operand on every call, about 2x faster than F.linear at decode sizes on CPU)."""
    flat = x.reshape(-1, x.shape[-1])
    y = torch.addmm(bias, flat, w_t) if bias is not None else flat @ w_t
    return y.view(*x.shape[:-1], w_t.shape[1])


class InferenceModel:
    def __init__(self, root: Dict[str, torch.Tensor], layers: List[Dict[str, torch.Tensor]], policy: Policy,
                 tp: int = 1, tp_group=None, dtype: torch.dtype = torch.float32):
        t = lambda d: {k: (v.t().contiguous() if k in MATRICES else v) for k, v in d.items()}  # noqa: E731
        self.root, self.layers, self.p = t(root), [t(w) for w in layers], policy
        self.tp, self.tp_group, self.dtype = tp, tp_group, dtype
        self.hq, self.hk = policy.num_heads // tp, policy.num_kv_heads // tp
        self.d = policy.head_dim
        self.cache_k: Optional[torch.Tensor] = None
        self.cache_v: Optional[torch.Tensor] = None

    # ---- cache ----
    def allocate(self, batch: int, max_len: int, device) -> None:
        shape = (len(self.layers), batch, self.hk, max_len, self.d)
        self.cache_k = torch.zeros(shape, dtype=self.dtype, device=device)
        self.cache_v = torch.zeros(shape, dtype=self.dtype, device=device)

    def keep_rows(self, keep: torch.Tensor) -> None:
        self.cache_k = self.cache_k[:, keep]
        self.cache_v = self.cache_v[:, keep]

    def release(self) -> None:
        self.cache_k = self.cache_v = None

    # ---- forward ----
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor, start: int) -> torch.Tensor:
        """Logits [B, T, V] of ``ids`` [B, T] at cache slots [start, start+T); ``key_valid`` [B, >=start+T]."""
        B, T = ids.shape
        end = start + T
        x = F.embedding(ids, self.root["embed"]).to(self.dtype)
        rot = rotary_cos_sin(self.root["inv_freq"], positions, float(self.root["rope_scaling"]), self.dtype)
        mask = key_valid[:, None, None, :end]
        if T > 1 or (self.p.sliding_window and end > self.p.sliding_window):
            q_idx = torch.arange(start, end, device=ids.device)[:, None]
            k_idx = torch.arange(end, device=ids.device)[None, :]
            allowed = k_idx <= q_idx
            if self.p.sliding_window:
                allowed = allowed & (q_idx - k_idx < self.p.sliding_window)
            mask = (allowed[None, None] & mask) | (q_idx == k_idx)[None, None]  # pads see themselves
        hq, hk, d = self.hq, self.hk, self.d
        for li, w in enumerate(self.layers):
            h = rms_norm(x, w["ln1"], self.p.eps)
            qkv = _mm(h, w["wqkv"], w.get("bqkv"))
            q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            q = q.view(B, T, hq, d).transpose(1, 2)
            k = k.view(B, T, hk, d).transpose(1, 2)
            v = v.view(B, T, hk, d).transpose(1, 2)
            q, k = apply_rotary(q, rot), apply_rotary(k, rot)
            self.cache_k[li, :, :, start:end] = k
            self.cache_v[li, :, :, start:end] = v
            a = attend(q, self.cache_k[li, :, :, :end], self.cache_v[li, :, :, :end], mask)
            x = x + self._all_reduce(_mm(a.transpose(1, 2).reshape(B, T, hq * d), w["wo"]))
            h = rms_norm(x, w["ln2"], self.p.eps)
            gate, up = _mm(h, w["w_gate_up"]).chunk(2, dim=-1)
            x = x + self._all_reduce(_mm(F.silu(gate) * up, w["w_down"]))
        x = rms_norm(x, self.root["norm"], self.p.eps)
        return _mm(x, self.root["lm_head"])

    # ---- decode loop ----
    @torch.no_grad()
    def generate(self, prompts: List[List[int]], sp: SamplingParams, *, eos_id: int, pad_id: int,
                 generator: Optional[torch.Generator] = None, device=None) -> Generation:
        """``sp.n`` samples of every prompt (prompt-major order)."""
        device = device or self.root["embed"].device
        rows = [p for p in prompts for _ in range(sp.n)]
        ids, pmask = left_pad(rows, pad_id, device)
        B, P = ids.shape
        N = sp.max_new_tokens
        self.allocate(B, P + N, device)
        valid = torch.zeros((B, P + N), dtype=torch.bool, device=device)
        valid[:, :P] = pmask.bool()
        positions = (pmask.cumsum(-1) - 1).clamp(min=0)
        out_tokens = torch.full((B, N), pad_id, dtype=torch.long, device=device)
        out_logp = torch.zeros((B, N), dtype=torch.float32, device=device)
        active = torch.arange(B, device=device)
        next_pos = positions[:, -1] + 1
        logits = self.forward(ids, positions, valid, start=0)[:, -1]
        for t in range(N):
            tok, logp = sample(logits, sp, generator, ban=eos_id if t < sp.min_new_tokens else None)
            out_tokens[active, t] = tok
            out_logp[active, t] = logp
            if t == N - 1:
                break
            keep = tok != eos_id
            if not bool(keep.all()):  # finished sequences leave the batch
                active, tok, next_pos, valid = active[keep], tok[keep], next_pos[keep], valid[keep]
                self.keep_rows(keep)
                if active.numel() == 0:
                    break
            valid[:, P + t] = True
            logits = self.forward(tok[:, None], next_pos[:, None], valid, start=P + t)[:, -1]
            next_pos = next_pos + 1
        self.release()
        return finish(ids, pmask, out_tokens, out_logp, eos_id, pad_id)


def finish(prompt_ids, prompt_mask, tokens, logprobs, eos_id: int, pad_id: int) -> Generation:
    """Masks everything after the first EOS as padding and builds the full sequences."""
    is_eos = tokens == eos_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    response_mask = (~after_eos).long()
    tokens = tokens.masked_fill(after_eos, pad_id)
    logprobs = logprobs.masked_fill(after_eos, 0.0)
    return Generation(sequences=torch.cat([prompt_ids, tokens], 1),
                      attention_mask=torch.cat([prompt_mask, response_mask], 1),
                      response_mask=response_mask, logprobs=logprobs, prompt_len=prompt_ids.shape[1])
