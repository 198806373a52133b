"""Tiny models of each supported family and reference generations with HF generate."""
from __future__ import annotations

import torch

PAD, BOS, EOS = 0, 1, 2


def tiny_config(family: str, vocab: int = 97, hidden: int = 64, layers: int = 2, heads: int = 4, kv: int = 2,
                intermediate: int = 128):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[family]
    return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
               pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=family == "llama",
               rms_norm_eps=1e-5)


def tiny_model(family: str, seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(tiny_config(family, **kw))
    with torch.no_grad():  # larger random weights: peaked distributions, fewer greedy ties
        for p in m.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
    return m.eval()


def mixed_prompts(n: int = 6, seed: int = 0, vocab: int = 97):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 3 + (i * 5) % 11
        out.append([BOS] + torch.randint(3, vocab, (length,), generator=g).tolist())
    return out


class Tok:
    """The three ids the engine needs from a tokenizer."""
    pad_token_id, eos_token_id, bos_token_id = PAD, EOS, BOS


@torch.no_grad()
def hf_greedy(model, prompts, max_new: int) -> torch.Tensor:
    from rlhf.engine.infer import left_pad
    ids, mask = left_pad(prompts, PAD)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                         min_new_tokens=max_new, pad_token_id=PAD, eos_token_id=EOS)
    return out[:, ids.shape[1]:]
