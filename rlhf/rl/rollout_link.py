"""Rollout workers on ranks of their own (``ppo.rollout_ranks=R``): the torchrun world of N ranks
split into T = N − R trainers and R rollout ranks.

- **The split**: ranks 0 … T − 1 train; for them ``WORLD_SIZE`` becomes T before their process group
  is made (their own group: FSDP, the data's shards, the sampling keys and the checkpoints are a
  T-rank run's), so a trainer rank's number is its rank in the world. Ranks T … N − 1 play episodes
  (``serve_rank``): the inference mode only, no training copy, no optimizer state. Where R divides
  T, trainer r is served by rollout rank T + r mod R: a rollout rank plays the requests of its
  T / R trainers, each as its own generation, in step and trainer order (the colocated rank's rows,
  so the same samples). Where T divides R, trainer r is served by the R / T rollout ranks T + r,
  T + r + T, …: each plays a contiguous share of the trainer's prompts with their keys (the same
  samples), and the trainer joins the shares' episodes in prompt order.
- **The link**: two gloo process groups over the whole world, made beside the trainers' group from
  the job's store (``down``: trainer → rollout rank; ``up``: back), point to point. The first
  trainer of each rollout rank sends it what the worker is built from (the tokenizer's and the
  actor config's files, the chat template, the inference dtype, the decode loop and its thread
  count), the weights after each update and its requests; the others their requests. Objects travel
  as ``torch.save`` bytes read back weights-only (no code runs from a message:
  rlhf/rl/link_messages.py); the weights as a header and their flat per-dtype buffers, one per layer
  and dtype, sent in buckets of at most ``BUCKET_BYTES``, on the host (a GPU deployment would send
  them by NCCL broadcast: not built).
- **TP workers** (``ppo.rollout_tp_size=P``): a worker is P consecutive rollout ranks (R / P
  workers, served as above with workers in place of ranks); the trainer sends each rank its TP
  slices, the requests to the first (the leader), which the others follow (rlhf/rl/rollout_tp.py).
- **Ends**: a rollout rank stops when its trainers say so (after the last step) or when the link to
  one of them breaks; a trainer hears a rollout rank that died or went silent as today's worker
  process (``WorkerLost``: exit 3), and torchrun ends the job's other ranks.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from rlhf.errors import first_line
from rlhf.rl.link_messages import Undecodable, decode, encode, plain_result

log = logging.getLogger("rlhf")

# the world's size before the split (WORLD_SIZE is the trainers' after it)
FULL_WORLD_ENV = "RLHF_FULL_WORLD_SIZE"
# the most bytes one send of a weights buffer carries
BUCKET_BYTES = 64 << 20
# how long a receive on the link may wait: a day (a trainer's update or evaluation, a worker's
# longest step); a worker that stops answering is the trainer's engine.timeout_s to find
# (AsyncRollouts), a rank that dies closes its connections at once
LINK_TIMEOUT_S = 86400.0
_OBJECT, _WEIGHTS = 0, 1


def world() -> Tuple[int, int]:
    """(this process's rank, the whole world's size): torchrun's, before any split."""
    n = int(os.environ.get(FULL_WORLD_ENV) or os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), n


def layout(ppo) -> Tuple[int, int, int]:
    """(trainers T, rollout workers W, their TP degree) of this world (``ppo.rollout_ranks``,
    ``ppo.rollout_tp_size``); exit 2 where they cannot serve it."""
    from rlhf.config import rollout_layout

    trainers, workers = rollout_layout(
        world()[1], ppo.rollout_ranks, ppo.rollout_tp_size, ppo.prompts_per_step
    )
    return trainers, workers, ppo.rollout_tp_size


def on_rollout_rank(ppo) -> bool:
    """Whether this process is one of the world's rollout ranks (``ppo.rollout_ranks``)."""
    if not ppo.rollout_ranks:
        return False
    return world()[0] >= layout(ppo)[0]


def split_world(ppo) -> None:
    """On a trainer rank, before its process group is made: the world it trains in is the T
    trainers."""
    trainers = layout(ppo)[0]
    os.environ.setdefault(FULL_WORLD_ENV, os.environ.get("WORLD_SIZE", "1"))
    os.environ["WORLD_SIZE"] = str(trainers)


def serving(rank: int, trainers: int, workers: int) -> List[int]:
    """The rollout workers that play trainer ``rank``'s episodes: one, r mod W, where W divides T;
    else the W / T workers r, r + T, … (each a contiguous share of its prompts)."""
    if workers <= trainers:
        return [rank % workers]
    return [rank + trainers * j for j in range(workers // trainers)]


def worker_ranks(worker: int, trainers: int, tp: int) -> List[int]:
    """The world's ranks of rollout worker ``worker``: ``tp`` consecutive ones after the trainers,
    its leader first."""
    return [trainers + worker * tp + j for j in range(tp)]


class Link:
    """The two process groups between trainers and rollout ranks; a collective to make (every
    rank of the world: ``Link.connect``)."""

    def __init__(self, store, rank: int, size: int, timeout_s: float, name: str = "job/0"):
        self.rank, self.size, self.store, self.name = rank, size, store, name
        # a send waits for its receiver to take it: engine.timeout_s at most (a frozen peer)
        self.send_timeout = datetime.timedelta(seconds=timeout_s)
        timeout = datetime.timedelta(seconds=max(timeout_s, LINK_TIMEOUT_S))

        def group(direction: str):
            prefixed = dist.PrefixStore(f"rlhf/rollout_link/{name}/{direction}", store)
            return dist.ProcessGroupGloo(prefixed, rank, size, timeout)

        self.down, self.up = group("down"), group("up")

    @classmethod
    def connect(cls, ppo, timeout_s: float) -> "Link":
        """This process's link, through the job's store (per run and restart attempt: our
        launcher gives every attempt a store of its own when it may restart)."""
        rank, size = world()
        trainers = layout(ppo)[0]
        run = os.environ.get("TORCHELASTIC_RUN_ID", "job")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(_store(rank, trainers, timeout_s), rank, size, timeout_s, f"{run}/{attempt}")

    def send(self, group, dst: int, obj) -> None:
        payload = encode(obj)
        self._send(group, dst, torch.tensor([_OBJECT, payload.numel()], dtype=torch.long))
        self._send(group, dst, payload)

    def _send(self, group, dst: int, t: torch.Tensor) -> None:
        group.send([t], dst, 0).wait(self.send_timeout)

    def recv(self, group, src: int, device: Optional[torch.device] = None):
        """The next message from ``src``: an object, or ``Weights`` (on ``device``); a message
        that does not decode raises ``Undecodable`` (the link stays in step)."""
        from rlhf.rl.rollout_worker import Weights

        head = torch.zeros(2, dtype=torch.long)
        group.recv([head], src, 0).wait()
        payload = torch.empty(int(head[1]), dtype=torch.uint8)
        group.recv([payload], src, 0).wait()
        obj = decode(payload)  # (Undecodable: weights-only unpickling refused it)
        if int(head[0]) == _OBJECT:
            return obj
        buffers = [torch.empty(n, dtype=_dtype(d)) for d, n in obj["buffers"]]
        for buf in buffers:
            for chunk in _chunks(buf):
                group.recv([chunk], src, 0).wait()
        if device is not None and device.type != "cpu":
            buffers = [b.to(device) for b in buffers]
        root = _views(obj["root"], buffers)
        return Weights(obj["version"], root, [_views(d, buffers) for d in obj["layers"]])

    def send_weights(self, dst: int, w) -> int:
        """The weights ``w`` (``rollout_worker.Weights``, each dict's tensors views of flat buffers:
        ``async_rollouts.packed``) to ``dst``; the bytes sent."""
        buffers: List[torch.Tensor] = []
        index: Dict[Tuple[int, torch.dtype], int] = {}
        header = {
            "version": w.version,
            "root": _described(w.root, buffers, index),
            "layers": [_described(d, buffers, index) for d in w.layers],
            "buffers": None,
        }
        header["buffers"] = [(str(b.dtype).removeprefix("torch."), b.numel()) for b in buffers]
        payload = encode(header)
        self._send(self.down, dst, torch.tensor([_WEIGHTS, payload.numel()], dtype=torch.long))
        self._send(self.down, dst, payload)
        for buf in buffers:
            for chunk in _chunks(buf):
                self._send(self.down, dst, chunk)
        return sum(b.numel() * b.element_size() for b in buffers)


def _store(rank: int, trainers: int, timeout_s: float):
    """The job's store: torchrun's agent's, or else rank 0's — its trainers' process group hosts
    it when there are several trainers, this call when there is one (no group over a TCP store)."""
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    master = not agent and rank == 0 and trainers == 1
    return dist.TCPStore(
        host,
        port,
        is_master=master,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _chunks(buf: torch.Tensor) -> List[torch.Tensor]:
    return list(buf.split(max(BUCKET_BYTES // buf.element_size(), 1)))


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _described(d: Dict, buffers: List[torch.Tensor], index: Dict) -> dict:
    """Where each tensor of ``d`` lies in the flat buffers (added to ``buffers`` as met, by their
    storage), and its other values as they are."""
    tensors, other = {}, {}
    for name, t in d.items():
        if not isinstance(t, torch.Tensor):
            other[name] = t
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.dtype)
        if key not in index:
            index[key] = len(buffers)
            numel = storage.nbytes() // t.element_size()
            flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (numel,))
            buffers.append(flat.cpu())
        tensors[name] = (index[key], t.storage_offset(), tuple(t.shape))
    return {"tensors": tensors, "other": other}


def _views(desc: dict, buffers: List[torch.Tensor]) -> dict:
    out = dict(desc["other"])
    for name, (b, offset, shape) in desc["tensors"].items():
        n = 1
        for s in shape:
            n *= s
        out[name] = buffers[b][offset : offset + n].view(shape)
    return out


# ---------------------------------------------------------------------------- the trainer's side


class OnRank:
    """A trainer rank's rollout worker on a rank of its own: what ``AsyncRollouts`` sends it and
    reads from it (the same calls as ``Beside``, the worker process beside the rank)."""

    def __init__(self, spec, rank: int, timeout_s: float):
        self.rank, self.pad_id = rank, spec.tokenizer.pad_token_id
        trainers, workers, self.tp = layout(spec.cfg.ppo)
        # each worker's ranks (its leader first: requests and episodes go through it)
        self.groups = [worker_ranks(w, trainers, self.tp) for w in serving(rank, trainers, workers)]
        self.workers = [g[0] for g in self.groups]
        self.who = f"the {_named(self.groups)} of trainer rank {rank}"
        self.where = f"{_named(self.groups)} (the inference mode alone) serving this rank"
        if len(self.groups) > 1:
            self.where += ", each playing its share of the prompts"
        # the first trainer a worker serves builds it and sends it the weights, over the link from
        # host memory (no shared memory), each TP rank its slices; a trainer with several workers
        # feeds them all
        self.shares, self.takes_weights = False, rank < workers
        self.link = Link.connect(spec.cfg.ppo, timeout_s)
        # (the worker's index among self.workers, its message)
        self.inbox: "queue.Queue" = queue.Queue()
        # a step's shares asked, and those arrived (by worker index)
        self.asked: Dict[int, int] = {}
        self.arrived: Dict[int, Dict[int, object]] = {}
        self.broken: Optional[str] = None
        for i in range(len(self.workers)):
            threading.Thread(
                target=self._listen, args=(i,), daemon=True, name="rollout-link"
            ).start()
        if self.takes_weights:
            for r in (r for g in self.groups for r in g):
                self._sending(r, self.link.send, self.link.down, r, _spec_message(spec))

    def _listen(self, i: int) -> None:
        from rlhf.rl.rollout_worker import Failed

        w = self.workers[i]
        while True:
            try:
                self.inbox.put((i, self.link.recv(self.link.up, w)))
            except Undecodable as e:
                self.inbox.put((i, Failed(f"rollout rank {w}'s episodes do not decode ({e})", 1)))
            except Exception as e:  # the link broke: the rank is gone
                self.broken = self.broken or f"rollout rank {w}: {first_line(e)}"
                return

    def _sending(self, w: int, send, *args) -> None:
        """``send(*args)`` to rollout rank ``w``; a link that breaks or a rank that does not take
        it within engine.timeout_s is the worker lost (exit 3)."""
        from rlhf.rl.rollout_worker import WorkerLost

        try:
            send(*args)
        except Exception as e:
            self.broken = self.broken or f"rollout rank {w}: {first_line(e)}"
            raise WorkerLost(
                f"{self.who} is gone ({self.broken}); rerun the same command to resume"
            ) from None

    def request(self, req) -> None:
        """The step's request; with several rollout ranks, each its contiguous share of the prompts
        (with their keys: the samples are those of the whole request)."""
        from rlhf.rl.rollout_worker import prompt_shares

        cuts = prompt_shares(len(req.ids), len(self.workers))
        parts = [(w, a, b) for w, (a, b) in zip(self.workers, cuts)]
        parts = [p for p in parts if p[2] > p[1]] or parts[:1]
        self.asked[req.step] = len(parts)
        for w, a, b in parts:
            if len(parts) > 1:
                part = dataclasses.replace(
                    req, ids=req.ids[a:b], examples=req.examples[a:b], keys=req.keys[a:b]
                )
            else:
                part = req
            self._sending(w, self.link.send, self.link.down, w, part)

    def weights(self, shards: list) -> None:
        """The weights of a version, TP rank j's slices ``shards[j]``, to each worker's ranks."""
        for g in self.groups:
            for r, w in zip(g, shards):
                self._sending(r, self.link.send_weights, r, w)

    def get(self, timeout: Optional[float] = None):
        """The next message: a step's result once every share of it is in, or a failure (raises
        ``queue.Empty``)."""
        from rlhf.rl.rollout_worker import Result

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if deadline is None:
                i, msg = self.inbox.get_nowait()
            else:
                i, msg = self.inbox.get(timeout=max(deadline - time.monotonic(), 0.0))
            if not isinstance(msg, Result):
                return msg
            got = self.arrived.setdefault(msg.step, {})
            got[i] = msg
            if len(got) == self.asked.get(msg.step, 1):
                del self.arrived[msg.step]
                self.asked.pop(msg.step, None)
                return joined_results([got[j] for j in sorted(got)], self.pad_id)

    def lost(self) -> Optional[str]:
        """Why the worker is gone, or None."""
        if self.broken is not None and self.inbox.empty():
            return f"{self.who} is gone ({self.broken})"
        return None

    def kill(self) -> None:
        """(Another rank: torchrun ends it when this one exits.)"""

    def close(self) -> None:
        if self.broken is None:
            # (a TP worker's other ranks hear only the trainer that feeds them)
            for g in self.groups:
                for r in g if self.takes_weights else g[:1]:
                    try:
                        self.link.send(self.link.down, r, None)
                    except Exception:  # (already gone)
                        pass


def _named(groups: List[List[int]]) -> str:
    """'rollout rank 2', 'rollout ranks 2, 3', 'rollout worker on ranks 2–3 (TP 2)', …"""
    if len(groups[0]) == 1:
        ranks = [g[0] for g in groups]
        return f"rollout rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    spans = ", ".join(f"{g[0]}–{g[-1]}" for g in groups)
    plural = "s" if len(groups) > 1 else ""
    return f"rollout worker{plural} on ranks {spans} (TP {len(groups[0])})"


def joined_results(parts: list, pad_id: int):
    """One step's result from its shares' (in prompt order): the episodes joined; the workers'
    idle and busy seconds, swaps and generation calls summed, the most requests in flight."""
    if len(parts) == 1:
        return parts[0]
    from rlhf.rl.episodes import concat_episodes

    return dataclasses.replace(
        parts[0],
        episodes=concat_episodes([p.episodes for p in parts], pad_id),
        idle_s=sum(p.idle_s for p in parts),
        busy_s=sum(p.busy_s for p in parts),
        swaps=sum(p.swaps for p in parts),
        calls=sum(p.calls for p in parts),
        in_flight=max(p.in_flight for p in parts),
    )


def _spec_message(spec) -> dict:
    """What a rollout rank builds its worker from: the tokenizer's and the actor config's files (as
    bytes), the chat template, the inference dtype, the decode loop, the trainer's threads."""
    with tempfile.TemporaryDirectory() as tmp:
        spec.tokenizer.save_pretrained(tmp)
        spec.model_config.save_pretrained(tmp)
        files = {
            p.name: torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8)
            for p in Path(tmp).iterdir()
            if p.is_file()
        }
    return {
        "files": files,
        "chat": spec.chat,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "decode": spec.decode,
        "threads": spec.threads,
    }


# ------------------------------------------------------------------------ the rollout rank's side


class _Answers:
    """The worker's results, each to the trainer that asked (a failure to every one)."""

    def __init__(self, link: Link, trainers: List[int]):
        self.link, self.trainers, self.lock = link, trainers, threading.Lock()

    def put(self, msg) -> None:
        from rlhf.rl.rollout_worker import Failed, Result

        if isinstance(msg, Result):
            msg = plain_result(msg)
        with self.lock:
            for t in self.trainers if isinstance(msg, Failed) else [msg.origin]:
                try:
                    self.link.send(self.link.up, t, msg)
                except Exception:  # (that trainer is gone: torchrun ends this rank)
                    pass


class _Intake:
    """The requests of a rollout rank's trainers, a step's in trainer order once all have asked
    (the order never depends on which arrived first); the weights from the first; a stop when all
    said so or a link broke. A TP worker's follower (no ``answers``: it hears weights only) has the
    stop, a broken link or a message that does not decode put among its weights as None."""

    def __init__(self, link: Link, trainers: List[int], answers=None, device=None):
        self.link, self.trainers, self.answers, self.device = link, trainers, answers, device
        self.requests: "queue.Queue" = queue.Queue()
        self.weights: "queue.Queue" = queue.Queue()
        self.lock = threading.Lock()
        self.pending: Dict[int, dict] = {}
        self.stopped = 0

    def start(self) -> None:
        for t in self.trainers:
            threading.Thread(target=self._listen, args=(t,), daemon=True).start()

    def _listen(self, trainer: int) -> None:
        from rlhf.rl.rollout_worker import Failed, Weights

        try:
            while True:
                try:
                    msg = self.link.recv(self.link.down, trainer, self.device)
                except Undecodable as e:
                    if self.answers is None:
                        raise
                    self.answers.put(Failed(f"a request does not decode ({e})", 1))
                    continue
                if isinstance(msg, Weights):
                    self.weights.put(msg)
                elif msg is None:
                    self._stop()
                    return
                else:
                    self._asked(msg)
        except Exception:  # the trainer is gone: the worker ends
            self.requests.put(None)
            self.weights.put(None)

    def _asked(self, req) -> None:
        with self.lock:
            step = self.pending.setdefault(req.step, {})
            step[req.origin] = req
            if len(step) == len(self.trainers):
                for t in self.trainers:
                    self.requests.put(step[t])
                del self.pending[req.step]

    def _stop(self) -> None:
        with self.lock:
            self.stopped += 1
            if self.stopped == len(self.trainers):
                self.requests.put(None)
                if self.answers is None:
                    self.weights.put(None)


def serve_rank(cfg) -> None:
    """A rollout rank's life (``ppo.rollout_ranks``): joins the link, builds its side of a worker
    from what its first trainer sends, and plays its trainers' requests until they stop — or, a TP
    worker's other rank, follows its leader (rlhf/rl/rollout_tp.py)."""
    import multiprocessing

    from rlhf.engine.mesh import choose_device
    from rlhf.models.loading import load_model_config, load_tokenizer
    from rlhf.rl import rollout_tp
    from rlhf.rl.rollout_worker import WorkerSpec, main

    rank, n = world()
    trainers, workers, tp = layout(cfg.ppo)
    worker, tp_rank = divmod(rank - trainers, tp)
    # (the name a worker process beside a trainer has: what a tool or environment may look for)
    multiprocessing.current_process().name = f"rlhf-rollout-worker-rank{rank}"
    link = Link.connect(cfg.ppo, cfg.engine.timeout_s)
    mine = [t for t in range(trainers) if worker in serving(t, trainers, workers)]
    msg = link.recv(link.down, mine[0])
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in msg["files"].items():
            (Path(tmp) / name).write_bytes(data.numpy().tobytes())
        tokenizer = load_tokenizer(tmp, trust_remote_code=cfg.model.trust_remote_code)
        model_config = load_model_config(tmp, trust_remote_code=cfg.model.trust_remote_code)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = choose_device(cfg.engine.device, local, int(os.environ.get("LOCAL_WORLD_SIZE", n)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = WorkerSpec(
        cfg,
        model_config,
        tokenizer,
        msg["chat"],
        cfg.ppo.rollout_worker_threads or msg["threads"],
        str(device),
        _dtype(msg["dtype"]),
        # (CUDA graphs capture no collective: a TP worker's decode steps run eagerly)
        "static" if tp > 1 and msg["decode"] == "graphs" else msg["decode"],
        parent=os.getppid(),
    )
    if tp > 1:
        spec.tp = tp
        groups = rollout_tp.tp_groups(
            link.store, link.name, rank - trainers, workers * tp, tp, LINK_TIMEOUT_S
        )
        spec.tp_group = groups[worker]
        leader = worker * tp  # (its rank in the rollout ranks' world)
        if tp_rank:
            # weights from the trainer that feeds this worker; the rest from the leader
            intake = _Intake(link, mine[:1], None, device)
            intake.start()
            return rollout_tp.follow(spec, intake.weights, leader)
        spec.mirror = rollout_tp.Mirror(spec.tp_group, leader)
    answers = _Answers(link, mine)
    intake = _Intake(link, mine, answers, device)
    intake.start()
    main(spec, intake.requests, answers, intake.weights)
