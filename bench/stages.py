"""Seconds per optimizer step of the SFT, reward-model and DPO stages (JSON lines,
    docs/benchmarks.md).

    python bench/stages.py [--stages sft reward dpo] [--workloads hh tiny small [smollm2]]
                           [--steps 5]
                           [--warmup 1] [--threads N] [--rows 8] [--device auto|cpu|cuda] [--seed 0]
                           [--variants padded packed_whole packed rlhf]
                           [--precision auto|fp32|bf16] [--flops]
                           [--training-gemm torch|onednn]

Each stage's own step, called directly: ``stages.sft.train_step(actor, micro_batches)``,
``stages.reward.train_step(reward_model, micro_batches, margin)`` and
``stages.dpo.train_step(actor, reference, micro_batches, dcfg)``, on engines built as the recipes
build them (one process: ``rlhf.engine.mesh.init_mesh``, ``TrainEngine``; the reward model is the
causal LM's checkpoint as ``AutoModelForSequenceClassification`` with ``init_head`` in a
``ScalarHeadModel``; DPO's reference is ``reference_for``'s ``FrozenModel``), from batches made by
the real collators (``collate_sft``, ``collate_pairs``, ``stages.dpo.collate``) of rows tokenized by
the stages' own ``tokenize_sft`` / ``tokenize_pairs``. One micro-batch of ``--rows`` rows (pairs for
the reward model and DPO) per step, no accumulation; AdamW at lr 1e-5, constant, clip 1.0,
``engine.precision`` from ``--precision`` (default auto: fp32 on the CPU; bf16: bf16 compute over
fp32 master weights).

Workloads:

- ``hh``: the HH-RLHF sample in tests/data/hh-rlhf (``data.format=hh`` through ``read_examples``):
  SFT
  on the chosen conversations (prompt + chosen answer; records with an empty answer skipped as the
  pipeline skips them), the reward model and DPO on the pairs. Tokenized with the project's
  byte-level BPE (``rlhf.data.tokenizer.train_tokenizer``, as ``train_embedded_tokenizer`` trains
  it, on the records' text with the ``small`` workload's 8,000 tokens) at the real lengths, capped
  at ``HH_MAX_PROMPT`` + ``HH_MAX_RESPONSE`` = 512 tokens (prompts cut from the left, pairs whose
  answer is longer than 192 tokens dropped, as the stages do). Model: the ``small`` workload's Llama
  shape with the tokenizer's vocabulary. Each step draws ``--rows`` records at random with a fixed
  seed; every variant runs the same batches. Variants ``padded`` (``engine.packing=false``: the
  padded reference forward), ``packed_whole`` (padding-free packed forwards, every row packed whole:
  ``rlhf.engine.packing.SHARE_PREFIXES`` off) and ``packed`` (``engine.packing=true``: packed, a
  pair's prompt computed once for both its sequences).
- ``smollm2``: ``hh``'s rows tokenized by SmolLM2-135M-Instruct's own tokenizer (the real model,
  fetched on first use by rlhf/models/get.py), every stage starting from its weights.
- ``tiny``, ``small`` (bench/common.py): rows of exactly the workload's prompt_len + new tokens (a
  BOS + digits prompt, a digits answer + EOS, one token per digit; pairs differ in their answers),
  so no padding; variant ``rlhf`` (``engine.packing`` at its default). bench/trl_stages.py runs
  TRL's trainers on the same models, tokenizer, rows and batches.

``--variants`` picks others on any workload: ``padded`` (``engine.packing=false``),
``packed_whole``, ``packed`` (true), ``rlhf`` (the default).

Metrics per (stage, workload, variant), the steps after ``--warmup`` warm-up ones: ``s_per_step``
(the median step: ``train_step`` wall time, collation excluded), ``tokens_per_s`` (median over steps
of the step's real (non-pad) tokens / its seconds; DPO and the reward model count chosen + rejected
tokens), ``samples_per_s`` (rows / ``s_per_step``) and ``padding_share`` (pad tokens / all tokens of
the padded batches the steps ran: the same for every variant); with ``--flops`` also
``gflops_per_s`` (median over steps of the step's FLOPs as torch's FLOP counter counts its GEMMs and
attention, forward and backward, by running each timed step once more under it, / its seconds) and
``peak_share`` (that over ``common.matmul_peak`` in the compute dtype, ``peak_gflops`` on the line).
Lines carry ``stage``, ``rows``, ``steps``, ``packing``, ``tokens_per_step`` (mean), ``params``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import device_label, matmul_peak  # noqa: E402

# stage_data puts the repository root first on the path: ``import stages`` is then the recipes, not
# this file
from stage_data import (  # noqa: E402
    ALL_WORKLOADS,
    DEFAULT_WORKLOADS,
    STAGES,
    batch_indices,
    collate,
    prepare,
    rows_of,
    save_model,
)

LR = 1e-5


def has_packing() -> bool:
    from rlhf.config import EngineConfig

    return "packing" in {f.name for f in dataclasses.fields(EngineConfig)}


def engine_config(
    device: str, threads: int, packing, precision: str = "auto", training_gemm: str = "torch"
):
    """``engine.*`` for one process; ``packing`` None = the key's default."""
    from rlhf.config import EngineConfig

    kw = dict(device=device, threads_per_rank=threads, precision=precision)
    if training_gemm != "torch":
        kw["training_gemm"] = training_gemm
    if packing is not None:
        kw["packing"] = packing
    return EngineConfig(**kw)


def build(stage: str, model_dir: Path, ecfg, tcfg, mesh, tokenizer):
    """The stage's engines, as its recipe builds them: (a callable running one step on
    micro-batches, the engines to release)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf.config import DPOConfig, RewardConfig
    from rlhf.engine.train import TrainEngine, reference_for
    from rlhf.models import loading
    from rlhf.models.value import ScalarHeadModel, init_head
    from stages import dpo, reward, sft

    src = str(model_dir)
    if stage == "sft":
        model = loading.build_model(
            AutoModelForCausalLM, path=src, tokenizer=tokenizer, trust_remote_code=False
        )
        actor = TrainEngine(model, mesh, ecfg.placement("actor"), tcfg)
        actor.train()
        return (lambda mbs: sft.train_step(actor, mbs)), [actor]
    if stage == "reward":
        model_cfg = loading.load_model_config(src, False)
        model_cfg.num_labels, model_cfg.pad_token_id = 1, tokenizer.pad_token_id
        model = loading.build_model(
            AutoModelForSequenceClassification,
            path=src,
            config=model_cfg,
            tokenizer=tokenizer,
            trust_remote_code=False,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            init_head(model)
        rm = TrainEngine(ScalarHeadModel(model), mesh, ecfg.placement("reward_model"), tcfg)
        rm.train()
        margin = RewardConfig().margin
        return (lambda mbs: reward.train_step(rm, mbs, margin)), [rm]

    def load(role: str = "reference"):
        return loading.causal_lm(src, mesh, tokenizer, False, True, role)

    actor = TrainEngine(load("policy"), mesh, ecfg.placement("actor"), tcfg)
    reference = reference_for(actor, load, mesh, ecfg.placement("reference"))
    actor.train()
    dcfg = DPOConfig()
    return (lambda mbs: dpo.train_step(actor, reference, mbs, dcfg)), [actor, reference]


def real_tokens(batch: dict) -> int:
    return int(batch["attention_mask"].sum())


def count_cpu_kernels() -> None:
    """Teaches torch's FLOP counter the CPU kernels its registry lacks: the fused attention
    (forward and backward: the formulas of the other SDPA kernels, halved for a causal call, as the
    kernel skips the blocks above the diagonal) and oneDNN's linear
    (``engine.training_gemm=onednn``: 2·M·N·K)."""
    import math

    import torch
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten

    def _linear(x, w, *args, out_shape=None, **kw):
        return 2 * math.prod(x[:-1]) * w[0] * x[-1]

    def _fwd(query, key, value, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kw):
        return fc.sdpa_flop_count(query, key, value) // (2 if is_causal else 1)

    def _bwd(grad_out, query, key, value, out, lse, dropout_p, is_causal, *a, out_shape=None, **k):
        return fc.sdpa_backward_flop_count(grad_out, query, key, value) // (2 if is_causal else 1)

    for op, formula in (
        (torch.ops.mkldnn._linear_pointwise, _linear),
        (aten._scaled_dot_product_flash_attention_for_cpu, _fwd),
        (aten._scaled_dot_product_flash_attention_for_cpu_backward, _bwd),
    ):
        if op not in fc.flop_registry:
            fc.register_flop_formula(op)(formula)


def counted_flops(step_fn, batch: dict) -> int:
    """The FLOPs of one step on ``batch`` as torch's FLOP counter sees its kernels (GEMMs and
    attention, forward and backward; elementwise work not counted), by running it once more."""
    from torch.utils.flop_counter import FlopCounterMode

    count_cpu_kernels()
    with FlopCounterMode(display=False) as counter:
        step_fn([batch])
    return counter.get_total_flops()


def time_steps(step_fn, batches: list, device) -> list:
    """Wall seconds of ``step_fn([batch])`` for each batch."""
    import torch

    times = []
    for b in batches:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step_fn([b])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


# variant -> (engine.packing (None: its default), a pair's common prefix computed once)
VARIANTS = {
    "padded": (False, True),
    "packed_whole": (True, False),
    "packed": (True, True),
    "rlhf": (None, True),
}


def set_sharing(share: bool) -> None:
    """Pairs' common prefixes computed once (or not), where this version of rlhf can."""
    from rlhf.engine import packing

    if hasattr(packing, "SHARE_PREFIXES"):
        packing.SHARE_PREFIXES = share


def variants_of(workload: str, requested=None) -> list:
    """(variant name, engine.packing) pairs to run on a workload: ``requested`` (--variants), else
    padded, packed_whole and packed on the HH workloads and rlhf on the fixed-length ones."""
    if requested:
        names = requested
    elif workload in ("hh", "smollm2"):
        names = ["padded", "packed_whole", "packed"]
    else:
        names = ["rlhf"]
    return [(name, VARIANTS[name]) for name in names]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    ap.add_argument(
        "--workloads", nargs="+", default=list(DEFAULT_WORKLOADS), choices=ALL_WORKLOADS
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads (one process)"
    )
    ap.add_argument("--rows", type=int, default=8, help="rows (pairs) per micro-batch")
    ap.add_argument(
        "--device", default="cpu", choices=("auto", "cpu", "cuda"), help="as engine.device"
    )
    ap.add_argument("--seed", type=int, default=0, help="the batches' draw")
    ap.add_argument(
        "--precision",
        default="auto",
        choices=("auto", "fp32", "bf16"),
        help="engine.precision (auto: fp32 on the CPU; bf16: fp32 master weights)",
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=None,
        choices=sorted(VARIANTS),
        help="default: padded packed_whole packed on hh, rlhf on tiny and small",
    )
    ap.add_argument(
        "--training-gemm",
        default="torch",
        choices=("torch", "onednn"),
        help="engine.training_gemm (rlhf/ops/train_gemm.py)",
    )
    ap.add_argument(
        "--flops",
        action="store_true",
        help="also gflops_per_s and peak_share: each timed batch's step once more under torch's "
        "FLOP counter, over the matmul peak in the compute dtype (bench/common.py)",
    )
    args = ap.parse_args()
    if args.steps < 1:
        sys.exit("bench/stages.py: --steps must be at least 1")

    import torch

    from rlhf.config import TrainConfig
    from rlhf.engine.mesh import init_mesh
    from rlhf.engine.train import compute_dtype

    mesh = init_mesh(engine_config(args.device, args.threads, None, args.precision))
    peak = None  # the matmul peak in the compute dtype, measured once (--flops)
    for workload in args.workloads:
        data = prepare(workload)
        with tempfile.TemporaryDirectory(prefix="bench_stages_") as tmp:
            model_dir, params = save_model(data, Path(tmp) / "model")
            for stage in args.stages:
                draws = batch_indices(
                    rows_of(stage, data), args.rows, args.warmup + args.steps, args.seed
                )
                batches = [collate(stage, data, ix) for ix in draws]
                timed = batches[args.warmup :]
                tokens = [real_tokens(b) for b in timed]
                area = sum(b["attention_mask"].numel() for b in timed)
                padding = 1.0 - sum(tokens) / area
                for variant, (packing, share) in variants_of(workload, args.variants):
                    if packing is not None and not has_packing():
                        print(
                            "bench/stages.py: no engine.packing in rlhf/config.py: "
                            f"{variant} skipped",
                            file=sys.stderr,
                        )
                        continue
                    ecfg = engine_config(
                        args.device, args.threads, packing, args.precision, args.training_gemm
                    )
                    set_sharing(share)
                    tcfg = TrainConfig(
                        max_steps=len(batches),
                        global_batch=args.rows,
                        lr=LR,
                        scheduler="constant",
                        warmup_steps=0,
                    )
                    step_fn, engines = build(stage, model_dir, ecfg, tcfg, mesh, data.tokenizer)
                    times = time_steps(step_fn, batches, mesh.device)[args.warmup :]
                    flops = [counted_flops(step_fn, b) for b in timed] if args.flops else []
                    del step_fn, engines
                    gc.collect()
                    step = statistics.median(times)
                    tps = statistics.median(n / t for n, t in zip(tokens, times))
                    base = {
                        "bench": "stages",
                        "workload": workload,
                        "variant": variant,
                        "stage": stage,
                        "world_size": 1,
                        "threads_per_rank": torch.get_num_threads(),
                        "torch": torch.__version__,
                        "device": device_label(mesh.device),
                        "rows": args.rows,
                        "steps": len(times),
                        "packing": ecfg.packing if has_packing() else False,
                        "tokens_per_step": round(sum(tokens) / len(tokens), 1),
                        "params": params,
                        "precision": args.precision,
                    }
                    if args.training_gemm != "torch":
                        base["training_gemm"] = args.training_gemm
                    lines = [
                        ("s_per_step", step, "s"),
                        ("tokens_per_s", tps, "tokens/s"),
                        ("samples_per_s", args.rows / step, "samples/s"),
                        ("padding_share", padding, "share"),
                    ]
                    if flops:
                        achieved = statistics.median(f / t for f, t in zip(flops, times))
                        if peak is None:
                            peak = matmul_peak(compute_dtype(ecfg, mesh))
                        base["peak_gflops"] = round(peak / 1e9, 1)
                        lines += [
                            ("gflops_per_s", achieved / 1e9, "GFLOP/s"),
                            ("peak_share", achieved / peak, "share"),
                        ]
                    for metric, value, unit in lines:
                        print(
                            json.dumps(
                                {**base, "metric": metric, "value": round(value, 4), "unit": unit}
                            ),
                            flush=True,
                        )


if __name__ == "__main__":
    main()
    from rlhf.engine.mesh import end_process

    # (a torchrun worker: without finalization, rlhf/engine/mesh.py says why)
    end_process()
