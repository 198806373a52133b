"""Asynchronous rollouts with a staleness bound: the trainer's side of its rollout worker
(``ppo.rollout_workers=1`` — a process beside the rank — or ``ppo.rollout_ranks=R`` — ranks of their
own: rlhf/rl/rollout_link.py; ``ppo.max_staleness=k``; the worker: rlhf/rl/rollout_worker.py).

Versions count updates: version v is the actor after v updates, the weights the colocated run
generates step v with. The trainer sends version v after the update of step v − 1 (its inference
layout at the worker's TP degree — 1, or ``ppo.rollout_tp_size``'s slices, one set per TP rank —
gathered layer by layer as the hybrid engine does, copied into shared memory or host memory: timed,
bytes counted) and asks for step s's episodes as soon as version s − k exists, so the worker runs up
to k steps ahead; step s's episodes start with the newest weights the worker holds, version ≥ s − k,
and take newer ones between turns. A row whose oldest token is older than the bound would be dropped
(no loss) and counted; the requests make that impossible, and the count says so every step.

``ppo.staleness_policy``: ``newest`` — a step's episodes start with the newest weights the worker
holds and take newer ones between turns (timing decides the versions); ``fixed`` — step s is played
wholly by version max(s − k, first), k updates off-policy from the run's k-th step on, as every run
of the same seed: reproducible.

k = 0 is the synchronous run: the worker waits for the weights of the step, so the samples and the
updates are the colocated run's (tests/e2e/test_async_rollouts.py). Resuming at step t sends
version t and asks for steps t… afresh, except with ``fixed``: a checkpoint at step t holds the
episodes of steps t … t + k − 1 (played by versions t − k … t − 1, which the checkpoint does not
keep; the trainer waits for them when it saves), and a resume on the same world size takes them
from it — the resumed run is the uninterrupted one. Otherwise (``newest``, another world size, a
checkpoint without them) the first k steps after a resume are generated with version t, weights
at least as new as the uninterrupted run's (regenerated; equal to it at k = 0).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import queue
import time
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from rlhf.engine.draws import strided_keys
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.mesh import Mesh
from rlhf.errors import UserError, first_line
from rlhf.ops import SamplingParams
from rlhf.rl.prompts import PromptSource
from rlhf.rl.rollout_worker import (
    POLL_S,
    Failed,
    Request,
    Result,
    Weights,
    WorkerLost,
    WorkerSpec,
    main,
)

log = logging.getLogger("rlhf")

# in a checkpoint (staleness_policy=fixed): a rank's episodes of the steps in flight
IN_FLIGHT_FILE = "rollouts_in_flight_rank{rank}.pt"


class AsyncRollouts:
    def __init__(
        self,
        hybrid: HybridEngine,
        spec: WorkerSpec,
        prompts: PromptSource,
        sampling: Callable[[int], SamplingParams],
        mesh: Mesh,
        max_staleness: int,
        max_steps: int,
        timeout_s: float,
    ):
        self.hybrid, self.spec, self.prompts, self.sampling, self.mesh = (
            hybrid,
            spec,
            prompts,
            sampling,
            mesh,
        )
        self.k, self.max_steps, self.timeout_s = max_staleness, max_steps, timeout_s
        # ppo.staleness_policy=fixed (k > 0): the steps in flight go with each checkpoint
        self.fixed = bool(max_staleness) and spec.cfg.ppo.staleness_policy == "fixed"
        self.chan = None  # Beside, or rollout_link.OnRank
        self.asked = -1  # the last step asked for
        self.ready: Dict[int, object] = {}  # results received, by step
        # CUDA IPC: the sender keeps them alive
        self.sent = collections.deque(maxlen=max_staleness + 2)
        self.transfer = {"async/transfer_s": 0.0, "async/transfer_bytes": 0.0}
        self.last_wait_s, self._last_ask = 0.0, None
        self.metrics: Dict[str, float] = {}

    # ---- the worker's life ----
    def spawn(self) -> None:
        """Starts the worker: a process beside this rank (its imports and environments get ready
        while the trainer evaluates), or joins the link to its rollout rank
        (``ppo.rollout_ranks``)."""
        if self.spec.cfg.ppo.rollout_ranks:
            from rlhf.rl.rollout_link import OnRank

            self.chan = OnRank(self.spec, self.mesh.rank, self.timeout_s)
        else:
            self.chan = Beside(self.spec, self.mesh.rank)

    def start(self, step: int) -> None:
        """Sends the weights of ``step`` (a resume's) and the first k + 1 requests."""
        if self.chan is None:
            self.spawn()
        self.first = step
        self.publish(step)
        for s in range(step, min(step + self.k + 1, self.max_steps)):
            if s not in self.ready:  # (a checkpoint's steps in flight: restore)
                self.ask(s)
        policy = ""
        if self.fixed:
            policy = ", each step played by the weights exactly k updates old (fixed)"
        log.info(
            "ppo: asynchronous rollouts: %s, at most %d step%s ahead%s",
            self.chan.where,
            self.k,
            "" if self.k == 1 else "s",
            policy,
        )

    def close(self) -> None:
        if self.chan is not None:
            chan, self.chan = self.chan, None
            chan.close()

    # ---- weights and requests ----
    def publish(self, version: int) -> None:
        """Sends the actor's weights after ``version`` updates. Collective (an FSDP gather per
        layer; a trainer whose rollout rank another trainer feeds only takes part)."""
        t0 = time.perf_counter()
        nbytes = [0]

        def copied(d: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
            out, n = packed(d, share=self.chan.shares, host=not self.chan.shares)
            nbytes[0] += n
            return out

        # (a trainer whose rollout rank another trainer feeds keeps nothing); a TP worker's ranks
        # each their slices (ppo.rollout_tp_size)
        copy = copied if self.chan.takes_weights else (lambda d: {})
        tp = self.chan.tp
        ranks = list(range(tp)) if self.chan.takes_weights else []
        root, shards = self.hybrid.inference_shards(tp, ranks, copy=copy)
        if self.chan.takes_weights:
            ws = [Weights(version, root, layers) for layers in shards]
            if self.chan.shares:
                self.sent.append(ws)  # (CUDA IPC: the sender keeps them alive)
            self.chan.weights(ws)
        self.transfer = {
            "async/transfer_s": time.perf_counter() - t0,
            "async/transfer_bytes": float(nbytes[0]),
        }

    def _asked(self, step: int) -> tuple:
        """(this rank's prompts of step ``step``, their sampling, their keys in the step)."""
        batch, sp = self.prompts.step(step), self.sampling(step)
        return batch, sp, strided_keys(len(batch.ids), self.mesh.rank, self.mesh.world_size)

    def ask(self, step: int) -> None:
        batch, sp, keys = self._asked(step)
        first = max(step - self.k, self.first)
        self.chan.request(Request(step, batch.ids, batch.examples, sp, keys, first, self.mesh.rank))
        self.asked = step

    def _digest(self, step: int) -> str:
        """What step ``step``'s request asks (prompts, sampling, keys): a saved step is taken back
        only by a run that would ask the same."""
        batch, sp, keys = self._asked(step)
        return hashlib.sha256(repr((batch.ids, sp, keys)).encode()).hexdigest()

    def updated(self, step: int) -> None:
        """After the update of step ``step`` (0-based): version step + 1 goes to the worker, and the
        step it now may run ahead to is asked for."""
        if step + 1 >= self.max_steps:
            return
        self.publish(step + 1)
        nxt = step + 1 + self.k
        if nxt < self.max_steps and nxt > self.asked:
            self.ask(nxt)

    # ---- results ----
    def episodes(self, step: int):
        """Step ``step``'s episodes from the worker (waiting for them, bounded by engine.timeout_s),
        and the step's ``async/*`` metrics in ``self.metrics``."""
        now = time.perf_counter()
        self._drain()
        depth = len(self.ready)
        t0 = time.perf_counter()
        self._await(step)
        res = self.ready.pop(step)
        self.last_wait_s = time.perf_counter() - t0
        span = now - self._last_ask if self._last_ask is not None else None
        self._last_ask = now
        self.metrics = {
            "async/queue_depth": float(depth),
            "async/wait_s": self.last_wait_s,
            "async/worker_idle_s": res.idle_s,
            "async/worker_idle_share": res.idle_s / max(res.idle_s + res.busy_s, 1e-9),
            "async/swaps": float(res.swaps),
            "async/generate_calls": float(res.calls),
            "async/in_flight": float(res.in_flight),
            **self.transfer,
        }
        if span is not None:
            # the trainer's idle share of the step before this one's request
            self.metrics["async/trainer_idle_share"] = min(self._prev_wait / max(span, 1e-9), 1.0)
        self._prev_wait = self.last_wait_s
        return res.episodes

    _prev_wait = 0.0

    def _await(self, step: int) -> None:
        t0 = time.perf_counter()
        while step not in self.ready:
            self._receive(t0)

    # ---- checkpoints (staleness_policy=fixed) ----
    def save(self, path: Path, step: int) -> None:
        """Into the checkpoint of step ``step`` (this rank's file): the episodes of steps step …
        step + k − 1, waited for (their weights are all sent: at most k − 1 generations' wait). A
        worker that is gone (a stop that reached it) leaves the file out: a resume then plays them
        afresh."""
        if not self.fixed:
            return
        steps = self._in_flight_at(step)
        try:
            for s in steps:
                self._await(s)
        except WorkerLost as e:  # (a worker's own error is the run's: raised)
            log.warning(
                "ppo: the checkpoint of step %d goes without its steps in flight: %s", step, e
            )
            return
        state = {
            "world_size": self.mesh.world_size,
            "k": self.k,
            "steps": {s: self.ready[s] for s in steps},
            "digests": {s: self._digest(s) for s in steps},
        }
        torch.save(state, path / IN_FLIGHT_FILE.format(rank=self.mesh.rank))

    def restore(self, ckpt: Path, step: int) -> None:
        """The steps in flight of the checkpoint ``ckpt`` of step ``step``, if a run with this
        world size, k, prompts and sampling wrote them; else (or for the steps it lacks) a warning
        that they are generated afresh. Collective: a step is taken back only where every trainer
        rank takes it (a rollout rank plays a step once all its trainers ask for it)."""
        if not self.fixed:
            return
        self._restore_mine(ckpt, step)
        wanted = self._in_flight_at(step)
        if self.mesh.world_size > 1 and len(wanted):
            have = torch.tensor([float(s in self.ready) for s in wanted])
            have = self.mesh.all_reduce(
                have.to(self.mesh.device), op=torch.distributed.ReduceOp.MIN
            )
            dropped = [s for s, h in zip(wanted, have.tolist()) if not h and s in self.ready]
            for s in dropped:
                del self.ready[s]
            if dropped:
                log.warning(
                    "ppo: step(s) %s in flight at the checkpoint are generated afresh: another "
                    "trainer rank could not take them back",
                    ", ".join(str(s + 1) for s in dropped),
                )

    def _restore_mine(self, ckpt: Path, step: int) -> None:
        f = ckpt / IN_FLIGHT_FILE.format(rank=self.mesh.rank)
        wanted = self._in_flight_at(step)
        state, why = None, "none saved"
        if f.exists():
            try:
                state = _load_in_flight(f, self.mesh.device)
            except Exception as e:  # (weights-only unpickling refused it, or a damaged file)
                why = f"{f.name} unreadable: {first_line(e)}"
        if state is not None:
            why = self._take_back(state, wanted)
            if why is None:
                return
        log.warning(
            "ppo: the checkpoint's steps in flight cannot all be taken (%s): those are generated "
            "afresh with its weights (not the uninterrupted run's samples)",
            why,
        )

    def _in_flight_at(self, step: int) -> range:
        """The steps asked for and not yet trained when the update of step ``step`` − 1 is done."""
        return range(step, min(step + self.k, self.max_steps))

    def _take_back(self, state: dict, wanted: range) -> Optional[str]:
        """The saved steps into ``ready`` if this run would ask the same of them; why not (or why
        some are missing), or None."""
        if (state["world_size"], state["k"]) != (self.mesh.world_size, self.k):
            return f"saved on {state['world_size']} rank(s) with ppo.max_staleness={state['k']}"
        if any(state["digests"][s] != self._digest(s) for s in state["steps"]):
            return "saved for other prompts or sampling"
        self.ready.update(state["steps"])
        log.info(
            "ppo: the %d step(s) in flight at the checkpoint restored (played by the weights "
            "before it)",
            len(state["steps"]),
        )
        if len(state["steps"]) < len(wanted):
            return f"{len(wanted) - len(state['steps'])} of them not saved (a longer run now)"
        return None

    def _drain(self) -> None:
        while True:
            try:
                self._keep(self.chan.get())
            except queue.Empty:
                return

    def _receive(self, since: float) -> None:
        try:
            self._keep(self.chan.get(timeout=POLL_S))
            return
        except queue.Empty:
            pass
        gone = self.chan.lost()
        if gone is not None:
            raise WorkerLost(f"{gone}; rerun the same command to resume")
        if time.perf_counter() - since > self.timeout_s:
            self.chan.kill()
            raise WorkerLost(
                f"{self.chan.who} sent no episodes for {self.timeout_s:g} s (engine.timeout_s); "
                "rerun the same command to resume"
            )

    def _keep(self, msg) -> None:
        if isinstance(msg, Failed):
            self.close()
            err = UserError(f"rollout worker of rank {self.mesh.rank}: {msg.message}")
            err.exit_code = msg.code
            raise err
        self.ready[msg.step] = msg


class Beside:
    """The rollout worker process beside a trainer rank (``ppo.rollout_workers=1``): queues of
    ``torch.multiprocessing`` (CPU tensors in shared memory, CUDA tensors by CUDA IPC)."""

    def __init__(self, spec: WorkerSpec, rank: int):
        ctx = torch.multiprocessing.get_context("spawn")
        self.requests, self.results, self._weights = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=main,
            args=(spec, self.requests, self.results, self._weights),
            daemon=True,
            name=f"rlhf-rollout-worker-{rank}",
        )
        self.proc.start()
        self.who = f"the rollout worker of rank {rank} (pid {self.proc.pid})"
        self.where = f"a worker process (pid {self.proc.pid}) beside each trainer rank"
        # the weights go to it in shared memory, every update, whole (TP 1)
        self.shares = self.takes_weights = True
        self.tp = 1

    def request(self, req: Request) -> None:
        self.requests.put(req)

    def weights(self, shards: list) -> None:
        self._weights.put(shards[0])

    def get(self, timeout: Optional[float] = None):
        """The next message (raises ``queue.Empty``)."""
        if timeout is None:
            return self.results.get_nowait()
        return self.results.get(timeout=timeout)

    def lost(self) -> Optional[str]:
        if self.proc.is_alive():
            return None
        return f"{self.who} died (exit code {self.proc.exitcode})"

    def kill(self) -> None:
        self.proc.kill()

    def close(self) -> None:
        try:
            self.requests.put(None)
            self.proc.join(timeout=10)
        finally:
            if self.proc.is_alive():
                self.proc.kill()


def _load_in_flight(f: Path, device) -> dict:
    """A checkpoint's steps in flight, read weights-only (no code runs from the file): tensors,
    plain values and the three classes a step's episodes are made of."""
    from rlhf.engine.infer import Generation
    from rlhf.rl.episodes import Episodes

    with torch.serialization.safe_globals([Result, Episodes, Generation]):
        return torch.load(f, weights_only=True, map_location=device)


def worker_spec(cfg, prep, models) -> WorkerSpec:
    """What the stage's rollout worker is built from: the run's configuration, the actor's config
    and tokenizer, the chat template, this rank's threads, device and inference dtype."""
    from rlhf.errors import ConfigError
    from rlhf.models.lora import unwrap

    hybrid, tp = models.hybrid, cfg.ppo.rollout_tp_size
    if not hybrid.inject:
        raise ConfigError(
            f"{cfg.ppo.remote} generates in the inference mode, which this model "
            "family has no injection "
            f"policy for ({type(unwrap(models.actor.module)).__name__}); play the episodes "
            "colocated (ppo.rollout_workers=0, ppo.rollout_ranks=0)"
        )
    why = hybrid.policy.check_tp(tp) if tp > 1 else None
    if why:
        raise ConfigError(
            f"ppo.rollout_tp_size={tp}: " + why.replace("engine.inference_tp_size", "its degree")
        )
    return WorkerSpec(
        cfg,
        unwrap(models.actor.module).config,
        prep.tokenizer,
        prep.runner.template,
        cfg.ppo.rollout_worker_threads or torch.get_num_threads(),
        str(hybrid.mesh.device),
        hybrid.dtype,
        hybrid.decode,
    )


def staleness(
    versions: Optional[torch.Tensor], step: int, mask: torch.Tensor
) -> Optional[torch.Tensor]:
    """[B, N] float: how many updates old the weights that sampled each policy token were at step
    ``step`` (0 elsewhere); None without versions (the colocated run)."""
    if versions is None:
        return None
    return (step - versions).clamp(min=0).float() * mask


def packed(tensors: Dict[str, torch.Tensor], share: bool = True, host: bool = False) -> tuple:
    """``(copies, bytes)``: the tensors copied into one buffer per dtype (with ``share``, in shared
    memory on the CPU: one file descriptor each, however many tensors; with ``host``, in host
    memory wherever they are), the copies views of it; a tensor named twice (tied embeddings)
    copied once."""
    by_dtype: Dict[tuple, list] = {}
    seen: Dict[tuple, str] = {}
    for name, t in tensors.items():
        if t is None or not isinstance(t, torch.Tensor):
            continue
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if key not in seen:
            seen[key] = name
            where = torch.device("cpu") if host else t.device
            by_dtype.setdefault((t.dtype, where), []).append(name)
    out, nbytes = {}, 0
    for (dtype, device), names in by_dtype.items():
        total = sum(tensors[n].numel() for n in names)
        buf = torch.empty(total, dtype=dtype, device=device)
        if share and device.type == "cpu":
            buf.share_memory_()
        at = 0
        for n in names:
            t = tensors[n]
            out[n] = buf[at : at + t.numel()].view(t.shape).copy_(t)
            at += t.numel()
        nbytes += total * buf.element_size()
    for name, t in tensors.items():
        if name not in out:
            out[name] = (
                out[seen[(t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))]]
                if isinstance(t, torch.Tensor)
                else t
            )
    return out, nbytes
