"""Injection policies: how a model family's HF weights map onto the inference modules, and the
tensor-parallel plan that slices them (Megatron-style: attention heads and MLP columns split over
the TP ranks; the output projections split by rows, followed by one all-reduce each).

Llama, Qwen2, Qwen3 and Mistral share module names (q/k/v/o_proj, gate/up/down_proj, two RMSNorms);
Phi-3 fuses them in its HF layout (qkv_proj rows = [q; k; v], gate_up_proj rows = [gate; up]). They
differ in biases (Qwen2: q/k/v; Qwen3 and Llama: q/k/v/o with ``attention_bias``; Llama: MLP with
``mlp_bias``), q/k RMSNorm per head before the rotation (Qwen3), partial rotary (Phi-3), and sliding
windows (Mistral and Phi-3: every layer; Qwen2/Qwen3: the layers ``layer_types`` names). Each family
is one row of FAMILY_TABLE (a ``Family``: those traits, each the HF modeling code's rule); the policy
reads the row, never the family's name, so a family whose traits are all in it needs only its row.
Anything the inference modules do not reproduce exactly (other activations, dynamic or LongRoPE
frequencies, other layer types, MoE) has no policy: the caller falls back to HF generate with the
one-line reason, never to wrong output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from rlhf.models.lora import is_lora_layer, weight
from rlhf.ops.rotary import interleave_permutation

WINDOW_RULES = ("none", "every_layer", "layer_types")


@dataclass(frozen=True)
class Family:
    """What the injection policy reads of one model family (HF ``config.model_type``): its HF modeling
    code's rules. One row per family in FAMILY_TABLE; a family with no row has no policy."""

    model_type: str
    # one fused input projection per block, HF rows qkv_proj = [q; k; v] and gate_up_proj = [gate; up]
    # (Phi-3); else q/k/v_proj and gate/up_proj
    fused: bool = False
    # which layers slide: "every_layer" (one mask for all, windowed when sliding_window is set: Mistral,
    # Phi-3), "layer_types" (layer i's mask is config.layer_types[i]'s: Qwen2/Qwen3), "none" (Llama)
    windows: str = "none"
    qkv_bias: bool = False  # q/k/v biases whatever the config says (Qwen2)
    attention_bias: bool = False  # config.attention_bias honoured: q/k/v and o_proj biases (Llama, Qwen3)
    mlp_bias: bool = False  # config.mlp_bias honoured: gate/up/down biases (Llama)
    qk_norm: bool = False  # RMSNorm of each q and k head before the rotation (Qwen3)
    partial_rotary: bool = False  # partial_rotary_factor honoured (Phi-3); the others rotate whole heads
    # training forwards may run packed (rlhf/engine/packing.py): its HF attention goes through
    # Transformers' attention interface with the keyword arguments (sequence bounds, sliding window)
    packs: bool = False

    def __post_init__(self):
        if self.windows not in WINDOW_RULES:
            raise ValueError(f"{self.model_type}: windows={self.windows!r}, expected one of {WINDOW_RULES}")


FAMILY_TABLE = (
    Family("llama", attention_bias=True, mlp_bias=True, packs=True),
    Family("qwen2", windows="layer_types", qkv_bias=True, packs=True),
    Family("qwen3", windows="layer_types", attention_bias=True, qk_norm=True, packs=True),
    Family("mistral", windows="every_layer", packs=True),
    Family("phi3", fused=True, windows="every_layer", partial_rotary=True, packs=True),
)
FAMILIES = tuple(f.model_type for f in FAMILY_TABLE)


def family_of(model_type: str) -> Optional[Family]:
    """The row of FAMILY_TABLE for ``model_type`` (read at call time), or None."""
    return next((f for f in FAMILY_TABLE if f.model_type == model_type), None)


STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at init


@dataclass
class InjectionPolicy:
    """How one model family's weights are laid out for the inference modules and sliced for TP (an
    injection policy, as DeepSpeed calls it: not the actor policy being trained)."""

    family: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    eps: float
    qkv_bias: bool
    sliding_window: Optional[int]  # the window of the layers that slide (None: no layer does)
    tie_word_embeddings: bool
    layer_windows: Tuple[Optional[int], ...] = ()  # per layer: its window, or None (full attention)
    rotary_dim: int = 0  # dimensions of a head that rotate (the first ones); 0 = head_dim
    qk_norm: bool = False  # RMSNorm of each q and k head before the rotation (Qwen3)
    o_bias: bool = False  # bias of the attention output projection
    mlp_bias: bool = False  # biases of gate/up/down
    fused: bool = False  # HF layout qkv_proj = [q; k; v], gate_up_proj = [gate; up] (Family.fused)

    def __post_init__(self):
        self.rotary_dim = self.rotary_dim or self.head_dim

    def window(self, layer: int) -> Optional[int]:
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def check_tp(self, tp: int) -> Optional[str]:
        """Why ``tp`` cannot slice this model, or None."""
        for name, n in (
            ("attention heads", self.num_heads),
            ("key/value heads", self.num_kv_heads),
            ("intermediate size", self.intermediate_size),
        ):
            if n % tp:
                return f"{name} ({n}) not divisible by engine.inference_tp_size={tp}"
        return None

    # ---- weights of one decoder layer, full (unsharded) tensors in, this TP rank's fused slices out ----
    def layer_weights(self, layer, tp_rank: int, tp: int) -> Dict[str, torch.Tensor]:
        a, m = layer.self_attn, layer.mlp
        hq, hk = self.num_heads // tp, self.num_kv_heads // tp
        d = self.head_dim
        qs, ks = slice(tp_rank * hq * d, (tp_rank + 1) * hq * d), slice(tp_rank * hk * d, (tp_rank + 1) * hk * d)
        i = self.intermediate_size // tp
        ms = slice(tp_rank * i, (tp_rank + 1) * i)
        (q, k, v), (gate, up) = self._qkv(a, "weight"), self._gate_up(m, "weight")
        w = {
            "wqkv": torch.cat([self._interleave(q[qs]), self._interleave(k[ks]), v[ks]]),
            "wo": weight(a.o_proj)[:, qs].clone(memory_format=torch.contiguous_format),
            "w_gate_up": torch.cat([gate[ms], up[ms]]),
            "w_down": weight(m.down_proj)[:, ms].clone(memory_format=torch.contiguous_format),
            "ln1": layer.input_layernorm.weight.detach().clone(),
            "ln2": layer.post_attention_layernorm.weight.detach().clone(),
        }
        if self.qkv_bias:
            q, k, v = self._qkv(a, "bias")
            w["bqkv"] = torch.cat([self._interleave(q[qs]), self._interleave(k[ks]), v[ks]])
        # a row-parallel output's bias is added once: by TP rank 0, before the all-reduce
        if self.o_bias and tp_rank == 0:
            w["bo"] = weight(a.o_proj, "bias").detach().clone()
        if self.mlp_bias:
            gate, up = self._gate_up(m, "bias")
            w["b_gate_up"] = torch.cat([gate[ms], up[ms]])
            if tp_rank == 0:
                w["b_down"] = weight(m.down_proj, "bias").detach().clone()
        if self.qk_norm:  # one weight row per q and k head of this rank, in the interleaved layout
            perm = self._perm(a.q_norm.weight.device)
            w["qk_norm"] = torch.cat([a.q_norm.weight[perm].expand(hq, d), a.k_norm.weight[perm].expand(hk, d)])
        return {k: v.detach() for k, v in w.items()}

    def _qkv(self, attn, what: str):
        """(q, k, v) rows of the attention input projections' ``weight`` or ``bias`` (full tensors)."""
        if self.fused:  # one fused projection, rows [q; k; v]
            t = weight(attn.qkv_proj, what)
            nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return t[:nq], t[nq : nq + nk], t[nq + nk :]
        return weight(attn.q_proj, what), weight(attn.k_proj, what), weight(attn.v_proj, what)

    def _gate_up(self, mlp, what: str):
        if self.fused:  # rows [gate; up] (HF: gate, up = gate_up_proj(x).chunk(2))
            t = weight(mlp.gate_up_proj, what)
            return t[: self.intermediate_size], t[self.intermediate_size :]
        return weight(mlp.gate_proj, what), weight(mlp.up_proj, what)

    def _perm(self, device) -> torch.Tensor:
        """Per head: the rotated dimensions interleaved (rlhf.ops.rotary), the rest where they were."""
        r = self.rotary_dim
        return torch.cat([interleave_permutation(r, device), torch.arange(r, self.head_dim, device=device)])

    def _interleave(self, w: torch.Tensor) -> torch.Tensor:
        """Rows of a q/k projection (per head) into the rotary-interleaved layout (rlhf.ops.rotary)."""
        d = self.head_dim
        return w.reshape(-1, d, *w.shape[1:])[:, self._perm(w.device)].reshape(w.shape)

    def root_weights(self, model) -> Dict[str, torch.Tensor]:
        base = model.model
        embed = weight(base.embed_tokens).detach().clone()  # LoRA-adapted where a user targets it
        # tied embeddings: the LM head is the base embedding (an embedding adapter changes only the lookup, as in HF)
        if not self.tie_word_embeddings:
            head = weight(model.lm_head).detach().clone()
        elif is_lora_layer(base.embed_tokens):
            head = base.embed_tokens.weight.detach().clone()
        else:
            head = embed
        rot = base.rotary_emb
        if 2 * rot.inv_freq.numel() != self.rotary_dim:
            raise ValueError(
                f"{self.family}: the rotary embedding has {2 * rot.inv_freq.numel()} dimensions, "
                f"the policy expects {self.rotary_dim}"
            )
        return {
            "embed": embed,
            "norm": base.norm.weight.detach().clone(),
            "lm_head": head,
            "inv_freq": rot.inv_freq.detach().clone().float(),
            "rope_scaling": torch.tensor(float(getattr(rot, "attention_scaling", 1.0)), device="cpu"),
        }


def _rope(config) -> Tuple[str, float]:
    """(RoPE type, partial rotary factor) as the HF rotary embedding reads them."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return "default", 1.0
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if factor is None:
        return rope_type, 1.0
    return rope_type, float(factor)


def _layer_windows(config, family: Family) -> Tuple[Optional[Tuple[Optional[int], ...]], str]:
    """Each layer's sliding window (None: full attention), as the family's HF model masks it."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if family.windows == "every_layer":  # HF: one mask for every layer, windowed when sliding_window is set
        return (window,) * n, ""
    if family.windows == "layer_types":  # HF: layer i's mask is config.layer_types[i]'s
        # (sliding_window is None unless use_sliding_window; the rule below is the config's own
        # default for layer_types)
        types = getattr(config, "layer_types", None) or [
            "sliding_attention" if window is not None and i >= config.max_window_layers else "full_attention"
            for i in range(n)
        ]
        out = []
        for t in types:
            if t == "full_attention":
                out.append(None)
            elif t == "sliding_attention" and window:
                out.append(window)
            elif t == "sliding_attention":
                return None, "layer_types names sliding layers but sliding_window is not set (use_sliding_window)"
            else:
                return None, f"layer type '{t}' is not supported by the inference modules"
        return tuple(out), ""
    return (None,) * n, ""  # "none" (Llama): no sliding window


def policy_for(config) -> tuple[Optional[InjectionPolicy], str]:
    """(policy, "") for a supported config, else (None, the reason)."""
    family = getattr(config, "model_type", "?")
    traits = family_of(family)
    if traits is None:
        supported = ", ".join(f.model_type for f in FAMILY_TABLE)
        return None, f"model family '{family}' has no injection policy (supported: {supported})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return None, f"activation {config.hidden_act} is not supported by the inference modules"
    rope_type, partial = _rope(config)
    if rope_type not in STATIC_ROPE:
        return None, f"RoPE type '{rope_type}' is not supported by the inference modules"
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if partial != 1.0 and not traits.partial_rotary:  # HF's other families rotate whole heads
        return None, f"partial rotary (partial_rotary_factor={partial}) is not supported for {family}"
    windows, why = _layer_windows(config, traits)
    if windows is None:
        return None, why
    attention_bias = bool(getattr(config, "attention_bias", False)) and traits.attention_bias
    slides = [w for w in windows if w]
    return InjectionPolicy(
        family=family,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        eps=config.rms_norm_eps,
        qkv_bias=traits.qkv_bias or attention_bias,
        sliding_window=slides[0] if slides else None,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        layer_windows=windows,
        rotary_dim=int(head_dim * partial),
        qk_norm=traits.qk_norm,
        o_bias=attention_bias,
        mlp_bias=traits.mlp_bias and bool(getattr(config, "mlp_bias", False)),
        fused=traits.fused,
    ), ""
