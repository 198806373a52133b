"""A LoRA adapter trained on a model whose tokenizer has no pad token (the pad ``load_tokenizer``
adds grows the embeddings by one row) loads with plain PEFT onto the user's original base model and
gives the merged export's logits on text without the pad (before: size mismatch, 276 rows vs
275)."""

import pytest
import torch

from tests.conftest import run_cli
from tests.e2e.test_tokenizer_pad import raw_model


@pytest.mark.parametrize(
    "extra",
    [(), ("model.lora.modules_to_save=[embed_tokens,lm_head]",)],
    ids=["adapters", "with_trained_embeddings"],
)
def test_adapter_loads_onto_the_original_base_and_matches_the_merged_export(tmp_path, extra):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    raw = raw_model(tmp_path / "raw")
    run = tmp_path / "run"
    proc = run_cli(
        "stage=sft",
        f"run.dir={run}",
        f"model.path={raw}",
        "model.lora.r=4",
        *extra,
        "train.max_steps=2",
        "train.global_batch=8",
        "train.warmup_steps=0",
        "train.lr=1e-2",
        "train.save_every=0",
        "eval.gold_prompts=0",
        "data.eval_size=8",
        "data.synthetic.num_records=300",
        "logger.progress=false",
        "engine.precision=fp32",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    vocab = len(AutoTokenizer.from_pretrained(raw))
    merged = AutoModelForCausalLM.from_pretrained(run / "sft" / "model").eval()
    # the export keeps the pad it trained with
    assert merged.config.vocab_size == vocab + 1
    base = AutoModelForCausalLM.from_pretrained(raw).eval()
    want_base = base(input_ids=torch.arange(3, 40)[None]).logits.detach()
    adapted = PeftModel.from_pretrained(base, run / "sft" / "adapter").eval()
    assert adapted.get_input_embeddings().weight.shape[0] == vocab
    # tokens of the original vocabulary, no pad
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        got = adapted(input_ids=ids).logits
        want = merged(input_ids=ids).logits
    assert got.shape[-1] == vocab and want.shape[-1] == vocab + 1
    assert torch.allclose(got, want[..., :vocab], atol=1e-5), (got - want[..., :vocab]).abs().max()
    # training moved the adapter (not a no-op comparison)
    assert (got - want_base).abs().max() > 1e-3
