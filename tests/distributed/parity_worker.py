"""Trains a tiny Llama for a few steps with the real SFT step and prints/writes its loss curve.

Run under torchrun (the distributed side) or imported (the single-process reference):
    torchrun --nproc-per-node=2 tests/distributed/parity_worker.py OUT.json
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rlhf.config import EngineConfig, TrainConfig  # noqa: E402
from rlhf.data.sampler import GlobalBatches  # noqa: E402
from rlhf.data.tokenize import collate_sft  # noqa: E402
from rlhf.engine.mesh import end_process, init_mesh  # noqa: E402
from rlhf.engine.train import TrainEngine  # noqa: E402
from stages.sft import train_step  # noqa: E402

GLOBAL_BATCH, STEPS, PAD = 8, 5, 0
# (name, zero_stage, micro_batch_per_rank at world size 2 — 0 means no accumulation)
CASES = [("zero0", 0, 0), ("zero1", 1, 0), ("zero2", 2, 0), ("zero3", 3, 0), ("zero3_accum", 3, 2)]
# the same with LoRA adapters (PEFT; frozen base weights next to trained adapters in each shard)
LORA_CASES = [
    ("lora_zero0", 0, 0),
    ("lora_zero1", 1, 0),
    ("lora_zero2", 2, 0),
    ("lora_zero3", 3, 2),
]
LORA = dict(r=4, alpha=8.0)


def tiny_model(seed: int = 0, on_meta: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    if on_meta:
        with torch.device("meta"):
            return LlamaForCausalLM(cfg)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def records(n: int = 64, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length, plen = rng.randint(6, 20), rng.randint(1, 5)
        # counting sequences: learnable in a few steps
        start = rng.randint(3, 60)
        out.append(([3 + (start + k) % 58 for k in range(length)], plen))
    return out


def with_lora(model, lora: bool, head=None):
    if not lora:
        return model
    from rlhf.config import LoraConfig
    from rlhf.models.lora import apply_lora

    return apply_lora(model, LoraConfig(**LORA), seed=3, head=head)


def loss_curve(
    mesh,
    zero_stage: int,
    micro: int,
    precision: str = "fp32",
    lora: bool = False,
    packing: bool = True,
) -> list[float]:
    recs = records()
    model = with_lora(tiny_model(on_meta=not mesh.is_main), lora)
    tcfg = TrainConfig(
        max_steps=STEPS,
        global_batch=GLOBAL_BATCH,
        micro_batch_per_rank=micro,
        lr=1e-2,
        warmup_steps=1,
    )
    engine = TrainEngine(
        model, mesh, EngineConfig(zero_stage=zero_stage, precision=precision, packing=packing), tcfg
    )
    micro = micro or GLOBAL_BATCH // mesh.world_size
    batches = GlobalBatches(len(recs), GLOBAL_BATCH, seed=1)
    losses = []
    for step in range(STEPS):
        mbs = [
            collate_sft([recs[i][0] for i in ix], [recs[i][1] for i in ix], PAD, True)
            for ix in batches.micro_batches(step, mesh.rank, mesh.world_size, micro)
        ]
        losses.append(train_step(engine, mbs)[0])
    return losses


def tiny_reward_model(mesh, members: int = 1):
    """The sequence-classification twin of ``tiny_model`` (head initialised as the reward stage
    does; on the meta device on ranks > 0)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlhf.models.value import init_head

    cfg = LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=members,
        pad_token_id=PAD,
    )
    if mesh.is_main:
        torch.manual_seed(0)
        model = LlamaForSequenceClassification(cfg)
        init_head(model)
    else:
        with torch.device("meta"):
            model = LlamaForSequenceClassification(cfg)
    return model


def reward_curve(
    mesh, zero_stage: int = 3, lora: bool = False, packing: bool = True, members: int = 1
) -> list[float]:
    """The reward stage's real step on a tiny sequence-classification Llama (pairs: a counting
    sequence is chosen over a shuffled one); ``members`` > 1: an ensemble with bootstrapped
    pairs."""
    from rlhf.data.sampler import bootstrap_weights
    from rlhf.data.tokenize import collate_pairs
    from rlhf.models.value import ScalarHeadModel
    from stages.reward import train_step as reward_step

    model = tiny_reward_model(mesh, members)
    tcfg = TrainConfig(max_steps=STEPS, global_batch=GLOBAL_BATCH, lr=1e-2, warmup_steps=1)
    model = with_lora(model, lora, head="score")
    ecfg = EngineConfig(zero_stage=zero_stage, precision="fp32", packing=packing)
    engine = TrainEngine(ScalarHeadModel(model), mesh, ecfg, tcfg)
    recs = records()
    rng = random.Random(5)
    rejected = [rng.sample(seq, len(seq)) for seq, _ in recs]
    batches = GlobalBatches(len(recs), GLOBAL_BATCH, seed=1)
    losses = []
    for step in range(STEPS):
        ixs = batches.micro_batches(
            step, mesh.rank, mesh.world_size, GLOBAL_BATCH // mesh.world_size
        )
        mbs = [
            collate_pairs([recs[i][0] for i in ix], [rejected[i] for i in ix], PAD) for ix in ixs
        ]
        weights = None
        if members > 1:
            weights = [
                torch.tensor(bootstrap_weights(ix, members, 1)).view(-1, members) for ix in ixs
            ]
        losses.append(reward_step(engine, mbs, 0.0, weights)[0])
    return losses


def main(out: str) -> None:
    mesh = init_mesh(EngineConfig(timeout_s=120, precision="fp32"))
    results = {name: loss_curve(mesh, z, m) for name, z, m in CASES}
    results["reward_zero3"] = reward_curve(mesh)
    # the padded reference path on 2 ranks (test_parity compares it with the packed single process)
    results["zero3_padded"] = loss_curve(mesh, 3, 0, packing=False)
    results["reward_zero3_padded"] = reward_curve(mesh, packing=False)
    results.update({name: loss_curve(mesh, z, m, lora=True) for name, z, m in LORA_CASES})
    results["reward_lora_zero3"] = reward_curve(mesh, lora=True)
    results["reward_ensemble_zero3"] = reward_curve(mesh, members=3)
    results["world_size"] = mesh.world_size
    if mesh.is_main:
        Path(out).write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # (a torchrun worker: without finalization, rlhf/engine/mesh.py says why)
    end_process()
