"""Per-rank bytes of parameters + gradients + optimizer state for ZeRO 0/1/2/3 (JSON lines, docs/contract.md).

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

``--lora R`` (default 8; 0 = off) adds the variants ``zero<k>_lora``: the same model with LoRA adapters
of rank R on every attention and MLP projection (PEFT), where gradients and AdamW state exist for
the adapters only (Φ parameters): the frozen fp32 weights 4Ψ (replicated under ZeRO-0/1; under
ZeRO-2 the gathered copy lives from forward to backward next to its shard, 4Ψ + 4Ψ/N; 4Ψ/N under
ZeRO-3) plus the adapters' 16Φ sharded as the stage says (``lora_formula``).
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

from common import WORKLOADS, device_label, llama_config  # noqa: E402  (docs/contract.md)


def formula(zero: int, psi: int, n: int, precision: str) -> float:
    if zero == 0:
        return 16 * psi
    if zero == 1:  # parameters and gradients replicated, optimizer state (master + Adam) sharded
        return 4 * psi + 12 * psi / n if precision == "bf16" else 8 * psi + 8 * psi / n
    if zero == 2:
        return 2 * psi + 14 * psi / n if precision == "bf16" else 4 * psi + 12 * psi / n
    return 16 * psi / n


def lora_formula(zero: int, psi: int, phi: int, n: int) -> float:
    """fp32: frozen weights 4Ψ; adapters 4Φ weights + 4Φ grads + 8Φ AdamW, sharded as the stage says."""
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
    for p in model.parameters():  # the tensors the modules hold now (gathered while unsharded)
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
            if fp.sharded_param is not None and fp.sharded_param is not getattr(mod, "_dummy", None):
                held = any(q is fp.sharded_param for q in model.parameters())
                if not held:
                    params += _local_bytes(fp.sharded_param)
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None and id(p) in seen)
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
        eng = TrainEngine(model, mesh, EngineConfig(zero_stage=zero, precision=precision), TrainConfig(lr=1e-4))
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="small", choices=sorted(WORKLOADS))
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--lora", type=int, default=8, help="LoRA rank of the zero<k>_lora variants (fp32 only; 0 = none)")
    ap.add_argument("--worker", nargs=4, metavar=("WORKLOAD", "PRECISION", "OUT", "LORA"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker[:3], lora_r=int(args.worker[3]))
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
