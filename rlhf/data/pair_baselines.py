"""What a reward model's held-out pair accuracy must beat: two baselines that read the text alone.

- ``length``: the longer response (in characters) wins; a tie counts half.
- ``bag_of_words``: a logistic regression on the difference of the two responses' word counts
  (lower-cased ``\\w+`` words, those seen in at least two training pairs), no bias, so that swapping a
  pair flips its score; L2-regularised, fitted by L-BFGS on the training pairs.

Both are computed by the reward stage on the same held-out pairs as the model (``eval/baseline_*`` in
its metrics and reward_stats.json) and cost a second or two on thousands of pairs.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Dict, List, Sequence, Tuple

import torch

from rlhf.data.records import Example

_WORD = re.compile(r"\w+")
MIN_PAIRS = 2  # a word counts when at least this many training pairs use it
L2 = 1e-2  # the regression's weight decay, per training pair


def _pairs(examples: Sequence[Example]) -> List[Tuple[str, str]]:
    return [(e.chosen or "", e.rejected or "") for e in examples if e.chosen is not None and e.rejected is not None]


def length_accuracy(examples: Sequence[Example]) -> float:
    """The share of pairs whose chosen response is the longer one (ties: half)."""
    pairs = _pairs(examples)
    if not pairs:
        return float("nan")
    longer = sum(len(c) > len(r) for c, r in pairs)
    ties = sum(len(c) == len(r) for c, r in pairs)
    return (longer + 0.5 * ties) / len(pairs)


def _counts(text: str) -> Counter:
    return Counter(_WORD.findall(text.lower()))


def _features(pairs: List[Tuple[str, str]], vocab: Dict[str, int]) -> torch.Tensor:
    x = torch.zeros(len(pairs), len(vocab), dtype=torch.float64)
    for i, (c, r) in enumerate(pairs):
        for sign, text in ((1.0, c), (-1.0, r)):
            for word, n in _counts(text).items():
                j = vocab.get(word)
                if j is not None:
                    x[i, j] += sign * n
    return x


def bag_of_words_accuracy(train: Sequence[Example], held_out: Sequence[Example]) -> float:
    """Held-out accuracy of a word-count logistic regression fitted on the training pairs (score > 0:
    chosen preferred; 0, a pair whose words cancel out, counts half)."""
    fit, test = _pairs(train), _pairs(held_out)
    if not fit or not test:
        return float("nan")
    seen = Counter(w for c, r in fit for w in set(_counts(c)) | set(_counts(r)))
    vocab = {w: i for i, w in enumerate(sorted(w for w, n in seen.items() if n >= MIN_PAIRS))}
    x = _features(fit, vocab)
    w = torch.zeros(len(vocab), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.softplus(-(x @ w)).mean() + L2 * (w * w).sum() / 2
        loss.backward()
        return loss

    opt.step(closure)
    scores = _features(test, vocab) @ w.detach()
    return float(((scores > 0).double() + 0.5 * (scores == 0).double()).mean())


KEYS = ("eval/baseline_length", "eval/baseline_bag_of_words")


def baselines(train: Sequence[Example], held_out: Sequence[Example]) -> Dict[str, float]:
    """``KEYS``: the held-out pair accuracies of the longer response and of the word counts."""
    return dict(zip(KEYS, (length_accuracy(held_out), bag_of_words_accuracy(train, held_out))))


def said(res: dict) -> str:
    """``res``'s baselines for a log line ('' without them)."""
    if KEYS[0] not in res:
        return ""
    return f"; longer response wins {res[KEYS[0]]:.4f}, bag of words {res[KEYS[1]]:.4f}"
