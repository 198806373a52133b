"""The command a migration builds: ``stage``, the ``key=value`` overrides in the order they were
set, notes (mapped, with a difference worth knowing), and what has no target — each with its kind
and why.

Kinds of what is not mapped (docs/deepspeed.md):
- ``no equivalent``: rlhf has nothing that does this; the behaviour is lost unless you act (the
  reason
  says how, where there is a way).
- ``not needed``: FSDP2 or rlhf's design does this without a setting (bucket sizes, prefetch,
  partition sizes, local_rank, ...).
- ``different default``: rlhf does the same thing its own way; the value would not change a run.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Dict, List

KINDS = ("no equivalent", "not needed", "different default")


@dataclass
class Unmapped:
    # "--flag value" or "ds_config zero_optimization.reduce_bucket_size=5e8"
    what: str
    kind: str
    why: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}")

    def line(self) -> str:
        return f"{self.what}: {self.kind}: {self.why}"


@dataclass
class Plan:
    stage: str
    where: str  # what it was read from
    overrides: Dict[str, str] = field(default_factory=dict)
    setters: Dict[str, str] = field(default_factory=dict)  # key -> what set it
    notes: List[str] = field(default_factory=list)
    unmapped: List[Unmapped] = field(default_factory=list)

    def set(self, key: str, value, by: str) -> None:
        """``key=value`` from ``by`` (a flag or ds_config key); a second source that disagrees is
        noted and the later one wins (a script's flag is read after the ds_config it names)."""
        text = render_value(value)
        old = self.overrides.get(key)
        if old is not None and old != text:
            self.notes.append(
                f"{key}: {self.setters[key]} gives {old}, {by} gives {text}: {text} kept"
            )
        self.overrides[key] = text
        self.setters[key] = by

    def note(self, text: str) -> None:
        self.notes.append(text)

    def skip(self, what: str, kind: str, why: str) -> None:
        self.unmapped.append(Unmapped(what, kind, why))

    def command(self) -> str:
        words = ["python", "-m", "rlhf", f"stage={self.stage}"] + [
            f"{k}={v}" for k, v in self.overrides.items()
        ]
        return " ".join(shlex.quote(w) for w in words)

    def render(self) -> str:
        out = [f"# {self.where}: stage={self.stage}", self.command()]
        if self.notes:
            out.append("# mapped, with a difference:")
            out += [f"#   {n}" for n in self.notes]
        if self.unmapped:
            out.append("# not mapped:")
            out += [f"#   {u.line()}" for u in self.unmapped]
        return "\n".join(out)


def render_value(value) -> str:
    """A value as a Hydra override writes it: booleans lower-case, lists ``[a,b]``, strings as they
    are (quoted where Hydra would read them otherwise: commas, spaces, brackets)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(render_value(v) for v in value) + "]"
    text = str(value)
    if any(c in text for c in ",[]{}() '\"=:$") and not text.startswith(("[", "{")):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text
