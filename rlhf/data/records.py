"""Records of every data format, read from local files with file:line error reporting.

One ``Example`` type serves all stages: SFT reads (prompt, response), the reward stage
(prompt, chosen, rejected), PPO (prompt, reference). A format provides what it can; asking a
format for a view it lacks is a configuration error.
"""
from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

from rlhf.errors import DataError


@dataclass
class Example:
    prompt: str
    response: Optional[str] = None  # SFT target
    chosen: Optional[str] = None  # preferred response (reward stage)
    rejected: Optional[str] = None
    reference: Optional[str] = None  # what the gold scorer compares against
    where: str = ""  # file:line of the record, for messages


HH_ASSISTANT = "\n\nAssistant:"


def _field(rec: dict, name: str, where: str, allow_empty: bool = False) -> str:
    if name not in rec:
        raise DataError(f"{where}: record has no field '{name}'")
    v = rec[name]
    if not isinstance(v, str):
        raise DataError(f"{where}: field '{name}' must be a string, got {type(v).__name__}")
    if not allow_empty and not v.strip():
        raise DataError(f"{where}: field '{name}' is empty")
    return v


def _prompt_response(rec: dict, where: str) -> Example:
    return Example(prompt=_field(rec, "prompt", where), response=_field(rec, "response", where), where=where)


def _prompt_chosen_rejected(rec: dict, where: str) -> Example:
    chosen = _field(rec, "chosen", where)
    return Example(prompt=_field(rec, "prompt", where), response=chosen, chosen=chosen,
                   rejected=_field(rec, "rejected", where), where=where)


def split_hh(dialogue: str, where: str, name: str) -> Tuple[str, str]:
    """HH-RLHF: the prompt is everything up to and including the last '\\n\\nAssistant:'."""
    i = dialogue.rfind(HH_ASSISTANT)
    if i < 0:
        raise DataError(f"{where}: field '{name}' has no '\\n\\nAssistant:' turn")
    cut = i + len(HH_ASSISTANT)
    return dialogue[:cut], dialogue[cut:]


def _hh(rec: dict, where: str) -> Example:
    prompt, chosen = split_hh(_field(rec, "chosen", where), where, "chosen")
    rej_dialogue = _field(rec, "rejected", where)
    if rej_dialogue.startswith(prompt):
        rejected = rej_dialogue[len(prompt):]
    else:
        rejected = split_hh(rej_dialogue, where, "rejected")[1]
    if not prompt.strip():
        raise DataError(f"{where}: field 'chosen' has an empty prompt")
    return Example(prompt=prompt, response=chosen, chosen=chosen, rejected=rejected, where=where)


GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def gsm8k_prompt(question: str) -> str:
    return f"Question: {question.strip()}\nAnswer:"


def _gsm8k(rec: dict, where: str) -> Example:
    question = _field(rec, "question", where)
    answer = _field(rec, "answer", where)
    m = GSM8K_ANSWER.search(answer)
    if m is None:
        raise DataError(f"{where}: field 'answer' does not end in '#### <number>'")
    return Example(prompt=gsm8k_prompt(question), response=" " + answer.strip(),
                   reference=m.group(1).replace(",", ""), where=where)


PARSERS: Dict[str, Callable[[dict, str], Example]] = {
    "prompt_response": _prompt_response,
    "prompt_chosen_rejected": _prompt_chosen_rejected,
    "hh": _hh,
    "gsm8k": _gsm8k,
}

DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")


def _open_text(path: Path):
    raw = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    return raw


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
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark (Windows editors): not data
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
        yield rec, where  # a per-line problem is yielded, not raised, so that skip mode can go on


def _iter_parquet(path: Path) -> Iterator[Tuple[dict, str]]:
    import datasets
    try:
        ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as e:  # pyarrow raises many kinds
        raise DataError(f"{path}: cannot read Parquet: {str(e).splitlines()[0]}") from None
    for i, rec in enumerate(ds):
        yield rec, f"{path}[row {i}]"


def _iter_hub(name: str) -> Iterator[Tuple[dict, str]]:
    import datasets
    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as e:
        raise DataError(f"data.path={name}: not a local file or directory, and loading it as a hub "
                        f"dataset failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    for i, rec in enumerate(ds):
        yield dict(rec), f"{name}[row {i}]"


def data_files(path: str) -> List[Path]:
    """The files behind data.path (a file, or every data file in a directory, sorted)."""
    p = Path(os.path.expanduser(path))
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(DATA_SUFFIXES))
        if not files:
            raise DataError(f"data.path={path}: directory holds no {', '.join(DATA_SUFFIXES)} files")
        return files
    if p.is_file():
        return [p]
    return []


def looks_like_hub_id(path: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path)) and not path.endswith(DATA_SUFFIXES)


def read_examples(path: str, fmt: str, on_bad_record: str = "error") -> Tuple[List[Example], int]:
    """Parses every record of ``path`` in format ``fmt``. Returns (examples, number skipped)."""
    parse = PARSERS[fmt]
    files = data_files(path)
    if files:
        raw = (item for f in files for item in iter_raw_records(f))
    elif looks_like_hub_id(path):
        raw = _iter_hub(path)
    else:
        raise DataError(f"data.path={path}: no such file or directory")
    out: List[Example] = []
    skipped = 0
    for rec, where in raw:
        try:
            if isinstance(rec, DataError):
                raise rec
            out.append(parse(rec, where))
        except DataError:
            if on_bad_record != "skip":
                raise
            skipped += 1
    if not out:
        raise DataError(f"data.path={path}: no records" + (f" ({skipped} malformed, skipped)" if skipped else ""))
    return out, skipped
