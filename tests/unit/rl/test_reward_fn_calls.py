"""A user's rule reward (ppo.reward_fn) is checked on every call, not only once before the run: one
number per response or exit 2 with one line naming the function (rlhf/rewards.py ``call``, used by
the pre-run ``check`` and by the rollouts in rlhf/rl/experience.py)."""

import contextlib
import logging
import math

import pytest
import torch

from rlhf import rewards
from rlhf.config import AlgorithmConfig, PPOConfig
from rlhf.data.records import Example
from rlhf.engine.infer import Generation
from rlhf.errors import ConfigError
from rlhf.ops import SamplingParams
from rlhf.rl.experience import Collector
from rlhf.rl.prompts import PromptBatch
from rlhf.rl.scorers import RewardNormaliser, Scorers
from tests.e2e.batch_reward import batch_mean, fails_on_text

EOS = 2


def per_response(responses, examples, fmt):
    return [float(len(r)) for r in responses]


def nan_reward(responses, examples, fmt):
    return [float("nan")] * len(responses)


def some_none(responses, examples, fmt):
    return [1.0] * (len(responses) - 1) + [None]


class Tok:
    eos_token_id, pad_token_id, eos_token = EOS, 0, None

    def decode(self, ids, skip_special_tokens=True):
        return self.batch_decode([ids])[0]

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(str(t) for t in r if t != EOS) for r in rows]


class Hybrid:
    """Two prompts × two samples, three response tokens each (the last row never ends)."""

    positions = 0  # rotary: no position table to fit
    # no injected inference model (nor a Mixture-of-Experts one's routing to record)
    inject, policy = False, None

    def holding(self):
        # (the hybrid engine keeps its inference model inside; nothing to keep here)
        return contextlib.nullcontext()

    def generate(self, prompts, sp, keys=None):
        seq = torch.tensor(
            [[5, 6, 7, 8, EOS], [5, 6, 9, EOS, 0], [5, 7, 7, 7, EOS], [5, 7, 8, 8, 8]]
        )
        resp = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
        return Generation(
            sequences=seq,
            attention_mask=torch.cat([torch.ones(4, 2, dtype=torch.long), resp], 1),
            response_mask=resp,
            logprobs=None,
            prompt_len=2,
        )


def rollout_with(rule):
    scorers = Scorers(
        ref=None,
        critic=None,
        reward_model=None,
        normalise=RewardNormaliser("none", {}),
        rule=rule,
        rule_weight=1.0,
        data_format="prompt_response",
    )
    collector = Collector(
        Hybrid(), None, scorers, None, AlgorithmConfig(), PPOConfig(), Tok(), None, seed=0
    )
    batch = PromptBatch([[5, 6], [5, 7]], [Example(prompt="a"), Example(prompt="b")])
    return collector.rollout(batch, SamplingParams(samples_per_prompt=2))


def test_a_batch_level_reward_stops_the_rollout_naming_it():
    # before: the one number was broadcast to every response and the run went on
    with pytest.raises(ConfigError) as e:
        rollout_with(batch_mean)
    msg = str(e.value)
    assert msg.startswith(
        "ppo.reward_fn=tests.e2e.batch_reward.batch_mean: it returned 1 value for 4 responses"
    ), msg
    assert "one number per response" in msg and "\n" not in msg
    # the right shape goes through, one reward per row
    ro = rollout_with(per_response)
    assert ro.parts["rule"].tolist() == [3.0, 1.0, 3.0, 5.0]  # '7 8', '9', '7 7', '8 8 8'


def test_an_error_inside_the_function_during_the_run_is_named_with_where_it_raised():
    with pytest.raises(ConfigError) as e:
        rollout_with(fails_on_text)
    msg = str(e.value)
    assert msg.startswith(
        "ppo.reward_fn=tests.e2e.batch_reward.fails_on_text: calling it on a batch of 4 "
        "responses failed: KeyError: '7 8' at "
    ), msg
    assert "tests/e2e/batch_reward.py:" in msg  # where it raised


def test_nan_is_a_number_the_update_handles():
    ro = rollout_with(nan_reward)
    assert all(math.isnan(x) for x in ro.parts["rule"].tolist())


@pytest.mark.parametrize(
    "fn, fragment",
    [
        (lambda r, e, f: 0.5, "it returned a float for 2 responses"),
        (lambda r, e, f: "1", "it returned a str for 2 responses"),
        (lambda r, e, f: [1.0, 2.0, 3.0], "it returned 3 values for 2 responses"),
        (some_none, "value 1 of the 2 it returned is not a number (NoneType None"),
        (lambda r, e, f: ["1.0", "2.0"], "value 0 of the 2 it returned is not a number (str"),
    ],
)
def test_call_refuses_anything_but_one_number_per_response(fn, fragment):
    with pytest.raises(ConfigError, match=r"^ppo.reward_fn=my.fn: ") as e:
        rewards.call(fn, ["a", "b"], [Example(prompt="p")] * 2, "prompt_response", path="my.fn")
    assert fragment in str(e.value), str(e.value)
    out = rewards.call(
        lambda r, e, f: torch.tensor([1.0, 2.0]), ["a", "b"], [Example(prompt="p")] * 2, "x"
    )
    assert out == [1.0, 2.0] and all(type(x) is float for x in out)


def test_the_pre_run_check_catches_a_batch_level_function():
    # before: one record, one response, one number: it passed and the run broadcast it
    with pytest.raises(
        ConfigError, match=r"^ppo.reward_fn=my\.mean: it returned 1 value for 2 responses"
    ):
        rewards.check(batch_mean, "my.mean", Example(prompt="p"), "prompt_response")
    rewards.check(per_response, "my.ok", Example(prompt="p"), "prompt_response")
    with pytest.raises(ConfigError, match="calling it on one record failed: KeyError"):
        rewards.check(
            lambda r, e, f: {}["answer"], "my.raises", Example(prompt="p"), "prompt_response"
        )


def test_an_unimportable_reward_function_logs_nothing_besides_its_error(caplog):
    """Hydra's get_method logs the error it raises (three lines on stderr before ours): silenced."""
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(
            ConfigError, match=r"^ppo.reward_fn=nosuchmodule.fn: cannot import it: "
        ) as e:
            rewards.resolve("nosuchmodule.fn")
    assert "\n" not in str(e.value) and "nosuchmodule" in str(e.value)
    assert caplog.records == [], [r.getMessage() for r in caplog.records]
    assert not logging.getLogger("hydra.utils").disabled  # left as it was
    assert rewards.resolve("rlhf.rewards.gold") is rewards.gold
