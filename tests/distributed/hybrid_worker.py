"""Hybrid engine on 2 ranks (ZeRO-3 actor): greedy tokens vs HF generate, log-probs vs the FSDP2
training-mode recompute, and training after generate, for inference_tp_size 1 and 2.

    torchrun --nproc-per-node=2 tests/distributed/hybrid_worker.py OUT.json
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rlhf.config import EngineConfig, TrainConfig  # noqa: E402
from rlhf.engine.hybrid import HybridEngine  # noqa: E402
from rlhf.engine.logprobs import response_logprobs  # noqa: E402
from rlhf.engine.mesh import end_process, init_mesh  # noqa: E402
from rlhf.engine.train import TrainEngine  # noqa: E402
from rlhf.ops import SamplingParams  # noqa: E402
from tests.infer_helpers import Tok, hf_greedy, mixed_prompts, tiny_model  # noqa: E402
from tests.unit.models.test_lora import adapted, merged_copy  # noqa: E402


def step_loss(eng, batch):
    batch = {k: v.to(eng.mesh.device) for k, v in batch.items()}
    logits = eng.forward(**batch).logits
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1)
    )
    eng.backward(loss)
    eng.step()
    return loss.item()


# families with every part that changes the numbers (random biases and q/k norm weights), and
# configs whose row-parallel biases (o_proj, down_proj: added once over the TP group), per-layer
# windows and partial rotary must survive TP slicing
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "qwen3_moe", "mixtral", "qwen2_moe")
CONFIGS = {
    "llama_biases": ("llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    "qwen2_window": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "phi3_partial_rotary": ("phi3", dict(partial_rotary_factor=0.5, sliding_window=6)),
}


def check(
    mesh, family: str, tp: int, hybrid: bool = True, lora: bool = False, expert_parallel=1, **kw
) -> dict:
    """Greedy tokens vs HF generate (of PEFT's own merged model with ``lora``), and the sampled
    tokens' log-probs vs the training-mode recompute: the largest gap, and relative to the
    log-prob's size (None from HF generate, which keeps no logits). Also the layernorm families'
    (layernorm_worker.py)."""
    mesh.set_inference_tp(tp)
    ecfg = EngineConfig(
        zero_stage=3,
        inference_tp_size=tp,
        hybrid=hybrid,
        precision="fp32",
        expert_parallel=expert_parallel,
    )
    if lora:
        model = adapted(family, **kw)
        ref = merged_copy(model)
    else:
        model = tiny_model(family, perturb=True, **kw)
        ref = copy.deepcopy(model)
    prompts = mixed_prompts(n=4 + mesh.rank, seed=mesh.rank)  # ranks hold different prompts
    eng = TrainEngine(model, mesh, ecfg, TrainConfig(lr=1e-2, warmup_steps=0))
    hy = HybridEngine(eng, Tok, ecfg)
    gen = hy.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, min_new_tokens=10))
    greedy_equal = torch.equal(gen.responses.cpu(), hf_greedy(ref, prompts, 10))
    sp = SamplingParams(temperature=0.8, max_new_tokens=10, samples_per_prompt=2, seed=5)
    gen = hy.generate(prompts, sp)
    with torch.no_grad():
        lp = response_logprobs(
            eng.forward, gen.sequences, gen.attention_mask, gen.prompt_len, sp.temperature
        )
    lp_diff = rel_diff = None
    if gen.logprobs is not None:
        gap = (lp - gen.logprobs).abs() * gen.response_mask
        lp_diff, rel_diff = gap.max().item(), (gap / lp.abs().clamp(min=1.0)).max().item()
    return {
        "greedy_equal": greedy_equal,
        "logprob_diff": lp_diff,
        "logprob_rel_diff": rel_diff,
        "inject": hy.inject,
        "rows": gen.sequences.shape[0],
        "switch_s": gen.timings.get("switch_s"),
    }


def no_corruption(mesh) -> list:
    batch = {
        "input_ids": torch.randint(
            3, 97, (4, 12), generator=torch.Generator().manual_seed(mesh.rank), device="cpu"
        )
    }
    out = []
    for do_generate in (False, True):
        ecfg = EngineConfig(zero_stage=3, inference_tp_size=2, precision="fp32")
        mesh.set_inference_tp(2)
        eng = TrainEngine(tiny_model("llama"), mesh, ecfg, TrainConfig(lr=1e-2, warmup_steps=0))
        hy = HybridEngine(eng, Tok, ecfg)
        step_loss(eng, batch)
        if do_generate:
            hy.generate(
                mixed_prompts(seed=mesh.rank), SamplingParams(temperature=1.0, max_new_tokens=6)
            )
        out.append(step_loss(eng, batch))
    return out


def main(out: str) -> None:
    mesh = init_mesh(EngineConfig(timeout_s=120, precision="fp32"))
    res = {}
    for family in FAMILIES:
        for tp in (1, 2):
            res[f"{family}_tp{tp}"] = check(mesh, family, tp)
    for name, (family, kw) in CONFIGS.items():
        res[f"{name}_tp2"] = check(mesh, family, 2, **kw)
    # expert-parallel training weights served by TP 2 (whole experts per TP rank)
    res["mixtral_ep2_tp2"] = check(mesh, "mixtral", 2, expert_parallel=2)
    res["llama_hf_fsdp"] = check(mesh, "llama", 1, hybrid=False)
    res["no_corruption"] = no_corruption(mesh)
    gathered = mesh.all_gather_object(res)
    if mesh.is_main:
        Path(out).write_text(json.dumps(gathered))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # (a torchrun worker: without finalization, rlhf/engine/mesh.py says why)
    end_process()
