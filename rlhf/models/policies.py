"""Injection policies: how a model family's HF weights map onto the inference modules, and the
tensor-parallel plan that slices them (Megatron-style: attention heads and MLP columns split over
the TP ranks; the output projections split by rows, followed by one all-reduce each).

Llama, Qwen2, Qwen3 and Mistral share module names (q/k/v/o_proj, gate/up/down_proj, two RMSNorms);
Phi-3 fuses them in its HF layout (qkv_proj rows = [q; k; v], gate_up_proj rows = [gate; up]). They
differ in biases (Qwen2: q/k/v; Qwen3 and Llama: q/k/v/o with ``attention_bias``; Llama: MLP with
``mlp_bias``), q/k RMSNorm per head before the rotation (Qwen3), partial rotary (Phi-3), and sliding
windows (Mistral and Phi-3: every layer; Qwen2/Qwen3: the layers ``layer_types`` names). Each family
is one row of FAMILY_TABLE (a ``Family``: those traits, each the HF modeling code's rule); the
policy reads the row, never the family's name, so a family whose traits are all in it needs only its
row. OPT and GPT-2 (DeepSpeed-Chat's own families) differ in kind, each a trait too: LayerNorm with
bias instead of RMSNorm, learned absolute positions (a table; OPT's rows offset by 2) instead of
rotary, a plain MLP (ReLU, GELU) with biases instead of the SiLU-gated one, post-LayerNorm blocks
(OPT's ``do_layer_norm_before=False``), projections between the embedding and hidden widths
(OPT-350m's ``project_in``/``project_out``), Conv1D weights stored [in, out] (GPT-2). Where a family
keeps each weight is its ``Modules`` row (paths relative to the causal LM and to a decoder layer).
GPT-NeoX combines kinds: LayerNorm, a plain GELU MLP, partial rotary, its fused ``query_key_value``
head by head, parallel blocks (``use_parallel_residual``: x + attn(ln1(x)) + mlp(ln2(x))).
Mixture-of-Experts families (Qwen3-MoE, Mixtral, Qwen2-MoE) are their dense family's row with a
router and 3-D expert weights in place of the MLP on the layers whose HF model has them (softmax
routing to the top k, renormalised or not; Qwen2-MoE's sigmoid-gated shared expert beside them);
under TP each rank holds E / tp whole experts (and its slice of a shared expert). Anything the
inference modules do not reproduce exactly (other activations, dynamic or LongRoPE frequencies,
other layer types, the config switches a family's ``refuse`` names) has no policy: the caller falls
back to HF generate with the one-line reason, never to wrong output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Dict, Optional, Tuple

import torch
import transformers

from rlhf.models.lora import is_lora_layer, param_weights, weight
from rlhf.ops.activation import ACTIVATIONS
from rlhf.ops.rotary import interleave_permutation

WINDOW_RULES = ("none", "every_layer", "layer_types")
# RMSNorm (weight only) | LayerNorm (weight and bias)
NORMS = ("rms", "layer")
# rotary embedding | a learned table added to the token embeddings
POSITIONS = ("rotary", "learned")
MLPS = ("gated", "plain")  # down(SiLU(gate) · up) | down(act(up))


@dataclass(frozen=True)
class Modules:
    """Where a family's HF model keeps the weights the policy reads: ``base`` (the decoder stack)
    and the root's modules relative to the causal LM and to ``base``, a block's relative to one
    decoder layer ("": the family has none; a module the model sets to None, such as OPT's
    ``project_in`` at equal widths or its final norm in post-LayerNorm models, is absent too)."""

    base: str = "model"
    embed: str = "embed_tokens"
    positions: str = ""  # the learned position table
    norm: str = "norm"  # the final norm
    # embedding width → hidden width (after the lookup)
    project_in: str = ""
    # hidden width → embedding width (before the LM head)
    project_out: str = ""
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    qkv: str = "self_attn.qkv_proj"  # fused, rows [q; k; v] (Family.fused)
    o: str = "self_attn.o_proj"
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    # fused, rows [gate; up] (Family.fused, gated MLP)
    gate_up: str = "mlp.gate_up_proj"
    down: str = "mlp.down_proj"
    # before attention (pre-norm) or after its residual add (post-norm)
    ln1: str = "input_layernorm"
    ln2: str = "post_attention_layernorm"  # the same around the MLP
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    # MoE blocks: the router ([experts, hidden]), the experts (3-D gate_up_proj [E, 2·I, hidden],
    # down_proj [E, hidden, I]), the shared expert (a gated MLP) and its [1, hidden] gate
    router: str = "mlp.gate"
    experts: str = "mlp.experts"
    shared: str = "mlp.shared_expert"
    shared_gate: str = "mlp.shared_expert_gate"


LLAMA_MODULES = Modules()
OPT_MODULES = Modules(
    base="model.decoder",
    positions="embed_positions",
    norm="final_layer_norm",
    project_in="project_in",
    project_out="project_out",
    o="self_attn.out_proj",
    up="fc1",
    down="fc2",
    ln1="self_attn_layer_norm",
    ln2="final_layer_norm",
)
GPT2_MODULES = Modules(
    base="transformer",
    embed="wte",
    positions="wpe",
    norm="ln_f",
    qkv="attn.c_attn",
    o="attn.c_proj",
    up="mlp.c_fc",
    down="mlp.c_proj",
    ln1="ln_1",
    ln2="ln_2",
)


NEOX_MODULES = Modules(
    base="gpt_neox",
    embed="embed_in",
    norm="final_layer_norm",
    qkv="attention.query_key_value",
    o="attention.dense",
    up="mlp.dense_h_to_4h",
    down="mlp.dense_4h_to_h",
)


def module_at(root, path: str):
    """The submodule of ``root`` at the dotted ``path``, or None ("" or absent)."""
    if not path:
        return None
    try:
        return attrgetter(path)(root)
    except AttributeError:
        return None


@dataclass(frozen=True)
class Family:
    """What the injection policy reads of one model family (HF ``config.model_type``): its HF
    modeling code's rules. One row per family in FAMILY_TABLE; a family with no row has no
    policy."""

    model_type: str
    # one fused input projection per block, HF rows qkv_proj = [q; k; v] and gate_up_proj = [gate;
    # up] (Phi-3; GPT-2's c_attn; GPT-NeoX's query_key_value, with ``qkv_per_head``); else
    # q/k/v_proj and gate/up_proj
    fused: bool = False
    # the fused rows head by head, [q_h; k_h; v_h] per head (GPT-NeoX)
    qkv_per_head: bool = False
    # which layers slide: "every_layer" (one mask for all, windowed when sliding_window is set:
    # Mistral, Phi-3), "layer_types" (layer i's mask is config.layer_types[i]'s: Qwen2/Qwen3),
    # "none" (Llama)
    windows: str = "none"
    # q/k/v biases whatever the config says (Qwen2)
    qkv_bias: bool = False
    # the attention's q/k/v and output biases, and the MLP's: "always" (GPT-2; GPT-NeoX's MLP), the
    # config flag that switches them (attention_bias: Llama, Qwen3, GPT-NeoX; mlp_bias: Llama;
    # enable_bias: both in OPT), or "" (none)
    attn_bias: str = ""
    mlp_bias: str = ""
    # RMSNorm of each q and k head before the rotation (Qwen3)
    qk_norm: bool = False
    # partial_rotary_factor honoured (Phi-3); the others rotate whole heads
    partial_rotary: bool = False
    # training forwards may run packed (rlhf/engine/packing.py): its HF attention goes through
    # Transformers' attention interface with the keyword arguments (sequence bounds, sliding window)
    packs: bool = False
    modules: Modules = LLAMA_MODULES
    norm: str = "rms"  # NORMS
    # the config field of the norms' epsilon ("": nn.LayerNorm's 1e-5, OPT)
    eps_key: str = "rms_norm_eps"
    # the config flag that says pre-norm blocks, false = post-norm (OPT: do_layer_norm_before); "":
    # pre-norm
    prenorm_key: str = ""
    # the config flag that says parallel blocks, x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX:
    # use_parallel_residual); "": sequential
    parallel_key: str = ""
    positions: str = "rotary"  # POSITIONS
    # learned: the table row of position p is p + offset (OPT: 2)
    position_offset: int = 0
    mlp: str = "gated"  # MLPS
    # the config field naming the MLP's activation
    act_key: str = "hidden_act"
    # the MLP's width: this config field; None there (GPT-2's n_inner) means 4 · hidden_size
    intermediate_key: str = "intermediate_size"
    # weights stored [in, out] (GPT-2's Conv1D), transposed to a Linear's [out, in]
    conv1d: bool = False
    # config switches the inference modules do not reproduce: (field, the only value served)
    refuse: Tuple[Tuple[str, object], ...] = ()
    # Mixture-of-Experts: a layer is MoE where its HF model has ``Modules.experts``
    # (mlp_only_layers and decoder_sparse_step decide it there); the config field of the number of
    # experts ("": a dense family)
    experts_key: str = ""
    # top-k routing probabilities renormalised to sum 1: "always" (Mixtral), the config flag
    # (norm_topk_prob: Qwen2/3-MoE), "" never
    topk_norm: str = ""
    # a shared expert beside the routed ones, gated by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)
    shared_expert: bool = False

    def __post_init__(self):
        for name, value, allowed in (
            ("windows", self.windows, WINDOW_RULES),
            ("norm", self.norm, NORMS),
            ("positions", self.positions, POSITIONS),
            ("mlp", self.mlp, MLPS),
        ):
            if value not in allowed:
                raise ValueError(f"{self.model_type}: {name}={value!r}, expected one of {allowed}")


FAMILY_TABLE = (
    Family("llama", attn_bias="attention_bias", mlp_bias="mlp_bias", packs=True),
    Family("qwen2", windows="layer_types", qkv_bias=True, packs=True),
    Family("qwen3", windows="layer_types", attn_bias="attention_bias", qk_norm=True, packs=True),
    Family("mistral", windows="every_layer", packs=True),
    Family("phi3", fused=True, windows="every_layer", partial_rotary=True, packs=True),
    Family(
        "opt",
        attn_bias="enable_bias",
        mlp_bias="enable_bias",
        packs=True,
        modules=OPT_MODULES,
        norm="layer",
        eps_key="",
        prenorm_key="do_layer_norm_before",
        positions="learned",
        position_offset=2,
        mlp="plain",
        act_key="activation_function",
        intermediate_key="ffn_dim",
        refuse=(("layer_norm_elementwise_affine", True),),
    ),
    Family(
        "gpt2",
        fused=True,
        attn_bias="always",
        mlp_bias="always",
        packs=True,
        modules=GPT2_MODULES,
        norm="layer",
        eps_key="layer_norm_epsilon",
        positions="learned",
        mlp="plain",
        act_key="activation_function",
        intermediate_key="n_inner",
        conv1d=True,
        refuse=(
            ("scale_attn_weights", True),
            ("scale_attn_by_inverse_layer_idx", False),
            ("reorder_and_upcast_attn", False),
            ("add_cross_attention", False),
        ),
    ),
    Family(
        "gpt_neox",
        fused=True,
        qkv_per_head=True,
        attn_bias="attention_bias",
        mlp_bias="always",
        partial_rotary=True,
        packs=True,
        modules=NEOX_MODULES,
        norm="layer",
        eps_key="layer_norm_eps",
        parallel_key="use_parallel_residual",
        mlp="plain",
    ),
)


def family_row(model_type: str) -> Family:
    return next(f for f in FAMILY_TABLE if f.model_type == model_type)


# (each its dense family's row and the MoE traits)
MOE_FAMILY_TABLE = (
    replace(
        family_row("qwen3"),
        model_type="qwen3_moe",
        packs=False,
        experts_key="num_experts",
        topk_norm="norm_topk_prob",
    ),
    replace(
        family_row("mistral"),
        model_type="mixtral",
        packs=False,
        experts_key="num_local_experts",
        topk_norm="always",
        # (HF multiplies the router's input by noise in training forwards only)
        refuse=(("router_jitter_noise", 0.0),),
    ),
    replace(
        family_row("qwen2"),
        model_type="qwen2_moe",
        packs=False,
        experts_key="num_experts",
        topk_norm="norm_topk_prob",
        shared_expert=True,
        refuse=(("qkv_bias", True),),
    ),
)
FAMILY_TABLE = FAMILY_TABLE + MOE_FAMILY_TABLE
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
    # the window of the layers that slide (None: no layer does)
    sliding_window: Optional[int]
    tie_word_embeddings: bool
    # per layer: its window, or None (full attention)
    layer_windows: Tuple[Optional[int], ...] = ()
    # dimensions of a head that rotate (the first ones); 0 = head_dim
    rotary_dim: int = 0
    # RMSNorm of each q and k head before the rotation (Qwen3)
    qk_norm: bool = False
    # bias of the attention output projection
    o_bias: bool = False
    # biases of gate/up/down (up/down of a plain MLP)
    mlp_bias: bool = False
    # HF layout qkv_proj = [q; k; v], gate_up_proj = [gate; up] (Family.fused)
    fused: bool = False
    # the fused q/k/v rows head by head (Family.qkv_per_head)
    qkv_per_head: bool = False
    modules: Modules = LLAMA_MODULES
    norm: str = "rms"  # NORMS
    # False: each block's norms after its residual adds (OPT-350m)
    prenorm: bool = True
    # x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX)
    parallel: bool = False
    positions: str = "rotary"  # POSITIONS
    position_offset: int = 0  # learned: table row of position p
    # learned: positions the table holds (after the offset)
    max_positions: int = 0
    mlp: str = "gated"  # MLPS
    # a plain MLP's (rlhf.ops.activation.ACTIVATIONS)
    activation: str = "silu"
    conv1d: bool = False  # HF weights stored [in, out]
    # Mixture-of-Experts: routed experts (0: dense), each token's top k, renormalised or not, a
    # shared expert on each MoE layer
    num_experts: int = 0
    top_k: int = 0
    topk_norm: bool = False
    shared_expert: bool = False
    shared_intermediate: int = 0  # the shared expert's MLP width

    def __post_init__(self):
        self.rotary_dim = self.rotary_dim or self.head_dim

    def window(self, layer: int) -> Optional[int]:
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def check_tp(self, tp: int) -> Optional[str]:
        """Why ``tp`` cannot slice this model, or None."""
        if self.num_experts % tp:
            return f"experts ({self.num_experts}) not divisible by engine.inference_tp_size={tp}"
        if self.shared_intermediate % tp:
            return (
                f"the shared expert's width ({self.shared_intermediate}) not divisible by "
                f"engine.inference_tp_size={tp}"
            )
        for name, n in (
            ("attention heads", self.num_heads),
            ("key/value heads", self.num_kv_heads),
            ("intermediate size", self.intermediate_size),
        ):
            if n % tp:
                return f"{name} ({n}) not divisible by engine.inference_tp_size={tp}"
        return None

    # ---- weights of one decoder layer, full (unsharded) tensors in, this TP rank's fused slices
    # out ----
    def layer_weights(self, layer, tp_rank: int, tp: int) -> Dict[str, torch.Tensor]:
        n = self.modules
        hq, hk = self.num_heads // tp, self.num_kv_heads // tp
        d = self.head_dim
        qs, ks = (
            slice(tp_rank * hq * d, (tp_rank + 1) * hq * d),
            slice(tp_rank * hk * d, (tp_rank + 1) * hk * d),
        )
        i = self.intermediate_size // tp
        ms = slice(tp_rank * i, (tp_rank + 1) * i)
        q, k, v = self._qkv(layer, "weight")
        w = {"wqkv": torch.cat([self._interleave(q[qs]), self._interleave(k[ks]), v[ks]])}
        w["wo"] = self._weight(layer, n.o)[:, qs].clone(memory_format=torch.contiguous_format)
        experts = module_at(layer, n.experts)
        if experts is not None:
            w.update(self._moe_weights(layer, experts, tp_rank, tp))
        elif self.mlp == "gated":
            gate, up = self._gate_up(layer, "weight")
            w["w_gate_up"] = torch.cat([gate[ms], up[ms]])
        else:
            w["w_up"] = self._weight(layer, n.up)[ms].clone(memory_format=torch.contiguous_format)
        if experts is None:
            w["w_down"] = self._weight(layer, n.down)[:, ms].clone(
                memory_format=torch.contiguous_format
            )
        ln1, ln2 = module_at(layer, n.ln1), module_at(layer, n.ln2)
        w["ln1"], w["ln2"] = ln1.weight.detach().clone(), ln2.weight.detach().clone()
        if self.norm == "layer":
            w["ln1_b"], w["ln2_b"] = ln1.bias.detach().clone(), ln2.bias.detach().clone()
        if self.qkv_bias:
            q, k, v = self._qkv(layer, "bias")
            w["bqkv"] = torch.cat([self._interleave(q[qs]), self._interleave(k[ks]), v[ks]])
        # a row-parallel output's bias is added once: by TP rank 0, before the all-reduce
        if self.o_bias and tp_rank == 0:
            w["bo"] = self._weight(layer, n.o, "bias").detach().clone()
        if self.mlp_bias:
            if self.mlp == "gated":
                gate, up = self._gate_up(layer, "bias")
                w["b_gate_up"] = torch.cat([gate[ms], up[ms]])
            else:
                w["b_up"] = self._weight(layer, n.up, "bias")[ms].clone()
            if tp_rank == 0:
                w["b_down"] = self._weight(layer, n.down, "bias").detach().clone()
        if self.qk_norm:
            # one weight row per q and k head of this rank, in the interleaved layout
            qn, kn = module_at(layer, n.q_norm).weight, module_at(layer, n.k_norm).weight
            perm = self._perm(qn.device)
            w["qk_norm"] = torch.cat([qn[perm].expand(hq, d), kn[perm].expand(hk, d)])
        return {k: v.detach() for k, v in w.items()}

    def _moe_weights(self, layer, experts, tp_rank: int, tp: int) -> Dict[str, torch.Tensor]:
        """A MoE layer's: ``router`` [E, hidden] (whole on every TP rank), this TP rank's E / tp
        experts (whole experts: ``experts_gate_up`` [E/tp, 2·I, hidden], rows [gate; up] per
        expert, ``experts_down`` [E/tp, hidden, I]); with a shared expert its gated MLP sliced as a
        dense layer's (``w_gate_up`` / ``w_down``) and ``shared_gate`` [1, hidden]."""
        n = self.modules
        # (LoRA on the experts merged in; an expert-parallel model's experts gathered)
        both = param_weights(experts, ("gate_up_proj", "down_proj"))
        mine = slice(tp_rank * self.num_experts // tp, (tp_rank + 1) * self.num_experts // tp)
        w = {
            "router": weight(module_at(layer, n.router)).clone(),
            "experts_gate_up": both["gate_up_proj"][mine].clone(),
            "experts_down": both["down_proj"][mine].clone(),
        }
        if self.shared_expert:
            shared = lambda name: self._weight(layer, f"{n.shared}.{name}")  # noqa: E731
            gate, up, down = shared("gate_proj"), shared("up_proj"), shared("down_proj")
            i = gate.shape[0] // tp
            ms = slice(tp_rank * i, (tp_rank + 1) * i)
            w["w_gate_up"] = torch.cat([gate[ms], up[ms]])
            w["w_down"] = down[:, ms].clone(memory_format=torch.contiguous_format)
            w["shared_gate"] = weight(module_at(layer, n.shared_gate)).clone()
        return w

    def _weight(self, layer, path: str, what: str = "weight") -> torch.Tensor:
        """The ``weight`` (as a Linear's [out, in], LoRA merged: ``lora.weight``) or ``bias`` of the
        projection at ``path`` of ``layer`` (a full tensor, possibly a view of the module's)."""
        t = weight(module_at(layer, path), what)
        return t.t() if self.conv1d and what == "weight" else t

    def _qkv(self, layer, what: str):
        """(q, k, v) rows of the attention input projections' ``weight`` or ``bias`` (full
        tensors)."""
        n = self.modules
        if self.fused and self.qkv_per_head:
            # rows [q_h; k_h; v_h] for each head h (multi-head attention)
            t = self._weight(layer, n.qkv, what)
            heads = t.reshape(self.num_heads, 3, self.head_dim, *t.shape[1:])
            return tuple(heads[:, i].reshape(-1, *t.shape[1:]) for i in range(3))
        if self.fused:  # one fused projection, rows [q; k; v]
            t = self._weight(layer, n.qkv, what)
            nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return t[:nq], t[nq : nq + nk], t[nq + nk :]
        return (
            self._weight(layer, n.q, what),
            self._weight(layer, n.k, what),
            self._weight(layer, n.v, what),
        )

    def _gate_up(self, layer, what: str):
        n = self.modules
        if self.fused:
            # rows [gate; up] (HF: gate, up = gate_up_proj(x).chunk(2))
            t = self._weight(layer, n.gate_up, what)
            return t[: self.intermediate_size], t[self.intermediate_size :]
        return self._weight(layer, n.gate, what), self._weight(layer, n.up, what)

    def _perm(self, device) -> torch.Tensor:
        """Per head: the rotated dimensions interleaved (rlhf.ops.rotary), the rest where they
        were."""
        r = self.rotary_dim
        return torch.cat(
            [interleave_permutation(r, device), torch.arange(r, self.head_dim, device=device)]
        )

    def _interleave(self, w: torch.Tensor) -> torch.Tensor:
        """Rows of a q/k projection (per head) into the rotary-interleaved layout (rlhf.ops.rotary);
        as they are with learned positions (nothing rotates)."""
        if self.positions != "rotary":
            return w
        d = self.head_dim
        return w.reshape(-1, d, *w.shape[1:])[:, self._perm(w.device)].reshape(w.shape)

    def root_weights(self, model) -> Dict[str, torch.Tensor]:
        """The weights outside the decoder layers: ``embed``, ``lm_head``, the final ``norm`` (and
        ``norm_b``) where the model has one, ``proj_in``/``proj_out`` where it has them, and the
        positions: ``inv_freq`` and ``rope_scaling`` (rotary) or the table ``wpe`` (learned: row p
        is position p, the family's offset dropped)."""
        n = self.modules
        base = module_at(model, n.base)
        embeddings = module_at(base, n.embed)
        embed = weight(embeddings).detach().clone()  # LoRA-adapted where a user targets it
        # tied embeddings: the LM head is the base embedding (an embedding adapter changes only the
        # lookup, as in HF)
        if not self.tie_word_embeddings:
            head = weight(model.lm_head).detach().clone()
        elif is_lora_layer(embeddings):
            head = embeddings.weight.detach().clone()
        else:
            head = embed
        out = {"embed": embed}
        norm = module_at(base, n.norm)
        if norm is not None:
            out["norm"] = norm.weight.detach().clone()
            if self.norm == "layer":
                out["norm_b"] = norm.bias.detach().clone()
        out["lm_head"] = head
        for key, path in (("proj_in", n.project_in), ("proj_out", n.project_out)):
            proj = module_at(base, path)
            if proj is not None:
                out[key] = weight(proj).detach().clone()
        if self.positions == "learned":
            table = weight(module_at(base, n.positions)).detach()
            out["wpe"] = table[
                self.position_offset : self.position_offset + self.max_positions
            ].clone()
            return out
        rot = base.rotary_emb
        if 2 * rot.inv_freq.numel() != self.rotary_dim:
            raise ValueError(
                f"{self.family}: the rotary embedding has {2 * rot.inv_freq.numel()} dimensions, "
                f"the policy expects {self.rotary_dim}"
            )
        out["inv_freq"] = rot.inv_freq.detach().clone().float()
        out["rope_scaling"] = torch.tensor(
            float(getattr(rot, "attention_scaling", 1.0)), device="cpu"
        )
        return out


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
    if family.windows == "every_layer":
        # HF: one mask for every layer, windowed when sliding_window is set
        return (window,) * n, ""
    if family.windows == "layer_types":
        # HF: layer i's mask is config.layer_types[i]'s
        # (sliding_window is None unless use_sliding_window; the rule below is the config's own
        # default for layer_types)
        types = getattr(config, "layer_types", None) or [
            "sliding_attention"
            if window is not None and i >= config.max_window_layers
            else "full_attention"
            for i in range(n)
        ]
        out = []
        for t in types:
            if t == "full_attention":
                out.append(None)
            elif t == "sliding_attention" and window:
                out.append(window)
            elif t == "sliding_attention":
                return (
                    None,
                    "layer_types names sliding layers but sliding_window is not set "
                    "(use_sliding_window)",
                )
            else:
                return None, f"layer type '{t}' is not supported by the inference modules"
        return tuple(out), ""
    return (None,) * n, ""  # "none" (Llama): no sliding window


def _switch(config, rule: str) -> bool:
    """A trait's "always", "" (never) or config flag, read."""
    return rule == "always" or bool(rule and getattr(config, rule, False))


def _flag(config, key: str, default: bool) -> bool:
    """The config flag a trait names (``default`` where it names none, or the config lacks it)."""
    if not key:
        return default
    return bool(getattr(config, key, default))


def policy_for(config) -> tuple[Optional[InjectionPolicy], str]:
    """(policy, "") for a supported config, else (None, the reason)."""
    family = getattr(config, "model_type", "?")
    traits = family_of(family)
    if traits is None:
        supported = ", ".join(f.model_type for f in FAMILY_TABLE)
        return None, f"model family '{family}' has no injection policy (supported: {supported})"
    for field, served in traits.refuse:
        value = getattr(config, field, served)
        if value != served:
            return None, f"{field}={value} is not supported by the inference modules"
    act = getattr(config, traits.act_key, "silu")
    if act not in (("silu",) if traits.mlp == "gated" else tuple(ACTIVATIONS)):
        return None, f"activation {act} is not supported by the inference modules"
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rotary_dim = 0
    if traits.positions == "rotary":
        rope_type, partial = _rope(config)
        if rope_type not in STATIC_ROPE:
            return None, f"RoPE type '{rope_type}' is not supported by the inference modules"
        if partial != 1.0 and not traits.partial_rotary:  # HF's other families rotate whole heads
            return (
                None,
                f"partial rotary (partial_rotary_factor={partial}) is not supported for {family}",
            )
        rotary_dim = int(head_dim * partial)
    windows, why = _layer_windows(config, traits)
    if windows is None:
        return None, why
    attn_bias, mlp_bias = _switch(config, traits.attn_bias), _switch(config, traits.mlp_bias)
    # nn.LayerNorm's default: OPT's norms read no epsilon from the config
    eps = 1e-5
    if traits.eps_key:
        eps = getattr(config, traits.eps_key)
    max_positions = 0
    if traits.positions == "learned":
        max_positions = config.max_position_embeddings
    slides = [w for w in windows if w]
    num_experts = top_k = 0
    if traits.experts_key and int(transformers.__version__.split(".")[0]) < 5:
        return None, f"{family}: Mixture-of-Experts layers are served in Transformers 5's layout"
    shared_intermediate = 0
    if traits.experts_key:
        num_experts = int(getattr(config, traits.experts_key, 0) or 0)
        top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    if traits.shared_expert:
        shared_intermediate = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
    return InjectionPolicy(
        family=family,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        intermediate_size=getattr(config, traits.intermediate_key, None) or 4 * config.hidden_size,
        eps=eps,
        qkv_bias=traits.qkv_bias or attn_bias,
        sliding_window=slides[0] if slides else None,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        layer_windows=windows,
        rotary_dim=rotary_dim,
        qk_norm=traits.qk_norm,
        o_bias=attn_bias,
        mlp_bias=mlp_bias,
        fused=traits.fused,
        modules=traits.modules,
        norm=traits.norm,
        prenorm=_flag(config, traits.prenorm_key, True),
        parallel=_flag(config, traits.parallel_key, False),
        qkv_per_head=traits.qkv_per_head,
        positions=traits.positions,
        position_offset=traits.position_offset,
        max_positions=max_positions,
        mlp=traits.mlp,
        activation=act,
        conv1d=traits.conv1d,
        num_experts=num_experts,
        top_k=top_k,
        topk_norm=_switch(config, traits.topk_norm),
        shared_expert=traits.shared_expert,
        shared_intermediate=shared_intermediate,
    ), ""
