"""Chat templates: conversations to token ids, with the assistant tokens marked.

``data.chat_template``: ``auto`` renders turns with the tokenizer's own template (the embedded
tokenizer has a small one: a user turn renders exactly as the synthetic task's prompt), ``none``
with none, or a Jinja file (also set on the tokenizer, so that it is exported with the model).
Without a template, ``messages`` data renders with ``FALLBACK_TEMPLATE`` (HH-RLHF's plain
"\\n\\nHuman: …\\n\\nAssistant: …" text) and the synthetic task keeps its plain text prompts.

A conversation is rendered turn by turn: for each assistant turn ``i`` the text up to it with the
generation prompt, ``render(turns[:i], add_generation_prompt=True)``, and the text with it,
``render(turns[:i + 1])``; the difference is that turn's assistant span (its content and the
template's end-of-turn markup). Each piece is tokenized on its own, the first with the tokenizer's
special prefix (BOS) unless the template writes it, so that training sequences, PPO prompts and
gold prompts split into tokens exactly as generation sees them. A final assistant span without EOS
gets one (the policy must learn to stop).

Records with tools (``Chat.tools``, the tool_arith task) render every piece with
``apply_chat_template(..., tools=)``; their tool results (role ``tool``) are rendered and never
trained on. ``Renderer.prompt_ids(turns, tools)`` is the opening a rollout starts from, the very
prefix of the SFT rendering. The plain fallback cannot render tools: such a record without a
template is a DataError.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from rlhf.data.records import Turn
from rlhf.errors import ConfigError, DataError, first_line

# JSON-schema function dicts for apply_chat_template(tools=), or None
Tools = Optional[List[dict]]

# HH-RLHF's plain form (records.plain_text writes the same text). The newlines are string literals:
# Transformers renders with trim_blocks, which would eat a newline right after a block tag.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}{{ '\\n\\nHuman: ' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '\\n\\nAssistant: ' + m['content'] }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n\\nAssistant:' }}{% endif %}"
)

log = logging.getLogger("rlhf")

_PROBE = [
    {"role": "user", "content": "Hello?"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "And then?"},
]


def _template_text(tokenizer) -> Optional[str]:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):  # named templates: the default one
        t = t.get("default")
    return t or None


def resolve_template(
    tokenizer, setting: str, key: str = "data.chat_template", records: Sequence = ()
) -> Optional[str]:
    """The template text ``setting`` (auto | none | a file) stands for with this tokenizer, or None
    (no template). A file's template is set on the tokenizer (it is saved with the exported model);
    a template that does not render a conversation is a ConfigError. ``records``: the stage's data —
    conversations in them with a tokenizer that has no template are said to become plain text
    (once)."""
    setting = str(setting)
    if setting == "none":
        return None
    if setting == "auto":
        text = _template_text(tokenizer)
        if text is None and any(getattr(r, "chat", None) for r in records):
            log.warning(
                "%s=auto and the tokenizer has no chat template: the records' "
                "conversations render as plain "
                "'\\n\\nHuman: …\\n\\nAssistant:' text (%s=<file> gives them a template)",
                key,
                key,
            )
        return text
    path = Path(setting).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"{key}={setting}: no such file (expected auto, none or the path of a Jinja "
            "chat template)"
        )
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}={setting}: cannot read the template: {e}") from None
    try:
        render(tokenizer, text, _PROBE, True)
    except Exception as e:
        # jinja2's TemplateSyntaxError, UndefinedError, raise_exception(...)
        line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        msg = first_line(e)
        raise ConfigError(f"{key}={setting}: not a usable chat template{line}: {msg}") from None
    tokenizer.chat_template = text
    return text


def render(
    tokenizer,
    template: str,
    turns: Sequence[Turn],
    add_generation_prompt: bool,
    tools: Tools = None,
) -> str:
    # none: the call of before, byte for byte
    extra = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(
        list(turns),
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **extra,
    )


def special_prefix(tokenizer) -> List[int]:
    """The ids the tokenizer puts before a text with ``add_special_tokens=True`` (BOS, or none)."""
    with_, without = (
        tokenizer("a", add_special_tokens=flag)["input_ids"] for flag in (True, False)
    )
    for i in range(len(with_) - len(without) + 1):
        if with_[i : i + len(without)] == without:
            return with_[:i]
    return []


class Renderer:
    """Renders and tokenizes conversations with one template (memoised: prompts repeat)."""

    def __init__(self, tokenizer, template: Optional[str]):
        self.tok = tokenizer
        self.template = template or FALLBACK_TEMPLATE
        self.prefix = special_prefix(tokenizer)
        self.eos = tokenizer.eos_token_id
        self._texts: Dict[Tuple[str, bool, Optional[str]], str] = {}

    def _render(self, turns: Sequence[Turn], gen: bool, where: str, tools: Tools = None) -> str:
        key = (
            json.dumps(list(turns), ensure_ascii=False),
            gen,
            json.dumps(tools) if tools else None,
        )
        text = self._texts.get(key)
        if text is None:
            if self.template is FALLBACK_TEMPLATE and (
                tools or any(t["role"] == "tool" for t in turns)
            ):
                raise DataError(
                    f"{where}: this conversation has tools or tool results, which the "
                    "plain fallback "
                    "(no chat template) cannot render: use data.chat_template=auto with a "
                    "tokenizer whose "
                    f"template has tools (the embedded one has), or a template file"
                )
            try:
                text = render(self.tok, self.template, turns, gen, tools)
            except Exception as e:
                # the template refuses this conversation (roles, order)
                msg = first_line(e)
                raise DataError(
                    f"{where}: the chat template cannot render this conversation: {msg}"
                ) from None
            self._texts[key] = text
        return text

    def pieces(
        self, turns: Sequence[Turn], where: str, tools: Tools = None
    ) -> List[Tuple[str, bool]]:
        """The conversation as (text, is_assistant) pieces; when the last turn is not the
        assistant's, it ends with the generation prompt. ``tools``: rendered with every piece."""
        out: List[Tuple[str, bool]] = []
        done = ""
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            before = self._render(turns[:i], True, where, tools) if i or tools else ""
            after = self._render(turns[: i + 1], False, where, tools)
            if not before.startswith(done) or not after.startswith(before):
                raise DataError(
                    f"{where}: the chat template does not render this conversation turn by turn "
                    f"(turn {i} rewrites the text before it), so its assistant tokens cannot be "
                    f"marked; use another data.chat_template"
                )
            out += [(before[len(done) :], False), (after[len(before) :], True)]
            done = after
        if turns and turns[-1]["role"] != "assistant":
            before = self._render(turns, True, where, tools)
            if not before.startswith(done):
                raise DataError(
                    f"{where}: the chat template does not render this conversation turn by turn; "
                    f"use another data.chat_template"
                )
            out.append((before[len(done) :], False))
        return out

    def encode(
        self,
        conversations: Sequence[Sequence[Turn]],
        wheres: Sequence[str],
        final_eos: bool = True,
        tools: Optional[Sequence[Tools]] = None,
    ) -> List[Tuple[List[int], List[int], int]]:
        """(ids, assistant mask, start of the last piece) of each conversation. ``final_eos``: a
        conversation that ends with an assistant turn gets EOS after it when its span has none.
        ``tools``: each conversation's tools (None: none)."""
        tools = tools if tools is not None else [None] * len(conversations)
        all_pieces = [self.pieces(c, w, t) for c, w, t in zip(conversations, wheres, tools)]
        ids_flat = encode_unique(self.tok, [text for ps in all_pieces for text, _ in ps], False)
        out, k = [], 0
        for ps in all_pieces:
            ids: List[int] = []
            mask: List[int] = []
            last = 0
            for j, (_, is_assistant) in enumerate(ps):
                piece = ids_flat[k]
                k += 1
                if j == 0 and self.prefix and piece[: len(self.prefix)] != self.prefix:
                    # BOS, unless written
                    ids += self.prefix
                    mask += [0] * len(self.prefix)
                if j == len(ps) - 1:
                    last = len(ids)
                    if (
                        is_assistant
                        and final_eos
                        and self.eos is not None
                        and self.eos not in piece
                    ):
                        piece.append(self.eos)
                ids += piece
                mask += [int(is_assistant)] * len(piece)
            out.append((ids, mask, last))
        return out

    def prompt_ids(
        self, turns: Sequence[Turn], tools: Tools = None, where: str = "prompt"
    ) -> List[int]:
        """The ids a rollout of ``turns`` starts from: rendered with ``tools`` and the generation
        prompt, BOS first — exactly the prefix of the SFT sequence of the same record. (A later
        turn's ids: ``encode([turns], [where], tools=[tools])``'s last piece, ``ids[last:]``.)"""
        return self.encode([turns], [where], tools=[tools])[0][0]


def encode_unique(tokenizer, texts: Sequence[str], add_special_tokens: bool) -> List[List[int]]:
    """``tokenizer(texts)["input_ids"]``, each distinct text tokenized once (fresh lists)."""
    if not texts:
        return []
    unique = list(dict.fromkeys(texts))
    ids = dict(zip(unique, tokenizer(unique, add_special_tokens=add_special_tokens)["input_ids"]))
    return [list(ids[t]) for t in texts]


def uses_chat(example, template: Optional[str]) -> bool:
    """Whether ``example`` goes through a Renderer: turns data always, the synthetic task when
    there is a template (its plain text is the same record without one)."""
    return example.chat is not None and (template is not None or example.chat.needs_template)


def shown_prompt(example, template: Optional[str]) -> str:
    """The prompt as samples.jsonl and the console show it: a record rendered through a chat
    template (``uses_chat``) as its turns, ``role: content`` a line (what the template adds aside: a
    default system turn, the tools' listing); else its text, which is what the model reads."""
    if not uses_chat(example, template):
        return example.prompt
    return "\n".join(f"{t['role']}: {t['content']}" for t in example.chat.prompt)


def template_key(template: Optional[str]) -> Optional[str]:
    """A short digest of a template (for cache keys)."""
    if template is None:
        return None
    return hashlib.sha256(template.encode()).hexdigest()[:16]
