"""TRL's SFTTrainer, RewardTrainer and DPOTrainer on bench/stages.py's workloads, for a side-by-side
step time (JSON lines, docs/benchmarks.md; variants ``trl_sft``, ``trl_reward``, ``trl_dpo``).

    pip install trl          # not a dependency of rlhf: only this bench imports it
    python bench/trl_stages.py [--stages sft reward dpo] [--workloads tiny small hh] [--steps 5]
    [--warmup 1]
                               [--threads N] [--rows 8] [--seed 0] [--sft-padding-free off|on]
                               [--precision fp32|bf16]

The same models (bench/stages.py's random-init Llama, saved with ``save_pretrained`` and loaded by
TRL: ``AutoModelForCausalLM`` for SFT and DPO, whose reference is a second copy loaded from the same
directory; ``AutoModelForSequenceClassification`` with ``num_labels=1`` for the reward model, its
head initialised by Transformers), tokenizer, rows and batches: bench/stage_data.py's rows in the
order of its fixed-seed draws, read in that order (``train_sampling_strategy="sequential"``), so
that TRL's step k is bench/stages.py's step k. SFT gets the rows tokenized (``input_ids`` and the
stages' loss mask as ``completion_mask``, ``completion_only_loss=True``), the reward model the
tokenized pairs (``chosen_ids``, ``rejected_ids``); ``DPOTrainer`` only reads text, so DPO gets the
records' prompt, chosen and rejected text, and the bench checks that TRL's tokenization gives the
same row lengths (the digits workloads: one token per digit). Each trainer:
``per_device_train_batch_size`` = the rows (pairs), gradient accumulation 1, fp32 (``bf16=False``;
``--precision bf16``: ``bf16=True``, Transformers' autocast over fp32 weights, as rlhf's
``engine.precision=bf16`` keeps fp32 master weights), no gradient checkpointing (TRL's configs turn
it on by default; rlhf's ``engine.activation_checkpointing`` is off), lr 1e-5 constant, clip 1.0,
one process, no evaluation, saving or reporting (``report_to="none"``, ``logging_strategy="no"``);
DPO with β = rlhf's ``dpo.beta`` default and the sigmoid loss, the reference run in each step as
rlhf runs it (``precompute_ref_log_probs=False``). Optimizer: TRL's default (``adamw_torch_fused``).

Settings chosen for speed: TRL's SFT ``padding_free`` (the rows of a batch flattened into one,
positions restarting per row) runs on this CPU without flash-attention (Transformers builds a
block-causal SDPA mask from the position ids); on rows without padding (tiny, small) it only makes
attention span the whole flattened batch, and it measured slower there (``--sft-padding-free on``
runs it), hence off by default. ``DPOConfig.padding_free`` is unavailable in TRL 1.16 (it warns and
pads); ``RewardConfig`` has none. No ``packing`` (it would change the rows and their count per
step).

The step time is the wall time of ``Trainer.training_step`` plus the optimizer step, from
``on_step_begin`` to ``on_step_end`` (collation excluded, as in bench/stages.py); the figures are
the medians of the steps after ``--warmup``, like bench/trl_grpo.py's. Metrics as bench/stages.py's:
``s_per_step``, ``tokens_per_s`` (real tokens of the step's rows / its seconds, median over steps),
``samples_per_s``; lines carry ``stage``, ``trl`` and ``padding_free``.

``--workloads hh`` runs SFT and the reward model on bench/stages.py's HH-RLHF rows (tokenized as
bench/stages.py tokenizes them, padded per batch by TRL's collators; ``--sft-padding-free on`` is
TRL's answer to the padding there); DPO is skipped on hh (its trainer tokenizes text itself, and the
rows would not be rlhf's).
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
sys.path.insert(0, str(ROOT / "bench"))

# stage_data puts the repository root first on the path (``import stages`` is the recipes)
from common import TRL_CPU, step_timer  # noqa: E402
from stage_data import (  # noqa: E402
    ALL_WORKLOADS,
    SEQ_WORKLOADS,
    STAGES,
    batch_indices,
    prepare,
    rows_of,
    save_model,
)

LR = 1e-5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    ap.add_argument("--workloads", nargs="+", default=list(SEQ_WORKLOADS), choices=ALL_WORKLOADS)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads (one process)"
    )
    ap.add_argument("--rows", type=int, default=8, help="rows (pairs) per batch")
    ap.add_argument("--seed", type=int, default=0, help="the batches' draw (bench/stages.py's)")
    ap.add_argument("--sft-padding-free", default="off", choices=("off", "on"))
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "bf16"),
        help="bf16: TRL's bf16=True (autocast, fp32 weights)",
    )
    args = ap.parse_args()
    try:
        import trl
        from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
    except ImportError:
        sys.exit(
            "bench/trl_stages.py: needs TRL (pip install trl); rlhf itself does not depend on it"
        )
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf.config import DPOConfig as RlhfDPO

    torch.set_num_threads(args.threads)

    n_steps = args.warmup + args.steps
    common = dict(
        per_device_train_batch_size=args.rows,
        gradient_accumulation_steps=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        max_steps=n_steps,
        logging_strategy="no",
        eval_strategy="no",
        bf16=args.precision == "bf16",
        gradient_checkpointing=False,
        train_sampling_strategy="sequential",
        **TRL_CPU,
    )

    for workload in args.workloads:
        data = prepare(workload)
        tok = data.tokenizer
        with tempfile.TemporaryDirectory(prefix="bench_trl_stages_") as tmp:
            model_dir, _ = save_model(data, Path(tmp) / "model")
            for stage in args.stages:
                if stage == "dpo" and workload not in SEQ_WORKLOADS:
                    # DPOTrainer tokenizes text itself: hh's rows (prompts cut from the left) would
                    # differ
                    print(
                        f"bench/trl_stages.py: DPO runs on tiny and small only, not {workload}",
                        file=sys.stderr,
                    )
                    continue
                draws = batch_indices(rows_of(stage, data), args.rows, n_steps, args.seed)
                order = [i for ix in draws for i in ix]
                out = str(Path(tmp) / f"trl_{stage}")
                timer = step_timer()
                padding_free = False
                if stage == "sft":
                    padding_free = args.sft_padding_free == "on"
                    rows = [data.sft["ids"][i] for i in order]
                    ds = Dataset.from_dict(
                        {"input_ids": rows, "completion_mask": [data.sft["mask"][i] for i in order]}
                    )
                    model = AutoModelForCausalLM.from_pretrained(
                        model_dir, dtype=torch.float32, trust_remote_code=False
                    )
                    cfg = SFTConfig(
                        output_dir=out,
                        completion_only_loss=True,
                        padding_free=padding_free,
                        packing=False,
                        max_length=None,
                        **common,
                    )
                    trainer = SFTTrainer(
                        model=model,
                        args=cfg,
                        train_dataset=ds,
                        processing_class=tok,
                        callbacks=[timer],
                    )
                    lengths = [len(r) for r in rows]
                elif stage == "reward":
                    chosen = [data.pairs["chosen"][i] for i in order]
                    rejected = [data.pairs["rejected"][i] for i in order]
                    ds = Dataset.from_dict({"chosen_ids": chosen, "rejected_ids": rejected})
                    model = AutoModelForSequenceClassification.from_pretrained(
                        model_dir, num_labels=1, dtype=torch.float32, trust_remote_code=False
                    )
                    model.config.pad_token_id = tok.pad_token_id
                    cfg = RewardConfig(output_dir=out, max_length=None, **common)
                    trainer = RewardTrainer(
                        model=model,
                        args=cfg,
                        train_dataset=ds,
                        processing_class=tok,
                        callbacks=[timer],
                    )
                    lengths = [len(c) + len(r) for c, r in zip(chosen, rejected)]
                else:
                    ex = [data.pair_examples[i] for i in order]
                    ds = Dataset.from_dict(
                        {
                            "prompt": [e.prompt for e in ex],
                            "chosen": [e.chosen for e in ex],
                            "rejected": [e.rejected for e in ex],
                        }
                    )
                    model = AutoModelForCausalLM.from_pretrained(
                        model_dir, dtype=torch.float32, trust_remote_code=False
                    )
                    ref = AutoModelForCausalLM.from_pretrained(
                        model_dir, dtype=torch.float32, trust_remote_code=False
                    )
                    cfg = DPOConfig(
                        output_dir=out,
                        beta=RlhfDPO().beta,
                        loss_type=["sigmoid"],
                        max_length=None,
                        precompute_ref_log_probs=False,
                        **common,
                    )
                    trainer = DPOTrainer(
                        model=model,
                        ref_model=ref,
                        args=cfg,
                        train_dataset=ds,
                        processing_class=tok,
                        callbacks=[timer],
                    )
                    got = trainer.train_dataset
                    lengths = [
                        len(p) + len(c) + len(p) + len(r)
                        for p, c, r in zip(
                            got["prompt_ids"], got["chosen_ids"], got["rejected_ids"]
                        )
                    ]
                    want = [
                        len(data.pairs["chosen"][i]) + len(data.pairs["rejected"][i]) for i in order
                    ]
                    if lengths != want:
                        raise RuntimeError(
                            f"{workload}: TRL tokenizes the DPO rows to other lengths than rlhf's"
                        )
                with contextlib.redirect_stdout(sys.stderr):  # stdout is JSON lines only
                    trainer.train()
                times = timer.times[args.warmup :]
                if len(times) != args.steps:
                    raise RuntimeError(f"{len(timer.times)} steps timed, expected {n_steps}")
                tokens = [
                    sum(lengths[k * args.rows : (k + 1) * args.rows])
                    for k in range(args.warmup, n_steps)
                ]
                step = statistics.median(times)
                base = {
                    "bench": "stages",
                    "workload": workload,
                    "variant": f"trl_{stage}",
                    "stage": stage,
                    "world_size": 1,
                    "threads_per_rank": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "device": "cpu",
                    "trl": trl.__version__,
                    "rows": args.rows,
                    "steps": len(times),
                    "padding_free": padding_free,
                    "precision": args.precision,
                    "tokens_per_step": round(sum(tokens) / len(tokens), 1),
                }
                for metric, value, unit in (
                    ("s_per_step", step, "s"),
                    (
                        "tokens_per_s",
                        statistics.median(n / t for n, t in zip(tokens, times)),
                        "tokens/s",
                    ),
                    ("samples_per_s", args.rows / step, "samples/s"),
                ):
                    print(
                        json.dumps(
                            {**base, "metric": metric, "value": round(value, 4), "unit": unit}
                        ),
                        flush=True,
                    )
                del trainer, model
                if stage == "dpo":
                    del ref


if __name__ == "__main__":
    main()
