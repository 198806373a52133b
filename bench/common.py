"""What the benches share: the workloads of docs/contract.md, the Llama built from one, and the device
label every JSON line carries."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# docs/contract.md (Workloads); ``inter`` (intermediate size) where the hidden × 8/3 rule does not apply
WORKLOADS = {
    "tiny": dict(hidden=128, layers=4, heads=4, kv=2, vocab=2000, prompts=8, prompt_len=32, new=64),
    "small": dict(hidden=512, layers=8, heads=8, kv=4, vocab=8000, prompts=8, prompt_len=64, new=128),
    "bigvocab": dict(hidden=256, layers=4, heads=4, kv=2, inter=704, vocab=151936, prompts=32, prompt_len=64, new=128),
    "gpu05b": dict(
        hidden=1024, layers=24, heads=16, kv=8, inter=2816, vocab=32000, prompts=64, prompt_len=128, new=256
    ),
    "gpu1b": dict(hidden=2048, layers=16, heads=16, kv=8, inter=5632, vocab=32000, prompts=64, prompt_len=128, new=256),
}


def intermediate(w: dict) -> int:
    """The workload's MLP width: ``inter`` when given, else hidden × 8/3 rounded down to a multiple of 64."""
    return w.get("inter") or w["hidden"] * 8 // 3 // 64 * 64


def llama_config(w: dict, **overrides):
    """The workload's LlamaConfig (untied LM head, 512 positions); ``overrides`` win (token ids, ...)."""
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=w["vocab"],
        hidden_size=w["hidden"],
        intermediate_size=intermediate(w),
        num_hidden_layers=w["layers"],
        num_attention_heads=w["heads"],
        num_key_value_heads=w["kv"],
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**kw, **overrides})


def resolve_device(requested: str = "auto", nproc: int = 1):
    """The torch.device a bench with ``nproc`` processes on this node runs on, as the engine picks it
    (``engine.device``: auto honours $RLHF_DEVICE and falls back to the CPU when there are fewer GPUs
    than processes)."""
    from rlhf.engine.mesh import choose_device

    return choose_device(requested, 0, nproc)


def device_label(device=None) -> str:
    """``cpu`` or ``cuda:<device name>`` (the ``device`` field of every bench line). ``device``: a
    torch.device or string; None = CUDA device 0 when torch sees one and $RLHF_DEVICE is not cpu."""
    import torch

    if device is None:
        use_cuda = torch.cuda.is_available() and os.environ.get("RLHF_DEVICE", "") != "cpu"
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device.index or 0)}"
    return device.type


def digit_share(responses, examples, fmt):
    """A rule reward for the GRPO bench (``ppo.reward_fn=bench.common.digit_share``): the share of
    digits in each response, so rewards vary within a prompt's group."""
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


def step_timer():
    """A Transformers ``TrainerCallback`` that records each optimizer step's wall time (``on_step_begin``
    → ``on_step_end``) in ``.times``: how the TRL benches time a trainer's step."""
    import time

    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    return StepTimer()
