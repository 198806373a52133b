"""Gold score: how good the policy really is, by the rule the reward model never sees.

Same seeded held-out prompts and decoding everywhere (CONTRACT.md): the first ``eval.gold_prompts``
held-out prompts, ``eval.gold_samples`` samples each at ``eval.temperature`` with seed ``eval.seed``.
Greedy gold is reported beside as ``gold/score_greedy``, never as the headline.
"""
from __future__ import annotations

from typing import Callable, List, Sequence

import torch

from rlhf.config import EvalConfig
from rlhf.data.records import Example
from rlhf.engine.mesh import Mesh


def left_pad(prompts: Sequence[List[int]], pad_id: int):
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, n - len(p):] = 1
    return ids, mask


def cut_at_eos(tokens: List[int], eos_id: int, pad_id: int) -> List[int]:
    out = []
    for t in tokens:
        if t == eos_id:
            break
        if t != pad_id:
            out.append(t)
    return out


@torch.no_grad()
def hf_sample(model, tokenizer, prompt_ids: List[List[int]], *, temperature: float, max_new_tokens: int,
              batch_size: int, seed: int, device) -> List[List[int]]:
    """Response tokens (up to EOS) for each prompt with HF ``generate`` (pure temperature sampling;
    greedy when temperature is 0). Seeded; the global RNG is left as it was."""
    out: List[List[int]] = []
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for s in range(0, len(prompt_ids), batch_size):
            ids, mask = left_pad(prompt_ids[s:s + batch_size], tokenizer.pad_token_id)
            ids, mask = ids.to(device), mask.to(device)
            kwargs = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                          top_k=0, top_p=1.0)
            if temperature > 0:
                kwargs["temperature"] = temperature
            gen = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
            for row in gen[:, ids.shape[1]:].tolist():
                out.append(cut_at_eos(row, tokenizer.eos_token_id, tokenizer.pad_token_id))
    model.train(was_training)
    return out


def gold_prompts(held_out: List[Example], ecfg: EvalConfig) -> List[Example]:
    return [e for e in held_out if e.reference is not None][:ecfg.gold_prompts]


def gold_score(model, tokenizer, held_out: List[Example], scorer: Callable[[str, str], float],
               ecfg: EvalConfig, mesh: Mesh) -> dict:
    """``gold/score`` (sampled) and ``gold/score_greedy`` of ``model`` (a plain module holding all
    weights on every rank). Prompts are split over ranks; the means are over all of them."""
    examples = gold_prompts(held_out, ecfg)
    if not examples:
        return {}
    encoded = tokenizer([e.prompt for e in examples], add_special_tokens=True)["input_ids"]
    results = {}
    modes = [("gold/score", ecfg.temperature, ecfg.gold_samples)]
    if ecfg.greedy_too and ecfg.temperature > 0:
        modes.append(("gold/score_greedy", 0.0, 1))
    for key, temperature, samples in modes:
        jobs = [(i, k) for i in range(len(examples)) for k in range(samples)][mesh.rank::mesh.world_size]
        responses = hf_sample(model, tokenizer, [encoded[i] for i, _ in jobs], temperature=temperature,
                              max_new_tokens=ecfg.max_new_tokens, batch_size=ecfg.batch_size,
                              seed=ecfg.seed + 1000 * mesh.rank, device=mesh.device)
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        total = sum(scorer(t, examples[i].reference) for (i, _), t in zip(jobs, texts))
        results[key] = mesh.sum(total) / mesh.sum(len(jobs))
    return results
