"""The gradients of SFT's, the reward stage's and DPO's real ``train_step`` on tiny random Llamas,
with row-count micro-batches or token-budget ones (``train.max_tokens_per_micro_batch``), for a few
steps at fixed weights (each step's gradient is captured, then dropped: no optimizer step).

Run under torchrun (the distributed side) or imported (the single-process reference):
    torchrun --nproc-per-node=2 tests/distributed/token_budget_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rlhf.config import DPOConfig, EngineConfig, TrainConfig  # noqa: E402
from rlhf.data.sampler import GlobalBatches, step_micro_batches, token_micro_batches  # noqa: E402
from rlhf.data.tokenize import collate_pairs, collate_sft, pair_tokens  # noqa: E402
from rlhf.engine.mesh import end_process, init_mesh  # noqa: E402
from rlhf.engine.train import FrozenModel, TrainEngine  # noqa: E402
from tests.distributed.dpo_worker import pairs  # noqa: E402
from tests.distributed.parity_worker import (  # noqa: E402
    PAD,
    records,
    tiny_model,
    tiny_reward_model,
)

GLOBAL_BATCH, STEPS = 8, 3
STAGES = ("sft", "reward", "dpo")
# per stage: the token budgets of the 2-rank run (records of 6..20 tokens, pairs of 9..42): on some
# step the two ranks' own counts differ, so the agreed count is tested
BUDGETS = {"sft": (24,), "reward": (70,), "dpo": (70,)}
DPO = DPOConfig(beta=0.5, sft_coef=0.5)


def reward_model(mesh):
    from rlhf.models.value import ScalarHeadModel

    return ScalarHeadModel(tiny_reward_model(mesh))


def capture_grads(engine: TrainEngine, into: list) -> None:
    """``engine.step`` appends the full gradients to ``into`` and drops them (weights stay)."""

    def step() -> float:
        grads = {}
        for name, p in engine.module.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[name] = g.detach().cpu().clone()
        into.append(grads)
        engine.optimizer.zero_grad(set_to_none=True)
        return 0.0

    engine.step = step


def stage_grads(mesh, stage: str, max_tokens: int, micro: int = 0, zero_stage: int = 3):
    """([loss per step], [{parameter: gradient} per step], [(micro-batches, this rank's own count)
    per step]); the own count: what this rank alone would need within ``max_tokens``."""
    from stages import dpo, reward, sft

    tcfg = TrainConfig(max_steps=STEPS, global_batch=GLOBAL_BATCH, lr=1e-2, warmup_steps=1)
    ecfg = EngineConfig(zero_stage=zero_stage, precision="fp32")
    micro = micro or GLOBAL_BATCH // mesh.world_size
    if stage == "sft":
        recs = records()
        cols = {"ids": [s for s, _ in recs], "prompt_len": [p for _, p in recs]}
        tokens = [len(x) for x in cols["ids"]]
        engine = TrainEngine(tiny_model(on_meta=not mesh.is_main), mesh, ecfg, tcfg)

        def collate(ix):
            return collate_sft(
                [cols["ids"][i] for i in ix], [cols["prompt_len"][i] for i in ix], PAD, True
            )

        def step(mbs):
            return sft.train_step(engine, mbs)[0]
    else:
        cols = pairs()
        tokens = pair_tokens(cols)
        if stage == "reward":
            engine = TrainEngine(reward_model(mesh), mesh, ecfg, tcfg)

            def collate(ix):
                return collate_pairs(
                    [cols["chosen"][i] for i in ix], [cols["rejected"][i] for i in ix], PAD
                )

            def step(mbs):
                return reward.train_step(engine, mbs)[0]
        else:
            engine = TrainEngine(tiny_model(on_meta=not mesh.is_main), mesh, ecfg, tcfg)
            ref = FrozenModel(tiny_model(on_meta=not mesh.is_main), mesh, ecfg)

            def collate(ix):
                return dpo.collate(cols, ix, PAD)

            def step(mbs):
                return dpo.train_step(engine, ref, mbs, DPO)[0]["loss"]

    grads: list = []
    capture_grads(engine, grads)
    batches = GlobalBatches(len(tokens), GLOBAL_BATCH, seed=1)
    losses, counts = [], []
    for s in range(STEPS):
        ixs = step_micro_batches(batches, s, mesh, micro, max_tokens, tokens)
        # every rank holds rows for every micro-batch here
        assert all(ixs), ixs
        own = 0
        if max_tokens:
            rows = batches.rank_rows(s, mesh.rank, mesh.world_size)
            own = len(token_micro_batches(rows, [tokens[i] for i in rows], max_tokens, lambda k: k))
        counts.append((len(ixs), own))
        losses.append(step([collate(ix) for ix in ixs]))
    return losses, grads, counts


def main(out: str) -> None:
    from safetensors.torch import save_file

    mesh = init_mesh(EngineConfig(timeout_s=120, precision="fp32"))
    results = {"world_size": mesh.world_size}
    for stage in STAGES:
        for budget in BUDGETS[stage]:
            losses, grads, counts = stage_grads(mesh, stage, budget)
            name = f"{stage}_{budget}"
            results[name] = {"losses": losses, "counts": mesh.all_gather_object(counts)}
            if mesh.is_main:
                save_file(
                    {f"{s}/{k}": g for s, gs in enumerate(grads) for k, g in gs.items()},
                    f"{out}/{name}.st",
                )
    if mesh.is_main:
        (Path(out) / "results.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # (a torchrun worker: without finalization, rlhf/engine/mesh.py says why)
    end_process()
