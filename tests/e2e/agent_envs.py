"""Environments for the agentic tests, used by dotted path (``ppo.env=tests.e2e.agent_envs.Echo``)."""

from rlhf.envs.base import Environment, StepResult


class Echo(Environment):
    """Answers every turn with a tool message (never ends by itself: ppo.max_turns does), rewarding
    each turn by its length (a per-turn reward)."""

    def __init__(self, reply: str = "ok 7"):
        self.reply = reply

    def step(self, text):
        return StepResult(
            messages=[{"role": "tool", "content": self.reply}],
            reward=0.01 * len(text),
            info={"echoes": 1, "long_turns": len(text) > 8},  # its own counts: metrics env/echoes, env/long_turns
        )


class Flaky(Environment):
    """Raises on every step."""

    def step(self, text):
        raise RuntimeError("the tool server is down")


class NoStep:
    def reset(self, example):
        return None


class BadInfo(Echo):
    """Its info holds a string where a number belongs."""

    def step(self, text):
        res = super().step(text)
        res.info = {"verdict": "solved"}
        return res
