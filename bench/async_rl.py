"""Asynchronous rollouts against the colocated synchronous run, side by side (docs/benchmarks.md,
`bench: "async_rl"`): the embedded agentic task (recipe=agentic: SFT, then GRPO with the calculator)
with a calculator that answers after 50–300 ms (bench/slow_tools.py).

    python bench/async_rl.py [--seeds 0 1 2] [--steps 60] [--eval-every 0] [--target 0.85] [--window
    5]
                             [--staleness 2] [--correction tis] [--worker-threads 1] [--policy
                             newest|fixed] [--placement beside|ranks] [--worker-name NAME]
                             [--fast-tools] [--out DIR]

Per seed: one SFT run, then from it (each arm its own run directory, one after the other)
  sync2    2 colocated ranks (torchrun), 1 thread each, generation between updates;
  worker   1 trainer rank + its rollout worker, 1 thread each, ppo.max_staleness=k: with
           --placement beside a worker process beside the rank (ppo.rollout_workers=1), with ranks
           a rollout rank of its own (torchrun, 2 ranks: ppo.rollout_ranks=1).
Training time is the sum of ``time/step_s`` (a step's wall time, evaluations and checkpoints aside).
The learning curve is the rollouts' own gold (``reward/gold``, every step, the mean of the last
--window steps): held-out evaluations only at the start and the end by default, since a worker keeps
generating while its trainer evaluates (work the step times would not show) and 2 colocated ranks
evaluate twice as fast as 1 trainer. ``seconds_to_target``: training seconds to the first step whose
windowed rollout gold reaches --target (the async run's rollouts lag its policy by up to k updates:
counted against it). Lines ``{"bench": "async_rl", "workload": "agentic_slow_tools"|"agentic",
"variant": arm, "seed": N, "metric": m, "value": v}`` with m in gold, gold_greedy (held-out, at the
end), step_s_median, train_s, seconds_to_target, curve; then ``variant: "worker/sync2"`` with the
ratios (speedup_to_target, step_speedup) and min / median over the seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import device_label  # noqa: E402

ENV = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled")


def run(cmd: list, log: Path) -> None:
    print(f"[bench] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"the run failed (exit {rc}); its log: {log}")


def sft(seed: int, out: Path) -> Path:
    run_dir = out / f"seed{seed}" / "sft_run"
    if not (run_dir / "sft" / "done.json").is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "rlhf",
            "stage=sft",
            "recipe=agentic",
            f"run.seed={seed}",
            f"run.dir={run_dir}",
        ]
        run(cmd + ["logger.progress=false", "engine.threads_per_rank=2"], run_dir / "sft.log")
    return run_dir / "sft"


def arm(args, seed: int, out: Path, name: str, sft_dir: Path) -> dict:
    run_dir = out / f"seed{seed}" / name
    name = "sync2" if name == "sync2" else "worker"
    if not (run_dir / "ppo" / "done.json").is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / "sft").exists():
            (run_dir / "sft").symlink_to(sft_dir)
        if not (run_dir / "cache").exists() and (sft_dir.parent / "cache").exists():
            (run_dir / "cache").symlink_to(sft_dir.parent / "cache")
        over = [
            "stage=ppo",
            "recipe=agentic",
            f"run.seed={seed}",
            f"run.dir={run_dir}",
            "logger.progress=false",
        ]
        over += [
            f"train.max_steps={args.steps}",
            f"train.eval_every={args.eval_every}",
            "train.save_every=0",
        ]
        over += ["engine.threads_per_rank=1"]
        if not args.fast_tools:
            over.append("env.tools=[bench.slow_tools.calculator]")
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "rlhf",
        ]
        if name == "sync2":
            # (the run directory's name says the arm)
            cmd = torchrun
        else:
            if args.placement == "ranks":
                cmd, placed = torchrun, "ppo.rollout_ranks=1"
            else:
                cmd, placed = [sys.executable, "-m", "rlhf"], "ppo.rollout_workers=1"
            over += [placed, f"ppo.max_staleness={args.staleness}"]
            over += [
                f"algorithm.mismatch_correction={args.correction}",
                f"ppo.staleness_policy={args.policy}",
                f"ppo.rollout_worker_threads={args.worker_threads}",
            ]
        run(cmd + over, run_dir / "ppo.log")
    rows = [json.loads(x) for x in (run_dir / "ppo" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "time/step_s" in r}
    evals = [
        (r["step"], r["gold/score"], r.get("gold/score_greedy")) for r in rows if "gold/score" in r
    ]
    order = sorted(steps)
    train_s, curve, reached = 0.0, [], None
    for i, s in enumerate(order):
        train_s += steps[s]["time/step_s"]
        window = [steps[t]["reward/gold"] for t in order[max(0, i + 1 - args.window) : i + 1]]
        gold = sum(window) / len(window)
        curve.append((s, round(gold, 3), round(train_s, 1)))
        if reached is None and len(window) == args.window and gold >= args.target:
            reached = train_s
    return {
        "gold": evals[-1][1],
        "gold_greedy": evals[-1][2],
        "gold_start": evals[0][1],
        "step_s_median": statistics.median(steps[s]["time/step_s"] for s in order),
        "train_s": train_s,
        "seconds_to_target": reached,
        "curve": curve[:: max(len(curve) // 12, 1)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument(
        "--eval-every", type=int, default=0, help="held-out evaluations between start and end"
    )
    ap.add_argument(
        "--target",
        type=float,
        default=0.85,
        help="the rollouts' windowed gold the time is measured to",
    )
    ap.add_argument(
        "--window", type=int, default=5, help="steps the rollouts' gold is averaged over"
    )
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument(
        "--correction", default="tis", help="the worker arm's algorithm.mismatch_correction"
    )
    ap.add_argument("--worker-threads", type=int, default=1, help="ppo.rollout_worker_threads")
    ap.add_argument(
        "--policy", default="newest", choices=["newest", "fixed"], help="ppo.staleness_policy"
    )
    ap.add_argument(
        "--placement",
        default="beside",
        choices=["beside", "ranks"],
        help="the worker arm's rollout worker: a process beside its trainer, or a rank of its own",
    )
    ap.add_argument(
        "--worker-name",
        default="worker",
        help="the worker arm's run directory (variants side by side)",
    )
    ap.add_argument("--fast-tools", action="store_true", help="the built-in calculator (instant)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="async_rl-"))
    workload = "agentic" if args.fast_tools else "agentic_slow_tools"
    base = {
        "bench": "async_rl",
        "workload": workload,
        "device": device_label("cpu"),
        "staleness": args.staleness,
        "placement": args.placement,
    }
    ratios = {"speedup_to_target": [], "step_speedup": []}
    for seed in args.seeds:
        sft_dir = sft(seed, out)
        res = {
            name: arm(args, seed, out, run, sft_dir)
            for name, run in (("sync2", "sync2"), ("worker", args.worker_name))
        }
        for name, figs in res.items():
            for metric, value in figs.items():
                print(
                    json.dumps(
                        {**base, "variant": name, "seed": seed, "metric": metric, "value": value}
                    ),
                    flush=True,
                )
        s, w = res["sync2"], res["worker"]
        if s["seconds_to_target"] and w["seconds_to_target"]:
            ratios["speedup_to_target"].append(s["seconds_to_target"] / w["seconds_to_target"])
        ratios["step_speedup"].append(s["step_s_median"] / w["step_s_median"])
        for metric in ratios:
            if ratios[metric] and len(ratios[metric]) == args.seeds.index(seed) + 1:
                line = {
                    **base,
                    "variant": "worker/sync2",
                    "seed": seed,
                    "metric": metric,
                    "value": ratios[metric][-1],
                }
                print(json.dumps(line), flush=True)
    for metric, values in ratios.items():
        for name, fn in (("min", min), ("median", statistics.median)):
            if values:
                line = {
                    **base,
                    "variant": f"worker/sync2 {name}",
                    "metric": metric,
                    "value": fn(values),
                }
                print(json.dumps({**line, "seeds": args.seeds}), flush=True)


if __name__ == "__main__":
    main()
