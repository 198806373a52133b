"""Multi-turn episodes (rlhf/rl/episodes.py): tokens in and out, observations without loss, the
rollout's log-probs equal to the training recompute over 3+ turns, failures and timeouts bounded,
and GAE / returns that run through the observations between turns."""

import time

import numpy as np
import pytest
import torch

from rlhf.algorithms import ppo as ppo_math
from rlhf.algorithms.estimators import advantages
from rlhf.config import AlgorithmConfig, EngineConfig, TrainConfig
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.logprobs import response_logprobs
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import TrainEngine
from rlhf.envs.base import StepResult
from rlhf.errors import ConfigError
from rlhf.ops import SamplingParams
from rlhf.rl.episodes import EpisodeRunner, ObservationEncoder, parallel
from rlhf.rl.metrics import episode_metrics
from tests.infer_helpers import BOS, PAD, mixed_prompts, tiny_model

VOCAB = 97


class CharTok:
    """A character tokenizer with a small chat template: user 'U:..\\n', assistant 'A:..</s>', tool
    'T:..\\n', generation prompt 'A:'. ``eos_id``: the EOS of the test's model."""

    eos_token, pad_token_id = "</s>", PAD

    def __init__(self, eos_id: int):
        self.eos_token_id = eos_id

    def _id(self, c: str) -> int:
        i = 3 + ord(c) % (VOCAB - 3)
        return i if i != self.eos_token_id else 3

    def __call__(self, text, add_special_tokens=True):
        def enc(t):
            ids = [BOS] if add_special_tokens else []
            for k, part in enumerate(t.split(self.eos_token)):
                if k:
                    ids.append(self.eos_token_id)
                ids += [self._id(c) for c in part]
            return ids

        if isinstance(text, list):
            return {"input_ids": [enc(t) for t in text]}
        return {"input_ids": enc(text)}

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if i in (self.eos_token_id, BOS, PAD) else chr(33 + i % 90) for i in ids)

    def batch_decode(self, rows, skip_special_tokens=True):
        return [self.decode(r) for r in rows]

    def apply_chat_template(
        self, turns, chat_template=None, tools=None, tokenize=False, add_generation_prompt=False
    ):
        out = "".join(
            {
                "user": f"U:{m['content']}\n",
                "assistant": f"A:{m['content']}</s>",
                "tool": f"T:{m['content']}\n",
            }.get(m["role"], "")
            for m in turns
        )
        return out + ("A:" if add_generation_prompt else "")


class Chatty:
    """Answers every turn with a tool message, a reward of 0.5 per turn; never ends by itself."""

    tools = ()

    def reset(self, example):
        return None

    def step(self, text):
        return StepResult(messages=[{"role": "tool", "content": "ok 7"}], reward=0.5)

    def close(self):
        pass


EOS = 50


def ending_model():
    """A random Qwen2 that samples EOS often enough for turns of 1–12 tokens: embedding dimension 0
    is a large constant, so the final hidden state's dimension 0 is too, and EOS's head row reads
    it."""
    model = tiny_model("qwen2")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 3.0
        model.lm_head.weight[EOS] = 0.0
        model.lm_head.weight[EOS, 0] = 0.6
    return model


def runner(tok, env_cls=Chatty, max_turns=4, max_tokens=96, timeout_s=10.0):
    return EpisodeRunner(
        lambda: env_cls(), "test", tok, "template", Mesh(), max_turns, max_tokens, timeout_s
    )


def test_multi_turn_logprobs_equal_the_training_recompute():
    model = ending_model()
    prompts = mixed_prompts(4)
    tok = CharTok(EOS)
    eng = TrainEngine(model, Mesh(), EngineConfig(), TrainConfig(lr=1e-2, warmup_steps=0))
    hy = HybridEngine(eng, tok, EngineConfig())
    assert hy.inject
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, samples_per_prompt=2, seed=11)
    with hy.holding():
        ep = runner(tok).run(hy.generate, prompts, [None] * len(prompts), sp)
    gen = ep.gen
    policy = gen.response_mask.bool()
    real = gen.attention_mask[:, gen.prompt_len :].bool()
    observation = real & ~policy
    # several turns with observations in between, the observation tokens carrying no policy mask
    turns = ep.stats["turns"] / len(ep.texts)
    # a row of 3+ policy turns
    assert max(ep.gen.response_mask.diff(dim=1).eq(1).sum(1)) >= 2, ep.stats
    assert observation.any(), (ep.stats, turns)
    assert (ep.gen.logprobs[observation] == 0).all()
    # every observation is 'T:ok 7\n' + 'A:' tokenized on its own
    obs_ids = tok("T:ok 7\nA:", add_special_tokens=False)["input_ids"]
    row = int(observation.sum(1).argmax())
    seq = gen.responses[row][observation[row]].tolist()
    assert seq[: len(obs_ids)] == obs_ids
    with torch.no_grad():
        lp = response_logprobs(
            eng.forward, gen.sequences, gen.attention_mask, gen.prompt_len, sp.temperature
        )
    diff = ((lp - gen.logprobs) * policy).abs().max().item()
    assert diff <= 1e-6, diff
    # the environment's per-turn rewards sit at the last token of each of their turns
    assert torch.allclose(ep.turn_rewards.sum(1), ep.env_rewards)
    assert (ep.turn_rewards[~policy] == 0).all()


def test_one_turn_is_the_single_turn_generation_itself():
    model = ending_model()
    prompts = mixed_prompts(4)
    tok = CharTok(EOS)
    eng = TrainEngine(model, Mesh(), EngineConfig(), TrainConfig(lr=1e-2, warmup_steps=0))
    hy = HybridEngine(eng, tok, EngineConfig())
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, samples_per_prompt=2, seed=11)
    direct = hy.generate(prompts, sp)
    ep = runner(tok, max_turns=1, max_tokens=10).run(hy.generate, prompts, [None] * 4, sp)
    assert torch.equal(ep.gen.sequences, direct.sequences)
    assert torch.equal(ep.gen.logprobs, direct.logprobs)
    assert ep.turn_rewards is not None  # Chatty rewards the one turn


class Raises(Chatty):
    def step(self, text):
        raise RuntimeError("tool server down")


class Hangs(Chatty):
    def step(self, text):
        time.sleep(30)


class FakeGen:
    """A generate() that answers every row with [5, 6, EOS]."""

    def __init__(self, eos):
        self.eos, self.calls = eos, 0

    def __call__(self, prompts, sp, keys=None):
        from rlhf.engine.infer import finish, left_pad

        self.calls += 1
        rows = [p for p in prompts for _ in range(sp.samples_per_prompt)] or [[BOS]]
        ids, mask = left_pad(rows, PAD)
        n = sp.max_new_tokens
        tokens = torch.full((len(rows), n), PAD)
        tokens[:, :3] = torch.tensor([5, 6, self.eos])
        g = finish(ids, mask, tokens, torch.full((len(rows), n), -0.5), self.eos, PAD)
        return g.rows(0, len(prompts) * sp.samples_per_prompt)


@pytest.mark.parametrize(
    "env_cls, error", [(Raises, "RuntimeError: tool server down"), (Hangs, "timed out after 1 s")]
)
def test_a_failing_or_hanging_environment_fails_its_trajectory_only(env_cls, error):
    tok = CharTok(2)
    t0 = time.perf_counter()
    ep = runner(tok, env_cls, timeout_s=1.0).run(
        FakeGen(2), [[BOS, 7], [BOS, 8]], [None, None], SamplingParams(max_new_tokens=4)
    )
    # the hanging step is abandoned at its timeout
    assert time.perf_counter() - t0 < 5
    assert ep.failed.all() and ep.stats["failed"] == 2
    assert error in ep.errors[0] and ep.errors[0].startswith("test: step: ")


def test_parallel_runs_calls_concurrently():
    t0 = time.perf_counter()
    out = parallel([lambda: time.sleep(0.5) or 1 for _ in range(8)], timeout_s=5)
    assert time.perf_counter() - t0 < 2 and [r for r, _ in out] == [1] * 8


def test_turns_stop_at_the_budget_and_at_max_turns():
    tok = CharTok(2)
    gen = FakeGen(2)
    ep = runner(tok, max_turns=3, max_tokens=200).run(
        gen, [[BOS, 7]], [None], SamplingParams(max_new_tokens=4)
    )
    assert gen.calls == 3 and ep.stats["turns"] == 3
    assert int(ep.gen.response_mask.sum()) == 9  # three turns of [5, 6, EOS]
    ep = runner(tok, max_turns=10, max_tokens=12).run(
        FakeGen(2), [[BOS, 7]], [None], SamplingParams(max_new_tokens=4)
    )
    assert (
        int(ep.gen.attention_mask[:, ep.gen.prompt_len :].sum()) <= 12
        and ep.stats["truncated"] == 1
    )


def test_a_template_that_drops_tool_messages_is_refused():
    class NoTool(CharTok):
        def apply_chat_template(self, turns, **kw):
            return super().apply_chat_template([m for m in turns if m["role"] != "tool"], **kw)

    with pytest.raises(ConfigError, match="does not render 'tool' messages"):
        ObservationEncoder(NoTool(2), "t").check()
    assert ObservationEncoder(CharTok(2), "t").text([{"role": "tool", "content": "9"}]) == "T:9\nA:"


# ---- GAE and returns through the observations between turns ----


def compressed(fn, rewards, values, mask):
    """``fn`` over each row's masked positions only (the reference: observations removed)."""
    out = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        on = mask[b].bool()
        r, v = rewards[b][on][None], values[b][on][None]
        out[b][on] = fn(r, v, torch.ones_like(r))[0]
    return out


def test_gae_and_returns_run_through_observation_tokens():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 12, generator=g), torch.randn(3, 12, generator=g)
    mask = torch.tensor(
        [[1] * 3 + [0] * 2 + [1] * 4 + [0] * 3, [1] * 12, [1, 0, 1, 0, 1, 1, 0, 0, 1, 0, 0, 0]]
    ).float()
    adv, ret = ppo_math.gae(rewards, values, mask, 0.9, 0.8)
    ref = compressed(lambda r, v, m: ppo_math.gae(r, v, m, 0.9, 0.8)[0], rewards, values, mask)
    assert torch.allclose(adv, ref, atol=1e-6)
    assert torch.allclose(ret, (ref + values) * mask, atol=1e-6)
    g_ret = ppo_math.discounted_returns(rewards, mask, 0.9)
    ref = compressed(lambda r, v, m: ppo_math.discounted_returns(r, m, 0.9), rewards, values, mask)
    assert torch.allclose(g_ret, ref, atol=1e-6)


def test_turn_rewards_count_where_they_were_earned():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]]).float()
    turn = torch.zeros(1, 7)
    # the first turn's reward at its last token
    turn[0, 1] = 0.5
    # the final reward 1.0 plus the turn's 0.5
    scores = torch.tensor([1.5])
    kl = torch.zeros(1, 7)
    alg = AlgorithmConfig(estimator="reinforce_pp", whiten_advantages=False, gamma=1.0)
    rewards = ppo_math.token_rewards(scores - turn.sum(1), kl, mask, 0.0) + turn
    assert rewards[0].tolist() == [0, 0.5, 0, 0, 0, 1.0, 0]
    # REINFORCE++ whitens; compare its unwhitened returns' order instead: the first turn earns both
    ret = ppo_math.discounted_returns(rewards, mask, 1.0)
    assert ret[0].tolist() == [1.5, 1.5, 0, 0, 1.0, 1.0, 0]
    adv, _ = advantages(alg, scores, kl, None, mask, 1, 0.0, None, turn)
    # whitened, still ordered: the first turn's tokens earned more
    assert adv[0, 0] > adv[0, 4]


class Counting(Chatty):
    """Chatty with counts of its own in ``info``."""

    def step(self, text):
        res = super().step(text)
        res.info = {
            "echoes": 1,
            "solved": text.endswith("6"),
            "score_sum": np.float32(0.25),
            "t": torch.tensor(2),
        }
        return res


class BadInfo(Chatty):
    def step(self, text):
        res = super().step(text)
        res.info = {"verdict": "solved"}
        return res


def test_an_environments_own_info_keys_become_env_metrics():
    tok = CharTok(2)
    ep = runner(tok, Counting, max_turns=3, max_tokens=200).run(
        FakeGen(2),
        [[BOS, 7], [BOS, 8]],
        [None, None],
        SamplingParams(max_new_tokens=4, samples_per_prompt=2),
    )
    # 4 episodes × 3 turns: step() answers the first two turns of each (the third is the last turn)
    assert ep.stats["turns"] == 12
    got = episode_metrics(ep.stats, Mesh())
    assert got["env/echoes"] == 3.0 and got["env/score_sum"] == 0.75 and got["env/solved"] == 0.0
    assert got["env/turns"] == 3.0 and got["env/t"] == 6.0 and "env/rows" not in got


def test_an_info_value_that_is_no_number_fails_the_episode_naming_it():
    tok = CharTok(2)
    ep = runner(tok, BadInfo).run(FakeGen(2), [[BOS, 7]], [None], SamplingParams(max_new_tokens=4))
    assert ep.failed.all()
    assert (
        "step() info['verdict'] must be a finite number (summed into env/verdict), got 'solved'"
        in ep.errors[0]
    )


def test_a_turn_that_would_not_fit_the_position_table_ends_the_episode_cut():
    tok = CharTok(2)
    sp = SamplingParams(max_new_tokens=4)
    free = runner(tok, max_turns=3, max_tokens=200).run(FakeGen(2), [[BOS, 7]], [None], sp)
    obs = len(tok("T:ok 7\nA:", add_special_tokens=False)["input_ids"])
    # room for the second turn's prompt and its new tokens, not for a third
    table = 2 + 3 + obs + 4
    cut = runner(tok, max_turns=3, max_tokens=200).run(
        FakeGen(2), [[BOS, 7]], [None], sp, positions=table
    )
    assert free.stats["turns"] == 3 and free.stats["truncated"] == 0
    assert cut.stats["turns"] == 2 and cut.stats["truncated"] == 1
    # every turn's generation fitted the table
    assert cut.gen.sequences.shape[1] <= table


def test_multi_turn_episodes_carry_a_moe_policys_routing():
    """A MoE policy's episodes carry, at every token of the assembled rows a turn's generation
    routed (prompts, earlier turns, observations a later turn read), the experts it chose — in
    fp32 those a training forward over the whole episode chooses — and −1 elsewhere."""
    from tests.unit.models.test_moe import own_routing

    model = tiny_model("mixtral", perturb=True)
    with torch.no_grad():  # (ending_model's trick: turns of a few tokens)
        model.model.embed_tokens.weight[:, 0] = 3.0
        model.lm_head.weight[EOS] = 0.0
        model.lm_head.weight[EOS, 0] = 0.6
    tok = CharTok(EOS)
    eng = TrainEngine(model, Mesh(), EngineConfig(), TrainConfig(lr=1e-2, warmup_steps=0))
    hy = HybridEngine(eng, tok, EngineConfig())
    hy.record_routing = True
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, samples_per_prompt=2, seed=11)
    with hy.holding():
        ep = runner(tok).run(hy.generate, mixed_prompts(4), [None] * 4, sp)
    gen = ep.gen
    assert ep.stats["turns"] > len(ep.texts)  # (several turns)
    rec, own = gen.routing.long(), own_routing(model, gen)
    assert rec.shape == own.shape
    recorded = (rec >= 0).all(-1).all(-1)
    real = gen.attention_mask.bool()
    assert (recorded <= real).all() and recorded[:, : gen.prompt_len].eq(
        real[:, : gen.prompt_len]
    ).all()
    # observation tokens a later turn read are recorded too
    observation = real[:, gen.prompt_len :] & ~gen.response_mask.bool()
    assert (recorded[:, gen.prompt_len :] & observation).any()
    assert torch.equal(rec[recorded].sort(-1).values, own[recorded].sort(-1).values)
