"""Environments for the agentic tests, used by dotted path
(``env.name=tests.e2e.agent_envs.Echo``)."""

from rlhf.envs.base import Environment, StepResult


class Echo(Environment):
    """Answers every turn with a tool message (never ends by itself: env.max_turns does), rewarding
    each turn by its length (a per-turn reward)."""

    def __init__(self, reply: str = "ok 7"):
        self.reply = reply

    def step(self, text):
        return StepResult(
            messages=[{"role": "tool", "content": self.reply}],
            reward=0.01 * len(text),
            # its own counts: metrics env/echoes, env/long_turns
            info={"echoes": 1, "long_turns": len(text) > 8},
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


class SlowEcho(Echo):
    """Echo behind a tool that takes ``delay_s`` to answer (a remote sandbox or API)."""

    def __init__(self, reply: str = "ok 7", delay_s: float = 0.3):
        super().__init__(reply)
        self.delay_s = delay_s

    def step(self, text):
        import time

        time.sleep(self.delay_s)
        return super().step(text)


def _in_rollout_worker() -> bool:
    import multiprocessing

    return multiprocessing.current_process().name.startswith("rlhf-rollout-worker")


class WorkerDies(Echo):
    """Kills the rollout worker process at its first step (the trainer's own checks pass)."""

    def step(self, text):
        if _in_rollout_worker():
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(text)


class WorkerHangs(Echo):
    """Stops the rollout worker process at its first step (SIGSTOP: a frozen machine)."""

    def step(self, text):
        if _in_rollout_worker():
            import os
            import signal

            os.kill(os.getpid(), signal.SIGSTOP)
        return super().step(text)
