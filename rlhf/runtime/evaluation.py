"""Gold score: how good the policy really is, by the rule the reward model never sees.

Same seeded held-out prompts and decoding everywhere (docs/contract.md): the first
``eval.gold_prompts`` held-out prompts, ``eval.gold_samples`` samples each at ``eval.temperature``
with seed ``eval.seed``. Greedy gold is reported beside as ``gold/score_greedy``, never as the
headline.

It can be long (256 prompts × 4 samples of a real model's full responses), so it says what it will
generate before it starts and shows its progress on rank 0 (``logger.progress``, as training does);
``eval.gold_prompts=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Callable, Dict, List, Optional, Tuple

from rlhf.config import EvalConfig
from rlhf.data.chat import shown_prompt
from rlhf.data.records import Example
from rlhf.data.tokenize import encode_prompts
from rlhf.engine.mesh import Mesh
from rlhf.ops import SamplingParams
from rlhf.outputs.log import progress
from rlhf.runtime.stage import rank_batches

log = logging.getLogger("rlhf")
_said: set = set()  # lines said once per process


def gold_prompts(held_out: List[Example], ecfg: EvalConfig) -> List[Example]:
    return [e for e in held_out if e.reference is not None][: ecfg.gold_prompts]


def evaluate_gold(
    generate,
    tokenizer,
    held_out: List[Example],
    scorer: Callable[[str, str], float],
    ecfg: EvalConfig,
    mesh: Mesh,
    chat: Optional[str] = None,
    show_progress: bool = True,
    play: Optional[Callable] = None,
    show: int = 0,
    kept: Optional[List[dict]] = None,
) -> dict:
    """``gold/score`` (sampled) and ``gold/score_greedy`` of a policy. ``generate(prompts, params,
    keys)`` is a hybrid engine's (every rank calls it with its share of the prompts, keyed by their
    indices: the same samples on any number of ranks); means are global. ``play(prompts, examples,
    params, keys) -> (final texts, episode stats)``: multi-turn episodes instead of one generation
    (rlhf/rl/episodes.py); then ``gold/tool_use`` (and ``gold/tool_use_greedy``) is the share of
    episodes that called a tool. ``chat``: the chat template the prompts go through
    (``chat.resolve_template``), as in training. ``show_progress``: ``logger.progress`` (a bar in a
    terminal, else a status line every 30 s). ``show``: the responses to the first ``show`` prompts
    (each mode's first sample), appended to ``kept`` on every rank (``show_samples``).
    ``eval.gold_prompts=0``: nothing (said once), ``{}``."""
    if ecfg.gold_prompts == 0:
        if "off" not in _said:
            _said.add("off")
            log.info(
                "eval.gold_prompts=0: no gold evaluation (no gold/score in metrics.jsonl "
                "or summary.json)"
            )
        return {}
    examples = gold_prompts(held_out, ecfg)
    if not examples:
        return {}
    encoded = encode_prompts(examples, tokenizer, chat, ecfg.max_prompt_len)
    max_new = ecfg.max_new_tokens or 16
    results = {}
    modes = [("gold/score", ecfg.temperature, ecfg.gold_samples)]
    if ecfg.greedy_too and ecfg.temperature > 0:
        modes.append(("gold/score_greedy", 0.0, 1))
    # prompts per generate call
    sizes = global_batch_sizes(len(examples), ecfg.batch_size, mesh.world_size)
    responses = len(examples) * sum(samples for _, _, samples in modes)
    _say_plan(len(examples), ecfg, len(modes), responses, max_new, len(modes) * len(sizes))
    bar = progress(responses, 0, show_progress, "gold", mesh.is_main, unit="response", leave=False)
    tool_use = play is not None  # episodes: how often they call a tool
    if play is None:
        play = decoded(generate, tokenizer)
    # this rank's rows of the first `shown` prompts
    mine: List[dict] = []
    shown = show if kept is not None else 0
    for key, temperature, samples in modes:
        total, count, used = 0.0, 0, 0.0
        for b, ix in enumerate(rank_batches(len(examples), ecfg.batch_size, mesh)):
            # collective calls
            sp = SamplingParams(
                temperature=temperature,
                max_new_tokens=max_new,
                samples_per_prompt=samples,
                seed=ecfg.seed,
            )
            texts, stats = play([encoded[i] for i in ix], [examples[i] for i in ix], sp, ix)
            refs = [examples[i].reference for i in ix for _ in range(samples)]
            scores = [scorer(t, r) for t, r in zip(texts, refs)]
            total += sum(scores)
            for j, i in enumerate(ix):
                if i < shown:
                    kind = "eval" if key == "gold/score" else "eval_greedy"
                    k = j * samples
                    mine.append(_shown(kind, i, examples[i], chat, texts[k], scores[k]))
            count += len(texts)
            used += stats.get("used_tools", 0.0)
            bar.step(n=sizes[b] * samples)
        results[key] = mesh.sum(total) / max(mesh.sum(count), 1)
        if tool_use:
            results[key.replace("score", "tool_use")] = mesh.sum(used) / max(mesh.sum(count), 1)
    bar.close()
    if shown:
        rows = [r for part in mesh.all_gather_object(mine) for r in part]
        kept.extend(sorted(rows, key=lambda r: (r["kind"], r["index"])))
    return results


def _say_plan(
    prompts: int, ecfg: EvalConfig, modes: int, responses: int, max_new: int, calls: int
) -> None:
    greedy = ""
    if modes > 1:
        greedy = " + 1 greedy"
    log.info(
        "gold: %d held-out prompts × %d sampled (temperature %g)%s = %d responses of at "
        "most %d new tokens, "
        "in %d generate calls (eval.gold_prompts, eval.gold_samples, eval.greedy_too make "
        "it smaller; "
        "eval.gold_prompts=0 skips it)",
        prompts,
        ecfg.gold_samples,
        ecfg.temperature,
        greedy,
        responses,
        max_new,
        calls,
    )


def _shown(kind: str, index: int, e: Example, chat: Optional[str], response: str, gold) -> dict:
    """A held-out response kept for the log and the report (``show_samples``)."""
    return {
        "kind": kind,
        "index": index,
        "prompt": shown_prompt(e, chat),
        "response": response,
        "gold": gold,
        "reference": e.reference,
    }


def stage_gold(
    cfg,
    hybrid,
    tokenizer,
    held_out: List[Example],
    scorer,
    mesh: Mesh,
    chat,
    kept: List[dict],
    play=None,
) -> dict:
    """``evaluate_gold`` as a stage calls it: the stage's ``eval.*``, its progress setting, and the
    first ``logger.samples`` responses kept in ``kept`` (samples.jsonl)."""
    return evaluate_gold(
        hybrid.generate,
        tokenizer,
        held_out,
        scorer,
        cfg.eval,
        mesh,
        chat,
        cfg.logger.progress,
        play,
        cfg.logger.samples,
        kept,
    )


def evaluate_reward(
    generate,
    tokenizer,
    held_out: List[Example],
    score_rows: Callable,
    ecfg: EvalConfig,
    mesh: Mesh,
    chat: Optional[str] = None,
    kept: Optional[List[dict]] = None,
    show: int = 0,
    even: bool = False,
) -> Tuple[dict, List[Tuple[str, float]]]:
    """The policy's greedy answers to the first ``eval.gold_prompts`` held-out prompts, by the
    reward model's own judgement (``score_rows(generation) -> [B]``, its part of the training
    reward) — any data, no reference needed: how the policy does where it does not train. Returns
    ``{"eval/reward_greedy": their mean reward, "eval/reward_greedy_std": the spread over the
    prompts, "eval/response_tokens_greedy": the answers' mean length}`` and one ``(digest of the
    answer's tokens, reward)`` per prompt, in prompt order, on every rank (rlhf/rl/gate.py compares
    them with step 0's); the first ``show`` prompts' rows (prompt, answer, reward, tokens; kind
    ``eval_reward``) appended to ``kept``. Collective (every rank generates and scores every turn,
    then the ranks' answers are gathered; ``even``: every rank scores as many rows, for a scorer
    whose micro-batches are collective forwards — ``ppo.micro_batch_per_rank``)."""
    examples = held_out[: ecfg.gold_prompts]
    if not examples:
        return {}, []
    encoded = encode_prompts(examples, tokenizer, chat, ecfg.max_prompt_len)
    total, square, length, count = 0.0, 0.0, 0, 0
    mine: Dict[int, Tuple[str, float]] = {}
    rows: List[dict] = []
    for b, ix in enumerate(rank_batches(len(examples), ecfg.batch_size, mesh)):
        sp = SamplingParams(
            temperature=0.0,
            max_new_tokens=ecfg.max_new_tokens or 16,
            samples_per_prompt=1,
            seed=ecfg.seed + b,
        )
        gen = generate([encoded[i] for i in _evened(ix, mesh, even)], sp)
        scores = score_rows(gen)[: len(ix)]
        if ix:
            total, square, count = (
                total + float(scores.sum()),
                square + float((scores * scores).sum()),
                count + len(ix),
            )
        rewards = scores.tolist()
        for j, i in enumerate(ix):
            tokens = gen.responses[j][gen.response_mask[j].bool()].tolist()
            digest = hashlib.blake2b(repr(tokens).encode(), digest_size=8).hexdigest()
            mine[i] = (digest, float(rewards[j]))
            length += len(tokens)
            if kept is not None and i < show:
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                row = {
                    "index": i,
                    "prompt": shown_prompt(examples[i], chat),
                    "response": text,
                    "reward": rewards[j],
                }
                rows.append({"kind": "eval_reward", **row, "tokens": len(tokens)})
    gathered = {i: a for part in mesh.all_gather_object(mine) for i, a in part.items()}
    n = max(mesh.sum(count), 1)
    mean = mesh.sum(total) / n
    res = {
        "eval/reward_greedy": mean,
        "eval/reward_greedy_std": max(mesh.sum(square) / n - mean * mean, 0.0) ** 0.5,
        "eval/response_tokens_greedy": mesh.sum(length) / n,
    }
    if ecfg.reward_samples:
        res.update(_sampled_reward(generate, encoded, score_rows, ecfg, mesh, even))
    if kept is not None and show:
        kept.extend(
            sorted(
                (r for part in mesh.all_gather_object(rows) for r in part), key=lambda r: r["index"]
            )
        )
    return res, [gathered[i] for i in range(len(examples))]


def _evened(ix: List[int], mesh, even: bool) -> List[int]:
    """The prompts a rank generates in a batch: ``ix``, one stand-in when it has none (generation is
    collective), and with ``even`` stand-ins up to the longest rank's (the rows past ``ix``'s are
    not counted)."""
    use = ix or [0]
    if even:
        use = use + [use[0]] * (mesh.max(len(use)) - len(use))
    return use


def _sampled_reward(
    generate, encoded: List[List[int]], score_rows, ecfg: EvalConfig, mesh, even: bool
) -> dict:
    """The reward model's view of ``eval.reward_samples`` samples a held-out prompt at
    ``eval.temperature`` (seeded and keyed by the prompt: the same draws at every evaluation, on
    any world size): their mean, spread and length (``eval/reward_sampled``, ``_std``,
    ``eval/response_tokens_sampled``). Collective."""
    total, square, length, count = 0.0, 0.0, 0, 0
    sp = SamplingParams(
        temperature=ecfg.temperature,
        max_new_tokens=ecfg.max_new_tokens or 16,
        samples_per_prompt=ecfg.reward_samples,
        seed=ecfg.seed + 7919,
    )
    for ix in rank_batches(len(encoded), ecfg.batch_size, mesh):
        use = _evened(ix, mesh, even)
        gen = generate([encoded[i] for i in use], sp, use)
        rows = len(ix) * ecfg.reward_samples
        scores = score_rows(gen)[:rows]
        total += float(scores.sum())
        square += float((scores * scores).sum())
        length += int(gen.response_mask[:rows].sum())
        count += rows
    n = max(mesh.sum(count), 1)
    mean = mesh.sum(total) / n
    return {
        "eval/reward_sampled": mean,
        "eval/reward_sampled_std": max(mesh.sum(square) / n - mean * mean, 0.0) ** 0.5,
        "eval/response_tokens_sampled": mesh.sum(length) / n,
    }


def decoded(generate, tokenizer) -> Callable:
    """``play`` of one generation: each row's response decoded, no episode statistics."""

    def play(
        ids: List[List[int]], examples: List[Example], sp: SamplingParams, keys: List[int]
    ) -> Tuple[List[str], Dict[str, float]]:
        gen = generate(ids, sp, keys)
        texts = tokenizer.batch_decode(
            [row[m.bool()].tolist() for row, m in zip(gen.responses, gen.response_mask)],
            skip_special_tokens=True,
        )
        return texts, {}

    return play


def global_batch_sizes(n: int, micro: int, world_size: int) -> List[int]:
    """Prompts of every rank together in each of ``rank_batches(n, micro, ...)``'s turns (what rank
    0's progress counts without asking the others)."""
    per_rank = [len(range(r, n, world_size)) for r in range(world_size)]
    turns = -(-n // world_size)
    return [sum(max(0, min(micro, k - s)) for k in per_rank) for s in range(0, turns, micro)]
