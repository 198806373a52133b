"""Records of every data format, read from local files with file:line error reporting.

One ``Example`` type serves all stages: SFT reads (prompt, response), the reward stage
(prompt, chosen, rejected), PPO (prompt, reference). A format provides what it can; asking a
format for a view it lacks is a configuration error. ``messages`` records also keep their turns
(``Example.chat``) for the chat-template path (rlhf/data/chat.py); their text fields hold the same
turns as plain "\\n\\nHuman: …\\n\\nAssistant: …" text.

Sources: JSON/JSONL/Parquet files (``.gz`` too), directories of them, ``datasets.save_to_disk``
folders (``load_from_disk``; a DatasetDict's split by ``data.hf_split``) and hub ids
(``data.hf_config``, ``data.hf_split``). ``data.columns`` renames a dataset's columns to the
format's fields before parsing. The parsers (and GSM8K's gold scorer) are here; which format uses
which is the one table of formats, rlhf/data/formats.py.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

from rlhf.errors import DataError, first_line

# {"role": system|user|assistant (tool: tool_arith records), "content": text}
Turn = Dict[str, str]
# a turn's keys; data.columns.role / .content name a dataset's own
TURN_KEYS = ("role", "content")


@dataclass
class Chat:
    """A record as conversation turns, for the chat-template path (rlhf/data/chat.py).

    ``prompt``: the turns before the final assistant turn (earlier assistant turns included; SFT
    trains on those too); ``response``/``chosen``/``rejected``: the final assistant turn's content.
    ``needs_template``: true for data that only exists as turns (``messages``): without a chat
    template it renders with the plain fallback; false where the text fields are the same record
    already (the synthetic task: its template-free text is the prompt as it always was).

    Tool use (the ``tool_arith`` task, rlhf/data/tool_arith.py): ``tools`` are the JSON-schema
    function dicts (``{"type": "function", "function": {...}}``) the template is given with every
    rendering of the record (``apply_chat_template(..., tools=)``); ``tool_turns`` are the turns
    between the prompt and the final response that a rollout produces — assistant tool calls and the
    ``tool`` role's results. SFT trains on their assistant turns (never on a tool result); PPO and
    gold prompts stop at ``prompt``, the opening a rollout starts from (it must not already hold the
    tool's answer)."""

    prompt: List[Turn]
    response: Optional[str] = None
    chosen: Optional[str] = None
    rejected: Optional[str] = None
    needs_template: bool = True
    tools: Optional[List[dict]] = None
    tool_turns: Optional[List[Turn]] = None


@dataclass
class Example:
    prompt: str
    response: Optional[str] = None  # SFT target
    chosen: Optional[str] = None  # preferred response (reward stage)
    rejected: Optional[str] = None
    reference: Optional[str] = None  # what the gold scorer compares against
    where: str = ""  # file:line of the record, for messages
    # the record as turns (messages format, the synthetic task)
    chat: Optional[Chat] = None
    # the text the response must keep to be scored (GSM8K: '#### 72')
    answer: Optional[str] = None


HH_ASSISTANT = "\n\nAssistant:"


class Record(dict):
    """A raw record with data.columns applied: ``aliases`` maps a format field to the dataset
    column it came from, so that errors name the column the user has."""

    # set by apply_columns, the one place that makes a Record
    aliases: Dict[str, str]


def _q(rec: dict, name: str) -> str:
    """A field's name for a message, quoted: the dataset's own column when data.columns renamed
    it."""
    alias = rec.aliases.get(name) if isinstance(rec, Record) else None
    return f"'{alias}' (data.columns.{name})" if alias else f"'{name}'"


def _field(rec: dict, name: str, where: str, allow_empty: bool = False) -> str:
    if name not in rec:
        raise DataError(f"{where}: record has no field {_q(rec, name)}")
    v = rec[name]
    if not isinstance(v, str):
        raise DataError(f"{where}: field {_q(rec, name)} must be a string, got {type(v).__name__}")
    if not allow_empty and not v.strip():
        raise DataError(f"{where}: field {_q(rec, name)} is empty")
    return v


def apply_columns(rec: dict, columns: Dict[str, str]) -> dict:
    """The record under the format's field names: each ``columns`` entry (format field -> dataset
    column) renames a column; a column the record lacks leaves the field absent (the parser then
    names the missing column)."""
    if not columns:
        return rec
    out = Record((k, v) for k, v in rec.items() if k not in columns)
    out.aliases = {}
    for name, column in columns.items():
        if name in TURN_KEYS:
            # keys inside each turn of a messages record
            continue
        out.aliases[name] = column
        if column in rec:
            out[name] = rec[column]
    return out


def empty_response(e: Example) -> bool:
    """Whether ``e``'s response (the last assistant turn; a pair's chosen one) is there but empty or
    blank. Every format reads such a record (a pair compares the empty answer as it is: saying
    nothing can be the better answer, as in HH-RLHF); SFT, which would learn to answer with nothing,
    skips it (rlhf/data/pipeline.py)."""
    return e.response is not None and not e.response.strip()


def parse_prompt_response(rec: dict, where: str) -> Example:
    return Example(
        prompt=_field(rec, "prompt", where),
        response=_field(rec, "response", where, allow_empty=True),
        where=where,
    )


def parse_prompt_chosen_rejected(rec: dict, where: str) -> Example:
    chosen = _field(rec, "chosen", where, allow_empty=True)
    return Example(
        prompt=_field(rec, "prompt", where),
        response=chosen,
        chosen=chosen,
        rejected=_field(rec, "rejected", where, allow_empty=True),
        where=where,
    )


def split_hh(dialogue: str, where: str, name: str) -> Tuple[str, str]:
    """HH-RLHF: the prompt is everything up to and including the last '\\n\\nAssistant:'."""
    i = dialogue.rfind(HH_ASSISTANT)
    if i < 0:
        raise DataError(f"{where}: field '{name}' has no '\\n\\nAssistant:' turn")
    cut = i + len(HH_ASSISTANT)
    return dialogue[:cut], dialogue[cut:]


def parse_hh(rec: dict, where: str) -> Example:
    prompt, chosen = split_hh(_field(rec, "chosen", where), where, "chosen")
    rej_dialogue = _field(rec, "rejected", where)
    if rej_dialogue.startswith(prompt):
        rejected = rej_dialogue[len(prompt) :]
    else:
        rejected = split_hh(rej_dialogue, where, "rejected")[1]
    if not prompt.strip():
        raise DataError(f"{where}: field 'chosen' has an empty prompt")
    return Example(prompt=prompt, response=chosen, chosen=chosen, rejected=rejected, where=where)


GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def gsm8k_prompt(question: str) -> str:
    return f"Question: {question.strip()}\nAnswer:"


def parse_gsm8k(rec: dict, where: str) -> Example:
    question = _field(rec, "question", where)
    answer = _field(rec, "answer", where)
    m = GSM8K_ANSWER.search(answer)
    if m is None:
        raise DataError(f"{where}: field {_q(rec, 'answer')} does not end in '#### <number>'")
    response = " " + answer.strip()
    return Example(
        prompt=gsm8k_prompt(question),
        response=response,
        reference=m.group(1).replace(",", ""),
        where=where,
        answer=GSM8K_ANSWER.search(response).group(0),
    )


def _number(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def gsm8k_score(response: str, reference: str) -> float:
    """GSM8K's gold scorer: exact match of the final answer, the number after '####' equals the
    reference's (GSM8K's own answer format; a response that never writes '####' scores 0, as it
    gives no final answer)."""
    m = GSM8K_ANSWER.search(response)
    if m is None:
        return 0.0
    found = m.group(1)
    a, b = _number(found), _number(reference)
    return 1.0 if a is not None and b is not None and abs(a - b) < 1e-6 else 0.0


# ---- messages: a list of {role, content} turns ----
ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {
    "human": "user",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
}  # ShareGPT-style names


def turns_of(
    value, where: str, name: str, role_key: str = "role", content_key: str = "content"
) -> List[Turn]:
    """A validated list of turns (roles normalised: ShareGPT's human/gpt become user/assistant)."""
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else type(value).__name__
        raise DataError(
            f"{where}: field '{name}' must be a non-empty list of {{{role_key}, "
            f"{content_key}}} turns, got {got}"
        )
    out: List[Turn] = []
    for i, turn in enumerate(value):
        at = f"{where}: field '{name}'[{i}]"
        if not isinstance(turn, dict):
            raise DataError(
                f"{at} must be an object with '{role_key}' and '{content_key}', got "
                f"{type(turn).__name__}"
            )
        role, content = turn.get(role_key), turn.get(content_key)
        if not isinstance(role, str):
            hint = ""
            if role_key == "role":
                hint = " (set data.columns.role to the turns' role key)"
            raise DataError(f"{at} has no '{role_key}'{hint}")
        role = ROLE_ALIASES.get(role.strip().lower(), role.strip().lower())
        if role not in ROLES:
            raise DataError(
                f"{at} has {role_key}={turn.get(role_key)!r}: expected system, user or assistant"
            )
        if not isinstance(content, str):
            hint = ""
            if content_key == "content" and content_key not in turn:
                hint = " (set data.columns.content to the turns' text key)"
            raise DataError(f"{at} has no string '{content_key}'{hint}")
        out.append({"role": role, "content": content})
    return out


def plain_text(turns: List[Turn], generation_prompt: bool = True) -> str:
    """Turns as plain text in HH-RLHF's form (the same as chat.FALLBACK_TEMPLATE renders them)."""
    head = {"user": "\n\nHuman: ", "assistant": "\n\nAssistant: ", "system": ""}
    text = "".join(head[t["role"]] + t["content"] for t in turns)
    return text + (HH_ASSISTANT if generation_prompt else "")


def _common_prefix(a: List[Turn], b: List[Turn]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def _prompt_turns(rec: dict, where: str, keys) -> List[Turn]:
    value = rec["prompt"]
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: field {_q(rec, 'prompt')} is empty")
        return [{"role": "user", "content": value}]
    return turns_of(value, where, "prompt", *keys)


def messages_parser(
    role_key: str = "role", content_key: str = "content"
) -> Callable[[dict, str], Example]:
    keys = (role_key, content_key)

    def parse(rec: dict, where: str) -> Example:
        if "chosen" in rec or "rejected" in rec:
            return _message_pair(rec, where, keys)
        if "messages" not in rec:
            raise DataError(
                f"{where}: record has no field {_q(rec, 'messages')} (nor 'chosen' and 'rejected')"
            )
        turns = turns_of(rec["messages"], where, "messages", *keys)
        if turns[-1]["role"] != "assistant":
            # a prompt only (PPO prompts); SFT says it has no target
            prompt, response = turns, None
        else:
            # an empty last turn is read as it is (records.empty_response)
            prompt, response = turns[:-1], turns[-1]["content"]
        if not any(t["role"] == "user" for t in prompt):
            raise DataError(
                f"{where}: field 'messages' has no user turn before the last assistant turn"
            )
        return Example(
            prompt=plain_text(prompt),
            response=None if response is None else " " + response,
            where=where,
            chat=Chat(prompt=prompt, response=response),
        )

    return parse


def _message_pair(rec: dict, where: str, keys) -> Example:
    for name in ("chosen", "rejected"):
        if name not in rec:
            other = "rejected" if name == "chosen" else "chosen"
            raise DataError(f"{where}: record has {_q(rec, other)} but no field {_q(rec, name)}")
    chosen = turns_of(rec["chosen"], where, "chosen", *keys)
    rejected = turns_of(rec["rejected"], where, "rejected", *keys)
    k = _common_prefix(chosen, rejected)
    tails = chosen[k:], rejected[k:]
    for name, tail, other in (("chosen", tails[0], tails[1]), ("rejected", tails[1], tails[0])):
        if not tail and len(other) == 1 and other[0]["role"] == "assistant":
            # a converter dropped the turn
            raise DataError(
                f"{where}: field '{name}' has no last assistant turn (write an empty answer as "
                f"an assistant turn with empty content)"
            )
    if any(len(t) != 1 or t[0]["role"] != "assistant" for t in tails):
        raise DataError(
            f"{where}: fields 'chosen' and 'rejected' must differ only in their last turn, an "
            f"assistant turn (they share {k} turns, then have {len(tails[0])} and {len(tails[1])})"
        )
    prompt = chosen[:k]
    if not prompt:
        # TRL's form: the prompt apart, chosen/rejected the assistant turn only
        if "prompt" not in rec:
            raise DataError(
                f"{where}: 'chosen' and 'rejected' share no turns and the record has no "
                f"field {_q(rec, 'prompt')}"
            )
        prompt = _prompt_turns(rec, where, keys)
    if prompt[-1]["role"] == "assistant" or not any(t["role"] == "user" for t in prompt):
        raise DataError(f"{where}: the prompt of 'chosen'/'rejected' must end with a user turn")
    # either may be empty (records.empty_response)
    c, r = tails[0][0]["content"], tails[1][0]["content"]
    return Example(
        prompt=plain_text(prompt),
        response=" " + c,
        chosen=" " + c,
        rejected=" " + r,
        where=where,
        chat=Chat(prompt=prompt, response=c, chosen=c, rejected=r),
    )


DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


def iter_raw_records(path: Path) -> Iterator[Tuple[Union[dict, DataError], str]]:
    """Yields (record, 'file:line') for a JSONL/JSON(.gz) or Parquet file; a malformed record is
    yielded as a ``DataError`` in place of the record. A file that cannot be read at all raises."""
    name = path.name
    if name.endswith(".parquet"):
        yield from _iter_parquet(path)
        return
    with _open_text(path) as f:
        try:
            data = f.read()
        except (OSError, EOFError) as e:
            raise DataError(f"{path}: cannot read: {e}") from None
    if data.startswith(b"\xef\xbb\xbf"):
        # a UTF-8 byte-order mark (Windows editors): not data
        data = data[3:]
    if name.endswith((".json", ".json.gz")) and data.lstrip()[:1] == b"[":
        try:
            items = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not valid UTF-8 at byte {e.start}") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: malformed JSON: {e.msg}") from None
        for i, rec in enumerate(items):
            where = f"{path}[{i}]"
            if not isinstance(rec, dict):
                rec = DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            yield rec, where
        return
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            rec = DataError(f"{where}: not valid UTF-8 at column {e.start + 1}")
        except json.JSONDecodeError as e:
            rec = DataError(f"{where}: malformed JSON: {e.msg} at column {e.colno}")
        if not isinstance(rec, (dict, DataError)):
            rec = DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        # a per-line problem is yielded, not raised, so that skip mode can go on
        yield rec, where


def _iter_parquet(path: Path) -> Iterator[Tuple[dict, str]]:
    # lazy (here and below): 1-1.5 s to import (measured), only these sources need it
    import datasets

    try:
        ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as e:  # pyarrow raises many kinds
        raise DataError(f"{path}: cannot read Parquet: {str(e).splitlines()[0]}") from None
    for i, rec in enumerate(ds):
        yield rec, f"{path}[row {i}]"


def _iter_hub(name: str, split: str, config: Optional[str], key: str) -> Iterator[Tuple[dict, str]]:
    import datasets

    from rlhf import hub

    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:
        what = f"{key}={name}"
        if config:
            what += f" (data.hf_config={config})"
        if hub.offline():
            raise DataError(
                f"{what}: not a local file or directory, and no copy of this hub dataset "
                "in the local cache "
                f"({hub.offline_why()}): give a local file, or download it where the hub "
                "can be reached"
            ) from None
        raise DataError(
            f"{what}: not a local file or directory, and loading it as a hub dataset "
            f"(split {split!r}) failed: {first_line(e)}"
        ) from None
    for i, rec in enumerate(ds):
        yield dict(rec), f"{name}[{split}][row {i}]"


def is_saved_dataset(p: Path) -> bool:
    """A folder written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return p.is_dir() and (
        (p / "dataset_dict.json").is_file()
        or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file())
    )


def _iter_saved(p: Path, split: str, key: str, split_key: str) -> Iterator[Tuple[dict, str]]:
    """Rows of a save_to_disk folder; a DatasetDict gives the split ``split``."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:
        raise DataError(
            f"{key}={p}: cannot load this datasets.save_to_disk folder: {first_line(e)}"
        ) from None
    where = f"{p}"
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(
                f"{key}={p}: the DatasetDict has no split {split!r} (it has "
                f"{', '.join(sorted(ds))}): set {split_key}"
            )
        ds, where = ds[split], f"{p}[{split}]"
    for i, rec in enumerate(ds):
        yield dict(rec), f"{where}[row {i}]"


def data_files(path: str, key: str = "data.path") -> List[Path]:
    """The files behind data.path (a file, or every data file in a directory, sorted)."""
    p = Path(os.path.expanduser(path))
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(DATA_SUFFIXES))
        if not files:
            raise DataError(
                f"{key}={path}: directory holds no {', '.join(DATA_SUFFIXES)} files "
                f"(nor a datasets.save_to_disk folder)"
            )
        return files
    if p.is_file():
        return [p]
    return []


def looks_like_hub_id(path: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path)) and not path.endswith(DATA_SUFFIXES)


def raw_records(
    path: str,
    split: str = "train",
    config: Optional[str] = None,
    key: str = "data.path",
    split_key: str = "data.hf_split",
) -> Iterator[Tuple[Union[dict, DataError], str]]:
    """(record or DataError, where) of every record behind ``path``: a file, a directory of files,
    a save_to_disk folder (``split`` of a DatasetDict), or a hub id (``config``, ``split``)."""
    p = Path(os.path.expanduser(path))
    if is_saved_dataset(p):
        return _iter_saved(p, split, key, split_key)
    files = data_files(path, key)
    if files:
        return (item for f in files for item in iter_raw_records(f))
    if looks_like_hub_id(path) and not path.startswith("."):
        return _iter_hub(path, split, config, key)
    raise DataError(f"{key}={path}: no such file or directory")


def read_examples(
    path: str,
    fmt: str,
    on_bad_record: str = "error",
    columns: Optional[Dict[str, str]] = None,
    split: str = "train",
    config: Optional[str] = None,
    key: str = "data.path",
    split_key: str = "data.hf_split",
    skip_key: Optional[str] = "data.on_bad_record",
) -> Tuple[List[Example], int]:
    """Parses every record of ``path`` in format ``fmt``, renaming ``columns`` (format field ->
    dataset column) first. Returns (examples, number skipped). A malformed record raises, its
    message naming ``skip_key`` (the way to skip such records) when there is one."""
    # here: the table's rows are built from this module's parsers
    from rlhf.data.formats import FORMATS

    columns = dict(columns or {})
    parse = FORMATS[fmt].parser(columns)
    raw = raw_records(path, split, config, key, split_key)
    out: List[Example] = []
    skipped, first = 0, None
    for rec, where in raw:
        try:
            if isinstance(rec, DataError):
                raise rec
            out.append(parse(apply_columns(rec, columns), where))
        except DataError as e:
            if on_bad_record != "skip":
                if skip_key is None:
                    raise
                raise DataError(
                    f"{e} (or set {skip_key}=skip to skip and count such records)"
                ) from None
            skipped += 1
            first = first or str(e)
    if not out:
        why = ""
        if skipped:
            why = f" ({skipped} malformed, skipped; the first: {first})"
        raise DataError(f"{key}={path}: no records{why}")
    return out, skipped
