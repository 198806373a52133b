"""The messages of the rollout ranks' links (rlhf/rl/rollout_link.py) and of a TP worker's leader
to its followers (rlhf/rl/rollout_tp.py): ``torch.save`` bytes read back weights-only, so that no
code runs from a message — tensors, plain values and the few classes a request, its episodes and a
generation's sampling are made of (``safe_classes``). An environment's numpy values and str
subclasses are made plain first (``plain``).
"""

from __future__ import annotations

import dataclasses
import io

import torch


class Undecodable(Exception):
    """A message the weights-only reader refused (a class not in ``safe_classes``)."""


def safe_classes() -> list:
    """The classes a message may hold (read weights-only: nothing else is built from one)."""
    from rlhf.data.records import Chat, Example
    from rlhf.engine.infer import Generation
    from rlhf.ops import SamplingParams
    from rlhf.rl.episodes import Episodes
    from rlhf.rl.rollout_worker import Failed, Request, Result

    return [Request, Result, Failed, Episodes, Generation, Example, Chat, SamplingParams]


def plain(x):
    """``x`` with numpy scalars and str subclasses as the plain values they stand for (an
    environment's observations and counts may hold them; a message is read weights-only)."""
    if isinstance(x, dict):
        return {plain(k): plain(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(plain(v) for v in x)  # (a namedtuple too)
    if isinstance(x, list):
        return [plain(v) for v in x]
    if isinstance(x, str):
        return str(x)
    if isinstance(x, bool):
        return bool(x)
    if hasattr(x, "tolist") and not isinstance(x, torch.Tensor) and type(x).__module__ == "numpy":
        return x.tolist()  # (a numpy scalar or array: Python values)
    if isinstance(x, float) and type(x) is not float:
        return float(x)
    if isinstance(x, int) and type(x) is not int:
        return int(x)
    return x


def plain_result(res):
    """A worker's result with its episodes' text and counts made plain (``plain``)."""

    ep = res.episodes
    ep = dataclasses.replace(
        ep,
        texts=plain(ep.texts),
        stats=plain(ep.stats),
        errors=plain(ep.errors),
        conversations=plain(ep.conversations),
        row_counts=plain(ep.row_counts),
    )
    return dataclasses.replace(res, episodes=ep)


def encode(obj) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def decode(payload: torch.Tensor):
    """The message ``payload`` holds; ``Undecodable`` naming what the weights-only reader refused
    (its 'Unsupported global' line) or why the bytes do not read."""
    try:
        with torch.serialization.safe_globals(safe_classes()):
            return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    except Exception as e:
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        why = next((x for x in lines if "Unsupported" in x), lines[0] if lines else repr(e))
        raise Undecodable(why) from None
