"""Tools that wait as remote ones do, for `bench/async_rl.py`:
``env.tools=[bench.slow_tools.calculator]`` is the built-in calculator (the same name and schema, so
the agentic task's prompts are unchanged) answering after 50–300 ms (uniform), as a sandbox or an
API across a network does."""

from __future__ import annotations

import random
import time

from rlhf.envs.tools import Tool, calculator_tool

DELAY_S = (0.05, 0.3)


def calculator() -> Tool:
    fast = calculator_tool()

    def slow(**arguments):
        time.sleep(random.uniform(*DELAY_S))
        return fast.fn(**arguments)

    return Tool(fast.name, fast.description, fast.parameters, slow)
