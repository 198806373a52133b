"""Fixed-seed numbers as a contract: a short SFT → reward → the five PPO variants → DPO sequence on
the embedded default (fp32), a reward-model ensemble with PPO against it, and the agentic tool task
(SFT, then GRPO episodes calling the calculator), run in a tree, and the comparison of two such runs
(metrics and exported weights). A refactor that should not change results runs it before and after:

    git worktree add /tmp/base <commit> && ln -s $PWD/.venv /tmp/base/.venv
    python scripts/fixed_seed.py run /tmp/base --out /tmp/fs_base [--nproc 2]
    python scripts/fixed_seed.py run .          --out /tmp/fs_now  [--nproc 2]
    python scripts/fixed_seed.py compare /tmp/fs_base /tmp/fs_now
    python scripts/fixed_seed.py run . --out /tmp/fs_padded --set engine.packing=false   # a
    setting's effect

``compare`` prints the number of identical metric values, every differing one (with its largest
difference), and whether every exported safetensors file is byte-identical; it exits 1 on any
difference. Keys present in one run only (a new metric) are listed, not failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

COMMON = [
    "engine.precision=fp32",
    "logger.progress=false",
    "data.synthetic.num_records=2000",
    "eval.gold_prompts=16",
    "eval.gold_samples=2",
    "train.save_every=0",
    "run.seed=7",
]
PPO = [
    "train.max_steps=3",
    "ppo.prompts_per_step=8",
    "ppo.samples_per_prompt=2",
    "ppo.ppo_epochs=2",
    "ppo.minibatches_per_epoch=2",
    "ppo.min_rm_accuracy=0",
    "train.eval_every=0",
]
# (name, stage, overrides, start): each step runs in <out>/<name>, made from a copy of <out>/<start>
# without the stage it runs nor ppo/dpo (None: a fresh run dir); "base" holds SFT then the reward
# model
STEPS = [
    ("base", "sft", ["train.max_steps=40", "train.warmup_steps=5", "train.eval_every=20"], None),
    ("base", "reward", ["train.max_steps=20", "train.eval_every=10"], None),
    ("ppo_gae", "ppo", PPO + ["ppo.ema_decay=0.5", "algorithm.ptx_coef=0.1"], "base"),
    (
        "ppo_grpo",
        "ppo",
        PPO
        + [
            "algorithm.estimator=grpo",
            "ppo.use_reward_model=false",
            "ppo.reward_fn=rlhf.rewards.gold",
            "ppo.dynamic_sampling=true",
        ],
        "base",
    ),
    ("ppo_rloo", "ppo", PPO + ["algorithm.estimator=rloo"], "base"),
    ("ppo_reinforce_pp", "ppo", PPO + ["algorithm.estimator=reinforce_pp"], "base"),
    (
        "ppo_lora",
        "ppo",
        PPO + ["model.lora.r=4", "model.lora.critic=true", "algorithm.mismatch_correction=tis"],
        "base",
    ),
    ("dpo", "dpo", ["train.max_steps=10", "train.eval_every=5"], "base"),
    # a reward-model ensemble (bootstrapped heads) and PPO against it, clipped and gated by
    # disagreement
    (
        "ensemble",
        "reward",
        ["train.max_steps=20", "train.eval_every=10", "reward.ensemble=2"],
        "base",
    ),
    (
        "ensemble",
        "ppo",
        PPO + ["ppo.reward_clip_to_heldout=true", "ppo.stop_disagreement=100"],
        None,
    ),
    # the agentic path: SFT on the tool task, then GRPO episodes calling the calculator
    (
        "agentic",
        "sft",
        ["recipe=agentic", "train.max_steps=40", "train.warmup_steps=5", "train.eval_every=20"],
        None,
    ),
    ("agentic", "ppo", ["recipe=agentic", *PPO], None),
]


def run(tree: Path, out: Path, nproc: int, overrides: tuple = ()) -> None:
    import shutil

    if out.is_dir() and any(out.iterdir()):
        # its finished stages would not run again: stale numbers
        print(
            f"fixed_seed: {out} already holds a run (a finished stage is not run again); "
            "use a new --out",
            file=sys.stderr,
        )
        raise SystemExit(2)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "RLHF_DEVICE": "cpu",
    }
    py = str(tree / ".venv" / "bin" / "python") if (tree / ".venv").exists() else sys.executable
    for name, stage, extra, start in STEPS:
        run_dir = out / name
        if start is not None and not run_dir.exists():
            shutil.copytree(
                out / start, run_dir, ignore=shutil.ignore_patterns(stage, "ppo", "dpo")
            )
        launch = (
            [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
            if nproc > 1
            else [py]
        )
        cmd = launch + [
            "-m",
            "rlhf",
            f"stage={stage}",
            f"run.dir={run_dir}",
            *COMMON,
            *extra,
            *overrides,
        ]
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-3000:])
            raise SystemExit(f"{name}: exit {proc.returncode}")
        print(f"{name}: done", flush=True)


def collect(out: Path):
    metrics, files = {}, {}
    for p in sorted(out.rglob("metrics.jsonl")):
        rel = p.relative_to(out)
        for line in p.read_text().splitlines():
            row = json.loads(line)
            for k, v in row.items():
                if k != "step" and not k.startswith(
                    ("time/", "gen/tokens_per_s", "samples_per_s", "mem/")
                ):
                    metrics[(str(rel), row["step"], k)] = v
    for p in sorted(out.rglob("*.safetensors")):
        files[str(p.relative_to(out))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return metrics, files


def compare(a: Path, b: Path) -> int:
    (ma, fa), (mb, fb) = collect(a), collect(b)
    same = [k for k in ma if k in mb and ma[k] == mb[k]]
    diff = [k for k in ma if k in mb and ma[k] != mb[k]]
    only = sorted(set(ma) ^ set(mb), key=str)
    print(f"metric values: {len(same)} identical, {len(diff)} differ, {len(only)} in one run only")
    for k in diff[:40]:
        print("  differs:", k, ma[k], mb[k])
    gaps = [
        abs(ma[k] - mb[k])
        for k in diff
        if isinstance(ma[k], (int, float)) and isinstance(mb[k], (int, float))
    ]
    if gaps:
        rel = [g / max(abs(ma[k]), 1e-12) for g, k in zip(gaps, diff)]
        print(f"largest difference: {max(gaps):.3g} absolute, {max(rel):.3g} relative")
    for k in only[:10]:
        print("  one run only:", k)
    bad = [f for f in fa if fb.get(f) != fa[f]] + [f for f in fb if f not in fa]
    print(
        f"safetensors: {len(fa) - len([f for f in bad if f in fa])}/{len(fa)} byte-identical"
        + (f"; differ or missing: {bad}" if bad else "")
    )
    return 1 if diff or bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("tree", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--nproc", type=int, default=1)
    r.add_argument(
        "--set",
        nargs="*",
        default=[],
        help="extra overrides for every stage (e.g. engine.packing=false)",
    )
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.tree.resolve(), args.out.resolve(), args.nproc, tuple(args.set))
    else:
        sys.exit(compare(args.a, args.b))


if __name__ == "__main__":
    main()
