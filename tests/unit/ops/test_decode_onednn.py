"""The decode GEMMs on oneDNN's fp32 layout (rlhf/ops/linear.py ``pack_onednn``): large matrices
take it, small ones keep MKL's packing. The test models are small, so the threshold is lowered to
send every matrix through oneDNN: the same numbers as the reference kernels and the training
mode."""

import pytest
import torch

import rlhf.ops.linear as linear_ops
from rlhf.engine.logprobs import response_logprobs
from rlhf.ops import SamplingParams
from rlhf.ops.linear import can_pack_onednn_fp32, linear, onednn_pays, pack_onednn, prepare_weight
from tests.infer_helpers import mixed_prompts, tiny_model
from tests.unit.engine.test_inference import hybrid

needs_onednn = pytest.mark.skipif(
    not can_pack_onednn_fp32(torch.float32, "cpu"), reason="torch without oneDNN"
)


@pytest.fixture
def every_matrix_on_onednn(monkeypatch):
    monkeypatch.setattr(linear_ops, "ONEDNN_MIN_WEIGHTS", 0)


def test_threshold_picks_large_matrices():
    assert onednn_pays(torch.empty(512, 1024).t()) and not onednn_pays(torch.empty(128, 256).t())
    # bf16 has its own oneDNN layout (packed)
    assert not can_pack_onednn_fp32(torch.bfloat16, "cpu")


@needs_onednn
# decode batches, fewer rows after some ended, a prefill
@pytest.mark.parametrize("rows", [1, 5, 8, 96])
def test_onednn_linear_matches_plain(rows):
    torch.manual_seed(0)
    w, b = torch.randn(160, 64) / 8, torch.randn(160)
    x = torch.randn(rows, 64)
    packed = pack_onednn(prepare_weight(w, False, for_rows=True))
    plain = linear(x, prepare_weight(w, False), b)
    torch.testing.assert_close(linear(x, packed, b, packed=True), plain, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_onednn_decode_logprobs_match_training_mode(family, every_matrix_on_onednn):
    eng, hy = hybrid(tiny_model(family, perturb=True))
    model = hy.build_inference_model()
    assert model.onednn_rows
    model.pack_for_rows(4)
    assert all(onednn_pays(model.layers[0][k]) for k in model._rw[0])
    sp = SamplingParams(temperature=0.7, max_new_tokens=10, samples_per_prompt=2, seed=3)
    gen = hy.generate(mixed_prompts(), sp)
    with torch.no_grad():
        lp = response_logprobs(
            eng.forward, gen.sequences, gen.attention_mask, gen.prompt_len, sp.temperature
        )
    assert ((lp - gen.logprobs) * gen.response_mask).abs().max().item() <= 1e-5


@needs_onednn
def test_onednn_decode_equals_reference_while_rows_leave(every_matrix_on_onednn):
    model = tiny_model("llama")
    with torch.no_grad():
        # EOS-prone: rows end early
        model.lm_head.weight[2] += 0.6 * model.lm_head.weight.abs().max()
    sp = SamplingParams(temperature=0, max_new_tokens=12)
    _, fast = hybrid(model)
    _, ref = hybrid(model, inference_kernels="reference")
    a, b = fast.generate(mixed_prompts(8), sp), ref.generate(mixed_prompts(8), sp)
    lengths = a.response_mask.sum(1)
    assert 1 < len(set(lengths.tolist())) and int(lengths.min()) < 12
    assert torch.equal(a.sequences, b.sequences)
    assert (a.logprobs - b.logprobs).abs().max().item() <= 1e-5
