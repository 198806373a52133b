"""Rule rewards wrong in ways one call on one record does not show: one number for the whole batch;
an error on generated text only (the pre-run check calls with empty responses)."""


def batch_mean(responses, examples, fmt):
    return [sum(len(r) for r in responses) / max(len(responses), 1)]


def fails_on_text(responses, examples, fmt):
    return [{"": 0.0}[r] for r in responses]
