"""OPT and GPT-2 (DeepSpeed-Chat's own families) and GPT-NeoX beyond the policy sweep: the static
decode step and the packed prefill serve their LayerNorms, plain MLPs, learned positions (OPT,
GPT-2) and parallel blocks with partial rotary (GPT-NeoX); a generation that would run past a
position table is refused; training forwards run packed (their HF attention goes through the packed
attention interface: logits and gradients equal the padded forward's); their sequence classifiers
are reward models and critics (``ScalarHeadModel``), their blocks found by ``decoder_layers``."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf.algorithms.tokens import position_ids
from rlhf.engine import packing
from rlhf.errors import ConfigError
from rlhf.models.loading import decoder_layers
from rlhf.models.value import ScalarHeadModel, init_head, sequence_scores
from rlhf.ops import SamplingParams
from tests.infer_helpers import PAD, mixed_prompts, tiny_config, tiny_model
from tests.unit.engine.test_inference import hybrid
from tests.unit.engine.test_inference_static import NEW, eos_prone, hf_greedy_until_eos
from tests.unit.engine.test_packing import TOL, _batch, _grads
from tests.unit.engine.test_prefill_packed import assert_logprobs_close, generate

# greedy rows of each end at 4-5 different steps (the EOS boost chosen per model for that: negative,
# as the LayerNorm'd hidden states of these models sum below zero)
CASES = {
    "opt_350m_like": ("opt", dict(boost=-0.4, do_layer_norm_before=False, word_embed_proj_dim=32)),
    "opt_125m_like": ("opt", dict(boost=-1.2)),
    "gpt2": ("gpt2", dict(boost=-1.5)),
    "gpt_neox": ("gpt_neox", dict(boost=-2.0)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_static_step_and_packed_prefill_generate_what_the_row_removing_loop_does(case):
    """Greedy: the static step (eager, buckets, key spans of 8) and the packed prefill give the
    row-removing loop's tokens, which are HF generate's (rows ending at different steps); sampled:
    the same draws. Log-probs within 1e-5 relative (the spread weights' larger activations round
    more than the Llama models' of tests/unit/engine/test_inference_static.py: 7.5e-6 seen for the
    static step)."""
    family, kw = CASES[case]
    model = eos_prone(family, **kw)
    prompts = mixed_prompts(7)
    _, hy = hybrid(model)
    greedy = SamplingParams(temperature=0, max_new_tokens=NEW)
    ref = generate(hy, "dynamic", False, greedy, prompts)
    ends = set(ref.response_mask.sum(1).tolist())
    assert len(ends) >= 3 and min(ends) < NEW, ends
    assert torch.equal(ref.responses, hf_greedy_until_eos(model, prompts, NEW))
    sampled = SamplingParams(
        temperature=0.9, top_k=30, max_new_tokens=NEW, samples_per_prompt=2, seed=3
    )
    ref_sampled = generate(hy, "dynamic", False, sampled, prompts)
    for decode, packed in (("static", False), ("dynamic", True), ("static", True)):
        out = generate(hy, decode, packed, greedy, prompts)
        assert torch.equal(out.sequences, ref.sequences) and torch.equal(
            out.response_mask, ref.response_mask
        )
        assert_logprobs_close(out.logprobs, ref.logprobs)
        out = generate(hy, decode, packed, sampled, prompts)
        assert torch.equal(out.sequences, ref_sampled.sequences)
        assert_logprobs_close(out.logprobs, ref_sampled.logprobs)


def test_a_generation_past_the_position_table_is_refused():
    """HF's table holds max_position_embeddings positions (OPT: after its offset of 2); the
    inference mode says so instead of reading past it."""
    _, hy = hybrid(tiny_model("opt", max_position_embeddings=16))
    prompt = [mixed_prompts(1)[0][:4]]
    assert hy.build_inference_model().root["wpe"].shape[0] == 16
    hy.generate(prompt, SamplingParams(temperature=0, max_new_tokens=13))  # positions 0..15
    with pytest.raises(
        ConfigError, match=r"reach position 16; the model's position table holds 16"
    ):
        hy.generate(prompt, SamplingParams(temperature=0, max_new_tokens=14))


PACKABLE = {
    "opt": ("opt", {}),
    "opt_350m_like": ("opt", dict(do_layer_norm_before=False, word_embed_proj_dim=32)),
    "gpt2": ("gpt2", {}),
    "gpt_neox": ("gpt_neox", {}),
    "gpt_neox_sequential": ("gpt_neox", dict(use_parallel_residual=False)),
}


def _classifier(family: str, **kw):
    """A sequence classifier of ``family`` (one label, head as the reward stage initialises it),
    random biases and LayerNorm weights as ``tiny_model`` spreads them."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(
        tiny_config(family, vocab=61, num_labels=1, **kw)
    )
    donor = tiny_model(family, perturb=True, vocab=61, **kw)  # the same backbone weights, spread
    getattr(model, model.base_model_prefix).load_state_dict(
        getattr(donor, donor.base_model_prefix).state_dict()
    )
    init_head(model)
    return model.train()


@pytest.mark.parametrize("case", sorted(PACKABLE))
@pytest.mark.parametrize("head", [False, True])
def test_packed_training_forward_equals_the_padded_one(case, head):
    """Causal LM and critic (``ScalarHeadModel``): packed logits/values and gradients equal the
    padded forward's (left- and right-padded rows, one of a single token), as for the other families
    (tests/unit/engine/test_packing.py)."""
    family, kw = PACKABLE[case]
    padded = (
        ScalarHeadModel(_classifier(family, **kw))
        if head
        else tiny_model(family, perturb=True, vocab=61, **kw)
    )
    padded.train()
    packed = copy.deepcopy(padded)
    assert packing.install(packed), packing.why_not(packed)
    ids, mask = _batch()
    real = mask.bool()
    out = packing.forward(packed, ids, mask, position_ids=position_ids(mask))
    ref = padded(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))
    if not head:
        out, ref = out.logits, ref.logits
    assert out.shape == ref.shape and (out - ref)[real].abs().max() <= TOL
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    ((ref * weights)[real].sum()).backward()
    ((out * weights)[real].sum()).backward()
    a, b = _grads(packed), _grads(padded)
    assert a.keys() == b.keys() and a
    for k in a:
        # TOL relative to the gradient's size (the spread weights make them reach ~50)
        gap = (a[k] - b[k]).abs().max().item()
        assert gap <= TOL * max(1.0, b[k].abs().max().item()), (case, k, gap)


@pytest.mark.parametrize("case", sorted(PACKABLE))
def test_sequence_classifier_is_a_reward_model_and_critic(case):
    """``ScalarHeadModel`` over OPT's / GPT-2's sequence classifier: the score at each row's last
    token is HF's own pooled score (the last token that is not the pad), whichever side the rows are
    padded on; ``decoder_layers`` finds the blocks."""
    family, kw = PACKABLE[case]
    hf = _classifier(family, **kw).eval()
    assert len(decoder_layers(hf)) == hf.config.num_hidden_layers
    critic = ScalarHeadModel(hf)
    rows = mixed_prompts(5, vocab=61)
    n = max(len(r) for r in rows)
    scores = []
    for left in (False, True):
        ids = torch.full((len(rows), n), PAD)
        mask = torch.zeros(len(rows), n, dtype=torch.long)
        for i, r in enumerate(rows):
            cols = slice(n - len(r), n) if left else slice(0, len(r))
            ids[i, cols], mask[i, cols] = torch.tensor(r), 1
        with torch.no_grad():
            scores.append(sequence_scores(critic(input_ids=ids, attention_mask=mask), mask))
            if not left:
                # HF pools the last non-pad token of right-padded rows
                want = hf(
                    input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)
                ).logits[:, 0]
                torch.testing.assert_close(scores[-1], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores[0], scores[1], rtol=1e-5, atol=1e-5)
    assert scores[0].std() > 0.1  # rows score differently: a real check
