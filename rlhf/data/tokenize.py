"""Tokenization with truncation, a content-hash keyed cache, and collators.

SFT sequence: prompt tokens (left-truncated to max_prompt_len: the end of the prompt, next to the
response, survives) + response tokens + EOS (right-truncated to max_response_len). The loss mask
(``mask``: 1 on the tokens SFT learns) covers the response, and for conversations every assistant
turn of the prompt too (rlhf/data/chat.py); everything when ``data.mask_prompt=false``.

``chat``: the chat template text (``chat.resolve_template``) or None. Records with turns
(``messages``, and the synthetic task when there is a template) go through it; the others are
their plain text.

Each tokenized set carries ``stats`` (records cut or dropped by the lengths, the 95th percentile
lengths): the stage warns once with the share and the key to change, and stops (exit 2) when
nothing would learn (every GSM8K response cut before its '####' answer).

The cache holds token ids only (safetensors; no pickles), keyed by a hash of the texts, the
tokenizer, the template and the lengths; rank 0 builds it while the other ranks wait.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rlhf.data.chat import Renderer, encode_unique, template_key, uses_chat
from rlhf.data.records import Example
from rlhf.errors import ConfigError, DataError
from rlhf.outputs.fileio import atomic_write_text

log = logging.getLogger("rlhf")
# name -> list of ints, or list of lists of ints (ragged)
Columns = Dict[str, list]
# of the cached columns (2: mask and stats)
SCHEMA = 2


def tokenizer_fingerprint(tok) -> str:
    if hasattr(tok, "backend_tokenizer"):
        text = tok.backend_tokenizer.to_str()
    else:
        text = repr(tok.get_vocab())
    h = hashlib.sha256(text.encode())
    h.update(repr((tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)).encode())
    return h.hexdigest()[:16]


def _encode(tok, texts: Sequence[str], special: bool) -> List[List[int]]:
    """Token ids of each text; repeated texts (prompts and answers repeat) are tokenized once."""
    return encode_unique(tok, texts, special)


def p95(lengths: Sequence[int]) -> int:
    """The 95th percentile (nearest rank) of ``lengths``; 0 for none."""
    if not lengths:
        return 0
    s = sorted(lengths)
    return s[max(0, -(-95 * len(s) // 100) - 1)]


def _split_by_path(examples: List[Example], chat: Optional[str]) -> Tuple[List[int], List[int]]:
    chat_ix = [i for i, e in enumerate(examples) if uses_chat(e, chat)]
    chosen = set(chat_ix)
    return chat_ix, [i for i in range(len(examples)) if i not in chosen]


def _conversation(e: Example, content: str):
    """The record's turns up to its final assistant turn ``content`` (tool calls and results
    first)."""
    return (
        list(e.chat.prompt)
        + list(e.chat.tool_turns or [])
        + [{"role": "assistant", "content": content}]
    )


def _tools(examples: List[Example], ix: List[int]) -> list:
    return [examples[i].chat.tools for i in ix]


def _full_sft_rows(examples: List[Example], tok, chat: Optional[str]):
    """Untruncated (prompt ids, prompt mask, response ids) per record."""
    for e in examples:
        if e.response is None:
            raise DataError(
                f"{e.where or 'a record'}: no response to train on (SFT needs one: for messages "
                f"data a last assistant turn)"
            )
    rows: List[Tuple[List[int], List[int], List[int]]]
    rows = [None] * len(examples)  # type: ignore[list-item]
    chat_ix, text_ix = _split_by_path(examples, chat)
    if text_ix:
        prompts = _encode(tok, [examples[i].prompt for i in text_ix], True)
        responses = _encode(tok, [examples[i].response for i in text_ix], False)
        for i, p, r in zip(text_ix, prompts, responses):
            rows[i] = (p, [0] * len(p), r + [tok.eos_token_id])
    if chat_ix:
        enc = Renderer(tok, chat).encode(
            [_conversation(examples[i], examples[i].chat.response) for i in chat_ix],
            [examples[i].where for i in chat_ix],
            tools=_tools(examples, chat_ix),
        )
        for i, (ids, mask, last) in zip(chat_ix, enc):
            rows[i] = (ids[:last], mask[:last], ids[last:])
    return rows


def _answer_kept(tok, e: Example, kept: List[int]) -> bool:
    return e.answer is None or e.answer in tok.decode(kept, skip_special_tokens=True)


def tokenize_sft(
    examples: List[Example], tok, max_prompt: int, max_response: int, chat: Optional[str] = None
) -> Columns:
    ids, plen, masks = [], [], []
    prompt_cut = response_cut = answers = answers_lost = 0
    p_lens, r_lens = [], []
    for e, (p, pm, r) in zip(examples, _full_sft_rows(examples, tok, chat)):
        p_lens.append(len(p))
        r_lens.append(len(r))
        prompt_cut += len(p) > max_prompt
        p, pm = p[-max_prompt:], pm[-max_prompt:]
        kept = r[:max_response]
        if len(r) > max_response:
            response_cut += 1
            answers_lost += not _answer_kept(tok, e, kept)
        answers += e.answer is not None
        ids.append(p + kept)
        plen.append(len(p))
        masks.append(pm + [1] * len(kept))
    stats = [
        len(examples),
        prompt_cut,
        response_cut,
        answers,
        answers_lost,
        p95(p_lens),
        p95(r_lens),
    ]
    return {"ids": ids, "prompt_len": plen, "mask": masks, "stats": stats}


def _save(path: Path, cols: Columns) -> None:
    tensors, meta = {}, {}
    for name, col in cols.items():
        if col and isinstance(col[0], list):
            lens = torch.tensor([len(x) for x in col], dtype=torch.int64, device="cpu")
            tensors[f"{name}.flat"] = torch.tensor(
                [t for x in col for t in x], dtype=torch.int32, device="cpu"
            )
            tensors[f"{name}.offsets"] = torch.cat(
                [torch.zeros(1, dtype=torch.int64, device="cpu"), lens.cumsum(0)]
            )
            meta[name] = "ragged"
        else:
            tensors[name] = torch.tensor(col, dtype=torch.int64, device="cpu")
            meta[name] = "flat"
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"columns": json.dumps(meta)})
    tmp.replace(path)


def _load(path: Path) -> Columns:
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["columns"])
    t = load_file(str(path))
    cols: Columns = {}
    for name, kind in meta.items():
        if kind == "ragged":
            flat, off = t[f"{name}.flat"].tolist(), t[f"{name}.offsets"].tolist()
            cols[name] = [flat[off[i] : off[i + 1]] for i in range(len(off) - 1)]
        else:
            cols[name] = t[name].tolist()
    return cols


def cached(
    kind: str,
    examples: List[Example],
    tok,
    params: dict,
    cache_dir: Path,
    mesh,
    build: Callable[[], Columns],
) -> Columns:
    """``build()`` once per content: rank 0 computes and stores, the others wait and read. Then
    (every rank, cached or not) ``report_lengths``: the warning once, the stop when nothing learns.
    ``mesh``: the process group as far as data needs it (``is_main`` and ``barrier()``; an
    ``rlhf.engine.mesh.Mesh``, which this folder does not import: data depends on nothing above
    it)."""
    params = {k: (template_key(v) if k == "chat" else v) for k, v in params.items()}
    h = hashlib.sha256(
        json.dumps(
            {"kind": kind, "tok": tokenizer_fingerprint(tok), "schema": SCHEMA, **params},
            sort_keys=True,
        ).encode()
    )
    for e in examples:
        h.update(json.dumps([e.prompt, e.response, e.chosen, e.rejected]).encode())
        if e.chat is not None:
            h.update(
                json.dumps(
                    [e.chat.prompt, e.chat.response, e.chat.chosen, e.chat.rejected]
                ).encode()
            )
            if e.chat.tools or e.chat.tool_turns:
                # only then: the keys of records without them stand
                h.update(json.dumps([e.chat.tools, e.chat.tool_turns]).encode())
    path = Path(cache_dir) / f"{kind}-{h.hexdigest()[:24]}.safetensors"
    if mesh.is_main and not path.is_file():
        cols = build()
        # a set nothing would learn from: stop before writing
        report_lengths(kind, cols, params, warn=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        _save(path, cols)
        atomic_write_text(
            path.with_suffix(".json"),
            json.dumps({"kind": kind, "records": len(examples), **params}) + "\n",
        )
    mesh.barrier()
    cols = _load(path)
    report_lengths(kind, cols, params, warn=mesh.is_main)
    return cols


_warned: set = set()


def cached_pairs(
    train: List[Example], held_out: List[Example], tok, lens: dict, cache_dir: Path, mesh
):
    """(train, held-out) preference pairs tokenized (``tokenize_pairs`` with ``lens``) through the
    cache, under the kinds the reward and DPO stages share: the same pairs tokenize once for
    both."""
    pairs = cached(
        "pairs", train, tok, lens, cache_dir, mesh, lambda: tokenize_pairs(train, tok, **lens)
    )
    return pairs, cached(
        "pairs-eval",
        held_out,
        tok,
        lens,
        cache_dir,
        mesh,
        lambda: tokenize_pairs(held_out, tok, **lens),
    )


def _is_main() -> bool:
    """Rank 0 of a torchrun job (or a single process): the one that warns."""
    return os.environ.get("RANK", "0") == "0"


def _pct(k: int, n: int) -> str:
    share = 100.0 * k / max(n, 1)
    return f"{share:.0f}%" if share >= 1 or k == 0 else f"{share:.1f}%"


def report_lengths(kind: str, cols: Columns, params: dict, warn: bool = True) -> None:
    """The share of records the lengths cut or drop, as one warning per kind (training sets; the
    held-out ones only stop the run), and a DataError when no response keeps its answer."""
    stats = cols.get("stats")
    if not stats:
        return
    mp, mr = params.get("max_prompt"), params.get("max_response")
    parts = []
    if kind.startswith("sft"):
        n, prompt_cut, response_cut, answers, lost, p_p95, r_p95 = stats
        if answers and lost == answers:
            raise DataError(
                f"data.max_response_len={mr} cuts the answer ('#### <number>') off every "
                "one of the "
                f"{answers} responses that have one ({kind} data; 95% of its responses fit in "
                f"{r_p95} tokens): nothing would learn to answer, raise data.max_response_len"
            )
        if prompt_cut:
            parts.append(
                f"{_pct(prompt_cut, n)} have their prompt cut to data.max_prompt_len={mp} "
                f"(95% fit in {p_p95} tokens)"
            )
        if response_cut:
            lost_part = f", {_pct(lost, answers)} of the answers ('####') with it" if lost else ""
            parts.append(
                f"{_pct(response_cut, n)} their response cut to data.max_response_len={mr} "
                f"(95% fit in {r_p95} tokens){lost_part}"
            )
    elif kind.startswith("pairs"):
        n, prompt_cut, dropped, p_p95, r_p95 = stats
        if dropped:
            parts.append(
                f"{_pct(dropped, n)} are dropped, their response longer than "
                f"data.max_response_len={mr} "
                f"(95% fit in {r_p95} tokens)"
            )
        if prompt_cut:
            parts.append(
                f"{_pct(prompt_cut, n)} have their prompt cut to data.max_prompt_len={mp} "
                f"(95% fit in {p_p95} tokens)"
            )
    else:
        return
    if parts and warn and not kind.endswith("-eval"):
        msg = (
            f"{kind} data: of {n} records, " + "; ".join(parts) + " (raise those keys to keep more)"
        )
        if msg not in _warned:
            _warned.add(msg)
            log.warning(msg)


def pad_right(seqs: List[List[int]], pad: int) -> torch.Tensor:
    n = max(len(s) for s in seqs)
    out = torch.full((len(seqs), n), pad, dtype=torch.long, device="cpu")
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long, device="cpu")
    return out


def collate_sft(
    ids: List[List[int]],
    prompt_lens: List[int],
    pad_id: int,
    mask_prompt: bool,
    masks: Optional[List[List[int]]] = None,
) -> dict:
    """input_ids/attention_mask right-padded; labels = -100 on padding (and, with ``mask_prompt``,
    where ``masks`` is 0 — the tokens SFT does not learn —, or before ``prompt_lens`` without
    masks)."""
    input_ids = pad_right(ids, pad_id)
    lengths = torch.tensor([len(s) for s in ids], device="cpu")
    pos = torch.arange(input_ids.shape[1], device="cpu")[None, :]
    attention_mask = (pos < lengths[:, None]).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    if mask_prompt and masks is not None:
        learn = pad_right(masks, 0).bool()
        labels = labels.masked_fill(~learn, -100)
    elif mask_prompt:
        labels = labels.masked_fill(pos < torch.tensor(prompt_lens, device="cpu")[:, None], -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _full_pair_rows(examples: List[Example], tok, chat: Optional[str]):
    """Untruncated (prompt ids, chosen ids, rejected ids) per pair, each response with its EOS."""
    rows: list = [None] * len(examples)
    chat_ix, text_ix = _split_by_path(examples, chat)
    if text_ix:
        prompts = _encode(tok, [examples[i].prompt for i in text_ix], True)
        chosen = _encode(tok, [examples[i].chosen for i in text_ix], False)
        rejected = _encode(tok, [examples[i].rejected for i in text_ix], False)
        for i, p, c, r in zip(text_ix, prompts, chosen, rejected):
            rows[i] = (p, c + [tok.eos_token_id], r + [tok.eos_token_id])
    if chat_ix:
        render = Renderer(tok, chat)
        wheres, tools = [examples[i].where for i in chat_ix], _tools(examples, chat_ix)
        c_enc = render.encode(
            [_conversation(examples[i], examples[i].chat.chosen) for i in chat_ix],
            wheres,
            tools=tools,
        )
        r_enc = render.encode(
            [_conversation(examples[i], examples[i].chat.rejected) for i in chat_ix],
            wheres,
            tools=tools,
        )
        for i, (c_ids, _, c_last), (r_ids, _, r_last) in zip(chat_ix, c_enc, r_enc):
            rows[i] = (c_ids[:c_last], c_ids[c_last:], r_ids[r_last:])
    return rows


def tokenize_pairs(
    examples: List[Example], tok, max_prompt: int, max_response: int, chat: Optional[str] = None
) -> Columns:
    """Preference pairs: (prompt + chosen + EOS, prompt + rejected + EOS). The prompt is cut from
    the left so that the responses' ends survive; a pair whose response alone is longer than
    ``max_response`` is dropped (counted in ``dropped``); when every pair is, a ``DataError``."""
    for e in examples:
        if e.chosen is None or e.rejected is None:
            raise DataError(f"{e.where or 'a record'}: no preference pair (chosen and rejected)")
    out: Columns = {"chosen": [], "rejected": [], "prompt_len": [], "dropped": []}
    dropped, prompt_cut, first = 0, 0, None
    p_lens, r_lens = [], []
    for e, (p, c, r) in zip(examples, _full_pair_rows(examples, tok, chat)):
        p_lens.append(len(p))
        r_lens.append(max(len(c), len(r)))
        if max(len(c), len(r)) > max_response:
            dropped += 1
            first = first or (e.where or "a generated record", max(len(c), len(r)))
            continue
        prompt_cut += len(p) > max_prompt
        p = p[-max_prompt:]
        out["chosen"].append(p + c)
        out["rejected"].append(p + r)
        out["prompt_len"].append(len(p))
    if examples and dropped == len(examples):
        # nothing left to train or evaluate on: say why
        raise DataError(
            f"{first[0]}: response of {first[1]} tokens (with EOS) is longer than "
            f"data.max_response_len={max_response}, and so is every other pair's "
            f"({dropped} of {dropped} dropped; 95% fit in {p95(r_lens)})"
        )
    out["dropped"] = [dropped]
    out["stats"] = [len(examples), prompt_cut, dropped, p95(p_lens), p95(r_lens)]
    return out


def encode_prompts(
    examples: List[Example], tok, chat: Optional[str] = None, max_prompt: Optional[int] = None
) -> List[List[int]]:
    """Prompt ids: plain text with the tokenizer's special prefix, or turns rendered with the
    generation prompt (exactly the prompt part of the SFT and pair sequences; for a record with tool
    turns, the opening before them, with its tools). ``max_prompt``: each keeps its last this many
    tokens (the rule of training prompts, ``tokenize_prompts``: the end, next to the answer,
    survives); None = untruncated."""
    out: List[List[int]] = [None] * len(examples)  # type: ignore[list-item]
    chat_ix, text_ix = _split_by_path(examples, chat)
    for i, ids in zip(text_ix, _encode(tok, [examples[i].prompt for i in text_ix], True)):
        out[i] = ids
    if chat_ix:
        enc = Renderer(tok, chat).encode(
            [examples[i].chat.prompt for i in chat_ix],
            [examples[i].where for i in chat_ix],
            tools=_tools(examples, chat_ix),
        )
        for i, (ids, _, _) in zip(chat_ix, enc):
            out[i] = ids
    if max_prompt is not None:
        out = [p[-max_prompt:] for p in out]
    return out


def tokenize_prompts(
    examples: List[Example],
    tok,
    max_prompt: int,
    chat: Optional[str] = None,
    max_new_tokens: Optional[int] = None,
    new_tokens_key: str = "ppo.max_new_tokens",
) -> Columns:
    """PPO prompts, left-truncated to ``max_prompt`` (a warning says how many). With
    ``max_new_tokens``: a ConfigError when no reference response reaches its answer ('####')
    within that many tokens (the policy imitates them: it would never be scored right), a warning
    when fewer than half do."""
    full = encode_prompts(examples, tok, chat)
    cut = sum(len(p) > max_prompt for p in full)
    if cut and _is_main():
        log.warning(
            "ppo prompts: %s of %d are cut to data.max_prompt_len=%d (95%% fit in %d): raise "
            "data.max_prompt_len to keep more",
            _pct(cut, len(full)),
            len(full),
            max_prompt,
            p95([len(p) for p in full]),
        )
    if max_new_tokens is not None:
        check_answer_budget(examples, tok, max_new_tokens, new_tokens_key)
    return {"prompt": [p[-max_prompt:] for p in full]}  # (encode_prompts' rule)


def answer_lengths(examples: List[Example], tok) -> List[int]:
    """Tokens each reference response needs to write its answer (GSM8K: up to the end of '####
    n')."""
    heads = []
    for e in examples:
        if e.answer is not None and e.response is not None and e.answer in e.response:
            heads.append(e.response[: e.response.index(e.answer) + len(e.answer)])
    return [len(x) for x in _encode(tok, heads, False)]


def check_answer_budget(examples: List[Example], tok, max_new_tokens: int, key: str) -> None:
    need = answer_lengths(examples, tok)
    if not need:
        return
    reach = sum(n <= max_new_tokens for n in need)
    if reach == 0:
        raise ConfigError(
            f"{key}={max_new_tokens} is too short to reach an answer: the shortest of the "
            f"{len(need)} reference responses needs {min(need)} tokens to write its '#### "
            "<number>' "
            f"(95% need at most {p95(need)}), so no response would ever be scored right: "
            f"raise {key}"
        )
    if reach < len(need) / 2 and _is_main():
        log.warning(
            "%s=%d: only %s of the reference responses reach their answer ('####') within it (95%% "
            "need at most %d tokens): raise %s",
            key,
            max_new_tokens,
            _pct(reach, len(need)),
            p95(need),
            key,
        )


def pair_tokens(cols: Columns) -> List[int]:
    """Each pair's real tokens of ``tokenize_pairs`` columns, chosen + rejected (one micro-batch
    holds both: what train.max_tokens_per_micro_batch counts)."""
    return [len(c) + len(r) for c, r in zip(cols["chosen"], cols["rejected"])]


def collate_pairs(chosen: List[List[int]], rejected: List[List[int]], pad_id: int) -> dict:
    """One right-padded batch: the chosen sequences first, then the rejected ones."""
    seqs = list(chosen) + list(rejected)
    input_ids = pad_right(seqs, pad_id)
    lengths = torch.tensor([len(s) for s in seqs], device="cpu")
    attention_mask = (
        torch.arange(input_ids.shape[1], device="cpu")[None, :] < lengths[:, None]
    ).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask}
