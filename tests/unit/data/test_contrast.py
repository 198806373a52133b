"""Contrast pairs for a reward model (rlhf/data/contrast.py): what each kind's loser is, how many,
drawn from the seed alone, the input columns untouched, and the config's checks."""

import pytest

from rlhf.config import RewardConfig
from rlhf.data import contrast
from rlhf.errors import ConfigError

EOS = 2


def _cols(n=8):
    """n pairs: prompt [100 + i] * (1 + i % 3), chosen response [10 + i, EOS], rejected
    [50 + i, EOS]."""
    cols = {"chosen": [], "rejected": [], "prompt_len": []}
    for i in range(n):
        p = [100 + i] * (1 + i % 3)
        cols["chosen"].append(p + [10 + i, EOS])
        cols["rejected"].append(p + [50 + i, EOS])
        cols["prompt_len"].append(len(p))
    return cols


def _prompt(seq, p):
    return seq[:p]


def test_other_pairs_keep_the_prompt_and_take_another_pairs_response():
    cols = _cols()
    out = contrast.with_contrast(cols, ["other"], 0.5, seed=0, eos=EOS)
    assert len(out["chosen"]) == 8 + 4
    for c, r, p in zip(out["chosen"][8:], out["rejected"][8:], out["prompt_len"][8:]):
        i = c[0] - 100
        assert c == cols["chosen"][i] and _prompt(r, p) == _prompt(c, p)
        loser = r[p:]
        assert loser[-1] == EOS and loser[0] in {10 + j for j in range(8)} | {
            50 + j for j in range(8)
        }
        # another prompt's response, never the pair's own
        assert loser[0] not in (10 + i, 50 + i)


def test_empty_pairs_lose_to_the_chosen_response_with_eos_alone():
    cols = _cols()
    out = contrast.with_contrast(cols, ["empty"], 0.25, seed=3, eos=EOS)
    assert len(out["chosen"]) == 8 + 2
    for c, r, p in zip(out["chosen"][8:], out["rejected"][8:], out["prompt_len"][8:]):
        assert r == _prompt(c, p) + [EOS] and c[p:] != [EOS]


def test_the_draw_is_the_seeds_and_the_input_is_left_alone():
    cols = _cols(20)
    before = {k: [list(s) if isinstance(s, list) else s for s in v] for k, v in cols.items()}
    a = contrast.with_contrast(cols, ["other", "empty"], 0.5, seed=1, eos=EOS)
    b = contrast.with_contrast(cols, ["other", "empty"], 0.5, seed=1, eos=EOS)
    c = contrast.with_contrast(cols, ["other", "empty"], 0.5, seed=2, eos=EOS)
    assert a == b and a != c
    assert cols == before
    assert len(a["chosen"]) == 20 + 10 + 10
    # the original pairs first, as they were
    assert a["chosen"][:20] == cols["chosen"] and a["rejected"][:20] == cols["rejected"]


def test_no_kinds_is_the_pairs_themselves():
    cols = _cols()
    assert contrast.with_contrast(cols, [], 0.5, seed=0, eos=EOS) == cols
    assert contrast.held_out(cols, [], seed=0, eos=EOS) == {}


def test_a_pair_equal_on_both_sides_is_left_out():
    cols = _cols(2)
    # pair 0's chosen response is EOS alone: its empty contrast would be the same sequence twice
    cols["chosen"][0] = cols["chosen"][0][:1] + [EOS]
    out = contrast.held_out(cols, ["empty"], seed=0, eos=EOS)
    assert out["empty"]["chosen"] == [cols["chosen"][1]]


def test_another_pairs_response_to_the_same_prompt_is_never_the_loser():
    cols = _cols(6)
    # pairs 0 … 4 share one prompt (several comparisons of one question); pair 5 has its own
    for i in range(5):
        cols["chosen"][i] = [100, 10 + i, EOS]
        cols["rejected"][i] = [100, 50 + i, EOS]
        cols["prompt_len"][i] = 1
    out = contrast.held_out(cols, ["other"], seed=0, eos=EOS)["other"]
    for c, r, p in zip(out["chosen"], out["rejected"], out["prompt_len"]):
        if c[0] == 100:  # its loser is pair 5's response, or it has none
            assert r[p:][0] in (15, 55)
        else:
            assert r[p:][0] in {10 + i for i in range(5)} | {50 + i for i in range(5)}
    # one prompt everywhere: no other prompt to answer, no pair
    same = {k: v[:5] for k, v in cols.items()}
    assert contrast.held_out(same, ["other"], seed=0, eos=EOS) == {}


def test_held_out_has_one_pair_of_each_kind_per_pair():
    cols = _cols(6)
    out = contrast.held_out(cols, ["other", "empty"], seed=0, eos=EOS)
    assert set(out) == {"other", "empty"}
    assert all(len(v["chosen"]) == 6 for v in out.values())
    assert out["other"]["chosen"] == cols["chosen"]


def test_describe():
    assert contrast.describe([], 0.5) == ""
    assert contrast.describe(["other", "empty"], 0.25) == "contrast pairs other+empty at 0.25 each"


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"contrast": ["shorter"]}, "reward.contrast"),
        ({"contrast": ["empty", "empty"]}, "reward.contrast"),
        ({"contrast": ["empty"], "contrast_share": 0.0}, "reward.contrast_share"),
        ({"contrast": ["empty"], "contrast_share": 1.5}, "reward.contrast_share"),
    ],
)
def test_bad_contrast_settings_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        RewardConfig(**kw)
