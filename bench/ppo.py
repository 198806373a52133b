"""Seconds per PPO step, split into generate / score / train / switch (JSON lines, CONTRACT.md).

    python bench/ppo.py [--workload tiny small] [--world-sizes 1 2] [--steps 3]

Runs the real stage (`python -m rlhf stage=ppo`) on a run directory it prepares: a random-init
Llama of the workload as the SFT model, a random-init scalar-head model as the reward model, and
prompts of exactly the workload's length (digits, one token each). One step = prompts per rank ×
1 sample (GAE) → score → 1 PPO epoch of 1 minibatch, at fixed response lengths. The figures are
the medians of the steps after the first (warm-up) one.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from generation import WORKLOADS  # noqa: E402


def prepare(run_dir: Path, w: dict) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from rlhf.data.tokenizer import train_tokenizer
    digits = ["".join(random.Random(i).choice("0123456789") for _ in range(40)) for i in range(200)]
    tok = train_tokenizer(digits + ["Q: A: ok"], 300, 1024)
    cfg = LlamaConfig(vocab_size=w["vocab"], hidden_size=w["hidden"], intermediate_size=w["hidden"] * 8 // 3 // 64 * 64,
                      num_hidden_layers=w["layers"], num_attention_heads=w["heads"], num_key_value_heads=w["kv"],
                      max_position_embeddings=512, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(run_dir / "sft" / "model")
    tok.save_pretrained(run_dir / "sft" / "model")
    cfg.num_labels = 1
    LlamaForSequenceClassification(cfg).save_pretrained(run_dir / "reward" / "model")
    tok.save_pretrained(run_dir / "reward" / "model")
    data = run_dir / "prompts.jsonl"
    rng = random.Random(1)
    with open(data, "w") as f:  # BOS + (len - 1) digits = exactly the workload's prompt length
        for _ in range(512):
            f.write(json.dumps({"prompt": "".join(rng.choice("0123456789") for _ in range(w["prompt_len"] - 1)),
                                "response": "x"}) + "\n")
    return data


def run_stage(run_dir: Path, data: Path, w: dict, nproc: int, hybrid: bool, steps: int) -> list:
    threads = max(1, (os.cpu_count() or 1) // nproc)
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "rlhf"]
              if nproc > 1 else [sys.executable, "-m", "rlhf"])
    out = run_dir / f"ppo_{nproc}_{hybrid}"
    cmd = launch + ["stage=ppo", f"run.dir={run_dir}", f"data.path={data}", "data.format=prompt_response",
                    f"train.max_steps={steps}", f"ppo.prompts_per_step={w['prompts'] * nproc}",
                    "ppo.samples_per_prompt=1", "ppo.ppo_epochs=1", "ppo.minibatches_per_epoch=1",
                    f"ppo.max_new_tokens={w['new']}", f"ppo.min_new_tokens={w['new']}", f"engine.hybrid={hybrid}",
                    "train.save_every=0", "train.eval_every=0", "logger.progress=false", "run.resume=false",
                    f"data.max_prompt_len={w['prompt_len']}", "algorithm.no_eos_penalty=0"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=sys.stderr)
    rows = [json.loads(x) for x in (run_dir / "ppo" / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "ppo" / "metrics.jsonl").rename(out.with_suffix(".jsonl"))
    return [r for r in rows if "time/train_s" in r]


def main() -> None:
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", nargs="+", default=["tiny", "small"], choices=sorted(WORKLOADS))
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    for workload in args.workload:
        w = WORKLOADS[workload]
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp)
            data = prepare(run_dir, w)
            for ws in args.world_sizes:
                for hybrid in (True, False):
                    rows = run_stage(run_dir, data, w, ws, hybrid, args.steps)[1:] or []
                    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
                    gen, score, train, switch = (med("time/generate_s"), med("time/score_s"), med("time/train_s"),
                                                 med("time/switch_s"))
                    step = gen + score + train + switch
                    samples = w["prompts"] * ws
                    base = {"bench": "ppo", "workload": workload, "variant": "hybrid" if hybrid else "hf",
                            "world_size": ws, "threads_per_rank": max(1, (os.cpu_count() or 1) // ws),
                            "torch": torch.__version__}
                    for metric, value, unit in (("s_per_step", step, "s"), ("generate_s", gen, "s"),
                                                ("score_s", score, "s"), ("train_s", train, "s"),
                                                ("switch_s", switch, "s"), ("samples_per_s", samples / step, "samples/s"),
                                                ("tokens_per_s", samples * w["new"] / step, "tokens/s")):
                        print(json.dumps({**base, "metric": metric, "value": round(value, 4), "unit": unit}), flush=True)


if __name__ == "__main__":
    main()
