"""Where the transformer blocks of a Hugging Face model are (what FSDP wraps one by one, what the
hybrid engine gathers one at a time, where LoRA's default targets live)."""
from __future__ import annotations

from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of an HF model (``model.layers`` in Llama/Qwen2/Mistral, ``h`` in GPT-2)."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks") and len(mod):
            return mod
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
