"""The rollout ranks' link (rlhf/rl/rollout_link.py): the world's split, messages and weights over
real gloo process groups (two ranks as two threads over one store), read back weights-only, and a
rollout rank's intake ordering its trainers' requests."""

import queue
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
    # trainers 0 … 3, rollout workers 0, 1 (ranks 4, 5): each serves two trainers
    assert [rollout_link.serving(r, 4, 2) for r in range(4)] == [[0], [1], [0], [1]]
    assert [rollout_link.worker_ranks(w, 4, 1) for w in (0, 1)] == [[4], [5]]
    # one trainer, two rollout ranks; two trainers, four: each trainer fed by two
    assert rollout_layout(3, 2) == (1, 2) and rollout_link.serving(0, 1, 2) == [0, 1]
    assert rollout_layout(6, 4) == (2, 4)
    assert [rollout_link.serving(r, 2, 4) for r in range(2)] == [[0, 2], [1, 3]]
    # workers of 2 TP ranks: 1 trainer + 2 ranks = 1 worker (ranks 1, 2); 2 + 4 = 2 workers
    assert rollout_layout(3, 2, tp=2) == (1, 1) and rollout_link.worker_ranks(0, 1, 2) == [1, 2]
    assert rollout_layout(6, 4, tp=2) == (2, 2)
    assert [rollout_link.worker_ranks(w, 2, 2) for w in (0, 1)] == [[2, 3], [4, 5]]
    with pytest.raises(ConfigError, match="leaves no trainer in a world of 2"):
        rollout_layout(2, 2)
    for world, r in ((5, 2), (7, 3)):
        with pytest.raises(ConfigError, match="do not divide one another"):
            rollout_layout(world, r)
    with pytest.raises(ConfigError, match=r"the 2 rollout workers of ppo.rollout_tp_size=2\) and"):
        rollout_layout(7, 4, tp=2)
    # a rollout worker with no prompt to play would keep every version's weights: refused
    assert rollout_layout(3, 2, prompts=2) == (1, 2)
    with pytest.raises(ConfigError, match=r"ppo\.prompts_per_step=1 leaves some of the 2 rollout"):
        rollout_layout(3, 2, prompts=1)


def test_the_tp_degree_needs_rollout_ranks_it_divides():
    from rlhf.config import PPOConfig

    assert PPOConfig(rollout_ranks=4, rollout_tp_size=2).rollout_tp_size == 2
    with pytest.raises(ConfigError, match=r"1 without ppo\.rollout_ranks"):
        PPOConfig(rollout_tp_size=2)
    with pytest.raises(ConfigError, match=r"a divisor of ppo\.rollout_ranks=3"):
        PPOConfig(rollout_ranks=3, rollout_tp_size=2)


def test_a_followers_intake_puts_the_stop_among_its_weights():
    class Down:
        down = "down"

        def __init__(self, msgs):
            self.msgs = list(msgs)

        def recv(self, group, src, device=None):
            if not self.msgs:
                raise ConnectionError("gone")
            return self.msgs.pop(0)

    w = Weights(1, {}, [])
    for msgs in ([w, None], [w]):  # the trainer's stop; the link broken
        intake = rollout_link._Intake(Down(msgs), trainers=[0])
        intake._listen(0)
        assert intake.weights.get_nowait() is w and intake.weights.get_nowait() is None


def test_prompt_shares_are_contiguous_and_even():
    from rlhf.rl.rollout_worker import prompt_shares

    assert prompt_shares(5, 2) == [(0, 2), (2, 5)]
    assert prompt_shares(4, 2) == [(0, 2), (2, 4)]
    assert prompt_shares(1, 2) == [(0, 0), (0, 1)]


class _Sent:
    """A link that records what goes down (to which rollout rank)."""

    down = "down"

    def __init__(self):
        self.sent = []

    def send(self, group, dst, obj):
        self.sent.append((dst, obj))

    def send_weights(self, dst, w):
        self.sent.append((dst, w))


def _fanned_out(workers):
    """A trainer's channel to several rollout ranks, its link recording (no process group)."""
    chan = object.__new__(rollout_link.OnRank)
    chan.rank, chan.pad_id, chan.workers, chan.tp = 0, 9, workers, 1
    chan.groups = [[w] for w in workers]
    chan.who, chan.link, chan.broken = "the rollout ranks", _Sent(), None
    chan.inbox, chan.asked, chan.arrived = queue.Queue(), {}, {}
    return chan


def test_a_trainer_with_two_rollout_ranks_sends_each_a_share_and_joins_their_episodes():
    from rlhf.rl.rollout_worker import Result
    from tests.unit.engine.test_rows import episodes, generation

    chan = _fanned_out([1, 2])
    req = Request(3, [[1], [2], [3], [4], [5]], list("abcde"), SamplingParams(), [0, 1, 2, 3, 4], 2)
    chan.request(req)
    (w1, a), (w2, b) = chan.link.sent
    assert (w1, w2) == (1, 2) and a.ids == [[1], [2]] and b.ids == [[3], [4], [5]]
    assert a.keys == [0, 1] and b.keys == [2, 3, 4] and b.examples == list("cde")
    assert (a.step, a.min_version, b.sp) == (3, 2, req.sp)
    chan.weights(["w"])
    assert chan.link.sent[2:] == [(1, "w"), (2, "w")]
    ea, eb = episodes(generation(2, 3, 4, seed=1), 1), episodes(generation(3, 2, 5, seed=2), 2)
    # the second share first: nothing until both are in, then prompt order
    chan.inbox.put((1, Result(3, eb, 1.0, 2.0, 1, 2, 1, 0)))
    with pytest.raises(queue.Empty):
        chan.get(timeout=0.05)
    chan.inbox.put((0, Result(3, ea, 0.5, 3.0, 0, 1, 2, 0)))
    got = chan.get(timeout=1)
    assert got.step == 3 and got.episodes.texts == ea.texts + eb.texts
    assert got.episodes.gen.sequences.shape == (5, 3 + 5)
    assert (got.idle_s, got.busy_s, got.swaps, got.calls, got.in_flight) == (1.5, 5.0, 1, 3, 2)
    # a failure passes at once
    chan.inbox.put((0, Failed("boom", 1)))
    assert isinstance(chan.get(timeout=1), Failed)


def test_a_tp_worker_gets_the_requests_at_its_leader_and_each_rank_its_slices():
    chan = _fanned_out([1])
    chan.groups, chan.tp, chan.takes_weights = [[1, 2]], 2, True
    req = Request(0, [[7], [8]], ["a", "b"], SamplingParams(), [0, 1], 0)
    chan.request(req)
    chan.weights(["slices 0", "slices 1"])
    chan.close()
    assert chan.link.sent == [(1, req), (1, "slices 0"), (2, "slices 1"), (1, None), (2, None)]
    # a trainer that does not feed the worker stops its leader only
    chan = _fanned_out([1])
    chan.groups, chan.tp, chan.takes_weights = [[1, 2]], 2, False
    chan.close()
    assert chan.link.sent == [(1, None)]


def test_fewer_prompts_than_rollout_ranks_ask_only_those_with_a_share():
    chan = _fanned_out([1, 2])
    chan.request(Request(0, [[7]], ["a"], SamplingParams(), [0], 0))
    assert [(w, r.ids) for w, r in chan.link.sent] == [(2, [[7]])]
    assert chan.asked == {0: 1}


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
        with pytest.raises(rollout_link.Undecodable, match=r"Unsupported global: .*Code"):
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
