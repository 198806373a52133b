"""When a peer fails: a clear one-line error, the right exit code, and a job that ends.

Workers (under any launcher):
  * ``Heartbeat``: every rank bumps a counter in the job's c10d store once a second from a daemon
    thread. A rank that stops answering (SIGSTOP, a frozen node) or dies stops bumping it, so the
    rank that sees a collective fail can name which peer went silent.
  * ``collective_failure(exc, timeout_s)``: recognises a gloo/NCCL/store timeout or a lost
    connection anywhere in an exception's chain and turns it into ``Failure(code=3, message)``, e.g.
    "collective timed out after 20 s waiting for a peer: rank 1 stopped answering (...)".
  * ``exit_with(failure)``: one line on stderr (once per job), the torchelastic error file (so
    the launcher can report the root cause), then ``os._exit`` (a process group with a silent
    peer can hang in its destructors).

The launcher (``python -m rlhf launcher.nnodes=N ...``):
  * ``JobWatch``: a launcher that gives up (its workers failed and no restart is left) writes
    "abort" into the rendezvous store; the launchers of the other nodes watch that key and shut
    their own workers down. Without it a node whose worker is stopped keeps waiting forever: its
    agent sees a live worker, and notices nothing else unless the node hosting the rendezvous
    store goes away (so the hang hits exactly when the stopped worker's node hosts the store).

Exit codes: 2 bad input (rlhf.errors), ``EXIT_PEER`` = 3 a collective failed because a peer died,
stopped answering or lost its connection (retryable: rerun to resume from the last checkpoint).
"""

from __future__ import annotations

import _thread
import atexit
import datetime
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import List, Optional

EXIT_PEER = 3
# host:port of a store the workers beat into (set by our launcher)
HEARTBEAT_STORE_ENV = "RLHF_HEARTBEAT_STORE"
# heartbeat period; a peer is silent when its counter does not move for 2.5 periods
BEAT_S = 1.0
_STORE_TIMEOUT = datetime.timedelta(seconds=5)

_DIST = re.compile(
    r"gloo|nccl|c10d|TCPStore|ProcessGroup|DistBackendError|DistNetworkError|DistStoreError", re.I
)
_TIMEOUT = re.compile(r"timed out|timeout|deadline exceeded", re.I)
_WAITED = re.compile(r"Timed out waiting (\d+)ms")
# checked first: "timed out connecting: Connection refused" is a missing peer, not a slow one
_LOST = re.compile(
    r"connection (closed|reset|refused)|broken pipe|end of file|socket closed|"
    r"connection (lost|abort)|no route to host|connectFullMesh failed|timed out connecting",
    re.I,
)


@dataclass
class Failure:
    code: int
    message: str


def _store(host: str, port: int):
    # torch is imported lazily in this module: rlhf/__main__.py's error path (one line, exit 2)
    # imports it, and torch would take a config error from 0.3 s to 2 s (measured, CPU dev machine)
    import torch.distributed as dist

    return dist.TCPStore(
        host, int(port), is_master=False, wait_for_workers=False, timeout=_STORE_TIMEOUT
    )


# ----------------------------------------------------------------------------------------- workers


class Heartbeat:
    """One counter per rank in the job's store (``MASTER_ADDR:MASTER_PORT``), bumped every
    ``BEAT_S`` by a daemon thread. Never raises: without a store there is just no diagnosis."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        # Keys outlive an elastic restart (and restart counts differ between nodes), so beats are
        # per rank for the whole job; only "who reports" is per attempt.
        self.prefix = f"rlhf/heartbeat/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/"
        self.attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        # Our launcher points us at its rendezvous store (hosted by an agent, so it answers even
        # when a worker is stopped); under plain torchrun MASTER_ADDR:MASTER_PORT is the agent's.
        endpoint = os.environ.get(HEARTBEAT_STORE_ENV, "")
        if endpoint:
            host, _, port = endpoint.rpartition(":")
            self.addr = (host.strip("[]"), port)
        else:
            self.addr = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._store = None

    def start(self) -> "Heartbeat":
        if not all(self.addr):
            return self
        try:
            self._store = _store(*self.addr)
            self._store.add(self._key("beat", self.rank), 1)
        except Exception:
            # no store reachable: run without the diagnosis
            self._store = None
            return self
        self._thread = threading.Thread(target=self._run, name="rlhf-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _key(self, what: str, rank: int) -> str:
        return f"{self.prefix}{what}/{rank}"

    def _run(self) -> None:
        errors = 0
        while not self._stop.wait(BEAT_S):
            try:
                self._store.add(self._key("beat", self.rank), 1)
                errors = 0
            except Exception:
                errors += 1
                if errors >= 3:
                    # the store is gone: the job is ending anyway
                    return

    def stop(self) -> None:
        """Ends the thread and waits for it (bounded): a daemon thread still inside a store call
        when the interpreter finalizes is unwound through C++ frames, and the process aborts
        ("terminate called without an active exception", exit 134) after its work is done."""
        self._stop.set()
        _join(self._thread)

    def silent_peers(self) -> Optional[List[int]]:
        """Ranks whose counter did not move for 2.5 beats and that are not exiting; None when the
        store cannot tell. Uses its own connection (the thread may hold the other)."""
        if self._store is None:
            return None
        # This rank is leaving: it stops beating and marks its final count as "exiting", so a
        # peer diagnosing at the same time (or later) does not take it for a silent one.
        self.stop()  # (and waits for the thread)
        try:
            store = _store(*self.addr)

            def counts():
                return [int(store.add(self._key("beat", r), 0)) for r in range(self.world_size)]

            before = counts()
            store.set(self._key("exiting", self.rank), str(before[self.rank]))
            time.sleep(2.5 * BEAT_S)
            after = counts()
            exited = [
                store.check([self._key("exiting", r)])
                and store.get(self._key("exiting", r)).decode() == str(after[r])
                for r in range(self.world_size)
            ]
            return [
                r
                for r in range(self.world_size)
                if r != self.rank and after[r] == before[r] and not exited[r]
            ]
        except Exception:
            return None

    def first_to_report(self) -> bool:
        """True for the first rank of this attempt to report a failure (one line, not one per
        rank)."""
        if self._store is None:
            return True
        try:
            return int(_store(*self.addr).add(f"{self.prefix}reported/{self.attempt}", 1)) == 1
        except Exception:
            return True


_heartbeat: Optional[Heartbeat] = None


def _join(thread: Optional[threading.Thread]) -> None:
    if thread is not None and thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=_STORE_TIMEOUT.total_seconds() + 2 * BEAT_S)


def start_heartbeat(rank: int, world_size: int) -> Optional[Heartbeat]:
    global _heartbeat
    if world_size > 1 and _heartbeat is None:
        _heartbeat = Heartbeat(rank, world_size).start()
        # every way out (errors included) stops it before finalization
        atexit.register(stop_heartbeat)
    return _heartbeat


def stop_heartbeat() -> None:
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _ranks(ranks: List[int]) -> str:
    names = ", ".join(map(str, ranks))
    if len(ranks) == 1:
        return f"rank {names}"
    return f"ranks {names}"


def collective_failure(exc: BaseException, timeout_s: float) -> Optional[Failure]:
    """``Failure`` when ``exc`` (or its cause) is a collective or store that timed out or lost a
    peer in a multi-process job; None for anything else (a bug keeps its traceback)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch.distributed as dist  # lazy: see _store

    text, is_dist = "", False
    for e in _chain(exc):
        text += f"\n{type(e).__name__}: {e}"
        is_dist |= isinstance(e, getattr(dist, "DistError", ())) or bool(
            _DIST.search(f"{type(e).__name__} {e}")
        )
    if not is_dist:
        return None
    lost = bool(_LOST.search(text))
    timed_out = not lost and bool(_TIMEOUT.search(text))
    if not lost and not timed_out:
        return None
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    silent = _heartbeat.silent_peers() if _heartbeat is not None else None
    guess = f"rank {1 - rank}" if world == 2 else "a rank"
    waited = _WAITED.search(text)
    t = f"{int(waited.group(1)) / 1000:g}" if waited else f"{timeout_s:g}"
    if timed_out:
        if silent:
            msg = (
                f"collective timed out after {t} s waiting for a peer: {_ranks(silent)} "
                "stopped answering "
                f"(hung, stopped, or its node is down)"
            )
        elif silent == []:
            msg = (
                f"collective timed out after {t} s although every rank is alive: the ranks wait in "
                f"different collectives, or one is slower than engine.timeout_s={t} allows"
            )
        else:
            msg = (
                f"collective timed out after {t} s waiting for a peer ({guess} stopped answering?)"
            )
    elif silent:
        msg = f"lost the connection to a peer: {_ranks(silent)} died or its node went down"
    else:
        msg = (
            f"lost (or could not open) the connection to a peer ({guess} died or its node went "
            "down?)"
        )
    return Failure(EXIT_PEER, msg)


def write_error_file(message: str, printed: bool) -> None:
    """The torchelastic reply file: the launcher reads the root cause's message from it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(
                {"message": message, "timestamp": int(time.time()), "rlhf": {"printed": printed}}, f
            )
    except OSError:
        pass


def hold_termination() -> None:
    """Blocks SIGTERM in this (exiting) process: the agent terminates the other ranks as soon as
    one fails, and a rank caught between printing its line and writing its error file would make
    the launcher print the line a second time. The process exits right after anyway."""
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    except (AttributeError, ValueError, OSError):
        pass


def exit_with(failure: Failure) -> None:
    """Reports ``failure`` (one line per job) and ends this process at once."""
    hb = _heartbeat
    printed = hb.first_to_report() if hb is not None else True
    hold_termination()
    if printed:
        print(f"rlhf: error: {failure.message}", file=sys.stderr, flush=True)
    write_error_file(failure.message, printed)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(failure.code)


# ---------------------------------------------------------------------------------------- launcher


class JobWatch:
    """Spreads "this job is over" between the launchers of a multi-node job (see module doc)."""

    def __init__(self, endpoint: str, rdzv_id: str):
        host, _, port = endpoint.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.key = f"rlhf/{rdzv_id}/abort"
        self.reason: Optional[dict] = None
        self._store = None
        self.fired = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rlhf-jobwatch", daemon=True)

    def start(self) -> "JobWatch":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                if self._store is None:
                    self._store = _store(self.host, self.port)
                if self.reason is None and self._store.check([self.key]):
                    self.reason = json.loads(self._store.get(self.key).decode())
            except Exception:
                # not up yet, or gone (then the agent notices by itself)
                self._store = None
                continue
            if self.reason is None:
                continue
            # Like a SIGTERM to this launcher: the agent's handler stops the workers (SIGTERM, then
            # SIGKILL after the shutdown timeout) and raises SignalException. Only once, and only
            # while the agent's handler is installed (it is while workers run).
            with self._lock:
                if self._stop.is_set():
                    return
                if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None):
                    self.fired = True
                    _thread.interrupt_main(signal.SIGTERM)
                    return

    def announce(self, code: int, message: str) -> None:
        """This node gives up: tell the other launchers (best effort)."""
        self.stop()
        try:
            # its own connection: the thread may hold the other
            store = _store(self.host, self.port)
            if not store.check([self.key]):
                store.set(self.key, json.dumps({"code": code, "message": message}))
        except Exception:
            pass

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
        _join(self._thread)  # (see Heartbeat.stop)
