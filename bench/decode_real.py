"""Decode on a real pretrained model: the inference mode against HF ``generate`` and against this
machine's roofline (docs/benchmarks.md, `bench: "decode_real"`).

    python bench/decode_real.py [--model smollm2-135m-instruct] [--batches 1 16 64] [--dtypes fp32
    bf16]
                                [--new 64] [--repeats 2] [--threads N]
                                [--moe EXPERTS [--moe-top-k 2] [--moe-width W]]

One process. The prompts are the held-out prompts of ``recipe=smollm2_arith`` through the model's
chat template (left-padded to the longest), greedy, exactly ``--new`` new tokens each (min = max:
equal work). Variants: ``hybrid`` (the inference mode as a training step calls it,
engine.inference_dtype = the dtype: the training weights gathered into the inference layout, then
the generation), ``hybrid_kept`` (the same with ``engine.release_inference_cache=false``: the
inference weights built once and kept, as between two weight syncs — the decode alone) and
``hf_generate`` (HF ``generate`` on the model cast to the dtype, KV cache on). Metrics per (variant,
dtype, batch): ``tokens_per_s`` (new tokens / wall time of the call, prefill included), and for the
hybrid variants ``vs_hf`` (the ratio) and ``roofline_fraction``: the roofline time of the same call
over the measured time; ``switch_s`` (hybrid): the call's gather into the inference layout. The
roofline of a call is its prefill (FLOPs ÷ peak, or its bytes ÷ bandwidth if larger) plus, per
decode step, the larger of (weights + the KV cache read) ÷ the measured memory bandwidth and the
step's FLOPs (2 × the parameters a token passes through, LM head included, plus attention over the
cached positions) ÷ the measured matmul peak in that dtype (``common.matmul_peak``: a 2048² GEMM,
the faster of torch's and oneDNN's, best of 5, on these threads). Lines carry ``peak_gflops``,
``bandwidth_gb_s``, ``roofline_bound`` (compute or bandwidth) and ``load_1m``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import device_label, matmul_peak  # noqa: E402
from generation import bandwidth_bytes_per_s  # noqa: E402


def best_of(repeats: int, fn, *args, **kwargs) -> float:
    import torch

    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        with torch.no_grad():
            fn(*args, **kwargs)
        best = min(best, time.perf_counter() - t)
    return best


def prompts(tok, n: int):
    from rlhf.config import SyntheticConfig
    from rlhf.data import arith
    from rlhf.data.chat import Renderer, resolve_template

    _, held = arith.generate(
        SyntheticConfig(num_records=1, min_operand=10, max_operand=49), max(n, 64), seed=0
    )
    render = Renderer(tok, resolve_template(tok, "auto"))
    return [render.prompt_ids(e.chat.prompt) for e in held[:n]]


def roofline_s(
    cfg, batch: int, prompt_len: int, new: int, elem: int, peak: float, bw: float
) -> tuple:
    """(seconds, bound) of the roofline of one generate call (see the module's docstring)."""
    h, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    head = cfg.head_dim if getattr(cfg, "head_dim", None) else h // cfg.num_attention_heads
    kv_width = cfg.num_key_value_heads * head
    # q, k, v, o, gate/up/down
    attn = h * (h + 2 * kv_width) + h * h
    per_layer = attn + 3 * h * cfg.intermediate_size
    # Mixture-of-Experts (every layer, as the tiny ones measured): a token passes through its k
    # experts and the router; a step reads the experts some row of the batch was routed to (at
    # most all of them)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", 0) or 0
    read_per_layer = per_layer
    if experts:
        k = cfg.num_experts_per_tok
        width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        per_layer = attn + h * experts + 3 * h * width * k
        read_per_layer = attn + h * experts + 3 * h * width * min(experts, batch * k)
    # the LM head (tied or not, it is read and multiplied)
    passed = layers * per_layer + vocab * h
    weight_bytes = (layers * read_per_layer + vocab * h) * elem
    # prefill: every prompt token through every weight, attention over the prompt (causal: half)
    flops = (
        2 * passed * batch * prompt_len + 2 * 2 * layers * batch * prompt_len * prompt_len / 2 * h
    )
    total = max(flops / peak, weight_bytes / bw)
    bounds = {"compute": 0, "bandwidth": 0}
    for t in range(1, new):
        positions = prompt_len + t
        kv_bytes = layers * batch * positions * 2 * kv_width * elem
        step_flops = 2 * passed * batch + 2 * 2 * layers * batch * positions * h
        c, m = step_flops / peak, (weight_bytes + kv_bytes) / bw
        bounds["compute" if c >= m else "bandwidth"] += 1
        total += max(c, m)
    return total, max(bounds, key=bounds.get)


def moe_model(path: Path, experts: int, top_k: int = 2, width: int = 0) -> Path:
    """A random-init Mixtral of ``path``'s shape (its attention, vocabulary, tokenizer and chat
    template) with ``experts`` experts of MLP width ``width`` (0: the model's), ``top_k`` per
    token, saved to a temporary directory."""
    import tempfile

    import torch
    from transformers import AutoConfig, AutoTokenizer, MixtralConfig, MixtralForCausalLM

    c = AutoConfig.from_pretrained(path, trust_remote_code=False)
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    keep += ("num_attention_heads", "num_key_value_heads", "max_position_embeddings")
    keep += ("rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    cfg = MixtralConfig(**{k: getattr(c, k) for k in keep})
    cfg.num_local_experts, cfg.num_experts_per_tok = experts, top_k
    cfg.intermediate_size = width or cfg.intermediate_size
    torch.manual_seed(0)
    out = Path(tempfile.mkdtemp(prefix="moe-"))
    MixtralForCausalLM(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(path, trust_remote_code=False).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a named model or a directory")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--moe",
        type=int,
        default=0,
        help="a random-init Mixtral of the model's shape with this many experts (top 2, each of "
        "the model's MLP width) instead of the model: the MoE inference mode against HF generate",
    )
    ap.add_argument("--moe-top-k", type=int, default=2, help="with --moe: experts per token")
    ap.add_argument(
        "--moe-width",
        type=int,
        default=0,
        help="with --moe: each expert's MLP width (0: the model's)",
    )
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.config import EngineConfig, TrainConfig
    from rlhf.engine.hybrid import HybridEngine
    from rlhf.engine.infer import left_pad
    from rlhf.engine.mesh import Mesh
    from rlhf.engine.train import TrainEngine
    from rlhf.models import get
    from rlhf.ops import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    path = get.ensure(args.model) if get.is_named(args.model) else Path(args.model)
    if args.moe:
        path = moe_model(path, args.moe, args.moe_top_k, args.moe_width)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    all_prompts = prompts(tok, max(args.batches))
    bw = bandwidth_bytes_per_s()
    base = {
        "bench": "decode_real",
        "workload": Path(path).name,
        "device": device_label("cpu"),
        "new_tokens": args.new,
    }
    base["threads"] = torch.get_num_threads()
    base["torch"] = torch.__version__.split("+")[0]
    for dtype_name in args.dtypes:
        dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
        peak = matmul_peak(dtype)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, trust_remote_code=False
        ).eval()
        engine = TrainEngine(
            model,
            Mesh(),
            EngineConfig(precision="fp32", inference_dtype=dtype_name),
            TrainConfig(lr=1e-6, warmup_steps=0),
        )
        hybrids = {
            name: HybridEngine(engine, tok, EngineConfig(**kw))
            for name, kw in (
                ("hybrid", dict(precision="fp32", inference_dtype=dtype_name)),
                (
                    "hybrid_kept",
                    dict(
                        precision="fp32",
                        inference_dtype=dtype_name,
                        release_inference_cache=False,
                    ),
                ),
            )
        }
        plain = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=False
        ).eval()
        for batch in args.batches:
            ps = all_prompts[:batch]
            sp = SamplingParams(temperature=0, max_new_tokens=args.new, min_new_tokens=args.new)
            ids, mask = left_pad(ps, tok.pad_token_id)
            kw = dict(
                do_sample=False,
                max_new_tokens=args.new,
                min_new_tokens=args.new,
                pad_token_id=tok.pad_token_id,
            )
            # warm-up (hybrid_kept: builds the weights it keeps)
            for hy in hybrids.values():
                hy.generate(ps, SamplingParams(temperature=0, max_new_tokens=2, min_new_tokens=2))
            with torch.no_grad():
                plain.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    **{**kw, "max_new_tokens": 2, "min_new_tokens": 2},
                )
            times = {v: best_of(args.repeats, hy.generate, ps, sp) for v, hy in hybrids.items()}
            one = SamplingParams(temperature=0, max_new_tokens=1)
            switch = hybrids["hybrid"].generate(ps, one).timings["gather_s"]
            times |= {
                "hf_generate": best_of(
                    args.repeats, plain.generate, input_ids=ids, attention_mask=mask, **kw
                ),
            }
            roof, bound = roofline_s(
                model.config, batch, ids.shape[1], args.new, dtype.itemsize, peak, bw
            )
            line = {**base, "dtype": dtype_name, "batch": batch, "prompt_len": ids.shape[1]}
            line.update(load_1m=os.getloadavg()[0], peak_gflops=peak / 1e9, bandwidth_gb_s=bw / 1e9)
            line["roofline_bound"] = bound
            out = [(v, "tokens_per_s", batch * args.new / s) for v, s in times.items()]
            out += [(v, "vs_hf", times["hf_generate"] / times[v]) for v in hybrids]
            out += [(v, "roofline_fraction", roof / s) for v, s in times.items()]
            out.append(("hybrid", "switch_s", switch))
            for variant, metric, value in out:
                print(
                    json.dumps({**line, "variant": variant, "metric": metric, "value": value}),
                    flush=True,
                )
        del model, plain, hybrids, engine


if __name__ == "__main__":
    main()
