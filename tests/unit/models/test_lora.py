"""LoRA (PEFT) in one process: the hybrid engine generates with the merged weights, the reference is
the base model, the export merges, training touches the adapters only."""

import copy

import pytest
import torch

from rlhf.config import EngineConfig, LoraConfig, TrainConfig
from rlhf.engine.checkpoint import write_hf
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.logprobs import response_logprobs
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import AdaptersOff, FrozenModel, TrainEngine, reference_for
from rlhf.errors import ConfigError
from rlhf.models import lora
from rlhf.ops import SamplingParams
from tests.infer_helpers import Tok, hf_greedy, mixed_prompts, tiny_model

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3"]


def adapted(family: str, r: int = 4, full=None, **kw):
    """A tiny model of ``family`` with adapters whose B is random (PEFT starts B at zero, where a
    dropped adapter would change nothing); ``full``: modules trained fully (their copies
    perturbed)."""
    model = lora.apply_lora(
        tiny_model(family, perturb=True, **kw), LoraConfig(r=r, alpha=2.0 * r), seed=0, full=full
    )
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif ".modules_to_save." in name:
                p.mul_(-1.5)
    return model.eval()


def merged_copy(model):
    """The plain model with the adapters merged by PEFT itself (an independent reference)."""
    return copy.deepcopy(model).merge_and_unload().eval()


def engine_of(model, **ecfg):
    eng = TrainEngine(model, Mesh(), EngineConfig(**ecfg), TrainConfig(lr=1e-2, warmup_steps=0))
    return eng, HybridEngine(eng, Tok, EngineConfig(**ecfg))


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_greedy_equals_hf_generate_on_the_merged_model(family):
    model = adapted(family)
    prompts = mixed_prompts()
    ref = hf_greedy(merged_copy(model), prompts, 12)
    _eng, hy = engine_of(model)
    assert hy.inject
    gen = hy.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, min_new_tokens=12))
    assert torch.equal(gen.responses, ref)
    with lora.adapters_disabled(model):
        # the adapters matter: the base model says something else
        assert not torch.equal(hf_greedy(model, prompts, 12), ref)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # tied and untied embeddings
def test_fully_trained_embeddings_are_served_and_exported(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model = adapted(family, full=["embed_tokens"])
    prompts = mixed_prompts()
    ref = hf_greedy(merged_copy(model), prompts, 12)
    _eng, hy = engine_of(model)
    gen = hy.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, min_new_tokens=12))
    assert torch.equal(gen.responses, ref)
    x = torch.tensor([prompts[0]])
    with torch.no_grad():
        want = model(input_ids=x).logits
    write_hf(model, {k: v.detach().clone() for k, v in model.state_dict().items()}, tmp_path / "m")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=x).logits, want, atol=1e-5)


def test_training_weights_stay_unmerged_and_rollout_logprobs_match_training():
    model = adapted("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eng, hy = engine_of(model)
    sp = SamplingParams(temperature=0.8, max_new_tokens=8, samples_per_prompt=2, seed=1)
    gen = hy.generate(mixed_prompts(), sp)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # bit for bit: nothing merged in place
    with torch.no_grad():
        lp = response_logprobs(
            eng.forward, gen.sequences, gen.attention_mask, gen.prompt_len, sp.temperature
        )
    assert ((lp - gen.logprobs) * gen.response_mask).abs().max().item() <= 1e-5


def test_reference_with_adapters_off_equals_the_base_model_loaded_apart():
    base = tiny_model("qwen2", perturb=True)
    apart = FrozenModel(copy.deepcopy(base), Mesh(), EngineConfig())
    model = lora.apply_lora(base, LoraConfig(r=4, alpha=8), seed=0)
    eng, hy = engine_of(model)
    # one optimizer step on the adapters so that the adapted model differs from its base
    ids = torch.tensor(mixed_prompts(4)[3:4] * 2)
    eng.backward(eng.forward(input_ids=ids).logits.logsumexp(-1).mean())
    eng.step()
    ref = reference_for(
        eng, lambda: pytest.fail("a LoRA policy needs no second model"), eng.mesh, EngineConfig()
    )
    assert isinstance(ref, AdaptersOff)
    gen = hy.generate(mixed_prompts(), SamplingParams(temperature=1.0, max_new_tokens=8, seed=2))
    args = (gen.sequences, gen.attention_mask, gen.prompt_len)
    ref_lp, apart_lp = (
        response_logprobs(ref.forward, *args),
        response_logprobs(apart.forward, *args),
    )
    policy_lp = response_logprobs(eng.forward, *args).detach()
    assert torch.equal(ref_lp, apart_lp)
    assert (policy_lp - ref_lp).abs().max() > 1e-4  # the policy itself moved
    # adapters back on
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_only_adapters_train():
    model = lora.apply_lora(tiny_model("llama"), LoraConfig(r=4, alpha=8), seed=0)
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    eng, _ = engine_of(model)
    ids = torch.tensor(mixed_prompts(4)[3:4] * 2)
    for _ in range(2):
        eng.backward(eng.forward(input_ids=ids).logits.logsumexp(-1).mean())
        eng.step()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    state = eng.optimizer.state
    # AdamW state of adapters only
    assert sum(1 for p in model.parameters() if p in state) == len(trained)


def test_export_merges_and_adapter_reloads_with_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = adapted("llama")
    x = torch.tensor([mixed_prompts(1)[0]])
    with torch.no_grad():
        want = model(input_ids=x).logits
    write_hf(
        model,
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        tmp_path / "model",
        adapter_dir=tmp_path / "adapter",
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    assert not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=x).logits, want, atol=1e-5)
        base = lora.unwrap(copy.deepcopy(model))
        reloaded = PeftModel.from_pretrained(merged_base(base), tmp_path / "adapter").eval()
        assert torch.allclose(reloaded(input_ids=x).logits, want, atol=1e-5)


def merged_base(base):
    """``base`` (the HF model with LoRA layers inside) back to a plain model with the base
    weights."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(base.config)
    sd = {
        k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k
    }
    plain.load_state_dict(sd)
    return plain


def test_merged_state_dict_golden():
    """W + B·A·α/r by hand on one 2×2 layer, the adapter keys dropped, a saved head renamed."""
    sd = {
        "base_model.model.l.base_layer.weight": torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
        "base_model.model.l.lora_A.default.weight": torch.tensor([[1.0, 2.0]]),  # r=1
        "base_model.model.l.lora_B.default.weight": torch.tensor([[3.0], [4.0]]),
        "base_model.model.score.original_module.weight": torch.tensor([[9.0, 9.0]]),
        "base_model.model.score.modules_to_save.default.weight": torch.tensor([[5.0, 6.0]]),
    }
    out = lora.merged_state_dict(sd, scale=0.5)
    assert set(out) == {"l.weight", "score.weight"}
    # B·A = [[3, 6], [4, 8]]; × 0.5 = [[1.5, 3], [2, 4]]; + I
    assert torch.equal(out["l.weight"], torch.tensor([[2.5, 3.0], [2.0, 5.0]]))
    assert torch.equal(out["score.weight"], torch.tensor([[5.0, 6.0]]))


def test_unknown_target_module_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model.lora.target_modules.*nope_proj"):
        lora.apply_lora(
            tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "nope_proj"]), seed=0
        )


def test_default_targets_are_the_block_projections():
    assert lora.default_targets(tiny_model("llama")) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert lora.default_targets(tiny_model("phi3")) == sorted(
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    )
