"""A generative judge (``ppo.judge_path``): a causal LM that reads each prompt and response through
a template with the rubric and answers with a verdict; the reward is its probability of the first
verdict against the second, read from one forward (the next token's logits after the rendered
question), so there is no text to parse and nothing to fail on.

The judge reads text, not the policy's token ids: its tokenizer may be another one. The template
(``ppo.judge_template``, a UTF-8 file) holds ``{response}`` and may hold ``{prompt}`` and
``{reference}`` (the record's reference answer, empty where it has none); the filled text is the
user turn of the judge's chat template where its tokenizer has one, else the text as it is. A
rendering longer than ``ppo.judge_max_tokens`` keeps its last tokens (where the question and the
answer are).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Sequence

import torch

from rlhf.algorithms.tokens import position_ids
from rlhf.data.records import Example
from rlhf.errors import ConfigError

FIELDS = ("{prompt}", "{response}", "{reference}")


def read_template(path: str, key: str = "ppo.judge_template") -> str:
    """The template's text: exit 2 (one line) when it cannot be read or has no ``{response}``."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}={path}: cannot read the template: {e}") from None
    if "{response}" not in text:
        raise ConfigError(
            f"{key}={path}: the template has no {{response}} (it may also hold {{prompt}}, "
            f"{{reference}})"
        )
    return text


def verdict_ids(tokenizer, verdicts: Sequence[str], path: str) -> List[int]:
    """The token id of each verdict: exit 2 naming one that is not a single token of the judge's."""
    ids = []
    for v in verdicts:
        tokens = tokenizer.encode(v, add_special_tokens=False)
        if len(tokens) != 1:
            raise ConfigError(
                f"ppo.judge_verdicts: {v!r} is {len(tokens)} tokens for the tokenizer of "
                f"ppo.judge_path={path}; "
                f"each verdict must be one token of it (try a leading space, or another word)"
            )
        ids += tokens
    return ids


class Plain:
    """A plain HF causal LM with the frozen engine's ``forward(..., logits_at=)`` (rlhf.score's
    judge)."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def forward(self, input_ids, attention_mask, position_ids, logits_at):
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        )
        out.logits = out.logits[logits_at]
        return out


class Judge:
    """``judge(texts, examples) -> [B]`` P(first verdict) / (P(first) + P(second)) of each response;
    ``seconds``: the time of the last call. Collective under FSDP (every rank runs as many forwards:
    the ranks hold as many rows)."""

    def __init__(
        self, model, tokenizer, template: str, verdicts: Sequence[str], max_tokens: int, path: str
    ):
        self.model, self.tokenizer, self.template, self.max_tokens = (
            model,
            tokenizer,
            template,
            max_tokens,
        )
        self.ids = verdict_ids(tokenizer, verdicts, path)
        self.chat = getattr(tokenizer, "chat_template", None) is not None
        self.seconds = 0.0

    def text(self, example: Example, response: str) -> str:
        """The judge's input for one response: the template filled, in the judge's chat template."""
        filled = self.template
        for name, value in zip(FIELDS, (example.prompt, response, example.reference or "")):
            filled = filled.replace(name, value)
        if not self.chat:
            return filled
        turns = [{"role": "user", "content": filled}]
        return self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)

    def encode(self, texts: List[str]) -> tuple:
        """Left-padded ids and mask, each row its last ``max_tokens`` tokens."""
        # the chat template writes the special tokens it needs
        chat = self.chat
        rows = [
            ids[-self.max_tokens :]
            for ids in self.tokenizer(texts, add_special_tokens=not chat)["input_ids"]
        ]
        width = max(len(r) for r in rows)
        # the padding is masked out: id 0, which every vocabulary has (a pad added to the tokenizer
        # may lie past the embeddings of a judge loaded as it is, rlhf.score's)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return ids, mask

    @torch.no_grad()
    def __call__(
        self, texts: Sequence[str], examples: Sequence[Example], micro: int, device
    ) -> torch.Tensor:
        t0 = time.perf_counter()
        ids, mask = self.encode([self.text(e, t) for e, t in zip(examples, texts)])
        out, step = [], micro or ids.shape[0]
        for s in range(0, ids.shape[0], step):
            i, m = ids[s : s + step].to(device), mask[s : s + step].to(device)
            last = torch.zeros_like(m, dtype=torch.bool)
            # left-padded: every row's last token is the last position
            last[:, -1] = True
            logits = self.model.forward(
                input_ids=i, attention_mask=m, position_ids=position_ids(m), logits_at=last
            )
            pair = logits.logits.float()[:, self.ids].log_softmax(-1)
            out.append(pair[:, 0].exp())
        self.seconds = time.perf_counter() - t0
        return torch.cat(out)
