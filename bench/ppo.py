"""Seconds per PPO step, split into generate / score / train / switch (JSON lines,
    docs/benchmarks.md).

    python bench/ppo.py [--workload tiny small] [--world-sizes 1 2] [--steps 3] [--variants hybrid
    hf]
                        [--micro-batch N] [--device auto|cpu|cuda] [--estimator gae|grpo] [--set
                        KEY=VAL ...]

Runs the real stage (`python -m rlhf stage=ppo`) on a run directory it prepares: a random-init
Llama of the workload as the SFT model, a random-init scalar-head model as the reward model, and
prompts of exactly the workload's length (digits, one token each). One step = prompts per rank ×
1 sample (GAE) → score → 1 PPO epoch of 1 minibatch, at fixed response lengths. The figures are
the medians of the steps after the first (warm-up) one.

``--estimator grpo``: prompts per rank × 4 samples, a rule reward (``bench.common.digit_share``, no
reward model, no critic), 1 epoch of 1 minibatch; variants reported as ``grpo_hybrid`` / ``grpo_hf``
(the workload of TRL's GRPOTrainer, so the two compare step for step).

Memory, per variant and world size: ``peak_rss_gb`` (the peak resident set of the stage process,
summed over its ranks; each rank runs under bench/stage_peak.py, which records its own
ru_maxrss at exit) and, on CUDA, ``peak_gpu_gb`` (torch.cuda.max_memory_allocated, summed over
ranks; ``per_rank`` lists them). ``static_gb``: parameters + gradients + optimizer state of the
four models, from the parameter counts of the models prepared here: actor and critic (the critic
is the reward model's architecture) 16 bytes/param (fp32 params, grads, AdamW m and v), reference
(= actor) and reward model 4 bytes/param; in total, not per rank (ZeRO-3 divides it by N).

``--device`` (engine.device, passed explicitly): auto = CUDA when the node has a GPU for each rank
of the world size, else the CPU. ``--micro-batch N``: ppo.micro_batch_per_rank=N (default: not
passed, i.e. auto). ``--set``: further stage overrides (e.g. ``algorithm.kl_coef=0``), carried by
every line as ``overrides``. Every line carries ``device``.
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

from common import WORKLOADS, device_label, llama_config, resolve_device  # noqa: E402

GiB = 2**30


def prepare(run_dir: Path, w: dict) -> tuple:
    """The SFT and reward models and the prompts; returns (prompts file, actor params, reward-model
    params)."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from rlhf.data.tokenizer import train_tokenizer

    digits = ["".join(random.Random(i).choice("0123456789") for _ in range(40)) for i in range(200)]
    tok = train_tokenizer(digits + ["Q: A: ok"], 300, 1024)
    cfg = llama_config(
        w,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    actor = LlamaForCausalLM(cfg)
    actor_params = sum(p.numel() for p in actor.parameters())
    actor.save_pretrained(run_dir / "sft" / "model")
    del actor
    tok.save_pretrained(run_dir / "sft" / "model")
    cfg.num_labels = 1
    rm = LlamaForSequenceClassification(cfg)
    rm_params = sum(p.numel() for p in rm.parameters())
    rm.save_pretrained(run_dir / "reward" / "model")
    del rm
    tok.save_pretrained(run_dir / "reward" / "model")
    data = run_dir / "prompts.jsonl"
    rng = random.Random(1)
    with open(data, "w") as f:
        # BOS + (len - 1) digits = exactly the workload's prompt length
        for _ in range(512):
            f.write(
                json.dumps(
                    {
                        "prompt": "".join(
                            rng.choice("0123456789") for _ in range(w["prompt_len"] - 1)
                        ),
                        "response": "x",
                    }
                )
                + "\n"
            )
    return data, actor_params, rm_params


def static_bytes(actor_params: int, rm_params: int, estimator: str = "gae") -> int:
    """Parameters + gradients + AdamW state of actor and critic (fp32: 4 + 4 + 8 bytes/param),
    parameters of the reference (the actor's architecture) and the reward model (the critic's) (4
    bytes/param); GRPO with a rule reward: actor and reference only."""
    if estimator == "grpo":
        return 16 * actor_params + 4 * actor_params
    return 16 * actor_params + 16 * rm_params + 4 * actor_params + 4 * rm_params


GRPO_SAMPLES = 4
GRPO = [
    "algorithm.estimator=grpo",
    "ppo.use_reward_model=false",
    "ppo.reward_fn=bench.common.digit_share",
    f"ppo.samples_per_prompt={GRPO_SAMPLES}",
]


def run_stage(
    run_dir: Path,
    data: Path,
    w: dict,
    nproc: int,
    hybrid: bool,
    steps: int,
    device: str = "auto",
    micro_batch: int | None = None,
    estimator: str = "gae",
    overrides: tuple = (),
) -> tuple:
    """The stage's per-step metrics rows and the per-rank peak memory records
    (bench/stage_peak.py)."""
    threads = max(1, (os.cpu_count() or 1) // nproc)
    wrapper = str(ROOT / "bench" / "stage_peak.py")
    peak_dir = run_dir / f"peak_{nproc}_{hybrid}"
    launch = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            wrapper,
        ]
        if nproc > 1
        else [sys.executable, wrapper]
    )
    out = run_dir / f"ppo_{nproc}_{hybrid}"
    extra = [f"engine.device={device}"] + (
        [f"ppo.micro_batch_per_rank={micro_batch}"] if micro_batch else []
    )
    extra += GRPO if estimator == "grpo" else ["ppo.samples_per_prompt=1"]
    extra += list(overrides)
    cmd = (
        launch
        + [
            str(peak_dir),
            "stage=ppo",
            f"run.dir={run_dir}",
            f"data.path={data}",
            "data.format=prompt_response",
            f"train.max_steps={steps}",
            f"ppo.prompts_per_step={w['prompts'] * nproc}",
            "ppo.ppo_epochs=1",
            "ppo.minibatches_per_epoch=1",
            f"ppo.max_new_tokens={w['new']}",
            f"ppo.min_new_tokens={w['new']}",
            f"engine.hybrid={hybrid}",
            "train.save_every=0",
            "train.eval_every=0",
            "logger.progress=false",
            "run.resume=false",
            f"data.max_prompt_len={w['prompt_len']}",
            "algorithm.no_eos_penalty=0",
        ]
        + extra
    )
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        WANDB_MODE="disabled",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(ROOT),
    )
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=sys.stderr)
    rows = [json.loads(x) for x in (run_dir / "ppo" / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "ppo" / "metrics.jsonl").rename(out.with_suffix(".jsonl"))
    peaks = sorted(
        (json.loads(f.read_text()) for f in peak_dir.glob("peak_*.json")), key=lambda r: r["rank"]
    )
    if len(peaks) != nproc:
        raise RuntimeError(
            f"bench/ppo.py: {len(peaks)} peak-memory records from {nproc} ranks in {peak_dir}"
        )
    return [r for r in rows if "time/train_s" in r], peaks


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", nargs="+", default=["tiny", "small"], choices=sorted(WORKLOADS))
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["hybrid", "hf"], choices=("hybrid", "hf"))
    ap.add_argument(
        "--micro-batch", type=int, default=None, help="ppo.micro_batch_per_rank (default: auto)"
    )
    ap.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="as engine.device"
    )
    ap.add_argument("--estimator", default="gae", choices=("gae", "grpo"))
    ap.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VAL", help="further stage overrides"
    )
    args = ap.parse_args()
    for workload in args.workload:
        w = WORKLOADS[workload]
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp)
            data, actor_params, rm_params = prepare(run_dir, w)
            static = static_bytes(actor_params, rm_params, args.estimator)
            for ws in args.world_sizes:
                dev = resolve_device(args.device, ws)
                for hybrid in (v == "hybrid" for v in args.variants):
                    rows, peaks = run_stage(
                        run_dir,
                        data,
                        w,
                        ws,
                        hybrid,
                        args.steps,
                        dev.type,
                        args.micro_batch,
                        args.estimator,
                        args.set,
                    )
                    rows = rows[1:]
                    gen, score, train, switch = [
                        statistics.median(r[k] for r in rows)
                        for k in (
                            "time/generate_s",
                            "time/score_s",
                            "time/train_s",
                            "time/switch_s",
                        )
                    ]
                    step = gen + score + train + switch
                    samples = w["prompts"] * ws * (GRPO_SAMPLES if args.estimator == "grpo" else 1)
                    variant = ("grpo_" if args.estimator == "grpo" else "") + (
                        "hybrid" if hybrid else "hf"
                    )
                    base = {
                        "bench": "ppo",
                        "workload": workload,
                        "variant": variant,
                        "world_size": ws,
                        "threads_per_rank": max(1, (os.cpu_count() or 1) // ws),
                        "torch": torch.__version__,
                        "device": device_label(dev),
                    }
                    if args.micro_batch:
                        base["micro_batch_per_rank"] = args.micro_batch
                    if args.set:
                        base["overrides"] = args.set
                    for metric, value, unit in (
                        ("s_per_step", step, "s"),
                        ("generate_s", gen, "s"),
                        ("score_s", score, "s"),
                        ("train_s", train, "s"),
                        ("switch_s", switch, "s"),
                        ("samples_per_s", samples / step, "samples/s"),
                        ("tokens_per_s", samples * w["new"] / step, "tokens/s"),
                    ):
                        print(
                            json.dumps(
                                {**base, "metric": metric, "value": round(value, 4), "unit": unit}
                            ),
                            flush=True,
                        )
                    for metric in ["peak_rss_gb"] + (["peak_gpu_gb"] if dev.type == "cuda" else []):
                        per_rank = [round(r[metric], 4) for r in peaks]
                        print(
                            json.dumps(
                                {
                                    **base,
                                    "metric": metric,
                                    "value": round(sum(per_rank), 4),
                                    "unit": "GiB",
                                    "per_rank": per_rank,
                                }
                            ),
                            flush=True,
                        )
                    print(
                        json.dumps(
                            {
                                **base,
                                "metric": "static_gb",
                                "value": round(static / GiB, 4),
                                "unit": "GiB",
                                "bytes": static,
                                "actor_params": actor_params,
                                "reward_params": rm_params,
                                "per_rank_zero3": round(static / GiB / ws, 4),
                            }
                        ),
                        flush=True,
                    )


if __name__ == "__main__":
    main()
