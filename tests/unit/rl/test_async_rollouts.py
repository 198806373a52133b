"""Asynchronous rollouts' parts (rlhf/rl/async_rollouts.py, rlhf/rl/rollout_worker.py): every token
of an episode keeps the version of the weights that sampled it across turns (a partial rollout), the
staleness it is trained at, the metrics over it, and the weights' shared copy (one buffer per dtype,
tied tensors once). The processes: tests/e2e/test_async_rollouts.py."""

import pytest
import torch

from rlhf.engine.mesh import Mesh
from rlhf.ops import SamplingParams
from rlhf.rl.async_rollouts import packed, staleness
from rlhf.rl.metrics import staleness_metrics
from tests.infer_helpers import BOS
from tests.unit.rl.test_episodes import CharTok, FakeGen, runner


class Versioned(FakeGen):
    """FakeGen whose weights are updated after every call: call c samples with version 10 + c."""

    def __call__(self, prompts, sp, keys=None):
        g = super().__call__(prompts, sp, keys)
        g.versions = torch.where(g.response_mask.bool(), 10 + self.calls - 1, -1)
        return g


def test_each_token_keeps_the_version_that_sampled_it_across_turns():
    tok = CharTok(2)
    ep = runner(tok, max_turns=3, max_tokens=200).run(
        Versioned(2),
        [[BOS, 7], [BOS, 8]],
        [None, None],
        SamplingParams(max_new_tokens=4, samples_per_prompt=2),
    )
    g = ep.gen
    assert g.versions.shape == g.response_mask.shape
    policy = g.response_mask.bool()
    for row in range(4):
        # three turns of [5, 6, EOS], observations between them
        assert g.versions[row][policy[row]].tolist() == [10] * 3 + [11] * 3 + [12] * 3
        assert (g.versions[row][~policy[row]] == -1).all()  # observations and padding: no version
    stale = staleness(g.versions, 12, g.response_mask.float())
    assert stale[0][policy[0]].tolist() == [2.0] * 3 + [1.0] * 3 + [0.0] * 3
    m = staleness_metrics(stale, g.response_mask.float(), Mesh())
    assert m["async/staleness_max"] == 2 and m["async/staleness_mean"] == 1.0
    assert [m[f"async/tokens_lag{j}"] for j in range(3)] == [3.0, 3.0, 3.0]


def test_the_colocated_run_has_no_versions():
    ep = runner(CharTok(2), max_turns=2).run(
        FakeGen(2), [[BOS, 7]], [None], SamplingParams(max_new_tokens=4)
    )
    assert ep.gen.versions is None and staleness(None, 3, ep.gen.response_mask.float()) is None


def test_the_shared_copy_is_one_buffer_per_dtype_with_tied_tensors_once():
    embed = torch.randn(5, 3)
    src = {
        "embed": embed,
        "lm_head": embed,  # tied
        "norm": torch.randn(3),
        "wt": torch.randn(3, 4).t(),  # not contiguous
        "inv_freq": torch.randn(2, dtype=torch.float64),
        "scalar": torch.tensor(1.5),
    }
    out, nbytes = packed(src)
    assert set(out) == set(src)
    for k, v in src.items():
        assert torch.equal(out[k], v) and out[k].dtype == v.dtype and out[k].shape == v.shape
        assert out[k].data_ptr() != v.data_ptr()  # a copy: the training weights move on
    assert out["lm_head"] is out["embed"]
    assert nbytes == (15 + 3 + 12 + 1) * 4 + 2 * 8
    floats = {out[k].untyped_storage().data_ptr() for k in ("embed", "norm", "wt", "scalar")}
    assert len(floats) == 1 and out["embed"].is_shared()
    src["norm"].add_(1.0)
    assert not torch.equal(out["norm"], src["norm"])


def test_episodes_played_in_groups_lay_out_as_one_generation():
    from rlhf.rl.episodes import concat_episodes

    tok = CharTok(2)
    prompts, sp = (
        [[BOS, 7], [BOS, 8, 9, 10], [BOS, 11, 12]],
        SamplingParams(max_new_tokens=4, samples_per_prompt=2),
    )
    whole = runner(tok, max_turns=2).run(Versioned(2), prompts, [None] * 3, sp)
    parts = [
        runner(tok, max_turns=2).run(Versioned(2), p, [None] * len(p), sp)
        for p in (prompts[:1], prompts[1:])
    ]
    merged = concat_episodes(parts, tok.pad_token_id)
    for name in ("sequences", "attention_mask", "response_mask", "logprobs", "versions"):
        assert torch.equal(getattr(merged.gen, name), getattr(whole.gen, name)), name
    assert merged.gen.prompt_len == whole.gen.prompt_len and merged.texts == whole.texts
    assert torch.equal(merged.turn_rewards, whole.turn_rewards) and merged.stats["rows"] == 6


def test_the_model_goes_to_the_oldest_step_waiting():
    import threading
    import time

    from rlhf.rl.rollout_worker import Gate

    gate, order, held = Gate(), [], threading.Event()

    def holder():
        with gate.turn(7):
            held.set()
            while len(gate.waiting) < 3:
                time.sleep(0.005)

    def ask(step):
        with gate.turn(step):
            order.append(step)

    threads = [threading.Thread(target=holder)]
    threads[0].start()
    assert held.wait(10)
    for step in (9, 5, 6):  # a request started ahead first, then two older steps' turns
        threads.append(threading.Thread(target=ask, args=(step,)))
        threads[-1].start()
    for t in threads:
        t.join(10)
    assert order == [5, 6, 9] and not gate.busy and not gate.waiting


def test_the_worker_never_goes_back_to_older_weights_and_counts_partial_rollouts():
    from types import SimpleNamespace

    from rlhf.rl.rollout_worker import Model, Weights, partial

    m = Model.__new__(Model)
    m.version, taken = 4, []
    m._take = lambda w: (taken.append(w.version), setattr(m, "version", w.version))
    assert not m._offer(Weights(3, {}, [])) and not m._offer(Weights(4, {}, []))
    assert m._offer(Weights(6, {}, [])) and taken == [6] and m.version == 6
    # rows: one version, two versions (a partial rollout), none (a failed row), two again
    v = torch.tensor([[2, 2, -1], [2, 3, 3], [-1, -1, -1], [5, -1, 6]])
    assert partial(SimpleNamespace(gen=SimpleNamespace(versions=v))) == 2
    assert partial(SimpleNamespace(gen=SimpleNamespace(versions=None))) == 0


def test_a_fixed_policy_worker_plays_each_step_with_its_own_version(monkeypatch):
    """staleness_policy=fixed: the weights kept by version until no request can name them, one
    inference model per version in play, released when its last step ends."""
    import queue
    from types import SimpleNamespace

    from rlhf.rl import rollout_worker
    from rlhf.rl.rollout_worker import Gate, Versions, Weights

    built, released = [], []

    class Fake:
        def __init__(self, version):
            self.version = version

        def release(self):
            released.append(self.version)

    def build(spec, policy, w):
        built.append(w.version)
        return Fake(w.version)

    monkeypatch.setattr(rollout_worker, "_build", build)
    q = queue.Queue()
    v = Versions.__new__(Versions)
    v.spec, v.weights, v.policy = SimpleNamespace(parent=None, mirror=None), q, None
    v.held, v.models = {}, {}
    for n in (0, 1, 2):
        q.put(Weights(n, {}, []))
    gate = Gate()
    assert v.wait(1, gate, step=2, stop=lambda: False)
    assert sorted(v.held) == [1, 2]  # version 0: no later request names it
    a, b = SimpleNamespace(min_version=1, step=2), SimpleNamespace(min_version=1, step=3)
    take_a, take_b = v.open(a, gate), v.open(b, gate)
    assert take_a()[1] == take_b()[1] == 1 and take_a()[0] is take_b()[0] and built == [1]
    c = SimpleNamespace(min_version=2, step=3)
    assert v.open(c, gate)()[1] == 2 and built == [1, 2]  # two steps in flight, two versions
    v.close(a, gate)
    assert released == []
    v.close(b, gate)
    assert released == [1] and sorted(v.models) == [2]
    # a version not yet sent: the request waits until it is, or until told to stop
    assert not v.wait(3, gate, step=4, stop=lambda: True)


def test_a_checkpoints_steps_in_flight_come_back_only_to_the_run_that_would_ask_for_them(
    tmp_path, caplog
):
    """staleness_policy=fixed: the steps saved with a checkpoint are taken back by a run with the
    same world size, k, prompts and sampling (a longer run takes what there is and says the rest
    is generated afresh); a worker gone at the save leaves them out."""
    from types import SimpleNamespace

    from rlhf.ops import SamplingParams
    from rlhf.rl.async_rollouts import IN_FLIGHT_FILE, AsyncRollouts, WorkerLost

    def client(k=2, max_steps=10, temperature=1.0):
        a = AsyncRollouts.__new__(AsyncRollouts)
        a.k, a.max_steps, a.fixed, a.first, a.timeout_s = k, max_steps, True, 0, 1.0
        a.mesh = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
        a.prompts = SimpleNamespace(
            step=lambda s: SimpleNamespace(ids=[[s, 1], [s, 2]], examples=[None, None])
        )
        a.sampling = lambda s: SamplingParams(temperature=temperature)
        a.ready = {}
        return a

    def restored(ckpt, **kw):
        a = client(**kw)
        a.restore(ckpt, 4)
        return sorted(a.ready)

    saver = client()
    saver.ready = {4: "episodes of step 4", 5: "episodes of step 5", 6: "not in flight"}
    saver.save(tmp_path, 4)
    assert restored(tmp_path) == [4, 5]
    assert restored(tmp_path, k=1) == [] and "max_staleness=2" in caplog.text
    assert restored(tmp_path, temperature=0.5) == [] and "other prompts or sampling" in caplog.text
    short = tmp_path / "short"
    short.mkdir()
    last = client(max_steps=5)
    last.ready = {4: "episodes of step 4"}
    last.save(short, 4)
    caplog.clear()
    assert restored(short) == [4] and "1 of them not saved" in caplog.text
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / IN_FLIGHT_FILE.format(rank=0)).write_bytes(b"not a checkpoint")
    assert restored(damaged) == [] and "unreadable" in caplog.text
    gone = tmp_path / "gone"
    gone.mkdir()
    lost = client()

    def worker_gone(step):
        raise WorkerLost("the rollout worker of rank 0 (pid 1) died")

    lost._await = worker_gone
    lost.save(gone, 4)
    assert not (gone / IN_FLIGHT_FILE.format(rank=0)).exists()
    # the worker's own error (an environment's: exit 2) is the run's, not a warning
    from rlhf.errors import UserError

    def env_failed(step):
        raise UserError("rollout worker of rank 0: env: boom")

    lost._await = env_failed
    with pytest.raises(UserError, match="env: boom"):
        lost.save(gone, 4)
    assert "goes without its steps in flight" in caplog.text


def test_a_step_in_flight_comes_back_only_where_every_trainer_takes_it(tmp_path, caplog):
    """On several trainer ranks a saved step is taken back only if every rank takes it (a rollout
    rank plays a step once all its trainers ask): the ranks' MIN decides."""
    from types import SimpleNamespace

    from rlhf.ops import SamplingParams
    from rlhf.rl.async_rollouts import AsyncRollouts

    def client(peer_has):
        a = AsyncRollouts.__new__(AsyncRollouts)
        a.k, a.max_steps, a.fixed, a.first, a.timeout_s = 2, 10, True, 0, 1.0
        # (the other rank's answer: which of steps 4, 5 it took back)
        a.mesh = SimpleNamespace(
            rank=0,
            world_size=2,
            device=torch.device("cpu"),
            all_reduce=lambda t, op: torch.minimum(t, torch.tensor(peer_has, dtype=t.dtype)),
        )
        a.prompts = SimpleNamespace(step=lambda s: SimpleNamespace(ids=[[s]], examples=[None]))
        a.sampling = lambda s: SamplingParams()
        a.ready = {}
        return a

    saver = client([1, 1])
    saver.ready = {4: "episodes of step 4", 5: "episodes of step 5"}
    saver.save(tmp_path, 4)
    both = client([1, 1])
    both.restore(tmp_path, 4)
    assert sorted(both.ready) == [4, 5]
    caplog.clear()
    one = client([1, 0])
    one.restore(tmp_path, 4)
    assert sorted(one.ready) == [4] and "step(s) 6 in flight" in caplog.text
    none = client([0, 0])
    none.restore(tmp_path, 4)
    assert none.ready == {}
