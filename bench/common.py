"""What the benches share: the workloads of docs/benchmarks.md, the Llama built from one, and the
device label every JSON line carries."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# docs/benchmarks.md (Workloads); ``inter`` (intermediate size) where the hidden × 8/3 rule does not
# apply
WORKLOADS = {
    "tiny": dict(hidden=128, layers=4, heads=4, kv=2, vocab=2000, prompts=8, prompt_len=32, new=64),
    "small": dict(
        hidden=512, layers=8, heads=8, kv=4, vocab=8000, prompts=8, prompt_len=64, new=128
    ),
    "bigvocab": dict(
        hidden=256,
        layers=4,
        heads=4,
        kv=2,
        inter=704,
        vocab=151936,
        prompts=32,
        prompt_len=64,
        new=128,
    ),
    "gpu05b": dict(
        hidden=1024,
        layers=24,
        heads=16,
        kv=8,
        inter=2816,
        vocab=32000,
        prompts=64,
        prompt_len=128,
        new=256,
    ),
    "gpu1b": dict(
        hidden=2048,
        layers=16,
        heads=16,
        kv=8,
        inter=5632,
        vocab=32000,
        prompts=64,
        prompt_len=128,
        new=256,
    ),
}


def intermediate(w: dict) -> int:
    """The workload's MLP width: ``inter`` when given, else hidden × 8/3 rounded down to a multiple
    of 64."""
    return w.get("inter") or w["hidden"] * 8 // 3 // 64 * 64


def llama_config(w: dict, **overrides):
    """The workload's LlamaConfig (untied LM head, 512 positions); ``overrides`` win (token ids,
    ...)."""
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
    """The torch.device a bench with ``nproc`` processes on this node runs on, as the engine picks
    it (``engine.device``: auto honours $RLHF_DEVICE and falls back to the CPU when there are fewer
    GPUs than processes)."""
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


def matmul_peak(dtype, n: int = 2048) -> float:
    """FLOP/s of an n × n × n GEMM in ``dtype`` on this process's threads, best of 5: the faster of
    torch's matmul and (on a CPU with oneDNN) oneDNN's linear on a weight in its blocked layout.
    On the CPU machine (an AMD EPYC with AVX-512) MKL's sgemm, behind torch's fp32 matmul, gives
    about 210 GFLOP/s on 2 threads where oneDNN gives about 490: a roofline that took the first
    would put fp32 code above 100% of it."""
    import time

    import torch

    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    calls = [lambda: a @ b]
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous())
        calls.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    except (AttributeError, RuntimeError):  # no oneDNN in this build, or not this dtype
        pass
    best = float("inf")
    for call in calls:
        call()
        for _ in range(5):
            t = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def digit_share(responses, examples, fmt):
    """A rule reward for the GRPO bench (``ppo.reward_fn=bench.common.digit_share``): the share of
    digits in each response, so rewards vary within a prompt's group."""
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


# the TrainingArguments every TRL bench shares: one CPU process, no saving, reporting, progress bar
# or dataloader workers, seed 0; precision and logging are each bench's own
TRL_CPU = dict(
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    fp16=False,
    seed=0,
    dataloader_num_workers=0,
    disable_tqdm=True,
)


def step_timer(from_step_end: bool = False):
    """A Transformers ``TrainerCallback`` that records each optimizer step's wall time in
    ``.times``: how the TRL benches time a trainer's step. ``on_step_begin`` → ``on_step_end``;
    ``from_step_end``: from one ``on_step_end`` to the next (the first from ``on_train_begin``), for
    a loop that calls no ``on_step_begin`` (TRL's PPOTrainer): the whole iteration."""
    import time

    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_train_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_begin(self, *a, **k):
            if not from_step_end:
                self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            self.times.append(now - self.t0)
            self.t0 = now

    return StepTimer()


def trl_ppo_args(description: str, steps: int):
    """The command line of the TRL PPO-family benches (bench/trl_grpo.py, bench/trl_ppo.py):
    ``--workload``, ``--steps`` (default ``steps``), ``--threads``; callers add their own."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workload", nargs="+", default=["tiny"], choices=sorted(WORKLOADS))
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads (bench/ppo.py gives its one process every core)",
    )
    return ap


def trl_line_base(workload: str, variant: str, threads: int, trl_version: str, steps: int) -> dict:
    """The fields every JSON line of a TRL PPO-family bench carries (bench/ppo.py's schema, one CPU
    process)."""
    import torch

    return {
        "bench": "ppo",
        "workload": workload,
        "variant": variant,
        "world_size": 1,
        "threads_per_rank": threads,
        "torch": torch.__version__,
        "device": "cpu",
        "trl": trl_version,
        "steps": steps,
    }


def trl_prompts(prompts_file, model_dir, w: dict):
    """bench/ppo.py's prompts (``prepare``'s JSON lines) for a TRL bench: (the tokenizer saved in
    ``model_dir``, the prompts' text, their token ids), each prompt checked to tokenize to exactly
    the workload's prompt length."""
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    prompts = [json.loads(x)["prompt"] for x in Path(prompts_file).read_text().splitlines()]
    ids = [tok(p)["input_ids"] for p in prompts]
    lengths = sorted({len(x) for x in ids})
    if lengths != [w["prompt_len"]]:
        raise RuntimeError(
            f"prompts tokenize to {lengths} tokens, not the workload's {w['prompt_len']}"
        )
    return tok, prompts, ids


def train_timed(trainer, timer) -> float:
    """Runs a TRL trainer whose callbacks include ``timer`` (``step_timer``) and returns the median
    step after the first (warm-up) one. TRL prints its log dicts: they go to stderr (stdout holds
    JSON lines only)."""
    import contextlib
    import statistics

    with contextlib.redirect_stdout(sys.stderr):
        trainer.train()
    return statistics.median(timer.times[1:])


def print_step_lines(base: dict, step: float, samples: int, new_tokens: int) -> None:
    """bench/ppo.py's per-step metrics of one variant as JSON lines: ``s_per_step``,
    ``samples_per_s`` and ``tokens_per_s`` (``samples`` responses of ``new_tokens`` tokens a
    step)."""
    import json

    for metric, value, unit in (
        ("s_per_step", step, "s"),
        ("samples_per_s", samples / step, "samples/s"),
        ("tokens_per_s", samples * new_tokens / step, "tokens/s"),
    ):
        print(
            json.dumps({**base, "metric": metric, "value": round(value, 4), "unit": unit}),
            flush=True,
        )
