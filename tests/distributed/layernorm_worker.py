"""The hybrid engine on 2 ranks (ZeRO-3 actor) for OPT and GPT-2 (learned positions, LayerNorm,
plain MLPs) and GPT-NeoX (parallel blocks, partial rotary, per-head fused q/k/v): greedy tokens vs
HF generate and log-probs vs the FSDP2 training-mode recompute at inference_tp_size 1 and 2 (heads
and MLP columns sliced, the output projections' biases added once), LoRA-adapted ones included
(GPT-2's Conv1D adapters: fan_in_fan_out).

    torchrun --nproc-per-node=2 tests/distributed/layernorm_worker.py OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rlhf.config import EngineConfig  # noqa: E402
from rlhf.engine.mesh import end_process, init_mesh  # noqa: E402
from tests.distributed.hybrid_worker import check  # noqa: E402

CONFIGS = {
    "opt_125m_like": ("opt", {}),
    "opt_350m_like": ("opt", dict(do_layer_norm_before=False, word_embed_proj_dim=32)),
    "gpt2": ("gpt2", {}),
    "gpt_neox": ("gpt_neox", {}),
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
    # (a torchrun worker: without finalization, rlhf/engine/mesh.py says why)
    end_process()
