"""The activations of plain (non-gated) MLPs, each computed as the Hugging Face module of that name
computes it (``transformers.activations.ACT2FN``), so that the inference mode's numbers are HF's.
One table: a config's activation name → the function (in place where the op allows it; the input is
the MLP's fresh first projection)."""

import math

import torch
import torch.nn.functional as F


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation, op for op as HF's ``NewGELUActivation``
    (F.gelu(approximate="tanh") rounds differently)."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


ACTIVATIONS = {
    "relu": F.relu_,  # HF nn.ReLU (OPT's default)
    # HF GELUActivation: the exact (erf) GELU
    "gelu": F.gelu,
    "gelu_new": gelu_new,  # GPT-2's default
}
