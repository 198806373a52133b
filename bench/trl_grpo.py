"""TRL's GRPOTrainer on the workload of ``bench/ppo.py --estimator grpo``, for a side-by-side step time
(JSON lines, docs/contract.md; variant ``trl_grpo``).

    pip install trl          # not a dependency of rlhf: only this bench imports it
    python bench/trl_grpo.py [--workload tiny] [--steps 4] [--threads N] [--beta B]

Same models, tokenizer and prompts as bench/ppo.py (``prepare``: a random-init Llama of the workload,
prompts of exactly the workload's length), prompts per step × 4 samples, the same rule reward
(``bench.common.digit_share``), fixed response length (``min_new_tokens`` = ``max_completion_length``
= the workload's new tokens), KL β = rlhf's default ``algorithm.kl_coef`` (a reference model, as in
rlhf's GRPO; ``--beta 0``: none, as ``algorithm.kl_coef=0``), 1 generation per optimizer step, 1 iteration,
fp32, one process. The step time is the wall time of ``Trainer.training_step`` (generation, reference and
policy forwards, backward) plus the optimizer step, from ``on_step_begin`` to ``on_step_end``; the figure
is the median of the steps after the first (warm-up) one, like bench/ppo.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import WORKLOADS, digit_share, step_timer  # noqa: E402
from ppo import GRPO_SAMPLES, prepare  # noqa: E402

from rlhf.config import AlgorithmConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", nargs="+", default=["tiny"], choices=sorted(WORKLOADS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads (bench/ppo.py gives its one process every core)",
    )
    ap.add_argument("--beta", type=float, default=AlgorithmConfig().kl_coef, help="KL coefficient (0: no reference)")
    args = ap.parse_args()
    try:
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        sys.exit("bench/trl_grpo.py: needs TRL (pip install trl); rlhf itself does not depend on it")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)

    for workload in args.workload:
        w = WORKLOADS[workload]
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp)
            data, _, _ = prepare(run_dir, w)
            tok = AutoTokenizer.from_pretrained(run_dir / "sft" / "model", trust_remote_code=False)
            model = AutoModelForCausalLM.from_pretrained(
                run_dir / "sft" / "model", dtype=torch.float32, trust_remote_code=False
            )
            prompts = [json.loads(x)["prompt"] for x in data.read_text().splitlines()]
            n_tokens = {len(tok(p)["input_ids"]) for p in prompts[:16]}
            if n_tokens != {w["prompt_len"]}:
                raise RuntimeError(f"prompts tokenize to {n_tokens} tokens, not the workload's {w['prompt_len']}")

            def reward(completions, **_):
                return digit_share(completions, None, None)

            cfg = GRPOConfig(
                output_dir=str(run_dir / "trl"),
                per_device_train_batch_size=w["prompts"] * GRPO_SAMPLES,
                num_generations=GRPO_SAMPLES,
                gradient_accumulation_steps=1,
                steps_per_generation=1,
                num_iterations=1,
                max_completion_length=w["new"],
                generation_kwargs={"min_new_tokens": w["new"]},
                beta=args.beta,
                temperature=1.0,
                learning_rate=1e-6,
                max_steps=args.steps,
                logging_steps=1,
                save_strategy="no",
                report_to="none",
                use_cpu=True,
                bf16=False,
                fp16=False,
                seed=0,
                dataloader_num_workers=0,
                disable_tqdm=True,
            )
            timer = step_timer()
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=reward,
                args=cfg,
                processing_class=tok,
                train_dataset=Dataset.from_dict({"prompt": prompts}),
                callbacks=[timer],
            )
            with contextlib.redirect_stdout(sys.stderr):  # TRL prints its log dicts: stdout is JSON lines only
                trainer.train()
            step = statistics.median(timer.times[1:])
            samples = w["prompts"] * GRPO_SAMPLES
            base = {
                "bench": "ppo",
                "workload": workload,
                "variant": "trl_grpo",
                "world_size": 1,
                "threads_per_rank": args.threads,
                "torch": torch.__version__,
                "device": "cpu",
                "trl": trl.__version__,
                "steps": len(timer.times),
                "beta": args.beta,
            }
            for metric, value, unit in (
                ("s_per_step", step, "s"),
                ("samples_per_s", samples / step, "samples/s"),
                ("tokens_per_s", samples * w["new"] / step, "tokens/s"),
            ):
                print(json.dumps({**base, "metric": metric, "value": round(value, 4), "unit": unit}), flush=True)


if __name__ == "__main__":
    main()
