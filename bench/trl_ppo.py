"""TRL's PPOTrainer on the workload of ``bench/ppo.py`` (GAE), for a side-by-side step time (JSON
lines, docs/benchmarks.md; variant ``trl_ppo``).

    pip install trl==1.12.0   # the last TRL with a PPO trainer (trl.experimental.ppo); not an rlhf
    dependency python bench/trl_ppo.py [--workload tiny] [--steps 6] [--threads N]

Same models, tokenizer and prompts as bench/ppo.py (``prepare``: a random-init Llama of the workload
as the policy and its reference, a random-init ``LlamaForSequenceClassification`` as the reward
model and, a second copy, the value model; prompts of exactly the workload's length), the workload's
prompts per step × 1 sample, fixed response length (``response_length`` = the workload's new tokens,
no stop token), TRL's default KL coefficient (0.05, rlhf's ``algorithm.kl_coef`` default too), 1 PPO
epoch of 1 minibatch, fp32, one process. The step time is the wall time from one ``on_step_end`` to
the next: the whole of TRL's PPO iteration (generation, the policy, reference, value and reward
forwards, GAE, the update, its logging and the ``gc.collect()`` it runs every step); the figure is
the median of the steps after the first (warm-up) one. bench/ppo.py's ``s_per_step`` is rlhf's
generate + switch + score + train (the stage's per-step logging is outside it).
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
    print_step_lines,
    step_timer,
    train_timed,
    trl_line_base,
    trl_ppo_args,
    trl_prompts,
)
from ppo import prepare  # noqa: E402


def main() -> None:
    ap = trl_ppo_args("TRL's PPOTrainer on bench/ppo.py's GAE workload", steps=6)
    args = ap.parse_args()
    if args.steps < 2:
        sys.exit("bench/trl_ppo.py: --steps must be at least 2 (the first is the warm-up)")
    try:
        import trl
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    except ImportError:
        sys.exit(
            "bench/trl_ppo.py: needs TRL with its PPO trainer (pip install trl==1.12.0: "
            "trl.experimental.ppo; "
            "later releases dropped it); rlhf itself does not depend on TRL"
        )
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.set_num_threads(args.threads)
    for workload in args.workload:
        w = WORKLOADS[workload]
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp)
            data, _, _ = prepare(run_dir, w)
            sft, rm = run_dir / "sft" / "model", run_dir / "reward" / "model"
            tok, _, ids = trl_prompts(data, sft, w)

            def causal(sft=sft):
                return AutoModelForCausalLM.from_pretrained(
                    sft, dtype=torch.float32, trust_remote_code=False
                )

            def scalar(rm=rm):
                return AutoModelForSequenceClassification.from_pretrained(
                    rm, num_labels=1, dtype=torch.float32, trust_remote_code=False
                )

            cfg = PPOConfig(
                output_dir=str(run_dir / "trl"),
                per_device_train_batch_size=w["prompts"],
                gradient_accumulation_steps=1,
                num_mini_batches=1,
                num_ppo_epochs=1,
                local_rollout_forward_batch_size=w["prompts"],
                total_episodes=w["prompts"] * args.steps,
                response_length=w["new"],
                stop_token=None,
                temperature=1.0,
                learning_rate=1e-6,
                num_sample_generations=0,
                logging_steps=1,
                bf16=False,
                **TRL_CPU,
            )
            timer = step_timer(from_step_end=True)
            trainer = PPOTrainer(
                args=cfg,
                processing_class=tok,
                model=causal(),
                ref_model=causal(),
                reward_model=scalar(),
                value_model=scalar(),
                train_dataset=Dataset.from_dict({"input_ids": ids}),
                callbacks=[timer],
            )
            step = train_timed(trainer, timer)
            base = trl_line_base(
                workload, "trl_ppo", args.threads, trl.__version__, len(timer.times)
            )
            print_step_lines(base, step, w["prompts"], w["new"])


if __name__ == "__main__":
    main()
