"""A real architecture at a real size: a Qwen2.5-0.5B-shaped model (its published config, random
init: there are no pretrained weights on these machines) through a few steps of SFT, reward and PPO
on HH-RLHF data in one process, with the pretrained recipe (docs/recipes.md). Prints JSON lines in
the schema of docs/benchmarks.md (Benchmarks), variant = the stage: ``s_per_step`` (SFT and reward:
from the stage's samples/s; PPO: the median iteration's generate + score + update seconds),
``peak_mem_gb`` (metrics.jsonl's ``mem/peak_gb``) and ``wall_s`` (the whole stage).

    python bench/real_size.py [--steps 3] [--out runs/bench_real_size] [--data
    tests/data/hh-rlhf/...]

Learning is not the point (random weights); the settings and the engine at that size are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, device_label

# Qwen/Qwen2.5-0.5B's config.json as published (architecture fields)
QWEN25_05B = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    use_sliding_window=False,
    sliding_window=32768,
    max_window_layers=24,
    attention_dropout=0.0,
    initializer_range=0.02,
)
HH = ROOT / "tests" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"


def build_model(out: Path, data: Path) -> Path:
    """The model directory: a byte-level BPE trained on the data (Qwen's own tokenizer is not here;
    the embedding keeps Qwen's 151,936 rows) and the random-init weights, saved as a user's
    model."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlhf.data.records import read_examples
    from rlhf.data.tokenizer import train_tokenizer

    if (out / "config.json").is_file():
        return out
    examples, _ = read_examples(str(data), "hh")
    texts = [t for e in examples for t in (e.prompt, e.chosen, e.rejected) if t]
    tok = train_tokenizer(
        texts, vocab_size=8192, model_max_length=QWEN25_05B["max_position_embeddings"]
    )
    cfg = Qwen2Config(
        **QWEN25_05B,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def stage(name: str, run: Path, common: list, extra: list, batch: dict) -> dict:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "rlhf", f"stage={name}", f"run.dir={run}", *common, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"stage={name} failed with exit {proc.returncode}")
    rows = [json.loads(x) for x in (run / name / "metrics.jsonl").read_text().splitlines()]
    if name == "ppo":
        # per iteration: generation, scoring and updates
        steps = [
            r["time/generate_s"] + r["time/score_s"] + r["time/train_s"]
            for r in rows
            if "time/train_s" in r
        ]
    else:
        # the stage's samples/s over all its steps, as seconds per step
        last = [r for r in rows if "samples_per_s" in r][-1]
        steps = [batch[name] / last["samples_per_s"]]
    peaks = [r["mem/peak_gb"] for r in rows if "mem/peak_gb" in r]
    recipe = next(
        (x.split("recipe=")[1].split(" ")[0] for x in proc.stderr.splitlines() if "recipe=" in x),
        None,
    )
    import torch

    base = {
        "bench": "real_size",
        "workload": "qwen2.5-0.5b-shape",
        "variant": name,
        "world_size": 1,
        "torch": torch.__version__,
        "device": device_label("cpu"),
        "recipe": recipe,
        "params": 494_032_768,
    }
    return [
        {**base, "metric": "s_per_step", "value": round(statistics.median(steps), 2), "unit": "s"},
        {
            **base,
            "metric": "peak_mem_gb",
            "value": round(max(peaks), 2) if peaks else None,
            "unit": "GiB",
        },
        {**base, "metric": "wall_s", "value": round(wall, 1), "unit": "s"},
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench_real_size"))
    ap.add_argument("--data", default=str(HH))
    ap.add_argument("--stages", default="sft,reward,ppo")
    args = ap.parse_args()
    out = Path(args.out)
    model = build_model(out / "qwen2.5-0.5b-shape", Path(args.data))
    run = out / "run"
    # the pretrained recipe as it is, but for the step count and the batch a 2-core CPU can take
    # in minutes (one process, fp32)
    common = [
        f"model.path={model}",
        f"data.path={args.data}",
        "data.format=hh",
        "logger.progress=false",
        f"train.max_steps={args.steps}",
        "train.log_every=1",
        "train.save_every=0",
        "run.resume=false",
        "engine.precision=fp32",
        "data.eval_size=32",
    ]
    batch = {"sft": 8, "reward": 8}
    extra = {
        "sft": [f"train.global_batch={batch['sft']}", "train.micro_batch_per_rank=4"],
        "reward": [f"train.global_batch={batch['reward']}", "train.micro_batch_per_rank=4"],
        # four fp32 models with AdamW state for two of them (≈ 24 GB before activations) do not fit
        # this 24 GB machine: PPO here trains LoRA adapters on actor and critic (the reference is
        # the actor with adapters off), as a user of one small machine would
        "ppo": [
            "ppo.prompts_per_step=4",
            "ppo.min_rm_accuracy=0",
            "ppo.max_new_tokens=64",
            "model.lora.r=16",
            "model.lora.critic=true",
            "train.lr=1e-4",
            "ppo.critic_lr=1e-4",
        ],
    }
    for name in args.stages.split(","):
        for line in stage(name, run, common, extra[name], batch):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
