"""Derived seeds: ``run.seed`` (or a stream's own seed) → the seed of each random stream of a run.

One place for the strides, so that no two streams are seeded with the same number by accident and a
new stream picks a stride of its own. Two forms, each kept exactly as those streams have always been
seeded (fixed-seed numbers are a contract, docs/architecture.md habit 11):

- ``offset(seed, i, stride) = seed + stride·i``: stream ``i`` of a family (``i = 0`` is ``seed``
  itself);
- ``nested(seed, i, stride) = seed·stride + i``: index ``i`` (an epoch, a step) under ``seed``.
"""

from __future__ import annotations

# offset: data source i of a blend (rlhf/data/pipeline.py)
SOURCE = 7919
# offset by 1: the order of data.eval_path's records (rlhf/data/pipeline.py)
HELD_OUT = 104_729
# nested: an epoch's shuffle of the global batches (rlhf/data/sampler.py)
EPOCH = 1_000_003
# offset: the sampling stream of a rank under HF generate (rlhf/engine/hybrid.py)
RANK = 1_000_003
# offset: the sampling stream of row key i of a generation (rlhf/ops/sampling.py)
SAMPLE = 1_299_709
# nested: the PPO rollouts of step i (stages/ppo.py)
ROLLOUT = 7919
# offset: the minibatch order of PPO step i (stages/ppo.py)
MINIBATCH = 31
# offset by 1: the PPO-ptx batches (rlhf/rl/sft_records.py)
PTX = 17
# offset by 1: GKD's dataset batches (algorithm.gkd_data_share; rlhf/rl/sft_records.py)
GKD_DATA = 23
# offset: dynamic sampling's extra round i (rlhf/rl/experience.py)
REFILL = 104_729
# offset: turn i (≥ 1) of a multi-turn rollout (rlhf/rl/episodes.py)
TURN = 15_485_863
# nested: record i's bootstrap draw for an ensemble's members (rlhf/data/sampler.py)
BOOTSTRAP = 2_750_159
# offset: kind i (≥ 1) of a reward model's contrast pairs (reward.contrast; rlhf/data/contrast.py),
# and of their held-out view
CONTRAST = 3_497_861
CONTRAST_EVAL = 4_256_233


def offset(seed: int, index: int, stride: int) -> int:
    """``seed + stride·index``: stream ``index`` of a family spaced ``stride`` apart."""
    return seed + stride * index


def nested(seed: int, index: int, stride: int) -> int:
    """``seed·stride + index``: ``index`` (an epoch, a step) under ``seed``."""
    return seed * stride + index
