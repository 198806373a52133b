"""engine.inference_dtype: a bf16 inference copy of fp32 training weights (one process).

bf16 rounds every activation to 8 mantissa bits, so exactness against fp32 is replaced by bounds:
log-probs within BF16_MAX_GAP (max) / BF16_MEAN_GAP (mean) of the fp32 training-mode recompute —
about what HF's own bf16 model shows (measured max ≈ 0.02, mean ≈ 0.003–0.005 on these models) —
and greedy tokens equal HF bf16's argmax wherever HF's top-2 logit margin exceeds bf16's resolution.
"""

import copy
import weakref

import pytest
import torch

from rlhf.config import EngineConfig, TrainConfig
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.logprobs import response_logprobs
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import TrainEngine
from rlhf.errors import ConfigError
from rlhf.ops import SamplingParams
from rlhf.ops.linear import can_pack, linear, prepare_weight
from tests.infer_helpers import EOS, PAD, Tok, hf_greedy, mixed_prompts, tiny_model

BF16_MAX_GAP = 0.06
BF16_MEAN_GAP = 0.012
# HF bf16 top-2 logit gap above which our bf16 greedy token must be HF's
MARGIN = 0.06


def hybrid(model, **ecfg):
    eng = TrainEngine(model, Mesh(), EngineConfig(**ecfg), TrainConfig(lr=1e-2, warmup_steps=0))
    return eng, HybridEngine(eng, Tok, EngineConfig(**ecfg))


def test_config_key_and_resolution():
    with pytest.raises(ConfigError, match=r"engine.inference_dtype"):
        EngineConfig(inference_dtype="fp8")
    model = tiny_model("llama")
    # default: auto = engine.precision = fp32
    assert hybrid(model)[1].dtype == torch.float32
    assert hybrid(model, precision="bf16")[1].dtype == torch.bfloat16
    assert hybrid(model, inference_dtype="bf16")[1].dtype == torch.bfloat16
    assert hybrid(model, precision="bf16", inference_dtype="fp32")[1].dtype == torch.float32


def test_inference_copy_is_bf16_and_training_weights_stay_fp32():
    eng, hy = hybrid(tiny_model("llama"), inference_dtype="bf16")
    model = hy.build_inference_model()
    assert (
        model.root["embed"].dtype == torch.bfloat16
        and model.layers[0]["ln1"].dtype == torch.bfloat16
    )
    assert model.packed == can_pack(torch.bfloat16, "cpu")
    assert all(p.dtype == torch.float32 for p in eng.model.parameters())


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_bf16_logprobs_close_to_fp32_training_recompute(family):
    model = tiny_model(family)
    hf16 = copy.deepcopy(model).to(torch.bfloat16)
    eng, hy = hybrid(model, inference_dtype="bf16")
    for temp in (1.0, 0.7):
        sp = SamplingParams(temperature=temp, max_new_tokens=12, samples_per_prompt=2, seed=1)
        gen = hy.generate(mixed_prompts(), sp)
        assert gen.logprobs.dtype == torch.float32
        with torch.no_grad():
            lp = response_logprobs(
                eng.forward, gen.sequences, gen.attention_mask, gen.prompt_len, temp
            )
            lp16 = response_logprobs(
                hf16.forward, gen.sequences, gen.attention_mask, gen.prompt_len, temp
            )
        n = gen.response_mask.sum()
        gap = ((lp - gen.logprobs) * gen.response_mask).abs()
        hf_gap = ((lp - lp16) * gen.response_mask).abs()  # HF's own bf16 model on the same tokens
        assert gap.max() <= BF16_MAX_GAP and gap.sum() / n <= BF16_MEAN_GAP, (
            temp,
            gap.max(),
            gap.sum() / n,
        )
        assert gap.sum() <= 2 * hf_gap.sum() + 1e-3 * n, (temp, gap.sum() / n, hf_gap.sum() / n)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_bf16_greedy_agrees_with_hf_bf16(family):
    model = tiny_model(family)
    hf16 = copy.deepcopy(model).to(torch.bfloat16)
    prompts = mixed_prompts()
    _, hy = hybrid(model, inference_dtype="bf16")
    gen = hy.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, min_new_tokens=12))
    # teacher-forced: HF bf16's next-token logits on our own greedy prefixes
    with torch.no_grad():
        logits = hf16(input_ids=gen.sequences, attention_mask=gen.attention_mask).logits.float()
    step = logits[:, gen.prompt_len - 1 : -1]
    step[..., EOS] = float("-inf")  # banned before min_new_tokens
    top2 = step.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > MARGIN
    assert clear.float().mean() > 0.4  # the check has teeth
    assert torch.equal(step.argmax(-1)[clear], gen.responses[clear])
    # free-running, whole sequences: errors compound after a first near-tie, so only "mostly"
    assert (gen.responses == hf_greedy(hf16, prompts, 12)).float().mean() >= 0.6


def test_bf16_fixed_seed_reproduces_and_eos_leaves_batch():
    model = tiny_model("llama")
    with torch.no_grad():
        # EOS (id 2) likely: rows end early
        model.lm_head.weight[2] += 2.0 * model.lm_head.weight.abs().max()
    _, hy = hybrid(model, inference_dtype="bf16")
    sp = SamplingParams(
        temperature=1.0,
        top_k=20,
        top_p=0.9,
        max_new_tokens=10,
        min_new_tokens=2,
        samples_per_prompt=3,
        seed=11,
    )
    a, b = hy.generate(mixed_prompts(), sp), hy.generate(mixed_prompts(), sp)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.logprobs, b.logprobs)
    lengths = a.response_mask.sum(1)
    assert (lengths >= 3).all() and (lengths < 10).any()  # ≥ 2 tokens then EOS; some rows ended
    for row, n in zip(a.responses, lengths):
        assert (row[n:] == PAD).all()
    c = hy.generate(
        mixed_prompts(),
        SamplingParams(temperature=1.0, max_new_tokens=10, samples_per_prompt=3, seed=12),
    )
    assert not torch.equal(a.sequences, c.sequences)


def test_bf16_sliding_window_matches_hf_bf16_where_clear():
    model = tiny_model("mistral")
    model.config.sliding_window = 5
    hf16 = copy.deepcopy(model).to(torch.bfloat16)
    _, hy = hybrid(model, inference_dtype="bf16")
    gen = hy.generate(
        mixed_prompts(), SamplingParams(temperature=0, max_new_tokens=10, min_new_tokens=10)
    )
    with torch.no_grad():
        step = hf16(input_ids=gen.sequences, attention_mask=gen.attention_mask).logits.float()[
            :, gen.prompt_len - 1 : -1
        ]
    step[..., EOS] = float("-inf")  # banned before min_new_tokens
    top2 = step.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > MARGIN
    assert torch.equal(step.argmax(-1)[clear], gen.responses[clear])


def test_bf16_inference_weights_and_cache_are_released():
    _, hy = hybrid(tiny_model("llama"), inference_dtype="bf16")
    model = hy.build_inference_model()
    refs = [weakref.ref(t) for w in [model.root, *model.layers] for t in w.values()]
    model.allocate(4, 16, "cpu")
    refs.append(weakref.ref(model.cache))
    model.release()
    del model
    assert all(r() is None for r in refs)


@pytest.mark.skipif(not can_pack(torch.bfloat16, "cpu"), reason="no oneDNN bf16 on this CPU")
def test_packed_bf16_linear_matches_plain_bf16():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    for rows in (1, 5, 8, 40):
        # rows leave the batch; prefill is wider than decode
        x = torch.randn(rows, 64, generator=g).bfloat16()
        ref = torch.addmm(b.float(), x.float(), w.float().t())
        for packed in (True, False):
            y = linear(x, prepare_weight(w, packed), b, packed)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
            torch.testing.assert_close(y.float(), ref, rtol=1.6e-2, atol=1e-2)


def test_hydra_override():
    from rlhf.compose import compose_config

    cfg, _ = compose_config(["engine.inference_dtype=bf16"])
    assert cfg.engine.inference_dtype == "bf16"
    assert compose_config([])[0].engine.inference_dtype == "auto"
    with pytest.raises(ConfigError, match=r"engine.inference_dtype"):
        compose_config(["engine.inference_dtype=fp8"])


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_mismatch_correction_on_real_rollouts(dtype):
    """TIS on the log-probs a bf16 inference copy really returns (gaps ~1e-2): per-token weights
    min(π_train/π_rollout, C), which change the policy loss by exactly that weighting; on fp32
    rollouts (gaps ~1e-7) the correction is a no-op to 1e-5."""
    from rlhf.algorithms import ppo as A

    eng, hy = hybrid(tiny_model("llama"), inference_dtype=dtype)
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, samples_per_prompt=2, seed=3)
    gen = hy.generate(mixed_prompts(), sp)
    m = gen.response_mask.float()
    with torch.no_grad():
        train = response_logprobs(
            eng.forward, gen.sequences, gen.attention_mask, gen.prompt_len, 1.0
        )
    w = A.mismatch_weights(train, gen.logprobs, m, "tis", cap=1.01)
    golden = torch.exp(train - gen.logprobs).clamp(max=1.01) * m
    assert torch.equal(w, golden)
    adv = torch.linspace(-1, 1, m.numel()).view_as(m)
    plain, _ = A.policy_loss(train, train, adv, m, normalizer=float(m.sum()))
    corrected, _ = A.policy_loss(train, train, adv, m, normalizer=float(m.sum()), weights=w)
    assert float(corrected) == pytest.approx(float((-adv * w).sum() / m.sum()), rel=1e-5)
    if dtype == "bf16":
        # the gaps are real and capped
        assert (w - m).abs().max() > 1e-3 and (w <= 1.01 + 1e-6).all()
        assert abs(float(corrected) - float(plain)) > 1e-6
    else:
        assert (w - m).abs().max() < 1e-5 and float(corrected) == pytest.approx(
            float(plain), abs=1e-6
        )
