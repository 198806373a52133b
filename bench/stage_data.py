"""The data of bench/stages.py and bench/trl_stages.py: the workloads' tokenizer, model config, rows
(tokenized by the stages' own ``tokenize_sft`` / ``tokenize_pairs``), the fixed-seed batch draws and
the stages' collators (bench/stages.py's docstring describes the workloads)."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# bench/stages.py shares its name with the recipes' package (ROOT/stages): the repository root goes
# first on the path, so that ``import stages`` is the recipes wherever a bench script runs from
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
sys.path.insert(0, str(ROOT))
sys.path.append(str(BENCH))

from common import WORKLOADS, llama_config  # noqa: E402

STAGES = ("sft", "reward", "dpo")
HH_DATA = ROOT / "tests" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
# 512 tokens in all: the Llama's positions
HH_MAX_PROMPT, HH_MAX_RESPONSE = 320, 192
HH_VOCAB = WORKLOADS["small"]["vocab"]
SEQ_WORKLOADS = ("tiny", "small")  # fixed-length rows
# the HH rows on the real pretrained model (rlhf/models/get.py fetches it on first use)
REAL_MODEL = "smollm2-135m-instruct"
ALL_WORKLOADS = ("hh",) + SEQ_WORKLOADS + ("smollm2",)
# bench/stages.py's default: the workloads that need no download
DEFAULT_WORKLOADS = ("hh",) + SEQ_WORKLOADS


@dataclasses.dataclass
class Data:
    """A workload's tokenizer, model config and tokenized rows (the stages' columns)."""

    name: str
    tokenizer: object
    config: object  # LlamaConfig
    sft_examples: list
    pair_examples: list
    sft: dict  # tokenize_sft's columns
    pairs: dict  # tokenize_pairs' columns
    lens: dict  # max_prompt, max_response
    # a real model's directory (its weights and tokenizer), or None: the random-init ``config``
    path: object = None


def digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def digit_tokenizer():
    """bench/ppo.py's tokenizer: the project's BPE, one token per digit."""
    from rlhf.data.tokenizer import train_tokenizer

    texts = ["".join(random.Random(i).choice("0123456789") for _ in range(40)) for i in range(200)]
    return train_tokenizer(texts + ["Q: A: ok"], 300, 1024)


def prepare(name: str, records: int = 512, seed: int = 1) -> Data:
    """The workload's data (see the module docstring); deterministic."""
    from rlhf.data.records import Example, empty_response, read_examples
    from rlhf.data.tokenize import tokenize_pairs, tokenize_sft
    from rlhf.data.tokenizer import train_tokenizer
    from rlhf.runtime.stage import text_corpus

    path = None
    if name in ("hh", "smollm2"):
        examples, _ = read_examples(str(HH_DATA), "hh")
        if name == "smollm2":
            from transformers import AutoConfig, AutoTokenizer

            from rlhf.models import get

            path = get.ensure(REAL_MODEL)
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
            cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
        else:
            tok = train_tokenizer(text_corpus(examples), HH_VOCAB, HH_MAX_PROMPT + HH_MAX_RESPONSE)
            cfg = llama_config(
                WORKLOADS["small"],
                vocab_size=len(tok),
                pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
            )
        lens = dict(max_prompt=HH_MAX_PROMPT, max_response=HH_MAX_RESPONSE)
        sft_examples = [e for e in examples if not empty_response(e)]
        pair_examples = examples
    else:
        w = WORKLOADS[name]
        tok = digit_tokenizer()
        cfg = llama_config(
            w,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
        rng = random.Random(seed)
        # BOS + (prompt_len - 1) digits; (new - 1) digits + EOS
        pair_examples = []
        for _ in range(records):
            prompt = digits(rng, w["prompt_len"] - 1)
            chosen, rejected = digits(rng, w["new"] - 1), digits(rng, w["new"] - 1)
            pair_examples.append(
                Example(prompt=prompt, response=chosen, chosen=chosen, rejected=rejected)
            )
        sft_examples = pair_examples
        lens = dict(max_prompt=w["prompt_len"], max_response=w["new"])
    sft = tokenize_sft(sft_examples, tok, **lens)
    pairs = tokenize_pairs(pair_examples, tok, **lens)
    if name in SEQ_WORKLOADS:
        want = WORKLOADS[name]["prompt_len"] + WORKLOADS[name]["new"]
        got = {len(x) for x in sft["ids"]} | {len(x) for x in pairs["chosen"] + pairs["rejected"]}
        if got != {want}:
            raise RuntimeError(f"{name}: rows of {sorted(got)} tokens, not the workload's {want}")
    return Data(name, tok, cfg, sft_examples, pair_examples, sft, pairs, lens, path)


def batch_indices(n: int, rows: int, steps: int, seed: int) -> list:
    """``steps`` draws of ``rows`` distinct indices in [0, n), fixed by ``seed``."""
    rng = random.Random(seed)
    return [rng.sample(range(n), rows) for _ in range(steps)]


def collate(stage: str, data: Data, indices: list) -> dict:
    """The stage's own batch (its collator on its columns)."""
    from rlhf.data.tokenize import collate_pairs, collate_sft
    from stages import dpo

    pad = data.tokenizer.pad_token_id
    if stage == "sft":
        cols = data.sft
        return collate_sft(
            [cols["ids"][i] for i in indices],
            [cols["prompt_len"][i] for i in indices],
            pad,
            True,
            [cols["mask"][i] for i in indices],
        )
    if stage == "reward":
        cols = data.pairs
        return collate_pairs(
            [cols["chosen"][i] for i in indices], [cols["rejected"][i] for i in indices], pad
        )
    return dpo.collate(data.pairs, indices, pad)


def rows_of(stage: str, data: Data) -> int:
    return len(data.sft["ids"]) if stage == "sft" else len(data.pairs["chosen"])


def save_model(data: Data, out: Path, seed: int = 0) -> tuple:
    """(the directory of the causal LM and tokenizer every stage and TRL start from, its
    parameters): the random-init model saved to ``out``, or the real model's own directory."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if data.path is not None:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(data.config)
        return Path(data.path), sum(p.numel() for p in model.parameters())
    torch.manual_seed(seed)
    model = LlamaForCausalLM(data.config)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    data.tokenizer.save_pretrained(out)
    return out, n
