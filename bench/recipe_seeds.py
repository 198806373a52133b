"""Learning over seeds for a recipe that starts from a pretrained model: one stage per seed, its
held-out gold before and after (docs/benchmarks.md, `bench: "recipe_seeds"`).

    python bench/recipe_seeds.py [--recipe smollm2_arith] [--stage ppo] [--seeds 0 1 2] [--threads
    T]
                                 [--out DIR] [--set KEY=VAL ...] [--label NAME]

Per seed: ``python -m rlhf stage=<stage> recipe=<recipe> run.seed=N run.dir=<out>/seed<N>`` (a seed
whose stage already finished in --out is read, not run again). The figures come from the stage's
metrics.jsonl: the gold of its first evaluation (step 0: the model it starts from) and of its last,
sampled and greedy, their gains, and the wall time of the run (model load and evaluations included;
``seconds_to_gain``: when the run's evaluations first showed both gains at the recipe's target,
0.30). Lines ``{"bench": "recipe_seeds", "workload": <recipe>, "variant": "seed<N>", "metric": m,
"value": v}`` with m in base_gold, base_gold_greedy, gold, gold_greedy, gain, gain_greedy, seconds,
seconds_to_gain; then variants min, median, max (with ``seeds``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import device_label  # noqa: E402

# issue 49: held-out greedy and sampled gold each at least the base model's + 0.30
TARGET_GAIN = 0.30


def gold_curve(metrics: Path) -> list:
    """[(step, gold, gold_greedy, wall seconds since the first line)] of every evaluation in
    metrics.jsonl."""
    out = []
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if "gold/score" in rec:
            out.append(
                (
                    rec["step"],
                    rec["gold/score"],
                    rec.get("gold/score_greedy"),
                    rec.get("time/wall_s"),
                )
            )
    return out


def figures(curve: list, seconds: float, eval_times: list) -> dict:
    (_, g0, gg0, _), (_, g1, gg1, _) = curve[0], curve[-1]
    out = {
        "base_gold": g0,
        "base_gold_greedy": gg0,
        "gold": g1,
        "gold_greedy": gg1,
        "gain": g1 - g0,
        "gain_greedy": gg1 - gg0,
        "seconds": seconds,
    }
    reached = [
        t
        for (_, g, gg, _), t in zip(curve, eval_times)
        if g - g0 >= TARGET_GAIN and gg - gg0 >= TARGET_GAIN
    ]
    out["seconds_to_gain"] = reached[0] if reached else None
    return out


def eval_times(log: Path, start: float) -> list:
    """Seconds from the run's start to each evaluation's result line ('step N: gold/score=...')."""
    times = []
    for line in log.read_text(errors="replace").splitlines():
        if ": gold/score=" in line and line.startswith("["):
            hms = line[1:9]
            h, m, s = (int(x) for x in hms.split(":"))
            t0 = time.localtime(start)
            day = time.mktime((t0.tm_year, t0.tm_mon, t0.tm_mday, h, m, s, 0, 0, -1))
            times.append((day - start) % 86400)
    return times


def run_seed(args, seed: int, out: Path) -> dict:
    run_dir = out / f"seed{seed}"
    stage_dir = run_dir / args.stage
    log = run_dir / "bench.log"
    timing = run_dir / "bench_time.json"
    if not (stage_dir / "done.json").is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "rlhf", f"stage={args.stage}", f"recipe={args.recipe}"]
        cmd += [f"run.seed={seed}", f"run.dir={run_dir}", "logger.progress=false"] + list(args.set)
        env = dict(
            os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled"
        )
        if args.threads:
            cmd.append(f"engine.threads_per_rank={args.threads}")
        print(f"[bench] seed {seed}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
        start = time.time()
        with open(log, "w") as f:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT
            ).returncode
        if rc != 0:
            raise SystemExit(f"seed {seed}: the run failed (exit {rc}); its log: {log}")
        timing.write_text(json.dumps({"start": start, "seconds": time.time() - start}))
    t = json.loads(timing.read_text()) if timing.is_file() else {"start": 0.0, "seconds": None}
    curve = gold_curve(stage_dir / "metrics.jsonl")
    return figures(curve, t["seconds"], eval_times(log, t["start"]) if log.is_file() else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="smollm2_arith")
    ap.add_argument("--stage", default="ppo")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument(
        "--threads", type=int, default=None, help="engine.threads_per_rank (default: the stage's)"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)"
    )
    ap.add_argument("--set", nargs="*", default=[], help="overrides for every run")
    ap.add_argument("--label", default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="recipe_seeds-"))
    base = {
        "bench": "recipe_seeds",
        "workload": args.recipe,
        "stage": args.stage,
        "device": device_label("cpu"),
    }
    if args.label:
        base["label"] = args.label
    if args.set:
        base["set"] = list(args.set)
    per_seed = {}
    for seed in args.seeds:
        per_seed[seed] = run_seed(args, seed, out)
        for metric, value in per_seed[seed].items():
            print(
                json.dumps({**base, "variant": f"seed{seed}", "metric": metric, "value": value}),
                flush=True,
            )
    for name, fn in (("min", min), ("median", statistics.median), ("max", max)):
        for metric in next(iter(per_seed.values())):
            values = [f[metric] for f in per_seed.values() if f[metric] is not None]
            if values:
                line = {
                    **base,
                    "variant": name,
                    "metric": metric,
                    "value": fn(values),
                    "seeds": list(per_seed),
                }
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
