"""What a reward model's held-out pair accuracy must beat: two baselines that read the text alone.

- ``length``: the longer response (in characters) wins; a tie counts half.
- ``bag_of_words``: a logistic regression on the difference of the two responses' word counts
  (lower-cased ``\\w+`` words, those seen in at least two training pairs), no bias, so that swapping
  a pair flips its score; L2-regularised, fitted by L-BFGS on the training pairs.

Both are computed by the reward stage on exactly the pairs the model trains and is evaluated on (its
tokenized columns, decoded: the pairs the lengths dropped are left out there too;
``eval/baseline_*`` in its metrics and reward_stats.json) and cost a second or two on thousands of
pairs.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Dict, List, Sequence, Tuple

import torch

_WORD = re.compile(r"\w+")
# a word counts when at least this many training pairs use it
MIN_PAIRS = 2
# the regression's weight decay, per training pair
L2 = 1e-2


Pairs = Sequence[Tuple[str, str]]  # (chosen response, rejected response)


def response_texts(cols: dict, tokenizer) -> List[Tuple[str, str]]:
    """The (chosen, rejected) responses of tokenized pair columns (``tokenize_pairs``), decoded
    without their special tokens."""
    out = []
    for c, r, p in zip(cols["chosen"], cols["rejected"], cols["prompt_len"]):
        c, r = (tokenizer.decode(list(ids)[p:], skip_special_tokens=True) for ids in (c, r))
        out.append((c, r))
    return out


def length_accuracy(pairs: Pairs) -> float:
    """The share of pairs whose chosen response is the longer one (ties: half)."""
    if not pairs:
        return float("nan")
    longer = sum(len(c) > len(r) for c, r in pairs)
    ties = sum(len(c) == len(r) for c, r in pairs)
    return (longer + 0.5 * ties) / len(pairs)


def _counts(text: str) -> Counter:
    return Counter(_WORD.findall(text.lower()))


def _features(pairs: Pairs, vocab: Dict[str, int]) -> torch.Tensor:
    x = torch.zeros(len(pairs), len(vocab), dtype=torch.float64)
    for i, (c, r) in enumerate(pairs):
        for sign, text in ((1.0, c), (-1.0, r)):
            for word, n in _counts(text).items():
                j = vocab.get(word)
                if j is not None:
                    x[i, j] += sign * n
    return x


def bag_of_words_accuracy(fit: Pairs, test: Pairs) -> float:
    """Held-out accuracy (on ``test``) of a word-count logistic regression fitted on the pairs
    ``fit`` (score > 0: chosen preferred; 0, a pair whose words cancel out, counts half)."""
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


def baselines(train: Pairs, held_out: Pairs) -> Dict[str, float]:
    """``KEYS``: the held-out pair accuracies of the longer response and of the word counts."""
    return dict(zip(KEYS, (length_accuracy(held_out), bag_of_words_accuracy(train, held_out))))


def said(res: dict) -> str:
    """``res``'s baselines for a log line ('' without them)."""
    if KEYS[0] not in res:
        return ""
    return f"; longer response wins {res[KEYS[0]]:.4f}, bag of words {res[KEYS[1]]:.4f}"
