"""A sweep of configs that trip injection policies: each one is either injected and generates the
greedy tokens of HF generate exactly, or falls back to HF generate with a one-line warning that
says why — never an approximate injection.

Biases and q/k norm weights are random (``perturb``), windows shorter than the prompts, and the
RoPE variants change the frequencies, so that a part the inference modules got wrong would show in
the tokens. OPT, GPT-2 (learned positions, LayerNorm, plain MLPs) and GPT-NeoX (parallel blocks,
partial rotary, LayerNorm, plain MLP): shrunk shapes of their real sizes, random biases and
LayerNorm weights, weights spread so that positions, biases, norms and the activation all show in
the tokens (``tests.infer_helpers._spread``); their sampled log-probs match the training recompute
(``LOGPROB_TOL``) and LoRA adapters (GPT-2's Conv1D: fan_in_fan_out) are merged. TP 2:
tests/distributed/test_hybrid_layernorm.py.
"""

import dataclasses
import logging

import pytest
import torch

from rlhf.engine.logprobs import response_logprobs
from rlhf.models import lora
from rlhf.ops import SamplingParams
from tests.infer_helpers import (
    BOS,
    EOS,
    LAYERNORM_FAMILIES,
    PAD,
    hf_greedy,
    mixed_prompts,
    tiny_model,
)
from tests.unit.engine.test_inference import hybrid
from tests.unit.models.test_lora import adapted, engine_of, merged_copy

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
    "rope_theta": 10000.0,
}
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}


def longrope(rotary_dim: int = 16):
    n = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + i / n for i in range(n)],
        "long_factor": [2.0 + i / n for i in range(n)],
        "original_max_position_embeddings": 128,
        "rope_theta": 10000.0,
    }


# name: (family, config fields, expected: None = injected, else a phrase of the fallback reason)
CASES = {
    # biases
    "llama_mlp_bias": ("llama", dict(mlp_bias=True), None),
    "llama_attention_bias": ("llama", dict(attention_bias=True), None),
    "llama_all_biases_untied": (
        "llama",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
        None,
    ),
    "qwen2_qkv_bias": ("qwen2", {}, None),
    # Mixture-of-Experts: renormalised top-k or not, a dense layer among MoE ones (mlp_only_layers),
    # windows, a shared expert; what the inference modules do not reproduce falls back
    "qwen3_moe_topk_norm_dense_layer": (
        "qwen3_moe",
        dict(norm_topk_prob=True, mlp_only_layers=[0], attention_bias=True),
        None,
    ),
    "qwen2_moe_topk_norm": ("qwen2_moe", dict(norm_topk_prob=True), None),
    "mixtral_window": ("mixtral", dict(sliding_window=4), None),
    "qwen2_moe_no_qkv_bias": ("qwen2_moe", dict(qkv_bias=False), "qkv_bias=False"),
    "mixtral_router_jitter": ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
    "qwen3_attention_bias": ("qwen3", dict(attention_bias=True), None),
    # sliding windows: every layer, some layers, none
    "mistral_window_all_layers": ("mistral", dict(sliding_window=4), None),
    "qwen2_window_all_layers": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=0),
        None,
    ),
    "qwen2_window_some_layers": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
        None,
    ),
    "qwen2_window_off": (
        "qwen2",
        dict(use_sliding_window=False, sliding_window=4, max_window_layers=0),
        None,
    ),
    "qwen3_window_some_layers": (
        "qwen3",
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
        None,
    ),
    "phi3_window": ("phi3", dict(sliding_window=4), None),
    # RoPE variants: static frequencies are served, frequencies that change with the length are not
    "llama_rope_linear": (
        "llama",
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
        None,
    ),
    "llama_rope_llama3": ("llama", dict(rope_parameters=LLAMA3), None),
    "llama_rope_yarn": ("llama", dict(rope_parameters=YARN), None),
    "qwen3_rope_yarn": ("qwen3", dict(rope_parameters=YARN), None),
    "llama_rope_dynamic": (
        "llama",
        dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        "RoPE type 'dynamic'",
    ),
    "llama_rope_longrope": ("llama", dict(rope_parameters=longrope()), "RoPE type 'longrope'"),
    "phi3_rope_longrope": ("phi3", dict(rope_parameters=longrope()), "RoPE type 'longrope'"),
    "phi3_partial_rotary": ("phi3", dict(partial_rotary_factor=0.5), None),
    # tied / untied embeddings
    "llama_untied": ("llama", dict(tie_word_embeddings=False), None),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True), None),
    "qwen3_tied": ("qwen3", dict(tie_word_embeddings=True), None),
    "phi3_tied": ("phi3", dict(tie_word_embeddings=True), None),
    # head_dim != hidden / heads
    "llama_head_dim": ("llama", dict(head_dim=32), None),
    "mistral_head_dim": ("mistral", dict(head_dim=8), None),
    "qwen3_head_dim": ("qwen3", dict(head_dim=32), None),
    # other activations
    "llama_gelu": ("llama", dict(hidden_act="gelu"), "activation gelu"),
    # OPT (DeepSpeed-Chat's examples), shrunk: 125m-like (pre-LN, final LayerNorm, head_dim 16 as 12
    # heads of 64 shrink), 350m-like (post-LN, project_in/out to a narrower embedding, no final
    # norm), 1.3b-like
    "opt_125m_like": ("opt", {}, None),
    "opt_350m_like": ("opt", dict(do_layer_norm_before=False, word_embed_proj_dim=32), None),
    "opt_1.3b_like": ("opt", dict(hidden=128, heads=8, intermediate=512, layers=3), None),
    "opt_untied_gelu": ("opt", dict(tie_word_embeddings=False, activation_function="gelu"), None),
    "opt_no_biases": ("opt", dict(enable_bias=False), None),
    "opt_final_norm_removed": ("opt", dict(_remove_final_layer_norm=True), None),
    "opt_silu": ("opt", dict(activation_function="silu"), "activation silu"),
    "opt_no_affine_norms": (
        "opt",
        dict(layer_norm_elementwise_affine=False),
        "layer_norm_elementwise_affine=False",
    ),
    # GPT-2: Conv1D weights, fused c_attn, gelu_new; n_inner unset = 4 · hidden
    "gpt2_small_like": ("gpt2", {}, None),
    "gpt2_medium_like": ("gpt2", dict(hidden=96, heads=6, layers=3, n_inner=None), None),
    "gpt2_untied": ("gpt2", dict(tie_word_embeddings=False), None),
    "gpt2_inverse_layer_scaling": (
        "gpt2",
        dict(scale_attn_by_inverse_layer_idx=True),
        "scale_attn_by_inverse_layer_idx=True",
    ),
    "gpt2_reorder_and_upcast": (
        "gpt2",
        dict(reorder_and_upcast_attn=True),
        "reorder_and_upcast_attn=True",
    ),
    "gpt2_unscaled_attention": ("gpt2", dict(scale_attn_weights=False), "scale_attn_weights=False"),
    "gpt2_cross_attention": ("gpt2", dict(add_cross_attention=True), "add_cross_attention=True"),
    "gpt2_gelu_fast": ("gpt2", dict(activation_function="gelu_fast"), "activation gelu_fast"),
    # GPT-NeoX (Pythia-like): parallel blocks, a quarter of each head rotating, per-head fused
    # q/k/v, untied
    "gpt_neox_pythia_like": ("gpt_neox", {}, None),
    "gpt_neox_sequential": ("gpt_neox", dict(use_parallel_residual=False), None),
    "gpt_neox_full_rotary_tied": (
        "gpt_neox",
        dict(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 1.0,
            },
            tie_word_embeddings=True,
        ),
        None,
    ),
    "gpt_neox_no_attention_bias": ("gpt_neox", dict(attention_bias=False, layers=3), None),
    "gpt_neox_rope_dynamic": (
        "gpt_neox",
        dict(
            rope_parameters={
                "rope_type": "dynamic",
                "factor": 2.0,
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            }
        ),
        "RoPE type 'dynamic'",
    ),
    "gpt_neox_gelu_fast": ("gpt_neox", dict(hidden_act="gelu_fast"), "activation gelu_fast"),
}
# the injected OPT, GPT-2 and GPT-NeoX cases
LAYERNORM = [
    c
    for c, (family, _, expected) in CASES.items()
    if family in LAYERNORM_FAMILIES and expected is None
]


def _other(family: str, **kw):
    """A tiny model of a family without a policy (built from its config class; random init)."""
    import transformers

    cls = getattr(
        transformers,
        {"gemma2": "Gemma2Config"}[family],
    )
    cfg = cls(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        **kw,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


OTHERS = {
    "gemma2_softcapping": (
        "gemma2",
        dict(head_dim=16, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    ),
}

NEW = 8
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, min_new_tokens=NEW)


class _Warnings(logging.Handler):
    """The warnings the ``rlhf`` logger emits (whatever its propagation and level setup)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _check(model, expected):
    prompts = mixed_prompts(5)
    ref = hf_greedy(model, prompts, NEW)
    logger, catch = logging.getLogger("rlhf"), _Warnings()
    level, logger.level = logger.level, min(logger.level or logging.WARNING, logging.WARNING)
    logger.addHandler(catch)
    try:
        _, hy = hybrid(model)
    finally:
        logger.removeHandler(catch)
        logger.setLevel(level)
    warnings = catch.lines
    gen = hy.generate(prompts, GREEDY)
    if expected is None:
        # injected: exactly HF's tokens, and not a word of warning
        assert hy.inject, warnings
        assert not warnings, warnings
        assert gen.logprobs is not None
    else:
        # HF generate, with one line that says why
        assert not hy.inject
        assert len(warnings) == 1 and "\n" not in warnings[0], warnings
        assert expected in warnings[0] and "HF generate" in warnings[0], warnings
        assert gen.logprobs is None
    assert torch.equal(gen.responses, ref)


@pytest.mark.parametrize("case", list(CASES))
def test_policy_sweep(case):
    family, kw, expected = CASES[case]
    _check(tiny_model(family, perturb=True, **kw), expected)


@pytest.mark.parametrize("case", list(OTHERS))
def test_families_without_policy_fall_back(case):
    family, kw = OTHERS[case]
    _check(_other(family, **kw), f"model family '{family}' has no injection policy")


def test_a_family_row_is_all_a_new_family_needs(monkeypatch):
    """policy_for reads the family's row of FAMILY_TABLE, not its name: Llama's row under another
    model_type gives that type Llama's policy, and the injection serves it exactly."""
    from rlhf.models import policies

    model = tiny_model(
        "llama", perturb=True, attention_bias=True, mlp_bias=True, tie_word_embeddings=False
    )
    llama_policy, _ = policies.policy_for(model.config)
    model.config.model_type = "llama_copy"
    assert policies.policy_for(model.config)[1].startswith(
        "model family 'llama_copy' has no injection policy"
    )
    row = dataclasses.replace(policies.family_of("llama"), model_type="llama_copy")
    monkeypatch.setattr(policies, "FAMILY_TABLE", policies.FAMILY_TABLE + (row,))
    policy, why = policies.policy_for(model.config)
    assert why == "" and policy.family == "llama_copy"
    assert dataclasses.replace(policy, family="llama") == llama_policy
    _check(model, None)


# Sampled tokens' log-probs against the training recompute, relative to the log-prob's size: |Δ| ≤
# 1e-5 · max(1, |log p|). The OPT/GPT-2 weights spread to make every part show
# (``tests.infer_helpers._spread``) give logits ~5x the Llama-like tiny models' (std 2.4 against
# ~0.5; 11.5 in a pre-LN OPT without its final norm) and fp32 rounding with them: absolute gaps of
# 2e-6 to 1.3e-5 (the others' ~1e-6); a wrong part of the model is off by 1e-3 and more. The OPT
# without a final norm (its unnormalised residual into the LM head: logits 5x larger again) gets 5x
# the tolerance.
LOGPROB_TOL = 1e-5
LOGPROB_SCALE = {"opt_final_norm_removed": 5.0}


def _logprob_gap(eng, hy, prompts) -> float:
    """The largest |rollout log-prob − training recompute| / max(1, |log-prob|) of sampled tokens
    (two samples per prompt)."""
    sp = SamplingParams(temperature=0.7, max_new_tokens=10, samples_per_prompt=2, seed=3)
    gen = hy.generate(prompts, sp)
    with torch.no_grad():
        lp = response_logprobs(
            eng.forward, gen.sequences, gen.attention_mask, gen.prompt_len, sp.temperature
        )
    return ((lp - gen.logprobs).abs() * gen.response_mask / lp.abs().clamp(min=1.0)).max().item()


@pytest.mark.parametrize("case", LAYERNORM)
def test_layernorm_families_logprobs_match_training(case):
    """OPT, GPT-2 and GPT-NeoX: the sampled tokens' log-probs of left-padded mixed-length prompts
    match the training-mode recompute (``LOGPROB_TOL``)."""
    family, kw, _ = CASES[case]
    eng, hy = hybrid(tiny_model(family, perturb=True, **kw))
    assert hy.inject and hy.policy.norm == "layer"
    assert _logprob_gap(eng, hy, mixed_prompts()) <= LOGPROB_TOL * LOGPROB_SCALE.get(case, 1.0)


@pytest.mark.parametrize("case", ["opt_350m_like", "gpt2_small_like", "gpt_neox_pythia_like"])
def test_layernorm_families_serve_lora_merged(case):
    """LoRA on every block projection (OPT: q/k/v/out_proj, fc1/fc2; GPT-2: the Conv1D
    c_attn/c_proj/c_fc, where PEFT stores B·A transposed, fan_in_fan_out; GPT-NeoX: query_key_value,
    dense, dense_h_to_4h, dense_4h_to_h): greedy tokens of PEFT's own merged model, and the adapters
    matter."""
    family, kw, _ = CASES[case]
    model = adapted(family, **kw)
    if family == "gpt2":
        layers = [m for m in model.modules() if lora.is_lora_layer(m)]
        assert layers and all(m.fan_in_fan_out for m in layers)
    prompts = mixed_prompts()
    ref = hf_greedy(merged_copy(model), prompts, 12)
    eng, hy = engine_of(model)
    assert hy.inject
    gen = hy.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, min_new_tokens=12))
    assert torch.equal(gen.responses, ref)
    with lora.adapters_disabled(model):
        assert not torch.equal(hf_greedy(model, prompts, 12), ref)
    assert _logprob_gap(eng, hy, prompts) <= LOGPROB_TOL
