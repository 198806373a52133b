"""The real SFT step in fp16 with loss scaling on a tiny Llama, an overflow injected into chosen
steps' gradients on chosen ranks; writes per step the loss, the loss scale, the skipped count and
whether each rank's weights changed.

Run under torchrun (the distributed side) or imported (the single-process reference):
    torchrun --nproc-per-node=2 tests/distributed/fp16_worker.py OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rlhf.config import EngineConfig, FP16Config, TrainConfig  # noqa: E402
from rlhf.data.sampler import GlobalBatches  # noqa: E402
from rlhf.data.tokenize import collate_sft  # noqa: E402
from rlhf.engine.mesh import end_process, init_mesh  # noqa: E402
from rlhf.engine.train import TrainEngine  # noqa: E402
from stages.sft import train_step  # noqa: E402
from tests.distributed.parity_worker import GLOBAL_BATCH, PAD, records, tiny_model  # noqa: E402
from tests.faults.fault_fp16_overflow import digest, poison  # noqa: E402

STEPS = 6
# 1-based steps whose gradients overflow (hysteresis 2: the first tolerated, the second halves)
POISONED = (3, 4)
# on 2 ranks: on this rank only (on 1 process: there)
POISON_RANK = 1
ZERO_STAGES = (0, 1, 2, 3)
FP16 = dict(initial_scale_power=12, hysteresis=2)


def fp16_curve(mesh, zero_stage: int) -> dict:
    """Per step: ``loss``, ``loss_scale`` and ``skipped`` after it, ``changed`` (per rank: did its
    weights move)."""
    recs = records()
    tcfg = TrainConfig(max_steps=STEPS, global_batch=GLOBAL_BATCH, lr=1e-2, warmup_steps=1)
    ecfg = EngineConfig(zero_stage=zero_stage, precision="fp16", fp16=FP16Config(**FP16))
    engine = TrainEngine(tiny_model(on_meta=not mesh.is_main), mesh, ecfg, tcfg)
    batches = GlobalBatches(len(recs), GLOBAL_BATCH, seed=1)
    step_of_engine = engine.step
    out = {"loss": [], "loss_scale": [], "skipped": [], "changed": []}
    for step in range(1, STEPS + 1):
        mbs = [
            collate_sft([recs[i][0] for i in ix], [recs[i][1] for i in ix], PAD, True)
            for ix in batches.micro_batches(
                step - 1, mesh.rank, mesh.world_size, GLOBAL_BATCH // mesh.world_size
            )
        ]
        before = digest(engine)

        def poisoned_step(step=step):
            if step in POISONED and mesh.rank == min(POISON_RANK, mesh.world_size - 1):
                # after backward (and DDP's all-reduce): this rank's gradients alone
                poison(engine)
            return step_of_engine()

        engine.step = poisoned_step
        loss = train_step(engine, mbs)[0]
        out["loss"].append(loss)
        out["loss_scale"].append(engine.scaler.scale)
        out["skipped"].append(engine.scaler.skipped)
        out["changed"].append(mesh.all_gather_object(digest(engine) != before))
    return out


def main(out: str) -> None:
    mesh = init_mesh(EngineConfig(timeout_s=120, precision="fp32"))
    results = {f"zero{z}": fp16_curve(mesh, z) for z in ZERO_STAGES}
    results["world_size"] = mesh.world_size
    if mesh.is_main:
        Path(out).write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # (a torchrun worker: without finalization, rlhf/engine/mesh.py says why)
    end_process()
