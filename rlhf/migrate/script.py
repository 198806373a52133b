"""A DeepSpeed-Chat launch script's text → the ``main.py`` invocations in it.

A script such as DeepSpeed-Chat's ``training_scripts/opt/single_node/run_1.3b.sh``::

    OUTPUT=$1
    ZERO_STAGE=$2
    if [ "$OUTPUT" == "" ]; then
        OUTPUT=./output
    fi
    deepspeed --num_gpus 2 main.py \\
       --data_path Dahoas/rm-static --data_split 2,4,4 \\
       --model_name_or_path facebook/opt-1.3b --zero_stage $ZERO_STAGE --output_dir $OUTPUT \\
       &> $OUTPUT/training.log

is read without running it: lines joined at backslashes, ``NAME=value`` assignments (also inside
``if [ "$X" == "" ]`` blocks: the defaults a script gives its positional arguments) substituted into
later lines, the ``deepspeed`` / ``torchrun`` / ``python`` launcher's arguments and the flags after
``main.py`` collected. A flag's value is the words up to the next ``--flag`` (``--data_path`` takes
several). What the script leaves to its caller (``$1`` with no default) stays as written, and the
migration says so.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from rlhf.errors import UserError

# DeepSpeed-Chat's training steps, by the directory of their main.py
STEP_DIRS = {
    "step1_supervised_finetuning": "sft",
    "step2_reward_model_finetuning": "reward",
    "step2_dpo_finetuning": "dpo",
    "step3_rlhf_finetuning": "ppo",
}
LAUNCHERS = ("deepspeed", "torchrun", "python", "python3", "accelerate")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*|[0-9])\}|\$([A-Za-z_][A-Za-z0-9_]*|[0-9])")


@dataclass
class Invocation:
    """One ``main.py`` run: its step (sft | reward | dpo | ppo; None = to be told by its flags), its
    flags (name without ``--`` → list of words; a flag without words is a switch), the launcher's
    arguments, where it was read."""

    step: Optional[str]
    flags: Dict[str, List[str]]
    launcher: Dict[str, List[str]] = field(default_factory=dict)
    where: str = ""
    unresolved: List[str] = field(default_factory=list)  # $names the script leaves to its caller


def _logical_lines(text: str) -> List[tuple]:
    """(line number of its first line, the line) with backslash continuations joined and comments
    dropped."""
    out, buf, start = [], "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        stripped = buf.strip()
        if stripped and not stripped.startswith("#"):
            out.append((start, stripped))
        buf = ""
    if buf.strip():
        out.append((start, buf.strip()))
    return out


def _substitute(line: str, env: Dict[str, str]) -> str:
    def repl(m):
        name = m.group(1) or m.group(2)
        return env.get(name, m.group(0))

    return _VAR.sub(repl, line)


def _words(line: str, where: str) -> List[str]:
    try:
        words = shlex.split(line, comments=True)
    except ValueError as e:
        raise UserError(f"{where}: cannot read this line as shell words ({e})") from None
    # output redirections (&> f, > f, 2>&1, | tee f) end the command
    for i, w in enumerate(words):
        if w in ("|", "&>", ">", ">>", "2>", "2>>", "&") or w.startswith(("&>", "2>", ">")):
            return words[:i]
    return words


def _step_of(script_word: str) -> Optional[str]:
    for part in re.split(r"[/\\]", script_word):
        if part in STEP_DIRS:
            return STEP_DIRS[part]
    return None


def read_script(
    text: str, name: str = "<script>", args: Optional[List[str]] = None
) -> List[Invocation]:
    """Every ``main.py`` invocation of a launch script. ``args``: the script's positional arguments
    ($1, $2, ...) where the caller knows them."""
    env: Dict[str, str] = {str(i + 1): a for i, a in enumerate(args or [])}
    found: List[Invocation] = []
    # inside `if ... fi`: an assignment is a default, taken only where the name has no value
    depth = 0
    for lineno, line in _logical_lines(text):
        where = f"{name}:{lineno}"
        first = line.split()[0]
        depth += first == "if"
        depth -= first == "fi" or line.endswith("; fi")
        words = _words(line, where)
        m = _ASSIGN.match(words[0]) if len(words) == 1 else None
        if m:
            key, value = m.group(1), _substitute(m.group(2), env)
            if depth == 0 or env.get(key, "").startswith("$") or not env.get(key):
                env[key] = value
            continue
        words = _words(_substitute(line, env), where)
        main_at = next((i for i, w in enumerate(words) if w.endswith("main.py")), None)
        if main_at is None or not words or words[0].split("/")[-1] not in LAUNCHERS:
            continue
        launcher = _flag_words(words[1:main_at], where, launcher=True)
        flags = _flag_words(words[main_at + 1 :], where)
        unresolved = sorted({v for ws in flags.values() for w in ws for v in _unresolved(w)})
        found.append(Invocation(_step_of(words[main_at]), flags, launcher, where, unresolved))
    return found


def _unresolved(word: str) -> List[str]:
    return ["$" + (m.group(1) or m.group(2)) for m in _VAR.finditer(word)]


def _flag_words(words: List[str], where: str, launcher: bool = False) -> Dict[str, List[str]]:
    flags: Dict[str, List[str]] = {}
    name = None
    for w in words:
        if w.startswith("--"):
            name, eq, value = w[2:].partition("=")
            name = name.replace("-", "_")
            flags[name] = [value] if eq else []
        elif name is not None:
            flags[name].append(w)
        elif launcher:
            # `-m module` / a script path before main.py: nothing to map
            continue
        else:
            raise UserError(f"{where}: '{w}' before any --flag after main.py")
    return flags


def infer_step(inv: Invocation) -> str:
    """The step of an invocation whose main.py path does not name it: step 3 has actor and critic
    paths, step-2 DPO a beta, step-2 reward the padding count; else step 1."""
    if inv.step:
        return inv.step
    f = inv.flags
    if "actor_model_name_or_path" in f or "critic_model_name_or_path" in f:
        return "ppo"
    if "beta" in f or "label_smoothing" in f:
        return "dpo"
    if "num_padding_at_beginning" in f or "eval_interval" in f:
        return "reward"
    return "sft"
