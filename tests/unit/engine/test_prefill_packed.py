"""The packed prefill (the CUDA prefill of left-padded prompts, issue 18 item 4) checked on the CPU,
where it is not the default: the real tokens of every row back to back, no padding computed, each
row attending within itself. The CPU stands in for the flash varlen kernel with one causal SDPA per
sequence (``rlhf.ops.attention.attend_varlen``); what is checked here is everything around the
kernel: the packing, the rotations by position, the cache slots written, the last token per row,
windows, biases, q/k norms, partial rotary heads, both decode loops."""

import pytest
import torch

from rlhf.engine.infer import Packed
from rlhf.ops import SamplingParams, attend, attend_varlen, varlen_kernel_fits
from tests.infer_helpers import mixed_prompts, tiny_model
from tests.unit.engine.test_inference import hybrid
from tests.unit.engine.test_inference_static import FAMILIES, NEW, eos_prone, hf_greedy_until_eos

CASES = {
    **FAMILIES,
    "qwen2_bias": ("qwen2", {}),
    "qwen2_window_3": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),
    ),
}


def assert_logprobs_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """fp32, relative to the log-prob's size: the packed GEMMs have other row counts than the padded
    ones, which changes roundings (measured up to 1.1e-6)."""
    gap = ((a - b).abs() / b.abs().clamp(min=1.0)).max().item()
    assert gap <= 1e-5, gap


def generate(hy, decode: str, packed: bool, sp: SamplingParams, prompts):
    model = hy.build_inference_model()
    model.decode, model.span_chunk, model.packed_prefill = decode, 8, packed
    return model.generate(prompts, sp, eos_id=2, pad_id=0)


def test_the_packed_prefill_is_for_the_flash_kernel_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not varlen_kernel_fits(torch.float32, cpu, 64) and not varlen_kernel_fits(
        torch.bfloat16, cpu, 64
    )
    assert not varlen_kernel_fits(torch.float32, cuda, 64)  # flash: half precision only
    assert varlen_kernel_fits(torch.bfloat16, cuda, 64) and not varlen_kernel_fits(
        torch.bfloat16, cuda, 60
    )
    _, hy = hybrid(tiny_model("llama"))
    assert not hy.build_inference_model().packed_prefill  # the CPU keeps the masked prefill


def test_packing_maps_tokens_slots_and_last_tokens():
    pmask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    pk = Packed.of(pmask, cache_len=10)
    assert pk.tokens.tolist() == [2, 3, 4, 5, 6, 7, 11]
    assert pk.slots.tolist() == [2, 3, 10, 11, 12, 13, 23]  # row b, slot s: b·10 + s
    assert pk.cu.tolist() == [0, 2, 6, 7] and pk.cu.dtype == torch.int32
    assert pk.last.tolist() == [1, 5, 6] and pk.max_len == 4
    assert Packed.of(torch.tensor([[1, 1], [0, 0]]), 4) is None  # an empty row: the masked prefill


@pytest.mark.parametrize("window", [None, 3])
def test_varlen_attention_equals_masked_attention_of_padded_rows(window):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 2, 7]
    P, H, KV, d = max(lengths), 4, 2, 8
    q, k, v = (torch.randn(len(lengths), h, P, d, generator=g) for h in (H, KV, KV))
    pmask = torch.stack([torch.arange(P) >= P - n for n in lengths])
    q_idx, k_idx = torch.arange(P)[:, None], torch.arange(P)[None, :]
    allowed = (k_idx <= q_idx) & ((q_idx - k_idx < window) if window else True)
    mask = (allowed[None, None] & pmask[:, None, None, :]) | (q_idx == k_idx)[None, None]
    ref = attend(q, k, v, mask)
    pk = Packed.of(pmask.long(), P)
    pack = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1], d)[pk.tokens]  # noqa: E731
    out = attend_varlen(pack(q), pack(k), pack(v), pk.cu, pk.max_len, window)
    torch.testing.assert_close(out, pack(ref), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_packed_prefill_generates_what_the_masked_prefill_generates(case, decode):
    family, kw = CASES[case]
    model = eos_prone(family, **kw)
    prompts = mixed_prompts(7)
    assert len({len(p) for p in prompts}) > 3  # left padding of several lengths
    _, hy = hybrid(model)
    greedy = SamplingParams(temperature=0, max_new_tokens=NEW)
    ref = generate(hy, decode, False, greedy, prompts)
    out = generate(hy, decode, True, greedy, prompts)
    assert torch.equal(out.sequences, ref.sequences) and torch.equal(
        out.response_mask, ref.response_mask
    )
    assert torch.equal(out.responses, hf_greedy_until_eos(model, prompts, NEW))
    assert_logprobs_close(out.logprobs, ref.logprobs)
    sampled = SamplingParams(
        temperature=0.9, top_k=30, max_new_tokens=NEW, samples_per_prompt=2, seed=3
    )
    ref, out = (generate(hy, decode, packed, sampled, prompts) for packed in (False, True))
    assert torch.equal(out.sequences, ref.sequences)
    assert_logprobs_close(out.logprobs, ref.logprobs)


def test_a_refused_kernel_falls_back_to_the_masked_prefill(monkeypatch, caplog):
    import rlhf.engine.infer as infer

    def refuse(*a, **k):
        raise RuntimeError("no kernel for these operands")

    _, hy = hybrid(tiny_model("llama", perturb=True))
    greedy = SamplingParams(temperature=0, max_new_tokens=4)
    ref = generate(hy, "dynamic", False, greedy, mixed_prompts(3))
    monkeypatch.setattr(infer, "attend_varlen", refuse)
    model = hy.build_inference_model()
    model.packed_prefill = True
    out = model.generate(mixed_prompts(3), greedy, eos_id=2, pad_id=0)
    assert torch.equal(out.sequences, ref.sequences) and not model.packed_prefill
    assert "packed prefill unavailable" in caplog.text
