"""A few steps of the DPO stage's real step on a tiny Llama: its losses and final weights.

Run under torchrun (the distributed side) or imported (the single-process reference):
    torchrun --nproc-per-node=2 tests/distributed/dpo_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rlhf.config import DPOConfig, EngineConfig, TrainConfig  # noqa: E402
from rlhf.data.sampler import GlobalBatches  # noqa: E402
from rlhf.engine.mesh import end_process, init_mesh  # noqa: E402
from rlhf.engine.train import FrozenModel, TrainEngine  # noqa: E402
from stages.dpo import collate, train_step  # noqa: E402
from tests.distributed.parity_worker import PAD, records, tiny_model  # noqa: E402

GLOBAL_BATCH, STEPS = 8, 4
# (name, zero_stage, micro_batch_per_rank at world size 2 — 0 means no accumulation, packed
# forwards)
CASES = [("zero0", 0, 0), ("zero3", 3, 0), ("zero3_accum", 3, 1), ("zero3_padded", 3, 0, False)]
# RPO's NLL term too: its per-token mean must not depend on the split either
DPO = DPOConfig(beta=0.5, sft_coef=0.5)


def pairs(n: int = 48, seed: int = 0) -> dict:
    """Columns like tokenize_pairs': prompt + counting continuation (chosen) or its shuffle
    (rejected), responses of different lengths so that padding and prompt lengths vary within a
    batch."""
    rng = random.Random(seed)
    cols = {"chosen": [], "rejected": [], "prompt_len": []}
    for seq, plen in records(n, seed):
        response = seq[plen:] + [2]  # EOS
        cols["chosen"].append(seq[:plen] + response)
        cols["rejected"].append(
            seq[:plen] + rng.sample(response, len(response))[: rng.randint(1, len(response))]
        )
        cols["prompt_len"].append(plen)
    return cols


def dpo_run(mesh, zero_stage: int, micro: int, packing: bool = True) -> tuple[list[float], dict]:
    """([loss, gradient norm] per step, final full weights on rank 0). The gradient norm (before
    clipping) catches a wrong scale of the gradient, which AdamW's weights alone would hide."""
    cols = pairs()
    tcfg = TrainConfig(
        max_steps=STEPS,
        global_batch=GLOBAL_BATCH,
        micro_batch_per_rank=micro,
        lr=1e-2,
        warmup_steps=1,
    )
    ecfg = EngineConfig(zero_stage=zero_stage, precision="fp32", packing=packing)
    engine = TrainEngine(tiny_model(on_meta=not mesh.is_main), mesh, ecfg, tcfg)
    reference = FrozenModel(tiny_model(on_meta=not mesh.is_main), mesh, ecfg)
    micro = micro or GLOBAL_BATCH // mesh.world_size
    batches = GlobalBatches(len(cols["chosen"]), GLOBAL_BATCH, seed=1)
    losses = []
    for step in range(STEPS):
        mbs = [
            collate(cols, ix, PAD)
            for ix in batches.micro_batches(step, mesh.rank, mesh.world_size, micro)
        ]
        stats, grad_norm = train_step(engine, reference, mbs, DPO)
        losses.append([stats["loss"], grad_norm])
    return losses, engine.full_state_dict()


def main(out: str) -> None:
    from safetensors.torch import save_file

    mesh = init_mesh(EngineConfig(timeout_s=120, precision="fp32"))
    results = {"world_size": mesh.world_size}
    for name, *case in CASES:
        losses, weights = dpo_run(mesh, *case)
        results[name] = losses
        if mesh.is_main:
            # tied: own copies
            tensors = {k: v.detach().clone().contiguous() for k, v in weights.items()}
            save_file(tensors, str(Path(out) / f"{name}.safetensors"))
    if mesh.is_main:
        (Path(out) / "losses.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # (a torchrun worker: without finalization, rlhf/engine/mesh.py says why)
    end_process()
