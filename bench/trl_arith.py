"""TRL's GRPOTrainer on ``recipe=smollm2_arith``'s work, side by side with a run of the recipe: step
time and time to the held-out accuracy (JSON lines, docs/benchmarks.md; variant ``trl_grpo``).

    pip install trl          # not a dependency of rlhf: only the TRL benches import it
    python bench/trl_arith.py --run-dir RUN [--steps 10] [--eval-every 5] [--threads N] [--out DIR]
                              [--trl-from EARLIER_OUTPUT]

``RUN``: a finished ``python -m rlhf stage=ppo recipe=smollm2_arith`` run (e.g.
bench/recipe_seeds.py's ``<out>/seed0``); TRL gets what it got: the same model, the same training
prompts in the same order (its records of ``run.seed``, as conversations through the model's chat
template), 8 samples a prompt, prompts per step, at most ``ppo.max_new_tokens`` new tokens at
temperature 1, KL β = ``algorithm.kl_coef`` (a reference model), its learning rate, constant, one
update per generation, fp32, no activation checkpointing (TRL's GRPO default has it on; the recipe
does not recompute), one process; the reward is the same rule (``rlhf.rewards.gold`` on the arith
format). What differs: TRL's own GRPO loss defaults (its ``loss_type``), no penalty for an answer
cut at the length limit (the recipe's −1), and generation with HF ``generate`` on the training model
(TRL on a CPU has no vLLM). Every ``--eval-every`` steps TRL's model is saved and scored by ``python
-m rlhf.eval`` with RUN's held-out prompts and decoding (its saved config), exactly as the recipe's
evaluations. Lines: ``s_per_step`` (median after the first), ``train_seconds`` (TRL's steps summed)
and, per evaluation, ``gold`` / ``gold_greedy`` with ``step`` and ``train_seconds_at`` (TRL's step
time summed to that step); then the recipe's run read from RUN's metrics.jsonl (variant ``rlhf``:
the same lines, its train seconds = generate + score + train of each step) and ``speedup`` lines
(``s_per_step`` over the same steps; and ``time_to_gain``: train seconds until both held-out golds
first gained ≥ 0.30 over the base model, when both did). ``--trl-from``: TRL's lines of an earlier
output for the same seed stand in for running it again (its samples are fixed by the seed; the base
model's gold it recorded must equal RUN's, else the bench stops); the lines then carry ``trl_from``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import TRL_CPU, device_label, step_timer  # noqa: E402

TARGET_GAIN = 0.30


def recipe_curve(run: Path, first: int) -> tuple:
    """(median s/step of steps 2..``first``, the ones TRL runs, [(step, gold, greedy, train seconds
    to that step)]) of RUN's PPO stage (its later steps' shorter answers aside)."""
    rows = [json.loads(x) for x in (run / "ppo" / "metrics.jsonl").read_text().splitlines()]
    spent, at, steps = 0.0, {0: 0.0}, []
    for r in rows:
        if "time/train_s" in r:
            s = (
                r["time/generate_s"]
                + r["time/score_s"]
                + r["time/train_s"]
                + r.get("time/switch_s", 0.0)
            )
            spent += s
            steps.append(s)
            at[r["step"]] = spent
    evals = [
        (r["step"], r["gold/score"], r["gold/score_greedy"], at[r["step"]])
        for r in rows
        if "gold/score" in r
    ]
    return statistics.median(steps[1:first]), evals


def time_to_gain(evals: list, base: tuple):
    for _, g, gg, t in evals:
        if g - base[0] >= TARGET_GAIN and gg - base[1] >= TARGET_GAIN:
            return t
    return None


def score(model_dir: Path, run: Path) -> tuple:
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.eval", str(model_dir), "--run-dir", str(run)],
        cwd=ROOT,
        env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"rlhf.eval failed on {model_dir}: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["gold/score"], out["gold/score_greedy"]


def run_trl(args) -> tuple:
    """TRL's GRPOTrainer on RUN's work: (its version, median s/step after the first, [(step, gold,
    greedy, train seconds to that step)])."""
    try:
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        sys.exit(
            "bench/trl_arith.py: needs TRL (pip install trl); rlhf itself does not depend on it"
        )
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from rlhf.compose import compose_config
    from rlhf.data import arith
    from rlhf.data.pipeline import load_stage_data
    from rlhf.data.sampler import GlobalBatches

    torch.set_num_threads(args.threads)
    saved = run_config(args.run_dir)
    ppo, alg, model_path = saved["ppo"], saved["algorithm"], saved["model"]["path"]
    cfg, _ = compose_config(
        ["stage=ppo", "recipe=smollm2_arith", f"run.seed={saved['run']['seed']}"]
    )
    data = load_stage_data(cfg.data, "ppo", cfg.run.seed)
    # the recipe's (PromptSource)
    order = GlobalBatches(len(data.train), ppo["prompts_per_step"], cfg.run.seed)
    records = [data.train[i] for step in range(args.steps) for i in order.global_indices(step)]
    dataset = Dataset.from_dict(
        {"prompt": [e.chat.prompt for e in records], "reference": [e.reference for e in records]}
    )

    def reward(completions, reference, **_):
        return [arith.gold_score(c[-1]["content"], r) for c, r in zip(completions, reference)]

    out = args.out or Path(tempfile.mkdtemp(prefix="trl_arith-"))
    evals_at = []

    class Saver(TrainerCallback):
        def on_step_end(self, a, state, control, model=None, **k):
            if state.global_step % args.eval_every == 0:
                d = out / f"step{state.global_step}"
                model.save_pretrained(d)
                tok.save_pretrained(d)
                evals_at.append((state.global_step, d))

    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, trust_remote_code=False
    )
    base_dir = out / "step0"
    model.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    tcfg = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=ppo["prompts_per_step"] * ppo["samples_per_prompt"],
        num_generations=ppo["samples_per_prompt"],
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=ppo["max_new_tokens"],
        beta=alg["kl_coef"],
        temperature=1.0,
        learning_rate=saved["train"]["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=args.steps,
        logging_steps=1,
        bf16=False,
        # TRL's GRPO default is on: an extra forward the recipe does not run
        gradient_checkpointing=False,
        shuffle_dataset=False,
        **TRL_CPU,
    )
    timer = step_timer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=tcfg,
        processing_class=tok,
        train_dataset=dataset,
        callbacks=[timer, Saver()],
    )
    with contextlib.redirect_stdout(sys.stderr):
        trainer.train()
    trl_step = statistics.median(timer.times[1:])
    spent = [sum(timer.times[:k]) for k in range(len(timer.times) + 1)]
    trl_evals = [(0, *score(base_dir, args.run_dir), 0.0)]
    trl_evals += [(s, *score(d, args.run_dir), spent[s]) for s, d in evals_at]
    return trl.__version__, trl_step, trl_evals


# what TRL got from RUN (run_trl): a recorded curve stands in only for the same
SAME_WORK = (
    ("run", "seed"),
    ("model", "path"),
    ("ppo", "prompts_per_step"),
    ("ppo", "samples_per_prompt"),
    ("ppo", "max_new_tokens"),
    ("algorithm", "kl_coef"),
    ("train", "lr"),
)


def run_config(run: Path) -> dict:
    return yaml.safe_load((run / "ppo" / "config.yaml").read_text())


def recorded_trl(path: Path, args) -> tuple:
    """``run_trl``'s answer from an earlier output of this bench (its ``trl_grpo`` lines): one run,
    the same ``--steps`` and ``--threads``, and a run directory whose settings TRL got are RUN's."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    mine = [x for x in lines if x.get("variant") == "trl_grpo"]
    steps = [x for x in mine if x["metric"] == "s_per_step"]
    if len(steps) != 1:
        sys.exit(f"bench/trl_arith.py: {path} holds {len(steps)} TRL runs, not one")
    rec = steps[0]
    if (rec["steps"], rec["threads"]) != (args.steps, args.threads):
        sys.exit(
            f"bench/trl_arith.py: {path} ran {rec['steps']} steps on {rec['threads']} threads, "
            f"not --steps {args.steps} --threads {args.threads}"
        )
    theirs, ours = run_config(Path(rec["run_dir"])), run_config(args.run_dir)
    for part, key in SAME_WORK:
        if theirs[part][key] != ours[part][key]:
            sys.exit(
                f"bench/trl_arith.py: {path} is TRL on {rec['run_dir']}, whose {part}.{key} "
                f"{theirs[part][key]!r} is not RUN's {ours[part][key]!r}"
            )
    golds = {x["step"]: x for x in mine if x["metric"] == "gold"}
    greedy = {x["step"]: x["value"] for x in mine if x["metric"] == "gold_greedy"}
    evals = [(s, g["value"], greedy[s], g["train_seconds_at"]) for s, g in sorted(golds.items())]
    return rec["trl"], rec["value"], evals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--trl-from",
        type=Path,
        default=None,
        help="an earlier output of this bench for the same seed: TRL's curve read from it "
        "instead of run again (TRL on a fixed seed gives the same samples; its step-0 gold "
        "must equal RUN's)",
    )
    args = ap.parse_args()
    base = {
        "bench": "trl_arith",
        "workload": "smollm2_arith",
        "device": device_label("cpu"),
        "threads": args.threads,
    }
    ours_step, ours_evals = recipe_curve(args.run_dir, args.steps)
    if args.trl_from is not None:
        version, trl_step, trl_evals = recorded_trl(args.trl_from, args)
        base["trl_from"] = str(args.trl_from)
        if tuple(trl_evals[0][1:3]) != tuple(ours_evals[0][1:3]):
            sys.exit(
                f"bench/trl_arith.py: the base gold {args.trl_from} recorded, "
                f"{trl_evals[0][1:3]}, is not RUN's {ours_evals[0][1:3]}: not the same model, "
                "seed or held-out prompts"
            )
    else:
        version, trl_step, trl_evals = run_trl(args)
    base.update(trl=version, steps=args.steps, run_dir=str(args.run_dir))
    lines = []
    for variant, step, evals in (
        ("trl_grpo", trl_step, trl_evals),
        ("rlhf", ours_step, ours_evals),
    ):
        lines.append({"variant": variant, "metric": "s_per_step", "value": step})
        for s, g, gg, t in evals:
            lines.append(
                {"variant": variant, "metric": "gold", "value": g, "step": s, "train_seconds_at": t}
            )
            lines.append(
                {
                    "variant": variant,
                    "metric": "gold_greedy",
                    "value": gg,
                    "step": s,
                    "train_seconds_at": t,
                }
            )
    lines.append(
        {
            "variant": "rlhf_vs_trl",
            "metric": "speedup",
            "what": "s_per_step",
            "value": trl_step / ours_step,
        }
    )
    t_trl = time_to_gain(trl_evals, trl_evals[0][1:3])
    t_ours = time_to_gain(ours_evals, ours_evals[0][1:3])
    if t_trl and t_ours:
        lines.append(
            {
                "variant": "rlhf_vs_trl",
                "metric": "speedup",
                "what": "time_to_gain",
                "value": t_trl / t_ours,
            }
        )
    for line in lines:
        print(json.dumps({**base, **line}), flush=True)


if __name__ == "__main__":
    main()
