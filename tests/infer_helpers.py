"""Tiny models of each supported family and reference generations with HF generate."""

from __future__ import annotations

import torch

PAD, BOS, EOS = 0, 1, 2
# LayerNorm, plain MLPs (OPT, GPT-2: learned positions)
LAYERNORM_FAMILIES = ("opt", "gpt2", "gpt_neox")


def tiny_config(
    family: str,
    vocab: int = 97,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv: int = 2,
    intermediate: int = 128,
    **kw,
):
    """``kw``: further config fields (biases, windows, RoPE scaling...). OPT, GPT-2 and GPT-NeoX:
    multi-head attention (``kv`` unused), dropout off, their own defaults otherwise (OPT and GPT-2
    tied, GPT-NeoX not)."""
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    if family in LAYERNORM_FAMILIES:
        return _layernorm_config(family, vocab, hidden, layers, heads, intermediate, **kw)

    cls = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
        "phi3": Phi3Config,
        "qwen3_moe": Qwen3MoeConfig,
        "mixtral": MixtralConfig,
        "qwen2_moe": Qwen2MoeConfig,
    }[family]
    fields = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=256,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=family == "llama",
        rms_norm_eps=1e-5,
    )
    if family in ("qwen3", "qwen3_moe"):
        fields["head_dim"] = hidden // heads  # Qwen3Config's default is 128
    fields.update(MOE_FIELDS.get(family, {}))
    return cls(**{**fields, **kw})


# tiny Mixture-of-Experts blocks: 4 experts, top 2 (Qwen2-MoE with a shared expert)
MOE_FIELDS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=96,
    ),
}


def _layernorm_config(
    family: str, vocab: int, hidden: int, layers: int, heads: int, intermediate: int, **kw
):
    from transformers import GPT2Config, GPTNeoXConfig, OPTConfig

    ids = dict(vocab_size=vocab, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    if family == "gpt_neox":
        # untied, parallel blocks, a quarter of each head rotating (its defaults)
        fields = dict(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            max_position_embeddings=256,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        return GPTNeoXConfig(**{**ids, **fields, **kw})
    if family == "opt":
        fields = dict(
            hidden_size=hidden,
            ffn_dim=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            max_position_embeddings=256,
            dropout=0.0,
            attention_dropout=0.0,
        )
        return OPTConfig(**{**ids, **fields, **kw})
    fields = dict(
        n_embd=hidden,
        n_inner=intermediate,
        n_layer=layers,
        n_head=heads,
        n_positions=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
    )
    return GPT2Config(**{**ids, **fields, **kw})


def tiny_model(family: str, seed: int = 0, perturb: bool = False, **kw):
    """``perturb``: random biases and q/k norm weights (HF initialises them to 0 and 1, where a
    dropped bias or a misplaced norm weight would change nothing); OPT, GPT-2, GPT-NeoX: their
    LayerNorm weights too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(tiny_config(family, **kw))
    if family in LAYERNORM_FAMILIES:
        return _spread(m, seed, perturb).eval()
    with torch.no_grad():
        # larger random weights: peaked distributions, fewer greedy ties
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                # a MoE router (Qwen's start at 0: every token to the same experts)
                p.copy_(torch.randn(p.shape) * 0.5)
            elif p.ndim >= 2:
                p.mul_(3.0)
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in m.named_parameters() if perturb else ():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.3)
    return m.eval()


# the token and position tables and an untied LM head (2-D, but not projections) of OPT, GPT-2,
# GPT-NeoX
TABLES = (
    "embed_tokens.weight",
    "embed_positions.weight",
    "wte.weight",
    "wpe.weight",
    "embed_in.weight",
    "lm_head.weight",
)


@torch.no_grad()
def _spread(m, seed: int, perturb: bool):
    """OPT, GPT-2 and GPT-NeoX weights whose every part shows in the greedy tokens: the residual
    stream is not a LayerNorm'd copy of the last token (embeddings at std 0.3, projections at 10x
    HF's init) nor drowned in biases (0.2); with ``perturb`` random biases and LayerNorm weights
    (HF: 0 and 1). At HF's scales a tiny model repeats one token whatever its positions, biases or
    activation."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in m.named_parameters():
        if name.endswith(TABLES):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        elif p.ndim == 2:
            p.mul_(10.0)
        elif perturb and name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        elif perturb and name.endswith(".weight"):  # LayerNorms
            p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.3)
    return m


def mixed_prompts(n: int = 6, seed: int = 0, vocab: int = 97):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 3 + (i * 5) % 11
        out.append([BOS] + torch.randint(3, vocab, (length,), generator=g).tolist())
    return out


class Tok:
    """The three ids the engine needs from a tokenizer."""

    pad_token_id, eos_token_id, bos_token_id = PAD, EOS, BOS


@torch.no_grad()
def hf_greedy(model, prompts, max_new: int) -> torch.Tensor:
    from rlhf.engine.infer import left_pad

    ids, mask = left_pad(prompts, PAD)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    return out[:, ids.shape[1] :]
