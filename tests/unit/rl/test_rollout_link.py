"""The rollout ranks' link (rlhf/rl/rollout_link.py): the world's split, messages and weights over
real gloo process groups (two ranks as two threads over one store), read back weights-only, and a
rollout rank's intake ordering its trainers' requests."""

import threading

import pytest
import torch
import torch.distributed as dist

from rlhf.config import rollout_layout
from rlhf.errors import ConfigError
from rlhf.ops import SamplingParams
from rlhf.rl import rollout_link
from rlhf.rl.async_rollouts import packed
from rlhf.rl.rollout_worker import Failed, Request, Weights


def linked(n: int = 2, timeout_s: float = 30):
    """``n`` Links of one world, made at once (each a collective), as threads of this process."""
    store = dist.HashStore()
    out = [None] * n

    def make(r):
        out[r] = rollout_link.Link(store, r, n, timeout_s=timeout_s, name="test")

    threads = [threading.Thread(target=make, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(out)
    return out


def across(send, receive):
    """``receive()``'s value, while ``send()`` runs in a thread."""
    t = threading.Thread(target=send)
    t.start()
    got = receive()
    t.join(60)
    return got


def test_the_split_and_who_serves_whom():
    assert rollout_layout(2, 1) == (1, 1) and rollout_layout(6, 2) == (4, 2)
    # trainers 0 … 3, rollout ranks 4, 5: each serves two trainers
    assert [rollout_link.served_by(r, 4, 2) for r in range(4)] == [4, 5, 4, 5]
    with pytest.raises(ConfigError, match="leaves no trainer in a world of 2"):
        rollout_layout(2, 2)
    with pytest.raises(ConfigError, match="does not divide the 3 trainer ranks"):
        rollout_layout(5, 2)


def test_weights_travel_as_flat_buffers_and_arrive_tied_as_sent():
    trainer, worker = linked()
    emb = torch.randn(50, 8)
    root = {"embed": emb, "head": emb, "inv_freq": torch.arange(4.0), "eps": 1e-5}
    layers = [{"q": torch.randn(8, 8), "norm": torch.randn(8).to(torch.bfloat16)} for _ in range(3)]
    shared = [packed(d, share=False)[0] for d in (root, *layers)]
    w = Weights(7, shared[0], shared[1:])
    old = rollout_link.BUCKET_BYTES
    rollout_link.BUCKET_BYTES = 64  # (many buckets per buffer)
    try:
        got = across(lambda: trainer.send_weights(1, w), lambda: worker.recv(worker.down, 0))
    finally:
        rollout_link.BUCKET_BYTES = old
    assert isinstance(got, Weights) and got.version == 7
    assert torch.equal(got.root["embed"], emb) and got.root["eps"] == 1e-5
    # tied weights stay one tensor
    assert got.root["head"].data_ptr() == got.root["embed"].data_ptr()
    for a, b in zip(got.layers, layers):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_requests_and_answers_round_trip_weights_only():
    trainer, worker = linked()
    req = Request(3, [[1, 2, 3]], [], SamplingParams(temperature=0.7), [5], 2, origin=0)
    got = across(lambda: trainer.send(trainer.down, 1, req), lambda: worker.recv(worker.down, 0))
    assert got == req
    fail = Failed("env: boom", 2)
    assert across(lambda: worker.send(worker.up, 0, fail), lambda: trainer.recv(trainer.up, 1)) == (
        fail
    )
    assert across(
        lambda: trainer.send(trainer.down, 1, None), lambda: worker.recv(worker.down, 0)
    ) is (None)


class Code:
    """A class no message may hold."""


def test_a_message_of_another_class_is_refused_and_the_link_stays_in_step():
    trainer, worker = linked()

    def send():
        trainer.send(trainer.down, 1, {"code": Code()})
        trainer.send(trainer.down, 1, "next")

    def receive():
        with pytest.raises(rollout_link.Undecodable, match="Weights only load failed"):
            worker.recv(worker.down, 0)
        return worker.recv(worker.down, 0)

    assert across(send, receive) == "next"


def test_a_send_nobody_takes_fails_within_the_timeout():
    import time

    trainer, _ = linked(timeout_s=1)
    t0 = time.perf_counter()
    with pytest.raises(Exception, match=r"[Tt]imed out"):
        trainer.send(trainer.down, 1, "never received")
    assert time.perf_counter() - t0 < 10


def test_a_step_is_played_in_trainer_order_whatever_arrives_first():
    intake = rollout_link._Intake(link=None, trainers=[0, 2])

    def req(step, origin):
        return Request(step, [], [], SamplingParams(), [], step, origin=origin)

    intake._asked(req(0, 2))
    assert intake.requests.empty()  # (trainer 0's part of step 0 not here yet)
    intake._asked(req(1, 2))
    intake._asked(req(0, 0))
    intake._asked(req(1, 0))
    order = [intake.requests.get_nowait() for _ in range(4)]
    assert [(r.step, r.origin) for r in order] == [(0, 0), (0, 2), (1, 0), (1, 2)]
    intake._stop()
    assert intake.requests.empty()  # one trainer of two said stop
    intake._stop()
    assert intake.requests.get_nowait() is None


def test_an_environments_numpy_values_travel_as_plain_ones():
    import collections

    import numpy as np

    P = collections.namedtuple("P", "a b")
    x = {np.str_("k"): [np.float64(1.5), np.bool_(True), np.array([1, 2]), P(np.int64(3), "s")]}
    plain = rollout_link._plain(x)
    assert plain == {"k": [1.5, True, [1, 2], (3, "s")]}
    assert rollout_link._decode(rollout_link._encode(plain)) == plain
