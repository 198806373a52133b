"""The hybrid engine on 2 ranks (ZeRO-3 actor) for OPT and GPT-2 (learned positions, LayerNorm, plain
MLPs) and GPT-NeoX (parallel blocks, partial rotary, per-head fused q/k/v): greedy tokens vs HF generate
and log-probs vs the FSDP2 training-mode recompute at inference_tp_size 1 and 2 (heads and MLP columns
sliced, the output projections' biases added once), LoRA-adapted ones included (GPT-2's Conv1D adapters:
fan_in_fan_out).

    torchrun --nproc-per-node=2 tests/distributed/layernorm_worker.py OUT.json
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
from rlhf.engine.mesh import init_mesh  # noqa: E402
from rlhf.engine.train import TrainEngine  # noqa: E402
from rlhf.ops import SamplingParams  # noqa: E402
from tests.infer_helpers import Tok, hf_greedy, mixed_prompts, tiny_model  # noqa: E402
from tests.unit.test_lora import adapted, merged_copy  # noqa: E402

CONFIGS = {
    "opt_125m_like": ("opt", {}),
    "opt_350m_like": ("opt", dict(do_layer_norm_before=False, word_embed_proj_dim=32)),
    "gpt2": ("gpt2", {}),
    "gpt_neox": ("gpt_neox", {}),
}


def check(mesh, family: str, tp: int, lora: bool = False, **kw) -> dict:
    """Greedy tokens vs HF generate (of PEFT's own merged model with ``lora``), and the sampled tokens'
    log-probs vs the training-mode recompute: the largest gap, and relative to the log-prob's size."""
    mesh.set_inference_tp(tp)
    ecfg = EngineConfig(zero_stage=3, inference_tp_size=tp, precision="fp32")
    model = adapted(family, **kw) if lora else tiny_model(family, perturb=True, **kw)
    ref = merged_copy(model) if lora else copy.deepcopy(model)
    prompts = mixed_prompts(n=4 + mesh.rank, seed=mesh.rank)  # ranks hold different prompts
    eng = TrainEngine(model, mesh, ecfg, TrainConfig(lr=1e-2, warmup_steps=0))
    hy = HybridEngine(eng, Tok, ecfg)
    gen = hy.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, min_new_tokens=10))
    greedy_equal = torch.equal(gen.responses.cpu(), hf_greedy(ref, prompts, 10))
    sp = SamplingParams(temperature=0.8, max_new_tokens=10, samples_per_prompt=2, seed=5)
    gen = hy.generate(prompts, sp)
    with torch.no_grad():
        lp = response_logprobs(eng.forward, gen.sequences, gen.attention_mask, gen.prompt_len, sp.temperature)
    gap = (lp - gen.logprobs).abs() * gen.response_mask
    return {
        "greedy_equal": greedy_equal,
        "logprob_diff": gap.max().item(),
        "logprob_rel_diff": (gap / lp.abs().clamp(min=1.0)).max().item(),
        "inject": hy.inject,
        "rows": gen.sequences.shape[0],
    }


def main(out: str) -> None:
    mesh = init_mesh(EngineConfig(timeout_s=120, precision="fp32"))
    res = {}
    for name, (family, kw) in CONFIGS.items():
        for tp in (1, 2):
            res[f"{name}_tp{tp}"] = check(mesh, family, tp, **kw)
    for name in ("opt_350m_like", "gpt2"):
        family, kw = CONFIGS[name]
        res[f"{name}_lora_tp2"] = check(mesh, family, 2, lora=True, **kw)
    gathered = mesh.all_gather_object(res)
    if mesh.is_main:
        Path(out).write_text(json.dumps(gathered))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
