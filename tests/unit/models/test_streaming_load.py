"""Streamed loading in one process (rlhf/models/streaming.py; its 2-rank checks: tests/distributed/
test_streaming_load.py): ``from_pretrained`` on placeholders leaves the bulk unloaded and reads the
rest; read back (``materialise``, or ``fill`` as ZeRO-0/1 does), the model equals the one loaded
whole, after the same random draws (a new head's init, the mean-resizing of grown embeddings). Where
it cannot apply (a .bin checkpoint, tensors Transformers converts on load) it says so and loads
whole. One process loads whole (nothing to shard)."""

import logging

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
)

from rlhf.engine.mesh import Mesh
from rlhf.models import loading, streaming


class Vocab:
    """What ``resize_for_tokenizer`` reads of a tokenizer: its length."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming_unit")
    cfg = dict(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    for name, tied in (("tied", True), ("untied", False)):
        torch.manual_seed(1)
        model = LlamaForCausalLM(
            LlamaConfig(num_key_value_heads=2, tie_word_embeddings=tied, **cfg)
        )
        model.save_pretrained(root / name, max_shard_size="20KB" if name == "untied" else "5GB")
    torch.save(model.state_dict(), root / "pytorch_model.bin")
    (root / "bin").mkdir()
    model.config.save_pretrained(root / "bin")
    (root / "pytorch_model.bin").rename(root / "bin" / "pytorch_model.bin")
    return root


def _load(cls, path, **kw):
    return lambda: cls.from_pretrained(str(path), dtype=torch.float32, **kw)


def _equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("name", ["tied", "untied"])
@pytest.mark.parametrize("cls", [AutoModelForCausalLM, AutoModelForSequenceClassification])
def test_deferred_then_read_equals_loaded_whole(saved, name, cls):
    torch.manual_seed(7)
    whole = _load(cls, saved / name)()
    loading.resize_for_tokenizer(whole, Vocab(53))  # grows 3 rows, mean-resized
    rng = torch.get_rng_state()
    torch.manual_seed(7)
    model = streaming.load_deferred(_load(cls, saved / name), "test")
    unloaded = {n for n, p in model.named_parameters() if streaming.unloaded(p) is not None}
    assert unloaded and all(
        ".layers." in n or "embed_tokens" in n or "lm_head" in n for n in unloaded
    )
    assert "model.norm.weight" not in unloaded  # read at once, as a score head would be
    if cls is AutoModelForSequenceClassification:
        # the new head: initialised, on the same draws
        assert "score.weight" not in unloaded and torch.equal(
            model.score.weight, whole.score.weight
        )
    loading.resize_for_tokenizer(model, Vocab(53))
    emb = model.get_input_embeddings().weight
    assert streaming.unloaded(emb) is not None and streaming.unloaded(emb).tail.shape[0] == 3
    assert emb.untyped_storage().nbytes() <= 4  # the grown embedding is unloaded again
    assert torch.equal(torch.get_rng_state(), rng)
    before = sum(streaming.read_counts().values())
    streaming.materialise(model)
    assert sum(streaming.read_counts().values()) > before
    assert not any(streaming.unloaded(p) is not None for p in model.parameters())
    _equal(model, whole)


def test_fill_reads_whole_tensors_as_ddp_does(saved):
    """ZeRO-0/1's fill in one process: plain tensors read whole onto the device."""
    torch.manual_seed(0)
    whole = _load(AutoModelForCausalLM, saved / "untied")()
    torch.manual_seed(0)
    model = streaming.load_deferred(_load(AutoModelForCausalLM, saved / "untied"), "test")
    plan = streaming.plan(model, Mesh())
    assert plan and set(plan) == {
        n for n, p in model.named_parameters() if streaming.unloaded(p) is not None
    }
    streaming.fill(model, plan, torch.device("cpu"))
    _equal(model, whole)


def test_unload_keeps_ties_and_goes_to_meta(saved):
    model = streaming.load_deferred(_load(AutoModelForCausalLM, saved / "tied"), "test")
    streaming.unload(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.is_meta
    assert not model.model.norm.weight.is_meta


@pytest.mark.parametrize("what", ["bin", "converted"])
def test_fallbacks_load_whole_and_say_why(saved, tmp_path, caplog, what):
    if what == "bin":
        path, why = saved / "bin", "not a safetensors checkpoint"
        cls = AutoModelForCausalLM
    else:
        # Mixtral's experts are stacked on load (a WeightConverter): the file's tensors are not the
        # model's
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(
            vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=1
        )
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_local_experts = 4, 2, 2
        MixtralForCausalLM(cfg).save_pretrained(tmp_path)
        path, why, cls = tmp_path, "Transformers converts", AutoModelForCausalLM
    torch.manual_seed(3)
    whole = _load(cls, path)()
    rng = torch.get_rng_state()
    torch.manual_seed(3)
    with caplog.at_level(logging.INFO, logger="rlhf"):
        model = streaming.load_deferred(_load(cls, path), f"model {path}")
    lines = [r.getMessage() for r in caplog.records if why in r.getMessage()]
    assert len(lines) == 1 and "rank 0 load" in lines[0] and str(path) in lines[0], caplog.text
    assert not any(streaming.unloaded(p) is not None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    _equal(model, whole)


def test_one_process_loads_whole(saved):
    """Nothing to shard in one process: build_model loads the checkpoint whole, as before."""
    assert not streaming.wanted()
    model = loading.build_model(AutoModelForCausalLM, path=str(saved / "tied"))
    assert not any(streaming.unloaded(p) is not None for p in model.parameters())
    _equal(model, _load(AutoModelForCausalLM, saved / "tied")())
