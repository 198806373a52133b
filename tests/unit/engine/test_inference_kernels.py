"""engine.inference_kernels: the fast GEMM paths of the inference mode against the reference
(plain GEMMs) — MKL-packed fp32 decode GEMMs on this CPU (one process)."""

import weakref

import pytest
import torch

from rlhf.compose import compose_config
from rlhf.config import EngineConfig
from rlhf.engine.logprobs import response_logprobs
from rlhf.errors import ConfigError
from rlhf.ops import SamplingParams
from rlhf.ops.linear import (
    can_pack_rows,
    linear,
    linear_rows,
    pack_rows,
    prepare_weight,
)
from tests.infer_helpers import Tok, mixed_prompts, tiny_model
from tests.unit.engine.test_inference import hybrid

MKL = can_pack_rows(torch.float32, "cpu")
needs_mkl = pytest.mark.skipif(not MKL, reason="torch without MKL (non-x86 build)")


def test_config_values():
    assert EngineConfig().inference_kernels == "auto"
    assert (
        compose_config(["engine.inference_kernels=reference"])[0].engine.inference_kernels
        == "reference"
    )
    with pytest.raises(ConfigError, match=r"engine.inference_kernels"):
        EngineConfig(inference_kernels="fast")


def test_reference_kernels_pack_nothing():
    _, hy = hybrid(tiny_model("llama"), inference_kernels="reference")
    model = hy.build_inference_model()
    assert not model.pack_rows and not model.packed
    assert model.layers[0]["wqkv"].is_contiguous()  # Wᵀ laid out as a copy, as before
    _, hy = hybrid(tiny_model("llama"))
    assert hy.build_inference_model().pack_rows == MKL


@needs_mkl
@pytest.mark.parametrize("in_f,out_f,bias", [(64, 96, False), (1344, 512, False), (64, 160, True)])
def test_linear_rows_pads_and_matches_plain(in_f, out_f, bias):
    torch.manual_seed(0)
    w = torch.randn(out_f, in_f) / in_f**0.5
    b = torch.randn(out_f) if bias else None
    x = torch.randn(8, in_f)
    wt = prepare_weight(w, False, for_rows=True)
    assert not wt.is_contiguous() and wt.t().is_contiguous()  # a view of W: no copy
    packed = pack_rows(wt, 8)
    full = linear_rows(x, packed, wt, 8, b)
    plain = linear(x, prepare_weight(w, False), b)
    torch.testing.assert_close(full, plain, rtol=1e-5, atol=1e-5)
    for m in (1, 5, 7):
        # fewer rows than packed for: zero-padded; a row's result does not change
        part = linear_rows(x[:m], packed, wt, 8, b)
        assert part.shape == (m, out_f)
        assert torch.equal(part, full[:m])


@needs_mkl
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_fast_kernels_agree_with_reference_while_rows_leave(family):
    """Greedy decoding with an EOS-prone model, so that rows leave the batch at different steps
    (the packed GEMMs then run on zero-padded inputs): the same tokens as the reference kernels,
    log-probs within fp32 rounding (test_inference.py checks the fast kernels against HF
    generate)."""
    model = tiny_model(family)
    with torch.no_grad():
        model.lm_head.weight[2] += 0.6 * model.lm_head.weight.abs().max()
    prompts = mixed_prompts(8)
    sp = SamplingParams(temperature=0, max_new_tokens=12)
    _, fast = hybrid(model)
    _, ref = hybrid(model, inference_kernels="reference")
    a, b = fast.generate(prompts, sp), ref.generate(prompts, sp)
    lengths = a.response_mask.sum(1)
    # rows did leave, at different steps
    assert 1 < len(set(lengths.tolist())) and int(lengths.min()) < 12
    assert torch.equal(a.sequences, b.sequences)
    assert (a.logprobs - b.logprobs).abs().max().item() <= 1e-5


@needs_mkl
def test_fast_kernels_logprobs_match_training_mode():
    # q/k/v biases: the packed GEMM's bias path
    model = tiny_model("qwen2")
    eng, hy = hybrid(model)
    sp = SamplingParams(temperature=0.7, max_new_tokens=10, samples_per_prompt=2, seed=3)
    gen = hy.generate(mixed_prompts(), sp)
    with torch.no_grad():
        lp = response_logprobs(
            eng.forward, gen.sequences, gen.attention_mask, gen.prompt_len, sp.temperature
        )
    assert ((lp - gen.logprobs) * gen.response_mask).abs().max().item() <= 1e-4


@needs_mkl
def test_packed_weights_live_only_while_decoding():
    _, hy = hybrid(tiny_model("llama"))
    model = hy.build_inference_model()
    assert model._rows == 0 and all(r is None for r in model._rw)
    model.allocate(4, 16, "cpu")
    model.pack_for_rows(4)
    assert model._rows == 4 and set(model._rw[0]) == {"wqkv", "wo", "w_gate_up", "w_down"}
    assert set(model._rw[-1]) == {"lm_head"}
    refs = [weakref.ref(t) for d in model._rw for t in d.values()]
    model.release()
    assert all(r() is None for r in refs) and model._rows == 0
    # generate packs for its own batch and releases on the way out
    out = model.generate(
        mixed_prompts(3),
        SamplingParams(temperature=0, max_new_tokens=3, samples_per_prompt=2),
        eos_id=Tok.eos_token_id,
        pad_id=Tok.pad_token_id,
    )
    assert out.sequences.shape[0] == 6 and model._rows == 0 and model.cache is None
