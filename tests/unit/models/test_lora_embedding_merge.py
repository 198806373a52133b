"""The merged export of a LoRA adapter on the embeddings
(model.lora.target_modules=[...,embed_tokens]): PEFT keeps an embedding's adapter as
``lora_embedding_A`` [r, vocab] / ``lora_embedding_B`` [dim, r] (no ``.weight``) and adds
(B·A)ᵀ·α/r; before, the merge left these keys in the export unmerged."""

import torch

from rlhf.models import lora


def test_merged_state_dict_merges_an_embedding_adapter_golden():
    sd = {
        "base_model.model.emb.base_layer.weight": torch.zeros(3, 2),  # vocab 3, dim 2
        "base_model.model.emb.lora_embedding_A.default": torch.tensor([[1.0, 2.0, 3.0]]),  # r=1
        "base_model.model.emb.lora_embedding_B.default": torch.tensor([[1.0], [-1.0]]),
    }
    out = lora.merged_state_dict(sd, scale=2.0)
    assert set(out) == {"emb.weight"}
    # B·A = [[1, 2, 3], [-1, -2, -3]]; transposed, × 2
    assert torch.equal(out["emb.weight"], torch.tensor([[2.0, -2.0], [4.0, -4.0], [6.0, -6.0]]))


def test_merged_embedding_equals_peft_merge():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    peft = get_peft_model(
        model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "embed_tokens"])
    )
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.normal_()
    ours = lora.merged_state_dict(peft.state_dict(), lora.scaling(peft))
    theirs = peft.merge_and_unload().state_dict()
    assert set(ours) == set(theirs)
    for k in theirs:
        assert torch.allclose(ours[k], theirs[k], atol=1e-6), k
