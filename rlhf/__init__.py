"""rlhf: supervised fine-tuning, reward models, PPO and its relatives, DPO
(docs/architecture.md)."""

from rlhf.threads import tame_openmp

# Before anything imports torch: OpenMP reads how its threads wait when it loads (rlhf/threads.py).
tame_openmp()
