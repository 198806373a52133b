"""Learning over seeds: the embedded pipeline per seed, JSON lines per seed and figure, then min /
median / max (docs/benchmarks.md, `bench: "seeds"`).

    python bench/seeds.py [--seeds 0 1 2 3 4] [--unseen N [--unseen-key KEY]] [--parallel K]
    [--threads T]
                          [--stages sft,reward,ppo,grpo] [--out DIR] [--set KEY=VAL ...]
                          [--stage-set STAGE:KEY=VAL ...] [--grpo-set KEY=VAL ...] [--label NAME]

Per seed (run.seed=N, run.dir=<out>/seed<N>): SFT → reward → PPO (GAE with the reward model), and
GRPO with the rule reward from the same SFT model (<out>/seed<N>/grpo[_<label>]/ppo). Figures:
sft_gold, sft_gold_greedy (held-out gold of the SFT policy, sampled and greedy), rm_accuracy,
ppo_gold, ppo_gold_greedy, ppo_gain (ppo_gold − sft_gold), ppo_greedy_change, grpo_gold, grpo_gain,
seconds (wall time of the seed's stages) and the seconds of each stage; agentic runs (``--set
recipe=agentic
--stages sft,ppo``: the PPO stage is the recipe's GRPO with the calculator) add sft_tool_use and
ppo_tool_use (the held-out episodes' share that called a tool, sampled). A PPO run that refuses the
seed's reward model (ppo.min_rm_accuracy, exit 2) is reported as ``ppo_refused: 1`` and the bench
goes on with the next stage. A stage whose output already exists in --out is not run again (point
--out at an earlier run to add stages or GRPO variants to it). ``--set`` passes overrides to every
stage, ``--stage-set sft:train.max_steps=500`` to one stage, ``--grpo-set`` to the GRPO run only
(e.g. clip-higher, dynamic sampling); ``--label`` names the GRPO variant (its own run directory) and
is carried by every line.

Validation on seeds nobody tuned on: ``--unseen N`` adds N seeds the bench draws itself from
``--unseen-key`` (default: the repository's HEAD commit), outside ``TUNED`` (the seeds the embedded
recipe was tuned and studied on); every line says its ``set`` (tuned or unseen), and min / median /
max come per set. A claim about unseen seeds is judged on the commit that makes it; a new commit
draws new ones. (``--seeds`` alone keeps its default only when ``--unseen`` is not given.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import device_label  # noqa: E402

# the seeds the embedded recipe was tuned and studied on (docs/history.md; issue 32's table: 5–10;
# the ten unseen seeds of 73afa42, studied since: docs/stages.md "Seeds nobody tuned on")
STUDIED_73AFA42 = {60713, 641233, 801015, 669279, 660094, 872239, 866424, 789828, 854154, 534250}
# the ten drawn from a25d5bd, on which the 4-layer SFT shape was judged (docs/history.md)
STUDIED_A25D5BD = {437728, 815532, 439844, 700747, 362623, 408167, 727957, 172411, 979146, 90805}
# the ten drawn from e00fb5b, on which 4 layers with a 2400-step SFT were judged over the pipeline
STUDIED_E00FB5B = {596778, 209180, 9496, 635140, 93268, 776926, 762847, 493268, 542853, 821718}
# the ten drawn from 2d96d49, on which the 3000-step SFT of that shape was judged (SFT only)
STUDIED_2D96D49 = {427282, 564482, 951513, 224930, 775791, 465502, 896189, 283354, 425434, 850378}
# the first six drawn from 1f27f60, on which that SFT was judged over the pipeline
STUDIED_1F27F60 = {194067, 187605, 876470, 784372, 804550, 662352}
# the first two drawn from f95d7b3 (4 layers, 3000 SFT steps, 1500 reward steps, 60 PPO iterations),
# on which PPO found the doubled last digit (74 → 744) its reward model scored above the right
# answer
STUDIED_F95D7B3 = {993765, 410071}
# the ten drawn from c7bcf50, on which the adopted recipe was judged (docs/stages.md)
STUDIED_C7BCF50 = {907370, 742418, 955088, 799945, 894733, 940949, 883706, 944950, 450094, 2948}
# the ten drawn from 1cb9dcc, on which the recipe was judged after shared prefixes (docs/stages.md)
STUDIED_1CB9DCC = {448121, 4549, 15388, 286741, 85400, 175861, 756882, 297839, 923001, 910926}
# the ten drawn from 35e0dc6, on which the recipe was judged after the packing's host work was
# halved
STUDIED_35E0DC6 = {593199, 592615, 786656, 24802, 14022, 471338, 708396, 283375, 559476, 341871}
# the ten drawn from 2af5602, on which the recipe was judged once more (docs/stages.md)
STUDIED_2AF5602 = {914325, 568926, 653900, 173582, 753218, 14698, 78114, 243609, 710901, 790300}
TUNED = (
    frozenset(range(11))
    | {1234}
    | STUDIED_73AFA42
    | STUDIED_A25D5BD
    | STUDIED_E00FB5B
    | STUDIED_2D96D49
    | STUDIED_1F27F60
    | STUDIED_F95D7B3
    | STUDIED_C7BCF50
    | STUDIED_1CB9DCC
    | STUDIED_35E0DC6
    | STUDIED_2AF5602
)
GRPO = ["algorithm.estimator=grpo", "ppo.use_reward_model=false", "ppo.reward_fn=rlhf.rewards.gold"]
OUTPUT = {
    "sft": "sft/model",
    "reward": "reward/model",
    "ppo": "ppo/actor",
    "grpo": "grpo/ppo/actor",
}


def unseen_seeds(n: int, key: str) -> list:
    """``n`` distinct seeds in [100, 10**6) drawn from ``key`` (sha256), none of them in
    ``TUNED``."""
    out, i = [], 0
    while len(out) < n:
        h = int.from_bytes(hashlib.sha256(f"{key}:{i}".encode()).digest()[:8], "big")
        seed = 100 + h % (10**6 - 100)
        if seed not in TUNED and seed not in out:
            out.append(seed)
        i += 1
    return out


def head_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        raise SystemExit(
            "seeds: --unseen needs --unseen-key (no git commit to draw seeds from)"
        ) from None


def last(metrics: Path, key: str):
    vals = [json.loads(x)[key] for x in metrics.read_text().splitlines() if key in json.loads(x)]
    return vals[-1] if vals else None


def gain(after, before):
    """after − before, or None when either was not measured (eval.gold_prompts=0, or a stage not
    run)."""
    return None if after is None or before is None else after - before


def grpo_dir(label) -> str:
    return f"grpo_{label}" if label else "grpo"


def run_stage(
    stage: str,
    seed_dir: Path,
    seed: int,
    threads: int,
    overrides: list,
    grpo_overrides: list,
    label,
    log,
) -> float:
    """Runs one stage of one seed (unless its output exists); returns its seconds (0 when skipped,
    None when PPO refused the reward model)."""
    output = f"{grpo_dir(label)}/ppo/actor" if stage == "grpo" else OUTPUT[stage]
    if (seed_dir / output / "config.json").is_file():
        return 0.0
    run_dir = seed_dir
    extra = list(overrides.get("*", [])) + list(overrides.get(stage, []))
    if stage == "grpo":
        # its own run dir (one per --label) holding a copy of the SFT output
        run_dir = seed_dir / grpo_dir(label)
        if not (run_dir / "sft").exists():
            shutil.copytree(
                seed_dir / "sft", run_dir / "sft", ignore=shutil.ignore_patterns("checkpoints")
            )
        extra += GRPO + list(grpo_overrides)
    cmd = [
        sys.executable,
        "-m",
        "rlhf",
        f"stage={'ppo' if stage == 'grpo' else stage}",
        f"run.dir={run_dir}",
        f"run.seed={seed}",
        "logger.progress=false",
        f"engine.threads_per_rank={threads}",
        *extra,
    ]
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS=str(threads),
    )
    t0 = time.perf_counter()
    # GRPO variants side by side
    log_file = seed_dir / f"{grpo_dir(label) if stage == 'grpo' else stage}.log"
    with open(log_file, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode == 2 and "ppo.min_rm_accuracy" in log_file.read_text():
        log(f"seed {seed}: {stage} refused the reward model (ppo.min_rm_accuracy); see {log_file}")
        return None
    if proc.returncode != 0:
        raise SystemExit(
            f"seeds: seed {seed} stage {stage} failed (exit {proc.returncode}); see {log_file}"
        )
    seconds = time.perf_counter() - t0
    log(f"seed {seed}: {stage} {seconds:.0f} s")
    return seconds


def figures(seed_dir: Path, stages: list, seconds: dict, label=None) -> dict:
    out = {}
    if (seed_dir / "sft/metrics.jsonl").is_file():
        out["sft_gold"] = last(seed_dir / "sft/metrics.jsonl", "gold/score")
        out["sft_gold_greedy"] = last(seed_dir / "sft/metrics.jsonl", "gold/score_greedy")
        # agentic runs only
        out["sft_tool_use"] = last(seed_dir / "sft/metrics.jsonl", "gold/tool_use")
    if (seed_dir / "reward/metrics.jsonl").is_file():
        out["rm_accuracy"] = last(seed_dir / "reward/metrics.jsonl", "eval/accuracy")
    if (seed_dir / "ppo/metrics.jsonl").is_file():
        out["ppo_gold"] = last(seed_dir / "ppo/metrics.jsonl", "gold/score")
        out["ppo_gold_greedy"] = last(seed_dir / "ppo/metrics.jsonl", "gold/score_greedy")
        out["ppo_gain"] = gain(out["ppo_gold"], out.get("sft_gold"))
        out["ppo_greedy_change"] = gain(out["ppo_gold_greedy"], out.get("sft_gold_greedy"))
        out["ppo_tool_use"] = last(seed_dir / "ppo/metrics.jsonl", "gold/tool_use")
    grpo_metrics = seed_dir / grpo_dir(label) / "ppo/metrics.jsonl"
    if grpo_metrics.is_file():
        out["grpo_gold"] = last(grpo_metrics, "gold/score")
        out["grpo_gold_greedy"] = last(grpo_metrics, "gold/score_greedy")
        out["grpo_gain"] = gain(out["grpo_gold"], out.get("sft_gold"))
    if seconds.get("ppo", 0) is None:
        out["ppo_refused"] = 1
    for s in stages:
        if seconds.get(s):
            out[f"{s}_seconds"] = seconds[s]
    out["seconds"] = sum(v for v in seconds.values() if v)
    return {k: v for k, v in out.items() if v is not None}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--seeds", type=int, nargs="*", default=None, help="default 0 1 2 3 4 (none with --unseen)"
    )
    ap.add_argument(
        "--unseen", type=int, default=0, help="also N seeds drawn outside the tuned ones"
    )
    ap.add_argument(
        "--unseen-key", default=None, help="what the unseen seeds are drawn from (default: HEAD)"
    )
    ap.add_argument(
        "--parallel", type=int, default=1, help="seeds run at once (threads split between them)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads per run (default: the cores ÷ --parallel)",
    )
    ap.add_argument("--stages", default="sft,reward,ppo,grpo")
    ap.add_argument(
        "--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)"
    )
    ap.add_argument("--set", nargs="*", default=[], help="overrides for every stage")
    ap.add_argument(
        "--stage-set", nargs="*", default=[], help="STAGE:KEY=VAL overrides for one stage"
    )
    ap.add_argument("--grpo-set", nargs="*", default=[], help="overrides for the GRPO run only")
    ap.add_argument("--label", default=None)
    args = ap.parse_args()
    if args.seeds is None:
        args.seeds = [] if args.unseen else [0, 1, 2, 3, 4]
    unseen = []
    if args.unseen:
        key = args.unseen_key or head_commit()
        unseen = unseen_seeds(args.unseen, key)
        print(f"[seeds] unseen seeds drawn from {key!r}: {unseen}", file=sys.stderr, flush=True)
    sets = {s: "tuned" if s in TUNED else "unseen" for s in args.seeds}
    sets.update({s: "unseen" for s in unseen})
    all_seeds = list(dict.fromkeys(list(args.seeds) + unseen))
    if not all_seeds:
        ap.error("no seeds: give --seeds or --unseen N")
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - set(OUTPUT)
    if unknown:
        ap.error(f"unknown stages {sorted(unknown)}: choose from {', '.join(OUTPUT)}")
    overrides = {"*": list(args.set)}
    for item in args.stage_set:
        stage, sep, kv = item.partition(":")
        if not sep or stage not in OUTPUT:
            ap.error(
                f"--stage-set {item!r}: expected STAGE:KEY=VAL with STAGE one of "
                f"{', '.join(OUTPUT)}"
            )
        overrides.setdefault(stage, []).append(kv)
    out = args.out or Path(tempfile.mkdtemp(prefix="rlhf-seeds-"))
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.parallel)

    def log(msg):
        print(f"[seeds] {msg}", file=sys.stderr, flush=True)

    def one(seed: int) -> dict:
        seed_dir = out / f"seed{seed}"
        seed_dir.mkdir(parents=True, exist_ok=True)
        seconds = {
            s: run_stage(s, seed_dir, seed, threads, overrides, args.grpo_set, args.label, log)
            for s in stages
        }
        return figures(seed_dir, stages, seconds, args.label)

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        results = dict(zip(all_seeds, pool.map(one, all_seeds)))
    base = {
        "bench": "seeds",
        "workload": "agentic" if "recipe=agentic" in args.set else "embedded",
        "world_size": 1,
        "threads_per_rank": threads,
        "torch": torch.__version__,
        "device": device_label(torch.device("cpu")),
        "out": str(out),
    }
    if args.label:
        base["label"] = args.label
    for seed, figs in results.items():
        for metric, value in figs.items():
            line = {
                **base,
                "set": sets[seed],
                "variant": f"seed{seed}",
                "metric": metric,
                "value": round(value, 4),
            }
            print(json.dumps(line))
    for which in ("tuned", "unseen"):
        # min / median / max per set: tuned and unseen seeds are apart
        group = {seed: figs for seed, figs in results.items() if sets[seed] == which}
        for metric in sorted({m for figs in group.values() for m in figs}):
            vals = [figs[metric] for figs in group.values() if metric in figs]
            for name, fn in (("min", min), ("median", statistics.median), ("max", max)):
                line = {
                    **base,
                    "set": which,
                    "variant": name,
                    "metric": metric,
                    "value": round(fn(vals), 4),
                }
                print(json.dumps({**line, "seeds": len(vals)}))


if __name__ == "__main__":
    main()
