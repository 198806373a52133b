"""A TP rollout worker's leader and followers (rlhf/rl/rollout_tp.py): the rollout ranks' own world
and TP groups, the leader's acts heard by a follower in order (two real processes over gloo), and a
follower's slices of the weights by version."""

import queue

import pytest
import torch.multiprocessing as mp

from rlhf.ops import SamplingParams
from rlhf.rl import rollout_tp
from rlhf.rl.rollout_worker import Weights

ACTS = [
    ("build", 1),
    ("generate", 1, [[5, 6], [7]], SamplingParams(temperature=0.5, seed=3), [0, 1]),
    ("release", 1),
    None,
]


def _rank(rank: int, path: str, out) -> None:
    import torch.distributed as dist

    store = dist.FileStore(path, 2)
    groups = rollout_tp.tp_groups(store, "test", rank, 2, 2, 60)
    assert len(groups) == 1
    if rank == 0:
        mirror = rollout_tp.Mirror(groups[0], 0)
        for act in ACTS[:-1]:
            mirror.say(act)
        mirror.stop()
    else:
        heard = []
        while True:
            act = rollout_tp.heard(groups[0], 0)
            heard.append(act)
            if act is None:
                break
        out.put(heard)
    dist.destroy_process_group()


def test_a_follower_hears_the_leaders_acts_in_order(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    heard = out.get(timeout=120)
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert heard == ACTS


def test_a_followers_slices_are_taken_by_version_the_older_dropped():
    q = queue.Queue()
    for v in (1, 2, 3):
        q.put(Weights(v, {}, [{"v": v}]))
    shards = rollout_tp._Shards(q)
    assert shards.take(2).version == 2
    assert set(shards.held) == {2}  # (version 1 gone: no later build names it)
    # a version asked again (a second model of the same weights) is still there
    assert shards.take(2).version == 2
    assert shards.take(3).layers == [{"v": 3}] and set(shards.held) == {3}
    q.put(None)
    with pytest.raises(RuntimeError, match="stopped before sending version 4"):
        shards.take(4)
