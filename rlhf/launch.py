"""``python -m rlhf ... launcher.nproc_per_node=G [launcher.nnodes=N launcher.node_rank=R
launcher.rdzv_endpoint=HOST:PORT launcher.max_restarts=K]``: start torch.distributed.run ourselves
(c10d rendezvous), with the same overrides for every worker."""
from __future__ import annotations

from typing import List


def launcher_args(cfg, overrides: List[str]) -> List[str]:
    lc = cfg.launcher
    return [f"--nnodes={lc.nnodes}", f"--nproc-per-node={lc.nproc_per_node}", f"--node-rank={lc.node_rank}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={lc.rdzv_endpoint}", f"--rdzv-id={lc.rdzv_id}",
            f"--max-restarts={lc.max_restarts}", "-m", "rlhf", *overrides]


def self_launch(cfg, overrides: List[str]) -> int:
    from torch.distributed.run import main as torchrun
    try:
        torchrun(launcher_args(cfg, overrides))
    except SystemExit as e:
        return int(e.code or 0)
    except Exception as e:  # ChildFailedError: a worker failed; its own message was printed
        print(f"rlhf: error: a worker failed ({type(e).__name__})")
        return 1
    return 0
