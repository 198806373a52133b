"""Gold score: how good the policy really is, by the rule the reward model never sees.

Same seeded held-out prompts and decoding everywhere (docs/contract.md): the first ``eval.gold_prompts``
held-out prompts, ``eval.gold_samples`` samples each at ``eval.temperature`` with seed ``eval.seed``.
Greedy gold is reported beside as ``gold/score_greedy``, never as the headline.
"""
from __future__ import annotations

from typing import Callable, List, Optional

from rlhf.config import EvalConfig
from rlhf.data.records import Example
from rlhf.data.tokenize import encode_prompts
from rlhf.engine.mesh import Mesh
from rlhf.ops import SamplingParams
from rlhf.runtime.stage import rank_batches


def gold_prompts(held_out: List[Example], ecfg: EvalConfig) -> List[Example]:
    return [e for e in held_out if e.reference is not None][:ecfg.gold_prompts]


def evaluate_gold(generate, tokenizer, held_out: List[Example], scorer: Callable[[str, str], float],
               ecfg: EvalConfig, mesh: Mesh, chat: Optional[str] = None) -> dict:
    """``gold/score`` (sampled) and ``gold/score_greedy`` of a policy. ``generate(prompts, params)``
    is a hybrid engine's (every rank calls it with its share of the prompts); means are global.
    ``chat``: the chat template the prompts go through (``chat.resolve_template``), as in training."""
    examples = gold_prompts(held_out, ecfg)
    if not examples:
        return {}
    encoded = encode_prompts(examples, tokenizer, chat)
    max_new = ecfg.max_new_tokens or 16
    results = {}
    modes = [("gold/score", ecfg.temperature, ecfg.gold_samples)]
    if ecfg.greedy_too and ecfg.temperature > 0:
        modes.append(("gold/score_greedy", 0.0, 1))
    for key, temperature, samples in modes:
        total, count = 0.0, 0
        for b, ix in enumerate(rank_batches(len(examples), ecfg.batch_size, mesh)):  # collective calls
            sp = SamplingParams(temperature=temperature, max_new_tokens=max_new, samples_per_prompt=samples,
                                seed=ecfg.seed + b * ecfg.batch_size)
            gen = generate([encoded[i] for i in ix], sp)
            texts = tokenizer.batch_decode(
                [row[m.bool()].tolist() for row, m in zip(gen.responses, gen.response_mask)], skip_special_tokens=True)
            refs = [examples[i].reference for i in ix for _ in range(samples)]
            total += sum(scorer(t, r) for t, r in zip(texts, refs))
            count += len(texts)
        results[key] = mesh.sum(total) / max(mesh.sum(count), 1)
    return results
