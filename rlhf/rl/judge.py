"""A generative judge (``ppo.judge_path``): a causal LM that reads each prompt and response through
a template with the rubric and answers. Two forms:

- **verdict** (the default): the reward is its probability of the first verdict against the second,
  read from one forward (the next token's logits after the rendered question), so there is no text
  to parse and nothing to fail on;
- **score** (``ppo.judge_score_pattern``, a regular expression whose first group is a number): the
  judge writes up to ``ppo.judge_max_new_tokens`` tokens greedily and the reward is the first
  match's number mapped from ``ppo.judge_score_range`` onto 0..1 (clipped); an answer without a
  match gets ``ppo.judge_failure_reward`` and is counted (``judge/parse_failures``).

The judge reads text, not the policy's token ids: its tokenizer may be another one. The template
(``ppo.judge_template``, a UTF-8 file) holds ``{response}`` and may hold ``{prompt}`` and
``{reference}`` (the record's reference answer, empty where it has none); the filled text is the
user turn of the judge's chat template where its tokenizer has one, else the text as it is. A
rendering longer than ``ppo.judge_max_tokens`` keeps its last tokens (where the question and the
answer are).
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from rlhf.algorithms.tokens import position_ids
from rlhf.config import score_pattern
from rlhf.data.records import Example
from rlhf.errors import ConfigError
from rlhf.ops import SamplingParams

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


def parse_score(text: str, pattern: "re.Pattern", lo: float, hi: float) -> Optional[float]:
    """The first match's number in ``text`` mapped from [lo, hi] onto [0, 1] (clipped); None
    without a match or a number."""
    m = pattern.search(text)
    if m is None:
        return None
    try:
        value = float(m.group(1))
    except (TypeError, ValueError):
        return None
    return min(max((value - lo) / (hi - lo), 0.0), 1.0)


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
    """``judge(texts, examples) -> [B]`` each response's reward (module docstring: the verdict's
    probability, or the parsed score); ``seconds``: the time of the last call, ``failed``: [B] bool,
    the answers the score form could not parse. Collective under FSDP (every rank runs as many
    forwards: the ranks hold as many rows, and the score form's decoding steps are agreed over
    ``mesh``)."""

    def __init__(
        self,
        model,
        tokenizer,
        template: str,
        verdicts: Sequence[str],
        max_tokens: int,
        path: str,
        score: Optional[str] = None,
        score_range: Sequence[float] = (0.0, 10.0),
        max_new_tokens: int = 16,
        failure_reward: float = 0.0,
        mesh=None,
        decoder=None,
    ):
        self.model, self.tokenizer, self.template, self.max_tokens = (
            model,
            tokenizer,
            template,
            max_tokens,
        )
        self.pattern = None if score is None else score_pattern(score)
        # the verdict form's two token ids
        self.ids = verdict_ids(tokenizer, verdicts, path) if self.pattern is None else []
        self.range, self.max_new_tokens = tuple(score_range), max_new_tokens
        self.failure_reward, self.mesh = failure_reward, mesh
        self.chat = getattr(tokenizer, "chat_template", None) is not None
        # the score form's answers: decoded by the inference mode (``decoder``, a HybridEngine over
        # the judge: one prefill, then a step a token over its KV cache) where its family has one,
        # else by a full forward a token (``_score``)
        self.decoder = decoder if decoder is not None and decoder.inject else None
        self.seconds = 0.0
        self.failed = torch.zeros(0, dtype=torch.bool)

    def text(self, example: Example, response: str) -> str:
        """The judge's input for one response: the template filled, in the judge's chat template."""
        filled = self.template
        for name, value in zip(FIELDS, (example.prompt, response, example.reference or "")):
            filled = filled.replace(name, value)
        if not self.chat:
            return filled
        turns = [{"role": "user", "content": filled}]
        return self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)

    def rows(self, texts: List[str]) -> List[List[int]]:
        """Each text's ids, its last ``max_tokens``."""
        # the chat template writes the special tokens it needs
        ids = self.tokenizer(texts, add_special_tokens=not self.chat)["input_ids"]
        return [r[-self.max_tokens :] for r in ids]

    def encode(self, texts: List[str]) -> tuple:
        """Left-padded ids and mask, each row its last ``max_tokens`` tokens."""
        return self.padded(self.rows(texts))

    @staticmethod
    def padded(rows: List[List[int]]) -> tuple:
        """(ids, mask) of ``rows`` left-padded to the longest."""
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
        rows = self.rows([self.text(e, t) for e, t in zip(examples, texts)])
        out, step = [], micro or len(rows)
        decoded = self.pattern is not None and self.decoder is not None
        # (decoded: the judge's inference weights gathered once for all the micro-batches)
        with self.decoder.holding() if decoded else contextlib.nullcontext():
            for s in range(0, len(rows), step):
                part = rows[s : s + step]
                if decoded:
                    out.append(self._score_decoded(part).to(device))
                    continue
                i, m = (x.to(device) for x in self.padded(part))
                out.append(self._verdict(i, m) if self.pattern is None else self._score(i, m))
        self.seconds = time.perf_counter() - t0
        rewards = torch.cat(out)
        self.failed = torch.zeros_like(rewards, dtype=torch.bool)
        if self.pattern is None:
            return rewards
        self.failed = rewards.isnan()
        return rewards.nan_to_num(self.failure_reward)

    def _next_logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, V] the next token's logits of left-padded rows (their last position)."""
        last = torch.zeros_like(mask, dtype=torch.bool)
        last[:, -1] = True
        out = self.model.forward(
            input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), logits_at=last
        )
        return out.logits.float()

    def _verdict(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pair = self._next_logits(ids, mask)[:, self.ids].log_softmax(-1)
        return pair[:, 0].exp()

    def _score(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Greedy answers of at most ``max_new_tokens`` tokens, parsed; NaN where the answer has no
        score. Without the inference mode (no ``decoder``): a full forward a token, no cache."""
        eos = self.tokenizer.eos_token_id
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        written = []
        for _ in range(self.max_new_tokens):
            nxt = self._next_logits(ids, mask).argmax(-1)
            # a finished row writes masked padding
            nxt = torch.where(done, torch.zeros_like(nxt), nxt)
            written.append(torch.where(done, torch.full_like(nxt, -1), nxt))
            ids = torch.cat([ids, nxt[:, None]], 1)
            # real tokens to the model, a finished row's too (its outputs are not read): every
            # row's last position is one the forward may be asked for (packed forwards refuse
            # padding)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            done |= nxt == eos if eos is not None else torch.zeros_like(done)
            # every rank decodes as many steps (the forwards are collective)
            going = float((~done).sum())
            if not (self.mesh.sum(going) if self.mesh is not None else going):
                break
        return self._parsed(torch.stack(written, 1).tolist()).to(ids.device)

    def _score_decoded(self, rows: List[List[int]]) -> torch.Tensor:
        """``_score``'s answers decoded greedily by the inference mode (collective, as the
        trainer's generations: every rank calls it as many times)."""
        sp = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens)
        gen = self.decoder.generate(rows, sp)
        tokens = gen.sequences[:, gen.prompt_len :].masked_fill(~gen.response_mask.bool(), -1)
        return self._parsed(tokens.tolist())

    def _parsed(self, tokens: List[List[int]]) -> torch.Tensor:
        """[B] each answer's parsed score (NaN: none) from its token ids (−1: none)."""
        eos = self.tokenizer.eos_token_id
        answers = [
            self.tokenizer.decode([t for t in row if t >= 0 and t != eos], skip_special_tokens=True)
            for row in tokens
        ]
        lo, hi = self.range
        scores = [parse_score(a, self.pattern, lo, hi) for a in answers]
        return torch.tensor([float("nan") if v is None else v for v in scores], dtype=torch.float32)
