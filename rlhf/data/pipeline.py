"""From ``cfg.data`` to the records a stage trains and evaluates on.

Order of operations, per source: read (or generate) → seeded shuffle → held-out records
(the same for every stage, so gold scores compare across stages) → the stage's ``data.split``
share of the rest (DPO, which reads pairs, takes the reward stage's share) → for SFT, without the
records whose response is empty (nothing to imitate: skipped and counted whatever
``data.on_bad_record``; pairs keep them). Sources are then blended by weight. With
``data.eval_path`` the held-out records are that file's (a seeded sample of ``data.eval_size``)
and nothing is carved out of the sources.

``DataConfig`` and ``SourceConfig`` (rlhf/config.py) appear in string annotations only:
rlhf/config.py imports this folder (the format table, the data.split helpers below), never the other
way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from rlhf import seeding
from rlhf.data.formats import FORMATS
from rlhf.data.records import Example, empty_response, read_examples
from rlhf.errors import ConfigError, DataError

log = logging.getLogger("rlhf")

# data.split keeps DeepSpeed-Chat's three shares (sft, reward, ppo); DPO trains on preference pairs,
# so it takes the reward stage's share (split_share_of)
SPLIT_SHARES = ("sft", "reward", "ppo")


@dataclass
class StageData:
    train: List[Example]
    eval: List[Example]
    gold: Optional[Callable[[str, str], float]]  # gold scorer when every source has one
    # malformed records skipped (data.on_bad_record=skip)
    skipped: int = 0
    description: str = ""
    # records SFT skipped for their empty response (train and held out)
    empty: int = 0
    stage: str = ""

    def digest(self) -> str:
        """A short digest of what the stage reads of its records, training and held out, in order (a
        run's fingerprint, rlhf/runtime/stage.py): another data file, seed, split or generator
        setting that changes them gives another; one that changes only fields the stage does not
        read does not."""
        fields = READS.get(self.stage, ALL_READ)
        h = hashlib.sha256()
        for part in (self.train, self.eval):
            h.update(f"|{len(part)}|".encode())
            for e in part:
                row = [e.prompt, e.reference, e.answer, *(getattr(e, f) for f in fields)]
                if e.chat is not None:
                    # the turns, the tools rendered with them and the tool calls trained on
                    turns = fields + ("tool_turns",) if fields else ()
                    row += [e.chat.prompt, e.chat.tools, *(getattr(e.chat, f) for f in turns)]
                h.update(json.dumps(row, default=str).encode())
        return h.hexdigest()[:12]


# what each stage reads of a record besides its prompt, its tools and its gold reference
# (StageData.digest; a stage that trains on a response also trains on the tool turns before it;
# PPO's rollouts make their own)
READS = {
    "sft": ("response",),
    "reward": ("chosen", "rejected"),
    "dpo": ("chosen", "rejected"),
    "ppo": (),
}
ALL_READ = ("response", "chosen", "rejected")


def split_share_of(stage: str) -> int:
    """The index of ``stage``'s weight in data.split: DPO reads pairs, the reward stage's share."""
    return SPLIT_SHARES.index("reward" if stage == "dpo" else stage)


def parse_split(spec: str) -> List[float]:
    try:
        parts = [float(p) for p in spec.split(",")]
    except ValueError:
        parts = []
    if len(parts) != len(SPLIT_SHARES) or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(
            f"data.split={spec!r} is invalid: expected three non-negative weights for "
            f'sft,reward,ppo such as "2,4,4" (dpo takes the reward share)'
        )
    return parts


def split_share(n: int, weights: List[float], index: int) -> slice:
    """DeepSpeed-Chat's data_split: contiguous shares of ``n`` proportional to ``weights``."""
    total = sum(weights)
    bounds = [0]
    acc = 0.0
    for w in weights:
        acc += w
        bounds.append(round(n * acc / total))
    return slice(bounds[index], bounds[index + 1])


def _read(
    src: "SourceConfig",
    dcfg: "DataConfig",
    key: str = "data.path",
    split_key: str = "data.hf_split",
):
    return read_examples(
        src.path,
        src.format,
        dcfg.on_bad_record,
        columns=src.columns,
        split=src.hf_split or dcfg.hf_split,
        config=src.hf_config or dcfg.hf_config,
        key=key,
        split_key=split_key,
    )


def _trainable(records: List[Example], stage: str, empty: List[Example]) -> List[Example]:
    """``records`` less, for SFT, those whose response is empty (added to ``empty``): SFT would
    learn to answer with nothing. The other stages keep them (a pair compares an empty answer as it
    is; PPO reads prompts only)."""
    if stage != "sft":
        return records
    empty += [e for e in records if empty_response(e)]
    return [e for e in records if not empty_response(e)]


def _load_source(
    src: "SourceConfig", dcfg: "DataConfig", seed: int, stage: str, empty: List[Example]
):
    path, fmt = src.path, src.format
    if FORMATS[fmt].generated:
        # the format's own generator (the synthetic task, tool_arith)
        if dcfg.synthetic.seed is not None:  # the data fixed whatever run.seed
            seed = dcfg.synthetic.seed
        train, held_out = FORMATS[fmt].generate(dcfg.synthetic, dcfg.eval_size, seed)
        skipped = 0
    else:
        records, skipped = _read(src, dcfg)
        random.Random(seed).shuffle(records)
        n_eval = 0 if dcfg.eval_path else min(dcfg.eval_size, len(records) // 10)
        held_out, train = records[:n_eval], records[n_eval:]
    if dcfg.eval_path:
        held_out = []  # data.eval_path's records instead
    if dcfg.split is not None:
        train = train[split_share(len(train), parse_split(str(dcfg.split)), split_share_of(stage))]
    n_empty = len(empty)
    train, held_out = _trainable(train, stage, empty), _trainable(held_out, stage, empty)
    if not train:
        why = f"{len(empty) - n_empty} with an empty response, " if len(empty) > n_empty else ""
        raise DataError(
            f"data.path={path}: no training records left for stage {stage} "
            f"({why}data.split={dcfg.split})"
        )
    return train, held_out, skipped


def load_eval(dcfg: "DataConfig", seed: int) -> Tuple[List[Example], int]:
    """data.eval_path's held-out records: a seeded sample of at most data.eval_size."""
    src = dcfg.eval_source()
    records, skipped = _read(src, dcfg, key="data.eval_path", split_key="data.eval_hf_split")
    random.Random(seeding.offset(seed, 1, seeding.HELD_OUT)).shuffle(records)
    return records[: dcfg.eval_size], skipped


def blend(parts: List[List[Example]], weights: List[float], seed: int) -> List[Example]:
    """Mixes sources so that each makes up a share ∝ its weight of a set as large as all of them
    together; a source smaller than its share repeats (each pass a fresh seeded order)."""
    if len(parts) == 1:
        return list(parts[0])
    rng = random.Random(seed)
    total = sum(len(p) for p in parts)
    out: List[Example] = []
    for part, w in zip(parts, weights):
        want = round(total * w / sum(weights))
        while want > 0:
            order = list(part)
            rng.shuffle(order)
            out.extend(order[:want])
            want -= len(order)
    rng.shuffle(out)
    return out


def load_stage_data(dcfg: "DataConfig", stage: str, seed: int) -> StageData:
    sources = dcfg.source_list()
    trains, evals, skipped, empty = [], [], 0, []
    for i, src in enumerate(sources):
        tr, ev, sk = _load_source(src, dcfg, seeding.offset(seed, i, seeding.SOURCE), stage, empty)
        trains.append(tr)
        evals.extend(ev)
        skipped += sk
    formats = {src.format for src in sources}
    if dcfg.eval_path:
        evals, sk = load_eval(dcfg, seed)
        evals = _trainable(evals, stage, empty)
        skipped += sk
        formats.add(dcfg.eval_source().format)
    if skipped:
        log.warning("skipped %d malformed records (data.on_bad_record=skip)", skipped)
    if empty:
        log.warning(
            "%s: skipped %d records whose response is empty (the first: %s): nothing to learn to "
            "answer from (the reward stage and DPO keep them)",
            stage,
            len(empty),
            empty[0].where,
        )
    gold = FORMATS[sources[0].format].gold if len(formats) == 1 else None
    train = blend(trains, [s.weight for s in sources], seed)
    desc = ", ".join(f"{s.format}:{s.path or 'generated'}" for s in sources)
    if dcfg.eval_path:
        desc += f"; held out: {dcfg.eval_source().format}:{dcfg.eval_path}"
    return StageData(
        train=train,
        eval=evals,
        gold=gold,
        skipped=skipped,
        description=desc,
        empty=len(empty),
        stage=stage,
    )
