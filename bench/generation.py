"""Generation throughput: HF generate on the ZeRO-3 actor vs the hybrid engine (TP 1 and 2) vs HF
generate on a plain model (JSON lines, docs/benchmarks.md).

    python bench/generation.py [--workload tiny small] [--repeats 3] [--dtypes fp32 bf16] [--nproc
    2]
                               [--device auto|cpu|cuda]

Each rank generates its own prompts (8 × prompt_len, sampling, temperature 1, min = max new tokens
so every variant does the same work). tokens_per_s is summed over ranks. The bandwidth bound of a
hybrid variant is batch × bandwidth / (weight bytes read per decode step), the bandwidth measured
by a large copy on each rank at the same time; a second bound (``bandwidth_bound_kv_tokens_per_s``)
adds the KV cache a decode step reads, averaged over the generation (prompt_len + new/2 cached
positions of every row: at batch 64 and 384 positions the cache of ``gpu1b`` is as many bytes as its
weights).

``--variants ... hybrid_tp1_ref hybrid_tp2_ref``: the hybrid variants with
engine.inference_kernels=reference (plain GEMMs instead of the packed ones), side by side.
``hybrid_tp1_nograph``: hybrid TP 1 with engine.cuda_graphs=off (on CUDA the row-removing decode
loop instead of the graph-captured static step; on the CPU the same loop as hybrid_tp1).
``--dtypes``: fp32 runs every variant; bf16 runs the hybrid variants with
engine.inference_dtype=bf16 (fp32 training weights, bf16 inference copy) and hf_plain on the model
cast to bf16, reported as ``<variant>_bf16`` (the fair comparison is equal precision:
hybrid_tp1_bf16 vs hf_plain_bf16). Every line carries ``dtype`` and the 1-minute load average when
its variant started (``load_1m``; it still counts the previous variant's own ranks for a while): on
a shared machine, numbers taken while other jobs run are not comparable.

Device (``--device``, as ``engine.device``; every line carries ``device``): auto = CUDA when this
node has a GPU for each of the ``--nproc`` processes, else the CPU. On CUDA the defaults are
``--variants hybrid_tp1 hybrid_tp1_nograph hybrid_tp2 hf_plain --dtypes bf16`` (hybrid:
engine.inference_dtype=bf16 with engine.precision=auto; hf_plain: the model cast to bf16 and moved
to the GPU), timed regions are bracketed by torch.cuda.synchronize(), and the bandwidth of the bound
is that of a large device-to-device copy. Variants whose TP degree does not divide ``--nproc`` are
skipped (stderr says so). hf_plain also gets a bandwidth bound (its weight bytes, the bandwidth
measured in its process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# WORKLOADS re-exported
from common import WORKLOADS, device_label, llama_config, resolve_device  # noqa: E402


def make_model(w: dict, on_meta: bool = False):
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_config(w)
    if on_meta:
        with torch.device("meta"):
            return LlamaForCausalLM(cfg)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def prompts_for(w: dict, rank: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return [
        torch.randint(3, w["vocab"], (w["prompt_len"],), generator=g).tolist()
        for _ in range(w["prompts"])
    ]


def bandwidth_bytes_per_s(device=None) -> float:
    """Host memory: a copy of 256 MiB (beyond any last-level cache, as a model's weights are),
    best of 8, bytes read + written / time."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        return cuda_bandwidth_bytes_per_s(torch.device(device))
    a = torch.empty(256 * 2**20 // 4, dtype=torch.float32).fill_(1.0)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(8):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best  # read + write


def cuda_bandwidth_bytes_per_s(device, mib: int = 512, copies: int = 10) -> float:
    """Device-to-device copy of ``mib`` MiB (far beyond L2), ``copies`` back to back between two
    synchronizations, best of 5: bytes read + written / time."""
    import torch

    a = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    b.copy_(a)  # warm-up
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(copies):
            b.copy_(a)
        torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t) / copies)
    del a, b
    torch.cuda.empty_cache()
    return 2 * mib * 2**20 / best  # read + write


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(model) -> int:
    # per decode step every layer weight and the LM head are read once (embedding: one row per
    # token)
    return sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n
    )


def kv_bytes_per_step(w: dict, rows: int, element_bytes: int) -> float:
    """KV cache bytes one decode step reads for ``rows`` rows, averaged over the generation: the
    step that samples token t (1..new-1) attends to prompt_len + t cached positions (mean prompt_len
    + new/2), K and V of every KV head in every layer."""
    positions = w["prompt_len"] + w["new"] / 2
    return (
        w["layers"] * rows * positions * 2 * w["kv"] * (w["hidden"] // w["heads"]) * element_bytes
    )


class Tok:
    pad_token_id, eos_token_id = 0, 2


def worker(
    workload: str, variant: str, repeats: int, out: str, dtype: str = "fp32", device: str = "auto"
) -> None:
    import torch

    from rlhf.config import EngineConfig, TrainConfig
    from rlhf.engine.hybrid import HybridEngine
    from rlhf.engine.mesh import init_mesh, shutdown
    from rlhf.engine.train import TrainEngine
    from rlhf.ops import SamplingParams

    w = WORKLOADS[workload]
    tp = tp_of(variant)
    # fp32: fp32 everywhere (also on CUDA, where precision=auto would be bf16); bf16: a bf16
    # inference copy, training precision auto (fp32 on the CPU, bf16 with fp32 master weights on
    # CUDA)
    ecfg = EngineConfig(
        zero_stage=3,
        inference_tp_size=tp,
        hybrid=variant != "hf_fsdp",
        timeout_s=600,
        device=device,
        precision="fp32" if dtype == "fp32" else "auto",
        inference_dtype=dtype,
        inference_kernels="reference" if variant.endswith("_ref") else "auto",
        cuda_graphs="off" if variant.endswith("_nograph") else "auto",
    )
    mesh = init_mesh(ecfg)
    model = make_model(w, on_meta=not mesh.is_main)
    eng = TrainEngine(model, mesh, ecfg, TrainConfig())
    hy = HybridEngine(eng, Tok, ecfg)
    sp = SamplingParams(temperature=1.0, max_new_tokens=w["new"], min_new_tokens=w["new"], seed=1)
    prompts = prompts_for(w, mesh.rank)
    # warm-up
    hy.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=4, min_new_tokens=4))
    best, switch = float("inf"), float("inf")
    for _ in range(repeats):
        sync(mesh.device)
        mesh.barrier()
        t = time.perf_counter()
        gen = hy.generate(prompts, sp)
        sync(mesh.device)
        mesh.barrier()
        dt = time.perf_counter() - t
        if dt < best:
            best, switch = dt, gen.timings.get("switch_s", 0.0)
    assert int(gen.response_mask.sum()) == w["prompts"] * w["new"]
    bw = bandwidth_bytes_per_s(mesh.device)
    mesh.barrier()
    res = {
        "seconds": best,
        "switch_s": switch,
        "tokens": w["prompts"] * w["new"] * mesh.world_size,
        "bandwidth": mesh.sum(bw) / mesh.world_size,
        "weight_bytes": weight_bytes(make_model(w, on_meta=True))
        * (2 if dtype == "bf16" else 4)
        // 4,
        "world_size": mesh.world_size,
        "threads": torch.get_num_threads(),
        "device": device_label(mesh.device),
    }
    if mesh.is_main:
        Path(out).write_text(json.dumps(res))
    shutdown(mesh)


def rate(r: dict, per_process: bool = False) -> float:
    """Tokens per second of one variant's result (per process: divided by its world size)."""
    return r["tokens"] / r["seconds"] / (r["world_size"] if per_process else 1)


def tp_of(variant: str) -> int:
    return 2 if variant.startswith("hybrid_tp2") else 1


def plain(workload: str, repeats: int, threads: int, dtype: str = "fp32", device=None) -> dict:
    import torch

    from rlhf.engine.infer import left_pad

    torch.set_num_threads(threads)
    w = WORKLOADS[workload]
    device = torch.device(device or "cpu")
    model = make_model(w).to(
        device=device, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32
    )
    ids, mask = left_pad(prompts_for(w, 0), 0, device)
    kw = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=w["new"],
        min_new_tokens=w["new"],
        pad_token_id=0,
        eos_token_id=2,
    )
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=mask, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4}
        )
        best = float("inf")
        for _ in range(repeats):
            sync(device)
            t = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=mask, **kw)
            sync(device)
            best = min(best, time.perf_counter() - t)
    res = {
        "seconds": best,
        "tokens": w["prompts"] * w["new"],
        "threads": threads,
        "weight_bytes": weight_bytes(model),
        "device": device_label(device),
    }
    del model, ids, mask
    if device.type == "cuda":
        # the next variant's processes get the memory
        torch.cuda.empty_cache()
    res["bandwidth"] = bandwidth_bytes_per_s(device)
    return res


# *_ref: the hybrid variant with engine.inference_kernels=reference (plain GEMMs), for a
# side-by-side; *_nograph: with engine.cuda_graphs=off
DTYPE_VARIANTS = {
    "fp32": (
        "hf_fsdp",
        "hybrid_tp1",
        "hybrid_tp2",
        "hf_plain",
        "hybrid_tp1_ref",
        "hybrid_tp2_ref",
        "hybrid_tp1_nograph",
    ),
    "bf16": (
        "hybrid_tp1",
        "hybrid_tp2",
        "hf_plain",
        "hybrid_tp1_ref",
        "hybrid_tp2_ref",
        "hybrid_tp1_nograph",
    ),
}
# (hf_fsdp generates in the training dtype)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", nargs="+", default=["tiny", "small"], choices=sorted(WORKLOADS))
    ap.add_argument(
        "--variants",
        nargs="+",
        default=None,
        choices=DTYPE_VARIANTS["fp32"],
        help="default: hf_fsdp hybrid_tp1 hybrid_tp2 hf_plain (CUDA: hybrid_tp1 hybrid_tp1_nograph "
        "hybrid_tp2 hf_plain)",
    )
    ap.add_argument(
        "--dtypes",
        nargs="+",
        default=None,
        choices=sorted(DTYPE_VARIANTS),
        help="default: fp32 bf16 (CUDA: bf16)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="as engine.device"
    )
    ap.add_argument(
        "--worker",
        nargs=6,
        metavar=("WORKLOAD", "VARIANT", "REPEATS", "OUT", "DTYPE", "DEVICE"),
        help=argparse.SUPPRESS,
    )
    args = ap.parse_args()
    if args.worker:
        worker(
            args.worker[0],
            args.worker[1],
            int(args.worker[2]),
            args.worker[3],
            args.worker[4],
            args.worker[5],
        )
        return
    dev = resolve_device(args.device, args.nproc)
    on_cuda = dev.type == "cuda"
    if args.variants is None:
        args.variants = (
            ["hybrid_tp1", "hybrid_tp1_nograph", "hybrid_tp2", "hf_plain"]
            if on_cuda
            else ["hf_fsdp", "hybrid_tp1", "hybrid_tp2", "hf_plain"]
        )
    if args.dtypes is None:
        args.dtypes = ["bf16"] if on_cuda else ["fp32", "bf16"]
    for v in [v for v in args.variants if args.nproc % tp_of(v)]:
        print(
            f"bench/generation.py: skipping {v}: its TP degree {tp_of(v)} does not divide "
            f"--nproc {args.nproc}",
            file=sys.stderr,
        )
    args.variants = [v for v in args.variants if args.nproc % tp_of(v) == 0]
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    label = device_label(dev)
    for workload in args.workload:
        results = {}
        for dtype in args.dtypes:
            for variant in (v for v in args.variants if v in DTYPE_VARIANTS[dtype]):
                name = variant if dtype == "fp32" else f"{variant}_{dtype}"
                load = os.getloadavg()[0]
                if variant == "hf_plain":
                    r = plain(workload, args.repeats, threads, dtype, dev)
                    ws = 1
                else:
                    out = tempfile.mktemp(suffix=".json")
                    cmd = [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        f"--nproc-per-node={args.nproc}",
                        __file__,
                        "--worker",
                        workload,
                        variant,
                        str(args.repeats),
                        out,
                        dtype,
                        dev.type,
                    ]
                    subprocess.run(
                        cmd,
                        check=True,
                        stdout=sys.stderr,
                        env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
                    )
                    r = json.loads(Path(out).read_text())
                    os.unlink(out)
                    ws = r["world_size"]
                results[name] = r
                base = {
                    "bench": "generation",
                    "workload": workload,
                    "variant": name,
                    "world_size": ws,
                    "threads_per_rank": r["threads"],
                    "torch": torch.__version__,
                    "dtype": dtype,
                    "load_1m": round(load, 2),
                    "device": r["device"],
                }
                tps = r["tokens"] / r["seconds"]
                print(
                    json.dumps(
                        {
                            **base,
                            "metric": "tokens_per_s",
                            "value": round(tps, 1),
                            "unit": "tokens/s",
                        }
                    ),
                    flush=True,
                )
                if variant != "hf_plain":
                    print(
                        json.dumps(
                            {
                                **base,
                                "metric": "switch_s",
                                "value": round(r["switch_s"], 5),
                                "unit": "s",
                            }
                        ),
                        flush=True,
                    )
                if variant.startswith("hybrid") or variant == "hf_plain":
                    tp = tp_of(variant)
                    # each rank reads its slice per decode step
                    per_step_bytes = r["weight_bytes"] / tp
                    rows_per_group = WORKLOADS[workload]["prompts"] * tp
                    bound = (ws // tp) * rows_per_group * r["bandwidth"] / per_step_bytes
                    print(
                        json.dumps(
                            {
                                **base,
                                "metric": "bandwidth_bound_tokens_per_s",
                                "value": round(bound, 1),
                                "unit": "tokens/s",
                                "fraction_reached": round(tps / bound, 4),
                                "bandwidth_gb_s": round(r["bandwidth"] / 1e9, 2),
                            }
                        ),
                        flush=True,
                    )
                    # + the KV cache: a TP rank holds kv_heads / tp of every row of its group
                    kv = (
                        kv_bytes_per_step(
                            WORKLOADS[workload], rows_per_group, 2 if dtype == "bf16" else 4
                        )
                        / tp
                    )
                    bound_kv = (ws // tp) * rows_per_group * r["bandwidth"] / (per_step_bytes + kv)
                    print(
                        json.dumps(
                            {
                                **base,
                                "metric": "bandwidth_bound_kv_tokens_per_s",
                                "value": round(bound_kv, 1),
                                "unit": "tokens/s",
                                "fraction_reached": round(tps / bound_kv, 4),
                                "bandwidth_gb_s": round(r["bandwidth"] / 1e9, 2),
                                "weight_bytes_per_step": int(per_step_bytes),
                                "kv_bytes_per_step": int(kv),
                            }
                        ),
                        flush=True,
                    )

        if "hybrid_tp1" in results and "hf_fsdp" in results:
            print(
                json.dumps(
                    {
                        "bench": "generation",
                        "workload": workload,
                        "device": label,
                        "variant": "hybrid_tp1_vs_hf_fsdp",
                        "metric": "speedup",
                        "value": round(rate(results["hybrid_tp1"]) / rate(results["hf_fsdp"]), 2),
                        "unit": "x",
                        "target": 5.0,
                    }
                ),
                flush=True,
            )
        # (b) per process / (d): fp32 vs fp32, bf16 vs bf16 (equal precision), bf16 vs fp32 (for
        # reference)
        for b, d in (
            ("hybrid_tp1", "hf_plain"),
            ("hybrid_tp1_bf16", "hf_plain_bf16"),
            ("hybrid_tp1_bf16", "hf_plain"),
        ):
            if b in results and d in results:
                variant = (
                    "hybrid_tp1_per_process_vs_hf_plain"
                    if b == "hybrid_tp1"
                    else f"{b}_per_process_vs_{d}"
                )
                print(
                    json.dumps(
                        {
                            "bench": "generation",
                            "workload": workload,
                            "device": label,
                            "variant": variant,
                            "metric": "speedup",
                            "value": round(
                                rate(results[b], per_process=True) / rate(results[d]), 2
                            ),
                            "unit": "x",
                            "target": 1.5,
                        }
                    ),
                    flush=True,
                )
        # packed vs plain GEMMs; graph-captured static step vs the row-removing loop (same run and
        # dtype)
        for name in [n for n in results if "_ref" in n or "_nograph" in n]:
            fast = name.replace("_ref", "").replace("_nograph", "")
            if fast in results:
                print(
                    json.dumps(
                        {
                            "bench": "generation",
                            "workload": workload,
                            "device": label,
                            "variant": f"{fast}_vs_{name}",
                            "metric": "speedup",
                            "value": round(rate(results[fast]) / rate(results[name]), 2),
                            "unit": "x",
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
    from rlhf.engine.mesh import end_process

    # (a torchrun worker: without finalization, rlhf/engine/mesh.py says why)
    end_process()
