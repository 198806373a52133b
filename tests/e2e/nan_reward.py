"""A broken rule reward for the non-finite test: always NaN."""


def nan_reward(responses, examples, fmt):
    return [float("nan")] * len(responses)
