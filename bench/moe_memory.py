"""ZeRO-3 + expert parallelism: training memory per rank of Mixture-of-Experts models, from their
configs on the meta device (docs/benchmarks.md, `bench: "moe_memory"`; no weights, no GPU).

    python bench/moe_memory.py [--models qwen3-30b-a3b deepseek-v3] [--ranks 8 64 512]
                               [--ep 1 8 64] [--compute-bytes 2]

Each model is built from its published config with Transformers on the meta device and its
parameters counted by kind: Ψ_d (dense: embeddings, attention, norms, routers, shared experts,
dense layers' MLPs) and Ψ_e (routed experts). The seed's ZeRO formula (mixed-precision AdamW: 2 + 2
+ 12 = 16 bytes per parameter, ZeRO-3 sharding all of them over the N data-parallel ranks) extended
to experts sharded over an expert-parallel group of ``ep`` ranks (each rank holds E / ep experts;
the N / ep ranks holding the same experts shard their states ZeRO-3 among themselves):

    model states per rank   = 16 · Ψ_d / N + 16 · Ψ_e / (ep · N / ep) = 16 · (Ψ_d + Ψ_e) / N
    gathered while a layer runs (ZeRO-3 all-gathers its parameters in the compute dtype, b bytes):
        without EP: b · (Ψ_d,layer + Ψ_e,layer)      with EP: b · (Ψ_d,layer + Ψ_e,layer / ep)
    peak per rank ≈ states + 2 gathered layers (the one running and the prefetched next; the
    largest layer's)

so EP leaves the sharded states alone and cuts the working set a layer gathers by its experts'
(E − E/ep)/E: what decides whether a model trains at all on a given memory. Activations and the
all-to-all buffers (k · hidden · b bytes per token each way per MoE layer, ``a2a_bytes_per_token``)
come on top and depend on the batch. Per (model, N): variants ``no_ep`` and ``ep<ep>`` (each
ep of ``--ep`` and min(N, E) that divides N and the experts), metrics ``states_gb``, ``layer_gb``
(the largest gathered layer), ``peak_gb``; lines carry ``params_dense``, ``params_experts``,
``experts``, ``top_k``, ``ranks``.
``rlhf``'s engine.expert_parallel (rlhf/engine/experts.py) shards the experts' states over all N
ranks as here.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import device_label  # noqa: E402

# published configs (the Hub's config.json, the fields that shape the parameters)
MODELS = {
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            vocab_size=151936,
            tie_word_embeddings=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
    # Transformers' DeepseekV3Config defaults are DeepSeek-V3's (671B; the multi-token-prediction
    # module of the release is not part of the causal LM)
    "deepseek-v3": ("DeepseekV3Config", dict()),
}
GB = 1e9


def counts(name: str):
    """(Ψ_d, Ψ_e, per layer [(dense, experts)], experts, top k, hidden) of a model's config."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cls, kw = MODELS[name]
    cfg = getattr(transformers, cls)(**kw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    layers = [[0, 0] for _ in range(cfg.num_hidden_layers)]
    dense = experts = 0
    for pname, p in model.named_parameters():
        m = re.search(r"\.layers\.(\d+)\.", pname)
        routed = ".experts." in pname and "shared" not in pname
        if routed:
            experts += p.numel()
        else:
            dense += p.numel()
        if m:
            layers[int(m.group(1))][1 if routed else 0] += p.numel()
    n_experts = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    return dense, experts, layers, n_experts, cfg.num_experts_per_tok, cfg.hidden_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--ep", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--compute-bytes", type=int, default=2, help="bf16 = 2")
    args = ap.parse_args()
    b = args.compute_bytes
    for name in args.models:
        dense, experts, layers, E, k, hidden = counts(name)
        base = {"bench": "moe_memory", "workload": name, "device": device_label("meta")}
        base.update(params_dense=dense, params_experts=experts, experts=E, top_k=k)
        base["a2a_bytes_per_token"] = k * hidden * b
        for n in args.ranks:
            states = 16 * (dense + experts) / n
            line = {**base, "ranks": n, "world_size": n}
            # without EP: ZeRO-3 gathers a layer's every expert
            whole = max(d + e for d, e in layers) * b
            figures = [("no_ep", "states_gb", states), ("no_ep", "layer_gb", whole)]
            figures.append(("no_ep", "peak_gb", states + 2 * whole))
            for ep in sorted({e for e in args.ep if e <= n} | {min(n, E)}):
                if n % ep or E % ep or ep == 1:
                    continue
                layer = max(d + e / ep for d, e in layers) * b
                figures += [(f"ep{ep}", "states_gb", states), (f"ep{ep}", "layer_gb", layer)]
                figures.append((f"ep{ep}", "peak_gb", states + 2 * layer))
            for variant, metric, value in figures:
                out = {**line, "variant": variant, "metric": metric, "value": value / GB}
                print(json.dumps({**out, "unit": "GB"}), flush=True)


if __name__ == "__main__":
    main()
