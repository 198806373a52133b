"""Injection policies: how a model family's HF weights map onto the inference modules, and the
tensor-parallel plan that slices them (Megatron-style: attention heads and MLP columns split over
the TP ranks; the output projections split by rows, followed by one all-reduce each).

Llama, Qwen2 and Mistral share module names (q/k/v/o_proj, gate/up/down_proj, two RMSNorms); they
differ in QKV biases (Qwen2) and sliding windows (Mistral). Anything the inference modules do not
reproduce exactly (other activations, dynamic RoPE, MLP biases) has no policy: the caller falls
back to HF generate with a warning, never to wrong output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from rlhf.ops.rotary import interleave_permutation

FAMILIES = ("llama", "qwen2", "mistral")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at init


@dataclass
class Policy:
    family: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    eps: float
    qkv_bias: bool
    sliding_window: Optional[int]
    tie_word_embeddings: bool

    def check_tp(self, tp: int) -> Optional[str]:
        """Why ``tp`` cannot slice this model, or None."""
        for name, n in (("attention heads", self.num_heads), ("key/value heads", self.num_kv_heads),
                        ("intermediate size", self.intermediate_size)):
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
        w = {
            "wqkv": torch.cat([self._interleave(a.q_proj.weight[qs]), self._interleave(a.k_proj.weight[ks]),
                               a.v_proj.weight[ks]]),
            "wo": a.o_proj.weight[:, qs].clone(memory_format=torch.contiguous_format),
            "w_gate_up": torch.cat([m.gate_proj.weight[ms], m.up_proj.weight[ms]]),
            "w_down": m.down_proj.weight[:, ms].clone(memory_format=torch.contiguous_format),
            "ln1": layer.input_layernorm.weight.detach().clone(),
            "ln2": layer.post_attention_layernorm.weight.detach().clone(),
        }
        if self.qkv_bias:
            w["bqkv"] = torch.cat([self._interleave(a.q_proj.bias[qs]), self._interleave(a.k_proj.bias[ks]),
                                   a.v_proj.bias[ks]])
        return {k: v.detach() for k, v in w.items()}

    def _interleave(self, w: torch.Tensor) -> torch.Tensor:
        """Rows of a q/k projection (per head) into the rotary-interleaved layout (rlhf.ops.rotary)."""
        d = self.head_dim
        perm = interleave_permutation(d, w.device)
        return w.reshape(-1, d, *w.shape[1:])[:, perm].reshape(w.shape)

    def root_weights(self, model) -> Dict[str, torch.Tensor]:
        base = model.model
        embed = base.embed_tokens.weight.detach().clone()
        head = embed if self.tie_word_embeddings else model.lm_head.weight.detach().clone()
        rot = base.rotary_emb
        return {"embed": embed, "norm": base.norm.weight.detach().clone(), "lm_head": head,
                "inv_freq": rot.inv_freq.detach().clone().float(),
                "rope_scaling": torch.tensor(float(getattr(rot, "attention_scaling", 1.0)), device="cpu")}


def policy_for(config) -> tuple[Optional[Policy], str]:
    """(policy, "") for a supported config, else (None, the reason)."""
    family = getattr(config, "model_type", "?")
    if family not in FAMILIES:
        return None, f"model family '{family}' has no injection policy (supported: {', '.join(FAMILIES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return None, f"activation {config.hidden_act} is not supported by the inference modules"
    if getattr(config, "mlp_bias", False):
        return None, "MLP biases are not supported by the inference modules"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE:
        return None, f"RoPE type '{rope_type}' is not supported by the inference modules"
    heads = config.num_attention_heads
    qkv_bias = family == "qwen2" or bool(getattr(config, "attention_bias", False))
    window = getattr(config, "sliding_window", None) if family == "mistral" or getattr(
        config, "use_sliding_window", False) else None
    return Policy(family=family, num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", heads),
                  head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                  hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                  eps=config.rms_norm_eps, qkv_bias=qkv_bias, sliding_window=window,
                  tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False))), ""
