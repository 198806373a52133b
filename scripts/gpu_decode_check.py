"""The CUDA-graph decode loop against the row-removing loop and HF generate, on a GPU (fp32).

    python scripts/gpu_decode_check.py        # (scripts/gpu_check.sh runs it; exit 1 when a check
    fails)

One JSON line per check, ``{"check": ..., "ok": ..., ...}``, on stdout. The model is the ``small``
bench workload (random Llama, fp32) with the EOS logit raised so that rows end at different steps;
its prompts have different lengths (left padding). Checks:

- greedy: graph-captured static step (engine.cuda_graphs=auto) = row-removing loop (off) = HF
  generate, token for token; log-probs of the two loops within 1e-5;
- sampled (temperature 1, top-p 0.9, min_new_tokens): the same rollouts from the same seed on both
  loops (the draws are made on the CPU generator), reported as the share of equal rows — a sampled
  token can flip where two loops' logits differ in the last bit near a CDF boundary;
- host synchronisations of one graph generation (torch.cuda.set_sync_debug_mode("warn")): about
  one per decode_sync_every steps, not one per step;
- memory: allocated CUDA memory after a generation returns to its level before (graphs, their
  pool and the static cache are released with the inference weights);
- tokens/s of both loops on this workload (bf16 timings: bench/generation.py);
- the packed prefill (bf16 inference copy: the real tokens back to back, flash varlen, no mask)
  against the masked prefill: chosen by default, last-token logits within bf16 rounding, the same
  greedy tokens on ≥ 90% of rows, and both prefills' seconds.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import WORKLOADS, llama_config  # noqa: E402

from rlhf.config import EngineConfig, TrainConfig  # noqa: E402
from rlhf.engine.hybrid import HybridEngine  # noqa: E402
from rlhf.engine.infer import left_pad  # noqa: E402
from rlhf.engine.mesh import init_mesh  # noqa: E402
from rlhf.engine.train import TrainEngine  # noqa: E402
from rlhf.ops import SamplingParams  # noqa: E402

PAD, EOS, NEW = 0, 2, 64


class Tok:
    pad_token_id, eos_token_id = PAD, EOS


def report(check: str, ok: bool, **fields) -> bool:
    print(json.dumps({"check": check, "ok": bool(ok), **fields}), flush=True)
    return bool(ok)


def host_syncs(hy, prompts, sp) -> int:
    """Synchronising CUDA calls during one generation (torch's sync debug mode, as warnings)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hy.generate(prompts, sp)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return len([w for w in caught if "synchroniz" in str(w.message).lower()])


def packed_prefill(model, prompts) -> bool:
    """The packed prefill against the masked one, on a bf16 inference copy."""
    ecfg = EngineConfig(device="cuda", precision="fp32", inference_dtype="bf16")
    hy = HybridEngine(TrainEngine(model, init_mesh(ecfg), ecfg, TrainConfig()), Tok, ecfg)
    m = hy.build_inference_model()
    ok = report("packed_prefill_chosen", m.packed_prefill)
    ids, pmask = left_pad(prompts, PAD, hy.mesh.device)
    P = ids.shape[1]
    rot = m.rotary_table(P, ids.device)
    logits, secs = {}, {}
    m.allocate(ids.shape[0], P, ids.device)
    for packed in (True, False, True, False):
        m.packed_prefill = packed
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            logits[packed] = m.prefill(ids, pmask, rot).float()
        torch.cuda.synchronize()
        secs[packed] = time.perf_counter() - t  # the second round: warm
    gap = ((logits[True] - logits[False]).abs().max() / logits[False].abs().max()).item()
    ok &= report("packed_prefill_logits", gap <= 3e-2, relative_gap=gap)
    same = (logits[True].argmax(-1) == logits[False].argmax(-1)).float().mean().item()
    ok &= report("packed_prefill_greedy", same >= 0.9, share_of_equal_rows=same)
    report(
        "prefill_seconds",
        True,
        packed=round(secs[True], 5),
        masked=round(secs[False], 5),
        rows=len(prompts),
        prompt_len=P,
        real_tokens=int(pmask.sum()),
    )
    m.release()
    return ok


def main() -> int:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(WORKLOADS["small"])).eval()
    with torch.no_grad():
        model.lm_head.weight[EOS] += 0.5 * model.lm_head.weight.abs().max()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 8000, (8 + 7 * i % 50,), generator=g).tolist() for i in range(24)]
    engines = {}
    for graphs in ("auto", "off"):
        ecfg = EngineConfig(device="cuda", precision="fp32", cuda_graphs=graphs)
        mesh = init_mesh(ecfg)
        eng = TrainEngine(model, mesh, ecfg, TrainConfig())
        engines[graphs] = HybridEngine(eng, Tok, ecfg)
    assert engines["auto"].decode == "graphs" and engines["off"].decode == "dynamic"
    device = engines["auto"].mesh.device
    ok = True

    greedy = SamplingParams(temperature=0, max_new_tokens=NEW)
    out = {k: hy.generate(prompts, greedy) for k, hy in engines.items()}
    ids, mask = left_pad(prompts, PAD, device)
    with torch.no_grad():
        hf = engines["off"].engine.module.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=NEW,
            pad_token_id=PAD,
            eos_token_id=EOS,
        )
    hf = hf[:, ids.shape[1] :]
    hf = torch.cat([hf, hf.new_full((hf.shape[0], NEW - hf.shape[1]), PAD)], 1)
    ends = sorted(set(out["off"].response_mask.sum(1).tolist()))
    gap = (out["auto"].logprobs - out["off"].logprobs).abs().max().item()
    ok &= report(
        "greedy_graphs_eq_rows_removed",
        torch.equal(out["auto"].sequences, out["off"].sequences),
        logprob_gap=gap,
        response_lengths=ends,
    )
    ok &= report("greedy_logprob_gap", gap <= 1e-5, value=gap)
    ok &= report("greedy_eq_hf_generate", torch.equal(out["auto"].responses, hf.to(device)))

    sampled = SamplingParams(
        temperature=1.0,
        top_p=0.9,
        max_new_tokens=NEW,
        min_new_tokens=4,
        samples_per_prompt=2,
        seed=3,
    )
    out = {k: hy.generate(prompts, sampled) for k, hy in engines.items()}
    same = (out["auto"].sequences == out["off"].sequences).all(1).float().mean().item()
    ok &= report("sampled_same_rollouts", same >= 0.9, share_of_equal_rows=same)

    syncs = {k: host_syncs(hy, prompts, greedy) for k, hy in engines.items()}
    k = engines["auto"].ecfg.decode_sync_every
    # the row-removing loop (the positive control: the counter sees its per-step checks) vs the
    # graphs
    ok &= report(
        "host_syncs_per_generation",
        syncs["off"] >= NEW - 1 and syncs["auto"] <= NEW // k + 16,
        graphs=syncs["auto"],
        rows_removed=syncs["off"],
        steps=NEW,
        sync_every=k,
    )
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    engines["auto"].generate(prompts, greedy)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated(device)
    ok &= report("memory_released", after <= before + 2**20, before=before, after=after)

    ok &= packed_prefill(model, prompts)

    for hy in engines.values():
        hy.generate(prompts, sampled)  # warm
        torch.cuda.synchronize()
        t = time.perf_counter()
        gen = hy.generate(prompts, sampled)
        torch.cuda.synchronize()
        tps = int(gen.response_mask.sum()) / (time.perf_counter() - t)
        report(f"tokens_per_s_{hy.decode}", True, value=round(tps, 1))
    return 0 if ok else 1


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("gpu_decode_check: no CUDA GPU", file=sys.stderr)
        sys.exit(2)
    sys.exit(main())
