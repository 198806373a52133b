"""Per-rank bytes of parameters + gradients + optimizer state for ZeRO 0/1/2/3 (JSON lines,
    docs/benchmarks.md).

    python bench/memory.py [--workload small] [--world-sizes 2 4] [--precision fp32 bf16] [--lora 8]

Launches itself under torch.distributed.run for each world size. On every rank it trains two
steps of the workload's Llama and takes, at three points of the second step (after forward,
after backward, after the optimizer step), the bytes of the tensors this rank holds: parameters
(the local shard, or the gathered copy while one exists, plus its shard), gradients and AdamW
state. The figure is the peak of their sum. Next to it, the seed's formulas for the same Ψ and N:

  mixed precision (bf16/fp16 params and grads, fp32 master + Adam, K=12):
    ZeRO-0 16Ψ    ZeRO-1 4Ψ + 12Ψ/N    ZeRO-2 2Ψ + 14Ψ/N    ZeRO-3 16Ψ/N
  fp32 equivalent (fp32 params, grads and Adam m, v: 4 + 4 + 8 bytes):
    ZeRO-0 16Ψ    ZeRO-1 8Ψ + 8Ψ/N     ZeRO-2 4Ψ + 12Ψ/N    ZeRO-3 16Ψ/N

``--lora R`` (default 8; 0 = off) adds the variants ``zero<k>_lora``: the same model with LoRA
adapters of rank R on every attention and MLP projection (PEFT), where gradients and AdamW state
exist for the adapters only (Φ parameters): the frozen fp32 weights 4Ψ (replicated under ZeRO-0/1;
under ZeRO-2 the gathered copy lives from forward to backward next to its shard, 4Ψ + 4Ψ/N; 4Ψ/N
under ZeRO-3) plus the adapters' 16Φ sharded as the stage says (``lora_formula``).

``--load`` measures loading instead: the peak host memory of each rank while a Qwen2.5-0.5B-shaped
model (its published config, random init, 494M parameters, saved as safetensors shards of
``--shard-mb`` in ``--ckpt-dtype``, bf16 as published: 1 GB; made once under ``--model-dir``) is
built as the stages build it (``build_model`` on rank 0, the meta device elsewhere) and wrapped for
``--zero`` (frozen, fp32 weights: 2 GB), for each of ``--world-sizes``: variant ``load_whole`` (rank
0 loads the whole model and broadcasts it: rlhf/models/streaming.py off) and ``load_streamed`` (each
rank reads its part from the files; in one process there is nothing to stream: one ``load_whole``
line). Each variant runs in fresh processes. Two peaks, each as its rise over the figure just before
the build (imports do not count): ``load_peak_anon_bytes``, the process's anonymous memory (what it
cannot give back: the weights it holds, copies, buffers), sampled every millisecond;
``load_peak_rss_bytes``, the kernel's high-water mark of the resident set (VmHWM, reset before the
build), which also counts the pages of the checkpoint files the process has mapped and read (page
cache, reclaimable).

``--grow N``: the embeddings grow by N rows first (a tokenizer with N more tokens; mean-resized).

    python bench/memory.py --load [--world-sizes 1 2] [--zero 3] [--shard-mb 500] [--ckpt-dtype
    bf16] [--grow 0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import WORKLOADS, device_label, llama_config  # noqa: E402  (docs/benchmarks.md)


def formula(zero: int, psi: int, n: int, precision: str) -> float:
    if zero == 0:
        return 16 * psi
    if zero == 1:
        # parameters and gradients replicated, optimizer state (master + Adam) sharded
        return 4 * psi + 12 * psi / n if precision == "bf16" else 8 * psi + 8 * psi / n
    if zero == 2:
        return 2 * psi + 14 * psi / n if precision == "bf16" else 4 * psi + 12 * psi / n
    return 16 * psi / n


def lora_formula(zero: int, psi: int, phi: int, n: int) -> float:
    """fp32: frozen weights 4Ψ; adapters 4Φ weights + 4Φ grads + 8Φ AdamW, sharded as the stage
    says."""
    frozen = {0: 4 * psi, 1: 4 * psi, 2: 4 * psi + 4 * psi / n, 3: 4 * psi / n}[zero]
    if zero == 0:
        return frozen + 16 * phi
    if zero == 1:
        return frozen + 8 * phi + 8 * phi / n
    if zero == 2:
        return frozen + 4 * phi + 12 * phi / n
    return frozen + 16 * phi / n


def _local_bytes(t) -> int:
    if t is None:
        return 0
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.numel() * local.element_size()


def _held_bytes(engine) -> dict:
    import torch

    model = engine.model
    params = 0
    seen = set()
    for p in model.parameters():
        # the tensors the modules hold now (gathered while unsharded)
        if id(p) not in seen:
            seen.add(id(p))
            params += _local_bytes(p)
    # FSDP2 keeps the sharded parameter alongside a gathered copy
    for mod in model.modules():
        state = getattr(mod, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        if group is None:
            continue
        for fp in group.fsdp_params:
            if fp.sharded_param is not None and fp.sharded_param is not getattr(
                mod, "_dummy", None
            ):
                held = any(q is fp.sharded_param for q in model.parameters())
                if not held:
                    params += _local_bytes(fp.sharded_param)
    grads = sum(
        _local_bytes(p.grad) for p in model.parameters() if p.grad is not None and id(p) in seen
    )
    optim = 0
    # ZeRO-1's ZeroRedundancyOptimizer holds this rank's share in its local optimizer (.optim)
    for st in getattr(engine.optimizer, "optim", engine.optimizer).state.values():
        for k, v in st.items():
            if k != "step" and isinstance(v, torch.Tensor):
                optim += _local_bytes(v)
    return {"params": params, "grads": grads, "optim": optim}


def _record_peak(engine, peak: dict, tag: str) -> None:
    """``peak``: the largest total of the bytes ``engine`` holds, its parts and where (``tag``)."""
    b = _held_bytes(engine)
    tot = sum(b.values())
    if tot > peak["total"]:
        peak.update(total=tot, at=tag, **b)


def worker(workload: str, precision: str, out: str, lora_r: int = 0) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from rlhf.config import EngineConfig, TrainConfig
    from rlhf.engine.mesh import init_mesh, shutdown
    from rlhf.engine.train import TrainEngine

    mesh = init_mesh(EngineConfig(timeout_s=300))
    w = WORKLOADS[workload]
    cfg = llama_config(w, max_position_embeddings=256)
    rows = []
    for zero, r in [(z, 0) for z in (0, 1, 2, 3)] + [(z, lora_r) for z in (0, 1, 2, 3) if lora_r]:
        torch.manual_seed(0)
        if mesh.is_main:
            model = LlamaForCausalLM(cfg)
        else:
            with torch.device("meta"):
                model = LlamaForCausalLM(cfg)
        psi = sum(p.numel() for p in (model.parameters()))
        if r:
            from rlhf.config import LoraConfig
            from rlhf.models.lora import apply_lora

            model = apply_lora(model, LoraConfig(r=r, alpha=2.0 * r), seed=0)
        phi = sum(p.numel() for p in model.parameters() if p.requires_grad) if r else psi
        eng = TrainEngine(
            model, mesh, EngineConfig(zero_stage=zero, precision=precision), TrainConfig(lr=1e-4)
        )
        peak = {"total": 0}
        ids = torch.randint(0, w["vocab"], (2, 64)).to(mesh.device)
        for step in range(2):
            out_ = eng.forward(input_ids=ids)
            if step == 1:
                _record_peak(eng, peak, "after_forward")
            loss = out_.logits.float().logsumexp(-1).mean()
            eng.backward(loss)
            if step == 1:
                _record_peak(eng, peak, "after_backward")
            # step without clearing grads first so that they count in the snapshot
            eng.optimizer.step()
            if step == 1:
                _record_peak(eng, peak, "after_step")
            eng.optimizer.zero_grad(set_to_none=True)
        rows.append(
            {
                "zero": zero,
                "lora": r,
                "psi": psi,
                "phi": phi,
                **peak,
                "formula": (
                    lora_formula(zero, psi, phi, mesh.world_size)
                    if r
                    else formula(zero, psi, mesh.world_size, precision)
                ),
                "device": device_label(mesh.device),
            }
        )
        del eng, model
    if mesh.is_main:
        Path(out).write_text(json.dumps(rows))
    shutdown(mesh)


# ---- --load: the host memory of loading a checkpoint ----


def load_model_dir(out: Path, shard_mb: int, dtype: str) -> Path:
    """The Qwen2.5-0.5B-shaped checkpoint (random init; safetensors shards of ``shard_mb`` MB in
    ``dtype``)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from real_size import QWEN25_05B
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        Qwen2Config(**QWEN25_05B, bos_token_id=0, eos_token_id=1)
    )
    model.to({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    model.save_pretrained(out, max_shard_size=f"{shard_mb}MB")
    return out


def _vm(field: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM, RssAnon) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class AnonPeak:
    """The largest RssAnon seen by a thread that reads it every millisecond, while in the block."""

    def __enter__(self):
        import threading

        self.peak, self._stop = _vm("RssAnon"), threading.Event()

        def sample():
            while not self._stop.wait(0.001):
                self.peak = max(self.peak, _vm("RssAnon"))

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _vm("RssAnon"))
        return False


class _Vocab:
    """A tokenizer's length, what ``resize_for_tokenizer`` reads of it (``--grow``)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def load_worker(model_dir: str, variant: str, zero: str, grow: str, out: str) -> None:
    import time

    from transformers import AutoModelForCausalLM

    from rlhf.config import EngineConfig
    from rlhf.engine.mesh import init_mesh, shutdown
    from rlhf.engine.train import wrap_model
    from rlhf.models import loading, streaming

    mesh = init_mesh(EngineConfig(timeout_s=1800))
    streaming.ENABLED = variant == "load_streamed"
    mesh.barrier()
    before, anon_before = _vm("VmRSS"), _vm("RssAnon")
    # VmHWM := VmRSS: the peak of what follows
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    with AnonPeak() as anon:
        model = loading.build_model(
            AutoModelForCausalLM, path=model_dir, on_meta=not mesh.is_main, trust_remote_code=False
        )
        if int(grow):
            # a tokenizer with more tokens: the embeddings grow (mean-resized)
            loading.resize_for_tokenizer(
                model, _Vocab(model.get_input_embeddings().weight.shape[0] + int(grow))
            )
        built = _vm("VmHWM"), anon.peak
        model = wrap_model(
            model, mesh, EngineConfig(zero_stage=int(zero), precision="fp32"), trainable=False
        )
        mesh.barrier()
    seconds = time.perf_counter() - t0
    held = sum(
        (p._local_tensor if hasattr(p, "_local_tensor") else p).nbytes for p in model.parameters()
    )
    row = {
        "rank": mesh.rank,
        "rss_before": before,
        "peak_rss": _vm("VmHWM"),
        "peak_rss_at_build": built[0],
        "anon_before": anon_before,
        "peak_anon": anon.peak,
        "peak_anon_at_build": built[1],
        "held_param_bytes": held,
        "read_bytes": sum(streaming.read_counts().values()),
        "load_s": seconds,
        "device": device_label(mesh.device),
    }
    rows = mesh.all_gather_object(row)
    if mesh.is_main:
        Path(out).write_text(json.dumps(rows))
    shutdown(mesh)


def load_bench(args) -> None:
    import tempfile

    import torch

    model_dir = args.model_dir or str(
        ROOT / "runs" / "bench_load" / f"qwen2.5-0.5b-shape-{args.ckpt_dtype}"
    )
    model_dir = load_model_dir(Path(model_dir), args.shard_mb, args.ckpt_dtype)
    files = sorted(model_dir.glob("*.safetensors"))
    ckpt, shard = sum(f.stat().st_size for f in files), max(f.stat().st_size for f in files)
    for n in args.world_sizes:
        for variant in ("load_whole", "load_streamed") if n > 1 else ("load_whole",):
            out = tempfile.mktemp(suffix=".json")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={n}",
                __file__,
            ]
            cmd += ["--load-worker", str(model_dir), variant, str(args.zero), str(args.grow), out]
            subprocess.run(
                cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=sys.stderr
            )
            for r in json.loads(Path(out).read_text()):
                base = {
                    "bench": "memory",
                    "workload": "qwen2.5-0.5b-shape",
                    "variant": variant,
                    "world_size": n,
                    "rank": r["rank"],
                    "zero": args.zero,
                    "precision": "fp32",
                    "torch": torch.__version__,
                    "device": r["device"],
                }
                extra = {
                    "held_param_bytes": r["held_param_bytes"],
                    "read_bytes": r["read_bytes"],
                    "checkpoint_bytes": ckpt,
                    "largest_shard_bytes": shard,
                    "shards": len(files),
                    "ckpt_dtype": args.ckpt_dtype,
                    "grow": args.grow,
                    "load_s": round(r["load_s"], 1),
                }
                for metric, what in (
                    ("load_peak_anon_bytes", "anon"),
                    ("load_peak_rss_bytes", "rss"),
                ):
                    row = {
                        **base,
                        "metric": metric,
                        "value": r[f"peak_{what}"] - r[f"{what}_before"],
                        "unit": "bytes",
                    }
                    row.update(
                        {f"peak_{what}": r[f"peak_{what}"], f"{what}_before": r[f"{what}_before"]}
                    )
                    row[f"peak_{what}_at_build"] = r[f"peak_{what}_at_build"]
                    print(json.dumps({**row, **extra}))
            os.unlink(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="small", choices=sorted(WORKLOADS))
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    ap.add_argument(
        "--lora",
        type=int,
        default=8,
        help="LoRA rank of the zero<k>_lora variants (fp32 only; 0 = none)",
    )
    ap.add_argument(
        "--worker",
        nargs=4,
        metavar=("WORKLOAD", "PRECISION", "OUT", "LORA"),
        help=argparse.SUPPRESS,
    )
    ap.add_argument(
        "--load",
        action="store_true",
        help="the host memory of loading a checkpoint (see the docstring)",
    )
    ap.add_argument(
        "--zero", type=int, default=3, help="--load: the ZeRO stage the model is wrapped for"
    )
    ap.add_argument(
        "--shard-mb", type=int, default=500, help="--load: the checkpoint's shard size (MB)"
    )
    ap.add_argument(
        "--ckpt-dtype",
        default="bf16",
        choices=["bf16", "fp32"],
        help="--load: the checkpoint's dtype",
    )
    ap.add_argument("--model-dir", help="--load: where the checkpoint is (made there once)")
    ap.add_argument(
        "--grow", type=int, default=0, help="--load: tokens a tokenizer adds (the embeddings grow)"
    )
    ap.add_argument("--load-worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker[:3], lora_r=int(args.worker[3]))
        return
    if args.load_worker:
        load_worker(*args.load_worker)
        return
    if args.load:
        load_bench(args)
        return
    import tempfile

    import torch

    for n in args.world_sizes:
        for prec in args.precision:
            out = tempfile.mktemp(suffix=".json")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={n}",
                __file__,
                "--worker",
                args.workload,
                prec,
                out,
                str(args.lora if prec == "fp32" else 0),
            ]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)
            for r in json.loads(Path(out).read_text()):
                variant = f"zero{r['zero']}" + ("_lora" if r["lora"] else "")
                base = {
                    "bench": "memory",
                    "workload": args.workload,
                    "variant": variant,
                    "world_size": n,
                    "precision": prec,
                    "torch": torch.__version__,
                    "device": r["device"],
                }
                print(
                    json.dumps(
                        {
                            **base,
                            "metric": "bytes_per_rank",
                            "value": r["total"],
                            "unit": "bytes",
                            "params": r["params"],
                            "grads": r["grads"],
                            "optim": r["optim"],
                            "peak_at": r["at"],
                            "psi": r["psi"],
                            "trainable": r["phi"],
                        }
                    )
                )
                print(
                    json.dumps(
                        {
                            **base,
                            "metric": "formula_bytes",
                            "value": r["formula"],
                            "unit": "bytes",
                            "ratio_measured_to_formula": r["total"] / r["formula"],
                        }
                    )
                )
            os.unlink(out)


if __name__ == "__main__":
    main()
    from rlhf.engine.mesh import end_process

    # (a torchrun worker: without finalization, rlhf/engine/mesh.py says why)
    end_process()
