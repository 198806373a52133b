"""Threads on a shared machine: the embedded SFT run idle and beside busy processes, with the
default thread choice against fixed counts (docs/benchmarks.md, `bench: "threads_load"`).

    python bench/threads_load.py [--steps 400] [--busy 2] [--variants default t1 t2 spin_default]
                                 [--repeats 1] [--out DIR]

Each variant runs ``python -m rlhf stage=sft train.max_steps=<steps>`` in a fresh run directory,
first on the idle machine, then with ``--busy`` processes beside it that each spin a core (plain
Python loops, started before and killed after each run). Variants: ``default``
(engine.threads_per_rank=0: rlhf/threads.py), ``t1``/``t2`` (engine.threads_per_rank=1/2),
``spin_default`` (the default threads with GNU OpenMP's own spin at barriers, GOMP_SPINCOUNT=300000:
the behaviour before rlhf/threads.py). Each run's seconds (wall, the process's start to its end) and
its final ``eval/loss`` (the same in every variant: the thread count must not change the numbers).

Lines ``{"bench": "threads_load", "workload": "embedded_sft", "variant": "<variant>/<idle|busyN>",
"metric": "seconds", ...}``, then per load ``metric: "default_vs_best"`` (the default's seconds over
the fastest variant's: issue 50's target is at most 1.3 under load).
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

VARIANTS = {
    "default": ([], {}),
    "t1": (["engine.threads_per_rank=1"], {}),
    "t2": (["engine.threads_per_rank=2"], {}),
    "spin_default": ([], {"GOMP_SPINCOUNT": "300000"}),
}


def busy(n: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_once(out: Path, steps: int, overrides: list, env_extra: dict) -> dict:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
    }
    env.update(env_extra)
    cmd = [
        sys.executable,
        "-m",
        "rlhf",
        "stage=sft",
        f"run.dir={out}",
        f"train.max_steps={steps}",
        "logger.progress=false",
        *overrides,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"threads_load: {' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    last = [json.loads(x) for x in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    loss = [m["eval/loss"] for m in last if "eval/loss" in m][-1]
    return {"seconds": seconds, "eval_loss": loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--busy", type=int, default=2, help="busy processes beside the loaded runs")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs per variant and load (the median is reported)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="threads_load-"))
    import torch

    base = {
        "bench": "threads_load",
        "workload": "embedded_sft",
        "world_size": 1,
        "torch": torch.__version__,
        "device": device_label("cpu"),
        "steps": args.steps,
    }
    for load in ("idle", f"busy{args.busy}"):
        seconds = {}
        for name in args.variants:
            overrides, env_extra = VARIANTS[name]
            runs = []
            for r in range(args.repeats):
                spinners = busy(args.busy) if load != "idle" else []
                try:
                    time.sleep(0.5 if spinners else 0)
                    runs.append(
                        run_once(out / f"{name}-{load}-{r}", args.steps, overrides, env_extra)
                    )
                finally:
                    for p in spinners:
                        p.kill()
                        p.wait()
            seconds[name] = statistics.median(x["seconds"] for x in runs)
            threads = {"t1": 1, "t2": 2}.get(name, 0)
            for metric, value, unit in (
                ("seconds", seconds[name], "s"),
                ("eval_loss", runs[-1]["eval_loss"], "nats"),
            ):
                line = {
                    **base,
                    "variant": f"{name}/{load}",
                    "metric": metric,
                    "value": round(value, 6),
                    "unit": unit,
                    "threads_per_rank": threads,
                }
                print(json.dumps(line), flush=True)
        if "default" in seconds:
            ratio = seconds["default"] / min(seconds.values())
            print(
                json.dumps(
                    {
                        **base,
                        "variant": f"default/{load}",
                        "metric": "default_vs_best",
                        "value": round(ratio, 3),
                        "unit": "x",
                        "threads_per_rank": 0,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
