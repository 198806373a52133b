"""The links' messages (rlhf/rl/link_messages.py): read back weights-only, an environment's
values made plain first, any other class refused."""

import pytest

from rlhf.ops import SamplingParams
from rlhf.rl import link_messages


def test_an_environments_numpy_values_travel_as_plain_ones():
    import collections

    import numpy as np

    P = collections.namedtuple("P", "a b")
    x = {np.str_("k"): [np.float64(1.5), np.bool_(True), np.array([1, 2]), P(np.int64(3), "s")]}
    plain = link_messages.plain(x)
    assert plain == {"k": [1.5, True, [1, 2], (3, "s")]}
    assert link_messages.decode(link_messages.encode(plain)) == plain


def test_a_tp_leaders_acts_round_trip_and_other_classes_are_refused():
    act = ("generate", 3, [[1, 2], [3]], SamplingParams(temperature=0.7), [4, 5])
    assert link_messages.decode(link_messages.encode(act)) == act

    import datetime

    with pytest.raises(link_messages.Undecodable, match=r"Unsupported global: .*datetime\.date"):
        link_messages.decode(link_messages.encode(datetime.date(2026, 11, 30)))
