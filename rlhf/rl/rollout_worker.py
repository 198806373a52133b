"""A rollout worker: the process beside a trainer rank that plays its episodes
(``ppo.rollout_workers=1``), or a rank of its own serving one or more trainer ranks
(``ppo.rollout_ranks``: the transport in rlhf/rl/rollout_link.py, the same worker).

The worker holds the inference mode only — an ``InferenceModel`` over weights the trainer sends in
the inference layout, no training copy, no optimizer state — and the environments of its trainer's
rows. It serves ``Request``s in order: each names a step, that step's prompts, sampling and keys
(the rows' keys in the whole step, so a sample is the one the colocated run draws) and the oldest
weights version it may be generated with (the staleness bound: ``rlhf/rl/async_rollouts.py``).
With k > 0 and multi-turn episodes it plays ``IN_FLIGHT`` requests at once, each in ``GROUPS``
groups of episodes, their generations one at a time through the model's ``Gate`` (the oldest
step's first): while one step's episodes wait on their tools, the next one's generate.
With ``ppo.staleness_policy=newest``, before every generation — each turn of a multi-turn episode —
it takes the newest weights that have arrived: a trajectory in flight when an update lands continues
with the new weights (a partial rollout). With ``fixed``, a step is played wholly by the version its
request names (``Versions``). Every token carries the version that sampled it
(``Generation.versions``) beside its behaviour log-prob.

Messages (``torch.multiprocessing`` queues; CPU tensors travel through shared memory, CUDA tensors
by CUDA IPC): trainer → worker ``Weights`` and ``Request`` (None: stop); worker → trainer ``Result``
or ``Failed`` (the worker's one line and exit code). The worker ends when its trainer process is
gone (on a rank of its own: when the link to a trainer breaks).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import logging
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from rlhf.errors import UserError
from rlhf.launcher.watchdog import EXIT_PEER
from rlhf.ops import SamplingParams

# how often a waiting worker checks that its trainer is still there
POLL_S = 1.0
# how often a request waiting for weights looks for them
WAIT_S = 0.02
# groups of episodes a worker plays at once (max_staleness > 0, multi-turn): one generates while the
# others wait on their tools
GROUPS = 4
# requests (steps) a worker plays at once (max_staleness > 0, multi-turn): the next step's episodes
# generate while the oldest's wait on their tools, within the staleness bound
IN_FLIGHT = 2


@dataclass
class WorkerSpec:
    """What a worker builds its side from (pickled into the spawned process)."""

    # the run's Config (env.* for the environment and episodes, ppo.* for the staleness, engine.*
    # for the inference mode)
    cfg: object
    # the actor's HF config: its injection policy
    model_config: object
    tokenizer: object
    # the chat template observations are rendered with
    chat: Optional[str]
    threads: int  # CPU threads (torch.set_num_threads)
    device: str
    dtype: torch.dtype  # the inference dtype
    # the decode loop (rlhf.engine.hybrid.decode_loop)
    decode: str
    parent: int = field(default_factory=os.getpid)
    # a worker over several rollout ranks (ppo.rollout_tp_size): its TP degree and group, and on
    # its leader the ``rollout_tp.Mirror`` that says each build, release and generation to the
    # other ranks first
    tp: int = 1
    tp_group: object = None
    mirror: object = None


@dataclass
class Weights:
    """The actor's weights after ``version`` updates, in the inference layout: whole at TP 1, or one
    TP rank's slices of a worker over several ranks (the root weights whole)."""

    version: int
    root: Dict[str, torch.Tensor]
    layers: List[Dict[str, torch.Tensor]]


@dataclass
class Request:
    step: int
    # this trainer rank's prompts of the step
    ids: List[List[int]]
    examples: list
    sp: SamplingParams
    # the prompts' keys in the step (the colocated run's)
    keys: List[int]
    # the oldest weights the step's episodes may start with (ppo.staleness_policy=fixed: the
    # weights they are played with)
    min_version: int
    # the trainer rank that asks (a rollout rank serves several: rlhf/rl/rollout_link.py)
    origin: int = 0


@dataclass
class Result:
    step: int
    # rlhf.rl.episodes.Episodes, versions on every policy token
    episodes: object
    # since the worker's last result: no step in play (waiting for requests or weights)
    idle_s: float
    busy_s: float  # a step or more in play
    # trajectories that went on with newer weights (tokens of two versions or more: partial
    # rollouts)
    swaps: int
    # the generations that played them
    calls: int = 0
    # the requests the worker was playing when it started this one, this one included
    in_flight: int = 1
    origin: int = 0  # the trainer rank that asked


@dataclass
class Failed:
    message: str
    code: int


class WorkerLost(UserError):
    """(The trainer's) the rollout worker died or stopped answering: exit 3, as for a silent peer
    (rerun to resume)."""

    exit_code = EXIT_PEER


def _say(spec: WorkerSpec, act) -> None:
    """A TP worker's leader: ``act`` said to the worker's other ranks (rlhf/rl/rollout_tp.py)."""
    if spec.mirror is not None:
        spec.mirror.say(act)


def _release(spec: WorkerSpec, model, version: int) -> None:
    _say(spec, ("release", version))
    model.release()


def _build(spec: WorkerSpec, policy, w: Weights):
    """The inference model over the weights ``w`` (this TP rank's slices)."""
    from rlhf.engine.hybrid import inference_model

    _say(spec, ("build", w.version))
    model = inference_model(
        w.root, w.layers, policy, spec.cfg.engine, spec.dtype, spec.decode, spec.tp, spec.tp_group
    )
    # a Mixture-of-Experts actor's generations carry their routing for the trainer to replay
    # (ppo.routing_replay; multi-turn episodes assemble theirs without it)
    model.record_routing = bool(
        spec.cfg.ppo.routing_replay and policy is not None and policy.num_experts
    )
    return model


class _Arrivals:
    """What both weights policies share: the worker's spec, the actor's injection policy, the
    weights queue read under the model's ``Gate``, and a request's wait for the weights it
    needs."""

    def __init__(self, spec: WorkerSpec, weights):
        from rlhf.models.policies import policy_for

        self.spec, self.weights = spec, weights
        self.policy = policy_for(spec.model_config)[0]

    def _arrived(self) -> List[Weights]:
        """The weights that arrived since the last call, oldest first."""
        out = []
        while True:
            try:
                out.append(self.weights.get_nowait())
            except queue.Empty:
                return out

    def _has(self, version: int) -> bool:
        """(Under the gate) whether the request naming ``version`` may start."""
        raise NotImplementedError

    def wait(self, version: int, gate: "Gate", step: int, stop: Callable[[], bool]) -> bool:
        """Until the weights the request of ``step`` needs (``version``, by the policy's rule)
        are in; False if ``stop()`` first. The weights are read under the gate only: a step in
        play takes them in at its next turn as soon as they arrive."""
        while True:
            with gate.turn(step):
                if self._has(version):
                    return True
            if stop():
                return False
            _trainer_there(self.spec.parent)
            time.sleep(WAIT_S)


class Model(_Arrivals):
    """``ppo.staleness_policy=newest``: the newest weights that have arrived and the inference
    model over them, taken before every generation; a request waits for weights of its version or
    newer (the staleness bound)."""

    def __init__(self, spec: WorkerSpec, weights):
        super().__init__(spec, weights)
        self.model, self.version = None, -1

    def _take(self, w: Weights) -> None:
        if self.model is not None:
            _release(self.spec, self.model, self.version)
        # (the old weights go before the new model is built)
        self.model = None
        self.model = _build(self.spec, self.policy, w)
        self.version = w.version

    def open(self, req: Request, gate: "Gate") -> Callable[[], Tuple[object, int]]:
        """What a turn of ``req``'s episodes generates with (called under the gate): the newest
        weights' model and version."""

        def take():
            self.newest()
            return self.model, self.version

        return take

    def close(self, req: Request, gate: "Gate") -> None:
        """``req``'s episodes are played."""

    def newest(self) -> None:
        """Takes the newest weights waiting, if any. Called with the model's ``Gate`` held."""
        arrived = self._arrived()
        if arrived:
            self._offer(arrived[-1])

    def _offer(self, w: Weights) -> bool:
        # (never back to older weights)
        if w.version <= self.version:
            return False
        self._take(w)
        return True

    def _has(self, version: int) -> bool:
        self.newest()
        return self.version >= version


class Versions(_Arrivals):
    """``ppo.staleness_policy=fixed``: each step played wholly by the version its request names.
    The weights that arrived are kept by version until no request can name them any more (requests
    come in step order, their versions in order too), and an inference model is built for each
    version a step in play uses (two at most, with two steps in flight)."""

    def __init__(self, spec: WorkerSpec, weights):
        super().__init__(spec, weights)
        self.held: Dict[int, Weights] = {}
        self.models: Dict[int, list] = {}  # version → [its inference model, steps playing with it]

    def _has(self, version: int) -> bool:
        for w in self._arrived():
            self.held[w.version] = w
        if version not in self.held:
            return False
        for old in [v for v in self.held if v < version]:
            del self.held[old]  # (no later request names it)
        return True

    def open(self, req: Request, gate: "Gate") -> Callable[[], Tuple[object, int]]:
        """The inference model of ``req``'s version (built if no step in play has it), right
        after ``wait`` (no later request can have dropped its weights yet)."""
        v = req.min_version
        with gate.turn(req.step):
            if v not in self.models:
                self.models[v] = [_build(self.spec, self.policy, self.held[v]), 0]
            self.models[v][1] += 1
            model = self.models[v][0]
        return lambda: (model, v)

    def close(self, req: Request, gate: "Gate") -> None:
        """``req``'s episodes are played: its version's model goes once no step in play uses it."""
        with gate.turn(req.step):
            entry = self.models[req.min_version]
            entry[1] -= 1
            if not entry[1]:
                _release(self.spec, entry[0], req.min_version)
                del self.models[req.min_version]


class Gate:
    """The inference model, to one generation at a time, the oldest step's first: a request
    started ahead delays the one the trainer waits for by one generation at most."""

    def __init__(self):
        self.cv = threading.Condition()
        self.busy, self.waiting = False, []

    @contextlib.contextmanager
    def turn(self, step: int):
        with self.cv:
            self.waiting.append(step)
            while self.busy or step != min(self.waiting):
                self.cv.wait()
            self.waiting.remove(step)
            self.busy = True
        try:
            yield
        finally:
            with self.cv:
                self.busy = False
                self.cv.notify_all()


def _trainer_there(parent: int) -> None:
    """The worker ends when its trainer process is gone."""
    if os.getppid() != parent:
        os._exit(0)


def _get(q, parent: int):
    """The next message of ``q``; the worker ends when its trainer process is gone."""
    while True:
        try:
            return q.get(timeout=POLL_S)
        except queue.Empty:
            _trainer_there(parent)


def main(spec: WorkerSpec, requests, results, weights) -> None:
    """The worker process (``torch.multiprocessing`` spawn target)."""
    from rlhf import host_memory

    logging.getLogger("rlhf").setLevel(logging.WARNING)
    # a Ctrl-C reaches the whole process group: the trainer checkpoints (with the steps this worker
    # plays, staleness_policy=fixed) and stops, and the worker ends with it (SIGTERM, as
    # multiprocessing ends a daemon process, or its trainer gone)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        torch.set_num_threads(spec.threads)
        if spec.device == "cpu":
            host_memory.configure(spec.cfg.engine.host_malloc)
        serve(spec, requests, results, weights)
    except BaseException as e:
        results.put(failed(e))


def failed(e: BaseException) -> Failed:
    """What the trainer says of a worker's error, in one line: a user's (exit 2) or another."""
    from rlhf.errors import UserError, first_line

    if isinstance(e, UserError):
        return Failed(str(e), 2)
    return Failed(f"{type(e).__name__}: {first_line(e)}", 1)


class Turns:
    """``generate`` of one request's episodes: each call (a turn) first takes the model to
    generate with (``take``: with ``staleness_policy=newest`` the newest weights that arrived, so
    the episodes go on with them, a partial rollout; with ``fixed`` the request's version), and
    tags its tokens with their version. Groups of episodes played in threads, and the requests in
    flight, call it through the model's ``Gate``, one at a time, the oldest step first. ``say``: a
    TP worker's leader tells its other ranks each generation first (``_say``)."""

    def __init__(self, take, gate: Gate, step: int, eos_id: int, pad_id: int, device, say=None):
        self.take, self.gate, self.step = take, gate, step
        self.eos_id, self.pad_id, self.device = eos_id, pad_id, device
        self.say = say or (lambda act: None)
        self.calls = 0  # generations run

    def __call__(self, prompts, sp, keys):
        with self.gate.turn(self.step):
            t = time.perf_counter()
            model, version = self.take()
            self.calls += 1
            t_gen = time.perf_counter()
            self.say(("generate", version, prompts, sp, keys))
            gen = model.generate(
                prompts, sp, eos_id=self.eos_id, pad_id=self.pad_id, keys=keys, device=self.device
            )
            gen.versions = torch.where(gen.response_mask.bool(), version, -1)
            gen.timings = {"switch_s": t_gen - t, "generate_s": time.perf_counter() - t_gen}
            return gen


def prompt_shares(n: int, parts: int) -> List[Tuple[int, int]]:
    """``n`` prompts cut into ``parts`` contiguous [start, end) shares as even as can be (a worker's
    groups of prompts; a trainer's rollout ranks', rlhf/rl/rollout_link.py)."""
    bounds = [n * g // parts for g in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def play(runners: list, turns: Turns, req: Request, positions: int):
    """The request's episodes: with several runners its prompts in as many groups of consecutive
    prompts, played at once in threads, so that one group generates while another waits on its
    tools; laid out as one generation (``concat_episodes``)."""
    from rlhf.rl.episodes import concat_episodes

    n = len(req.ids)
    groups = min(len(runners), n)
    if groups == 1:
        return runners[0].run(turns, req.ids, req.examples, req.sp, req.keys, positions)
    bounds = prompt_shares(n, groups)
    out, errors = [None] * groups, []

    def one(g: int) -> None:
        a, b = bounds[g]
        try:
            out[g] = runners[g].run(
                turns, req.ids[a:b], req.examples[a:b], req.sp, req.keys[a:b], positions
            )
        except BaseException as e:  # (raised again in the worker's thread)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(g,), daemon=True) for g in range(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return concat_episodes(out, turns.pad_id)


class _Busy:
    """The worker's idle time (no request in flight) between two results."""

    def __init__(self):
        self.lock = threading.Lock()
        self.in_flight, self.idle, self.since = 0, 0.0, time.perf_counter()
        self.mark = self.since  # the last result sent

    def start(self) -> int:
        """A request starts: the requests in flight now, it included."""
        with self.lock:
            if not self.in_flight:
                self.idle += time.perf_counter() - self.since
            self.in_flight += 1
            return self.in_flight

    def done(self) -> Tuple[float, float]:
        """(idle, busy) seconds since the last result; the request ended."""
        with self.lock:
            now = time.perf_counter()
            self.in_flight -= 1
            if not self.in_flight:
                self.since = now
            idle, span = self.idle, now - self.mark
            self.idle, self.mark = 0.0, now
            return idle, span - idle


@torch.no_grad()
def serve(spec: WorkerSpec, requests, results, weights) -> None:
    from rlhf import host_memory
    from rlhf.engine.mesh import Mesh
    from rlhf.envs.builtin import environment
    from rlhf.rl.episodes import EpisodeRunner

    ppo, device = spec.cfg.ppo, torch.device(spec.device)
    env = environment(spec.cfg.env)

    def runner(tok):
        return EpisodeRunner.of(spec.cfg.env, env, tok, spec.chat, Mesh(device=device))

    # k = 0: one request at a time, its rows played together (the colocated run's layout, to the
    # last bit); k > 0 with tools or an environment: IN_FLIGHT requests at once, each in GROUPS
    # groups, each group with a tokenizer of its own (a fast tokenizer is not for two threads)
    sets = [[runner(spec.tokenizer)]]
    if ppo.max_staleness and sets[0][0].multi_turn:
        sets[0] += [runner(copy.deepcopy(spec.tokenizer)) for _ in range(GROUPS - 1)]
        sets += [
            [runner(copy.deepcopy(spec.tokenizer)) for _ in range(GROUPS)]
            for _ in range(IN_FLIGHT - 1)
        ]
    fixed = ppo.max_staleness and ppo.staleness_policy == "fixed"
    model = (Versions if fixed else Model)(spec, weights)
    gate, busy = Gate(), _Busy()
    pol = model.policy
    positions = pol.max_positions if pol.positions == "learned" else 0
    eos_id, pad_id = spec.tokenizer.eos_token_id, spec.tokenizer.pad_token_id
    free, errors, slots = list(range(len(sets))), [], threading.Condition()

    def one(req: Request, i: int, in_flight: int, take) -> None:
        try:
            try:
                say = functools.partial(_say, spec)
                turns = Turns(take, gate, req.step, eos_id, pad_id, device, say)
                ep = play(sets[i], turns, req, positions)
            finally:
                model.close(req, gate)
            idle, active = busy.done()
            res = Result(
                req.step, ep, idle, active, partial(ep), turns.calls, in_flight, req.origin
            )
            results.put(res)
        except BaseException as e:
            # the trainer hears it now (it waits for this step); the main thread stops
            results.put(failed(e))
            errors.append(e)
        else:
            host_memory.settle()
        with slots:
            free.append(i)
            slots.notify_all()

    try:
        while True:
            req = _get(requests, spec.parent)
            if req is None:
                return
            with slots:
                while not free and not errors:
                    slots.wait(POLL_S)
                    _trainer_there(spec.parent)
            if errors or not model.wait(req.min_version, gate, req.step, lambda: bool(errors)):
                return
            take = model.open(req, gate)
            n = busy.start()
            with slots:
                i = free.pop(0)
            if len(sets) == 1:
                # one step at a time (k = 0: the colocated run's, on the main thread as it was)
                one(req, i, n, take)
                continue
            threading.Thread(
                target=one, args=(req, i, n, take), daemon=True, name=f"step-{req.step}"
            ).start()
    finally:
        # a TP worker's other ranks stop once no generation is in play (under the gate: never
        # amid a generation's all-reduces)
        if spec.mirror is not None:
            with gate.turn(sys.maxsize):
                spec.mirror.stop()


def partial(ep) -> int:
    """The trajectories whose policy tokens carry two versions or more (partial rollouts)."""
    v = ep.gen.versions
    if v is None:
        return 0
    real = v >= 0
    newest = torch.where(real, v, -1).amax(1)
    oldest = torch.where(real, v, torch.iinfo(v.dtype).max).amin(1)
    return int((newest > oldest).sum())  # (a row with no policy token: -1 against the max)
