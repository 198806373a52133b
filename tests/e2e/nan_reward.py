"""Broken rule rewards: always NaN (the non-finite test); raising on a record (the bad-input
table)."""


def nan_reward(responses, examples, fmt):
    return [float("nan")] * len(responses)


def raises(responses, examples, fmt):
    raise KeyError("answer")
