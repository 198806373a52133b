"""The injected inference mode in one process: exactness against HF, log-probs, no weight
corruption, memory release, sampling."""

import weakref

import pytest
import torch

from rlhf.config import EngineConfig, TrainConfig
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.logprobs import response_logprobs
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import TrainEngine
from rlhf.ops import SamplingParams
from rlhf.ops.sampling import filter_logits, sample
from tests.infer_helpers import Tok, hf_greedy, mixed_prompts, tiny_model


def hybrid(model, **ecfg):
    eng = TrainEngine(model, Mesh(), EngineConfig(**ecfg), TrainConfig(lr=1e-2, warmup_steps=0))
    return eng, HybridEngine(eng, Tok, EngineConfig(**ecfg))


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "qwen3_moe", "mixtral", "qwen2_moe"]


def assert_injected_greedy_equals_hf(model):
    prompts = mixed_prompts()
    ref = hf_greedy(model, prompts, 12)
    _, hy = hybrid(model)
    assert hy.inject
    gen = hy.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, min_new_tokens=12))
    assert torch.equal(gen.responses, ref)
    assert gen.prompt_len == max(len(p) for p in prompts)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate(family):
    assert_injected_greedy_equals_hf(tiny_model(family, perturb=True))


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_moe_experts_packed_or_plain_equal_hf(kernels):
    # auto on a oneDNN CPU: each expert's matrices packed once per weight sync; reference: F.linear
    # on the [E, out, in] tensors; both HF's greedy tokens
    from rlhf.ops.linear import can_pack_onednn_fp32

    model = tiny_model("mixtral", perturb=True)
    prompts = mixed_prompts()
    ref = hf_greedy(model, prompts, 12)
    _, hy = hybrid(model, inference_kernels=kernels)
    packed = isinstance(hy.build_inference_model().layers[0]["experts_gate_up"], list)
    assert packed == (kernels == "auto" and can_pack_onednn_fp32(torch.float32, "cpu"))
    gen = hy.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, min_new_tokens=12))
    assert torch.equal(gen.responses, ref)


def test_greedy_equals_hf_generate_with_sliding_window():
    model = tiny_model("mistral")
    # shorter than most prompts: prefill and decode both cut keys
    model.config.sliding_window = 5
    prompts = mixed_prompts()
    ref = hf_greedy(model, prompts, 12)
    _, hy = hybrid(model)
    assert hy.policy.sliding_window == 5
    gen = hy.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, min_new_tokens=12))
    assert torch.equal(gen.responses, ref)


# configs whose every part changes the numbers (random biases and q/k norm weights, windows shorter
# than the prompts, half-rotary heads): each served exactly, or a test fails
CONFIGS = {
    "llama_attention_bias": ("llama", dict(attention_bias=True)),  # q/k/v and o_proj biases
    "llama_mlp_bias": ("llama", dict(mlp_bias=True)),
    "qwen3_attention_bias": ("qwen3", dict(attention_bias=True)),
    # a window on the layers from max_window_layers on only (HF's rule), and from layer_types
    "qwen2_window_upper_layers": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    "qwen2_window_layer_types": (
        "qwen2",
        dict(
            use_sliding_window=True,
            sliding_window=4,
            layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    "qwen3_window_upper_layers": (
        "qwen3",
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    "phi3_partial_rotary": ("phi3", dict(partial_rotary_factor=0.5)),
    "phi3_window": ("phi3", dict(sliding_window=5)),
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_greedy_equals_hf_generate_with_config(case):
    family, kw = CONFIGS[case]
    assert_injected_greedy_equals_hf(tiny_model(family, perturb=True, **kw))


def test_per_layer_windows_follow_hf():
    """Qwen2/Qwen3: the window is on the layers ``layer_types`` names (from max_window_layers by
    default)."""
    for family in ("qwen2", "qwen3"):
        _, hy = hybrid(
            tiny_model(
                family, layers=4, use_sliding_window=True, sliding_window=5, max_window_layers=3
            )
        )
        assert hy.policy.layer_windows == (None, None, None, 5)
        # use_sliding_window=False
        _, hy = hybrid(tiny_model(family, layers=4, sliding_window=5, max_window_layers=0))
        assert hy.policy.layer_windows == (None,) * 4 and hy.policy.sliding_window is None


@pytest.mark.parametrize("family", FAMILIES + ["qwen2_window_upper_layers", "phi3_partial_rotary"])
def test_logprobs_match_training_mode(family):
    family, kw = CONFIGS.get(family, (family, {}))
    model = tiny_model(family, perturb=True, **kw)
    eng, hy = hybrid(model)
    assert hy.inject
    sp = SamplingParams(temperature=0.7, max_new_tokens=10, samples_per_prompt=2, seed=3)
    gen = hy.generate(mixed_prompts(), sp)
    with torch.no_grad():
        lp = response_logprobs(
            eng.forward, gen.sequences, gen.attention_mask, gen.prompt_len, sp.temperature
        )
    diff = ((lp - gen.logprobs) * gen.response_mask).abs().max().item()
    assert diff <= 1e-5, diff


def test_bf16_logprob_gap_is_small():
    model = tiny_model("llama")
    eng, hy = hybrid(model, precision="bf16")
    gen = hy.generate(mixed_prompts(), SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))
    with torch.no_grad():
        lp = response_logprobs(eng.forward, gen.sequences, gen.attention_mask, gen.prompt_len, 1.0)
    assert ((lp - gen.logprobs) * gen.response_mask).abs().max().item() < 0.1


def _train_loss(eng, batch):
    out = eng.forward(**batch).logits
    loss = torch.nn.functional.cross_entropy(
        out[:, :-1].reshape(-1, out.shape[-1]), batch["input_ids"][:, 1:].reshape(-1)
    )
    eng.backward(loss)
    eng.step()
    return loss.item()


def test_generate_leaves_training_exactly_as_it_was():
    batch = {"input_ids": torch.randint(3, 97, (4, 12))}
    losses = []
    for do_generate in (False, True):
        eng, hy = hybrid(tiny_model("llama"))
        _train_loss(eng, batch)
        if do_generate:
            hy.generate(mixed_prompts(), SamplingParams(temperature=1.0, max_new_tokens=8))
        losses.append(_train_loss(eng, batch))
    assert losses[0] == losses[1]


def test_inference_weights_and_cache_are_released():
    eng, hy = hybrid(tiny_model("llama"))
    model = hy.build_inference_model()
    refs = [weakref.ref(t) for w in model.layers for t in w.values()]
    model.allocate(4, 16, "cpu")
    refs.append(weakref.ref(model.cache))
    model.release()
    del model
    assert all(r() is None for r in refs)
    before = sum(p.numel() for p in eng.model.parameters())
    hy.generate(mixed_prompts(), SamplingParams(max_new_tokens=4))
    assert hy._model is None and sum(p.numel() for p in eng.model.parameters()) == before


def _live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (what the CPU allocator must
    hold)."""
    import gc

    gc.collect()
    seen, total = set(), 0
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type != "meta":
            try:
                st = o.untyped_storage()
                key, nbytes = st.data_ptr(), st.nbytes()
            except (RuntimeError, NotImplementedError):  # opaque (e.g. packed) tensors
                key, nbytes = id(o), o.numel() * o.element_size()
            if key not in seen:
                seen.add(key)
                total += nbytes
    return total


def test_memory_after_generate_returns_to_the_level_before():
    eng, hy = hybrid(tiny_model("llama", hidden=128, layers=3, vocab=512, intermediate=256))
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, samples_per_prompt=4, seed=5)
    # warm-up: lazily created state exists from here on
    hy.generate(mixed_prompts(8, vocab=512), sp)
    before = _live_tensor_bytes()
    gen = hy.generate(mixed_prompts(8, vocab=512), sp)
    del gen
    after = _live_tensor_bytes()
    weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    # the inference copy and cache would be a visible share of ``before``
    assert weights > 1_000_000
    assert after <= 1.05 * before, (before, after)


def test_fixed_seed_gives_identical_samples():
    _, hy = hybrid(tiny_model("llama"))
    sp = SamplingParams(
        temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=10, samples_per_prompt=3, seed=11
    )
    a, b = hy.generate(mixed_prompts(), sp), hy.generate(mixed_prompts(), sp)
    assert torch.equal(a.sequences, b.sequences)
    c = hy.generate(
        mixed_prompts(),
        SamplingParams(temperature=1.0, max_new_tokens=10, samples_per_prompt=3, seed=12),
    )
    assert not torch.equal(a.sequences, c.sequences)


def test_min_new_tokens_and_eos_handling():
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight[2] += 5.0 * model.lm_head.weight.abs().max()  # make EOS (id 2) likely
    _, hy = hybrid(model)
    gen = hy.generate(
        mixed_prompts(), SamplingParams(temperature=1.0, max_new_tokens=8, min_new_tokens=3, seed=0)
    )
    lengths = gen.response_mask.sum(1)
    assert (lengths >= 4).all()  # ≥ 3 tokens, then EOS (counted)
    for row, n in zip(gen.responses, lengths):
        assert (row[n:] == Tok.pad_token_id).all()


def test_sampling_distributions_match_reference():
    """Empirical frequencies of temperature / top-k / top-p sampling on a fixed logit vector."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 40000
    g = torch.Generator().manual_seed(0)
    for temp, k, p in [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8), (2.0, 4, 0.9)]:
        sp = SamplingParams(temperature=temp, top_k=k, top_p=p)
        toks, _ = sample(logits.expand(n, -1), sp, torch.rand((n, 1), generator=g))
        freq = torch.bincount(toks, minlength=6).float() / n
        # reference: sort, keep top-k, keep the smallest prefix with mass >= p, renormalise
        probs = (logits[0] / temp).softmax(-1)
        order = probs.argsort(descending=True)
        keep = torch.zeros(6, dtype=torch.bool)
        mass = 0.0
        for rank, i in enumerate(order.tolist()):
            if (k and rank >= k) or mass >= p:
                break
            keep[i] = True
            mass += probs[i].item()
        ref = torch.where(keep, probs, torch.zeros_like(probs))
        ref = ref / ref.sum()
        assert (freq - ref).abs().max().item() < 0.01, (temp, k, p, freq, ref)
    assert torch.isinf(filter_logits(logits, 2, 1.0)[0, 2:]).all()


def test_kept_inference_weights_are_reused_until_the_weights_change():
    """engine.release_inference_cache=false: the gathered inference weights serve the next
    generation while no optimizer step (or checkpoint load) has changed the training weights, and
    are rebuilt after."""
    model = tiny_model("llama")
    prompts = mixed_prompts()
    greedy = SamplingParams(temperature=0, max_new_tokens=8, min_new_tokens=8)
    eng, hy = hybrid(model, release_inference_cache=False)
    first = hy.generate(prompts, greedy)
    kept = hy._model
    again = hy.generate(prompts, greedy)
    assert hy._model is kept and torch.equal(first.sequences, again.sequences)
    ids = first.sequences
    loss = eng.forward(input_ids=ids).logits.float().logsumexp(-1).mean()  # any loss: a real step
    eng.backward(loss)
    eng.step()
    after = hy.generate(prompts, greedy)
    assert hy._model is not kept  # rebuilt from the new weights
    # a fresh engine on the updated weights generates the same
    _fresh_eng, fresh = hybrid(eng.model)
    assert torch.equal(after.sequences, fresh.generate(prompts, greedy).sequences)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "opt", "mixtral"])
def test_samples_sharing_their_prompts_prefill_equal_each_row_prefilled(family):
    """The dynamic loop prefills each prompt once for its samples (``share_prefill``) and copies its
    keys, values and first logits: the same tokens and log-probs as a prefill of every row, over
    left-padded prompts of several lengths, sampled and with several samples a prompt."""
    _, hy = hybrid(tiny_model(family, perturb=True))
    model = hy.build_inference_model()
    prompts = mixed_prompts()
    for n in (2, 3):
        sp = SamplingParams(temperature=1.0, max_new_tokens=10, samples_per_prompt=n, seed=5)
        gens = []
        for share in (False, True):
            model.share_prefill = share
            gens.append(
                model.generate(prompts, sp, eos_id=Tok.eos_token_id, pad_id=Tok.pad_token_id)
            )
        each, shared = gens
        assert torch.equal(each.sequences, shared.sequences)
        assert torch.equal(each.attention_mask, shared.attention_mask)
        torch.testing.assert_close(shared.logprobs, each.logprobs, rtol=0, atol=1e-6)
        # samples differ from one another: the rows are not one row copied
        assert not torch.equal(shared.sequences[0], shared.sequences[1])
