"""The data formats (``data.format``): one row each, everything the code knows of a format.

A row names the fields ``data.columns`` may map, the default lengths, the record parser and the
gold scorer. Configuration (rlhf/config.py: validation, ``data.columns``, default lengths, the
default ``eval.max_new_tokens``), reading (``records.read_examples``), the pipeline (generated or
read, the gold scorer of a stage's data) and ``rlhf.rewards.gold`` all read this table, so that a
new format is one parser and one row of ``_ROWS``.

rlhf/config.py imports this table, so nothing in rlhf/data/ imports rlhf/config.py (the folder's
functions that take a ``DataConfig`` or ``SyntheticConfig`` name it in a string annotation only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from rlhf.data import arith, records, synthetic, tool_arith
from rlhf.data.records import TURN_KEYS, Example

# (record under the format's field names, 'file:line') -> Example
Parser = Callable[[dict, str], Example]
# (response, reference) -> gold score in [0, 1]
Scorer = Callable[[str, str], float]
# (data.synthetic: a SyntheticConfig, data.eval_size, seed) -> (training records, held-out records)
Generator = Callable[[Any, int, int], Tuple[List[Example], List[Example]]]
# data.synthetic -> the texts the embedded tokenizer learns
Corpus = Callable[[Any], List[str]]


@dataclass(frozen=True)
class Format:
    name: str  # the value of data.format
    # the fields it reads: what data.columns may map a dataset's own names onto
    fields: Tuple[str, ...]
    # (max_prompt_len, max_response_len) when data.max_prompt_len / data.max_response_len are unset
    lengths: Tuple[int, int]
    # the record parser (data.columns applied first); None: the data is generated (data.synthetic)
    parse: Optional[Parser]
    # the gold scorer: a rule that says how good a response really is, never seen by the reward
    # model (eval gold/score, rlhf.rewards.gold); None: no gold score for this format
    gold: Optional[Scorer] = None
    # turn data: the parser for turns whose role/content keys have other names (data.columns.role,
    # data.columns.content), from those names
    parse_turns: Optional[Callable[[str, str], Parser]] = None
    # eval.max_new_tokens=None: this many new tokens (short answers); None: data.max_response_len
    new_tokens: Optional[int] = None
    # generated formats (parse=None): the generator of their records, and the texts the embedded
    # tokenizer is trained on when a run builds one for the task
    generate: Optional[Generator] = None
    corpus: Optional[Corpus] = None

    @property
    def generated(self) -> bool:
        """The embedded task: generated, no data.path, nothing to parse."""
        return self.parse is None

    def parser(self, columns: Optional[Dict[str, str]] = None) -> Parser:
        """The parser for records read with data.columns ``columns``."""
        columns = columns or {}
        if self.parse_turns is not None and any(k in columns for k in TURN_KEYS):
            return self.parse_turns(*(columns.get(k, k) for k in TURN_KEYS))
        if self.parse is None:
            raise ValueError(f"data.format={self.name} is generated: it has no records to parse")
        return self.parse


# lengths: the 95th percentile of the shared samples (HH-RLHF harmless-base, GSM8K train) in tokens
# of a 32k byte-level BPE, rounded up to a multiple of 64 (hh: prompt p95 337, longer response of a
# pair p95 159; gsm8k: question p95 97, answer p95 169). Formats without a sample of their own take
# the chat numbers (hh's); messages adds room for the chat template's markup. The synthetic task:
# 64/64. tool_arith (rendered by the embedded template, its tokenizer): an SFT prompt with its tool
# turns is at most 62 tokens, a tool call 30 with EOS, the final answer 11: 96/64, 48 new tokens a
# turn. arith (SmolLM2's tokenizer, its chat template): a prompt of at most 40 tokens, an answer of
# a few; 64 new tokens leave room for a worked answer ("34 + 36 = 70"). fields: messages also reads
# the keys of each turn: role and content.
_ROWS = (
    Format(
        "synthetic",
        fields=(),
        lengths=(64, 64),
        parse=None,
        gold=synthetic.gold_score,
        new_tokens=16,
        generate=synthetic.generate,
        corpus=synthetic.tokenizer_corpus,
    ),
    Format(
        "prompt_response",
        fields=("prompt", "response"),
        lengths=(384, 192),
        parse=records.parse_prompt_response,
    ),
    Format(
        "prompt_chosen_rejected",
        fields=("prompt", "chosen", "rejected"),
        lengths=(384, 192),
        parse=records.parse_prompt_chosen_rejected,
    ),
    Format("hh", fields=("chosen", "rejected"), lengths=(384, 192), parse=records.parse_hh),
    Format(
        "gsm8k",
        fields=("question", "answer"),
        lengths=(128, 192),
        parse=records.parse_gsm8k,
        gold=records.gsm8k_score,
    ),
    Format(
        "messages",
        fields=("messages", "prompt", "chosen", "rejected") + TURN_KEYS,
        lengths=(448, 192),
        parse=records.messages_parser(),
        parse_turns=records.messages_parser,
    ),
    # the tool-use task (rlhf/data/tool_arith.py): SFT and PPO only (no preference pairs)
    Format(
        "tool_arith",
        fields=(),
        lengths=(96, 64),
        parse=None,
        gold=synthetic.gold_score,
        new_tokens=48,
        generate=tool_arith.generate,
        corpus=tool_arith.tokenizer_corpus,
    ),
    # arithmetic in natural language through a pretrained model's chat template (rlhf/data/arith.py)
    Format(
        "arith",
        fields=(),
        lengths=(64, 64),
        parse=None,
        gold=arith.gold_score,
        new_tokens=64,
        generate=arith.generate,
        corpus=arith.tokenizer_corpus,
    ),
)
# in this order in messages ("one of ...")
FORMATS: Dict[str, Format] = {f.name: f for f in _ROWS}


def gold_formats() -> Tuple[str, ...]:
    """The formats with a gold scorer, in the table's order."""
    return tuple(name for name, f in FORMATS.items() if f.gold is not None)
