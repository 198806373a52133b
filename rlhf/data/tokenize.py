"""Tokenization with truncation, a content-hash keyed cache, and collators.

SFT sequence: prompt tokens (left-truncated to max_prompt_len: the end of the prompt, next to the
response, survives) + response tokens + EOS (right-truncated to max_response_len). The loss mask
covers the response (and the prompt too when ``data.mask_prompt=false``).

The cache holds token ids only (safetensors; no pickles), keyed by a hash of the texts, the
tokenizer and the lengths; rank 0 builds it while the other ranks wait.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch

from rlhf.data.records import Example
from rlhf.engine.mesh import Mesh
from rlhf.errors import DataError
from rlhf.fileio import atomic_write_text

Columns = Dict[str, list]  # name -> list of ints, or list of lists of ints (ragged)


def tokenizer_fingerprint(tok) -> str:
    h = hashlib.sha256(tok.backend_tokenizer.to_str().encode() if hasattr(tok, "backend_tokenizer")
                       else repr(tok.get_vocab()).encode())
    h.update(repr((tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)).encode())
    return h.hexdigest()[:16]


def _encode(tok, texts: Sequence[str], special: bool) -> List[List[int]]:
    return tok(list(texts), add_special_tokens=special)["input_ids"] if texts else []


def tokenize_sft(examples: List[Example], tok, max_prompt: int, max_response: int) -> Columns:
    prompts = _encode(tok, [e.prompt for e in examples], True)
    responses = _encode(tok, [e.response for e in examples], False)
    ids, plen = [], []
    for p, r in zip(prompts, responses):
        p = p[-max_prompt:]
        r = (r + [tok.eos_token_id])[:max_response]
        ids.append(p + r)
        plen.append(len(p))
    return {"ids": ids, "prompt_len": plen}


def _save(path: Path, cols: Columns) -> None:
    from safetensors.torch import save_file
    tensors, meta = {}, {}
    for name, col in cols.items():
        if col and isinstance(col[0], list):
            lens = torch.tensor([len(x) for x in col], dtype=torch.int64, device="cpu")
            tensors[f"{name}.flat"] = torch.tensor([t for x in col for t in x], dtype=torch.int32, device="cpu")
            tensors[f"{name}.offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64, device="cpu"), lens.cumsum(0)])
            meta[name] = "ragged"
        else:
            tensors[name] = torch.tensor(col, dtype=torch.int64, device="cpu")
            meta[name] = "flat"
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"columns": json.dumps(meta)})
    tmp.replace(path)


def _load(path: Path) -> Columns:
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["columns"])
    t = load_file(str(path))
    cols: Columns = {}
    for name, kind in meta.items():
        if kind == "ragged":
            flat, off = t[f"{name}.flat"].tolist(), t[f"{name}.offsets"].tolist()
            cols[name] = [flat[off[i]:off[i + 1]] for i in range(len(off) - 1)]
        else:
            cols[name] = t[name].tolist()
    return cols


def cached(kind: str, examples: List[Example], tok, params: dict, cache_dir: Path, mesh: Mesh,
           build: Callable[[], Columns]) -> Columns:
    """``build()`` once per content: rank 0 computes and stores, the others wait and read."""
    h = hashlib.sha256(json.dumps({"kind": kind, "tok": tokenizer_fingerprint(tok), **params},
                                  sort_keys=True).encode())
    for e in examples:
        h.update(json.dumps([e.prompt, e.response, e.chosen, e.rejected]).encode())
    path = Path(cache_dir) / f"{kind}-{h.hexdigest()[:24]}.safetensors"
    if mesh.is_main and not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        _save(path, build())
        atomic_write_text(path.with_suffix(".json"), json.dumps({"kind": kind, "records": len(examples),
                                                                  **params}) + "\n")
    mesh.barrier()
    return _load(path)


def pad_right(seqs: List[List[int]], pad: int) -> torch.Tensor:
    n = max(len(s) for s in seqs)
    out = torch.full((len(seqs), n), pad, dtype=torch.long, device="cpu")
    for i, s in enumerate(seqs):
        out[i, :len(s)] = torch.tensor(s, dtype=torch.long, device="cpu")
    return out


def collate_sft(ids: List[List[int]], prompt_lens: List[int], pad_id: int, mask_prompt: bool) -> dict:
    """input_ids/attention_mask right-padded; labels = -100 on padding (and on the prompt)."""
    input_ids = pad_right(ids, pad_id)
    lengths = torch.tensor([len(s) for s in ids], device="cpu")
    pos = torch.arange(input_ids.shape[1], device="cpu")[None, :]
    attention_mask = (pos < lengths[:, None]).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    if mask_prompt:
        labels = labels.masked_fill(pos < torch.tensor(prompt_lens, device="cpu")[:, None], -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def tokenize_pairs(examples: List[Example], tok, max_prompt: int, max_response: int) -> Columns:
    """Preference pairs: (prompt + chosen + EOS, prompt + rejected + EOS). The prompt is cut from
    the left so that the responses' ends survive; a pair whose response alone is longer than
    ``max_response`` is dropped (counted in ``dropped``); when every pair is, a ``DataError``."""
    prompts = _encode(tok, [e.prompt for e in examples], True)
    chosen = _encode(tok, [e.chosen for e in examples], False)
    rejected = _encode(tok, [e.rejected for e in examples], False)
    out: Columns = {"chosen": [], "rejected": [], "prompt_len": [], "dropped": []}
    dropped, first = 0, None
    for e, p, c, r in zip(examples, prompts, chosen, rejected):
        c, r = c + [tok.eos_token_id], r + [tok.eos_token_id]
        if max(len(c), len(r)) > max_response:
            dropped += 1
            first = first or (e.where or "a generated record", max(len(c), len(r)))
            continue
        p = p[-max_prompt:]
        out["chosen"].append(p + c)
        out["rejected"].append(p + r)
        out["prompt_len"].append(len(p))
    if examples and dropped == len(examples):  # nothing left to train or evaluate on: say why
        raise DataError(f"{first[0]}: response of {first[1]} tokens (with EOS) is longer than "
                        f"data.max_response_len={max_response}, and so is every other pair's "
                        f"({dropped} of {dropped} dropped)")
    out["dropped"] = [dropped]
    return out


def tokenize_prompts(examples: List[Example], tok, max_prompt: int) -> Columns:
    return {"prompt": [p[-max_prompt:] for p in _encode(tok, [e.prompt for e in examples], True)]}


def collate_pairs(chosen: List[List[int]], rejected: List[List[int]], pad_id: int) -> dict:
    """One right-padded batch: the chosen sequences first, then the rejected ones."""
    seqs = list(chosen) + list(rejected)
    input_ids = pad_right(seqs, pad_id)
    lengths = torch.tensor([len(s) for s in seqs], device="cpu")
    attention_mask = (torch.arange(input_ids.shape[1], device="cpu")[None, :] < lengths[:, None]).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask}
