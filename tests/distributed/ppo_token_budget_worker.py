"""One GAE step on 2 ranks (ZeRO-3) with row-count and token-budget micro-batches (the scored
tensors and every update's full gradients: tests/unit/rl/test_ppo_token_budget.py's ``run``), saved
by rank 0.

    torchrun --nproc-per-node=2 tests/distributed/ppo_token_budget_worker.py OUT.pt
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rlhf.config import EngineConfig  # noqa: E402
from rlhf.engine.mesh import end_process, init_mesh  # noqa: E402
from tests.unit.rl.test_ppo_token_budget import run  # noqa: E402

# 0: the row-count reference; 8: most rows alone; 30: a few rows together
BUDGETS = (0, 8, 30)


def main(out: str) -> None:
    mesh = init_mesh(EngineConfig(timeout_s=120, precision="fp32"))
    results = {}
    for budget in BUDGETS:
        exp, actor_grads, critic_grads = run(budget, mesh=mesh)
        scored = {
            k: getattr(exp, k)
            for k in ("old_logprobs", "ref_logprobs", "values", "scores", "advantages")
        }
        results[budget] = {"scored": scored, "actor": actor_grads, "critic": critic_grads}
    if mesh.is_main:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # (a torchrun worker: without finalization, rlhf/engine/mesh.py says why)
    end_process()
