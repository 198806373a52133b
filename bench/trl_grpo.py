"""TRL's GRPOTrainer on the workload of ``bench/ppo.py --estimator grpo``, for a side-by-side step
time (JSON lines, docs/benchmarks.md; variant ``trl_grpo``).

    pip install trl          # not a dependency of rlhf: only this bench imports it
    python bench/trl_grpo.py [--workload tiny] [--steps 4] [--threads N] [--beta B]

Same models, tokenizer and prompts as bench/ppo.py (``prepare``: a random-init Llama of the
workload, prompts of exactly the workload's length), prompts per step × 4 samples, the same rule
reward (``bench.common.digit_share``), fixed response length (``min_new_tokens`` =
``max_completion_length`` = the workload's new tokens), KL β = rlhf's default ``algorithm.kl_coef``
(a reference model, as in rlhf's GRPO; ``--beta 0``: none, as ``algorithm.kl_coef=0``), 1 generation
per optimizer step, 1 iteration, fp32, no activation checkpointing (TRL's GRPO default has it on),
one process. The step time is the wall time of ``Trainer.training_step`` (generation, reference and
policy forwards, backward) plus the optimizer step, from ``on_step_begin`` to ``on_step_end``; the
figure is the median of the steps after the first (warm-up) one, like bench/ppo.py's.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import (  # noqa: E402
    TRL_CPU,
    WORKLOADS,
    digit_share,
    print_step_lines,
    step_timer,
    train_timed,
    trl_line_base,
    trl_ppo_args,
    trl_prompts,
)
from ppo import GRPO_SAMPLES, prepare  # noqa: E402

from rlhf.config import AlgorithmConfig  # noqa: E402


def main() -> None:
    ap = trl_ppo_args("TRL's GRPOTrainer on bench/ppo.py --estimator grpo's workload", steps=4)
    ap.add_argument(
        "--beta",
        type=float,
        default=AlgorithmConfig().kl_coef,
        help="KL coefficient (0: no reference)",
    )
    args = ap.parse_args()
    try:
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        sys.exit(
            "bench/trl_grpo.py: needs TRL (pip install trl); rlhf itself does not depend on it"
        )
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)

    for workload in args.workload:
        w = WORKLOADS[workload]
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp)
            data, _, _ = prepare(run_dir, w)
            tok, prompts, _ = trl_prompts(data, run_dir / "sft" / "model", w)
            model = AutoModelForCausalLM.from_pretrained(
                run_dir / "sft" / "model", dtype=torch.float32, trust_remote_code=False
            )

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
                bf16=False,
                # TRL's GRPO default is on: an extra forward rlhf does not run
                gradient_checkpointing=False,
                **TRL_CPU,
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
            step = train_timed(trainer, timer)
            base = trl_line_base(
                workload, "trl_grpo", args.threads, trl.__version__, len(timer.times)
            )
            base["beta"] = args.beta
            print_step_lines(base, step, w["prompts"] * GRPO_SAMPLES, w["new"])


if __name__ == "__main__":
    main()
