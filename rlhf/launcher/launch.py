"""``python -m rlhf ... launcher.nproc_per_node=G [launcher.nnodes=N launcher.node_rank=R
launcher.rdzv_endpoint=HOST:PORT launcher.max_restarts=K]``: start torch.distributed.run ourselves
(c10d rendezvous), with the same overrides for every worker.

When workers fail and no restart is left, the launcher exits with the root cause's exit code (the
first rank to fail: 2 for bad input, 3 for a lost or silent peer, 128+N for a worker killed by
signal N) and makes sure the whole job ends: a short shutdown timeout turns a stopped worker into
a killed one within seconds, and on several nodes ``rlhf.launcher.watchdog.JobWatch`` tells the
other launchers to stop their workers too.
"""

from __future__ import annotations

import os
import sys
import time
from typing import List, Optional, Tuple

from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.run import parse_args, run

from rlhf.errors import one_line
from rlhf.launcher.watchdog import EXIT_PEER, HEARTBEAT_STORE_ENV, JobWatch
from rlhf.outputs.fileio import pid_running

# Seconds the agent waits after SIGTERM before it SIGKILLs a worker. Our workers do not handle
# SIGTERM (they die at once); only a stopped or wedged one needs the SIGKILL, and torch's 30 s
# default would add half a minute to every failure with such a peer.
SHUTDOWN_TIMEOUT_S = 5


def shutdown_timeout() -> int:
    """$TORCH_ELASTIC_SHUTDOWN_TIMEOUT when set, else SHUTDOWN_TIMEOUT_S."""
    env = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    return int(env) if env else SHUTDOWN_TIMEOUT_S


# pids of workers the agent itself terminated (they were still running when it closed the group):
# their deaths are consequences of another rank's failure, never its cause.
_terminated_by_agent: set = set()


def _patch_worker_close(seconds: int) -> None:
    """torch's agent closes its workers with a hard-coded 30 s grace in two places (the process
    context's own ``close()`` when a worker fails, and ``_stop_workers`` → ``_shutdown()``); its
    ``--shutdown-timeout`` only reaches the exit paths. Cap every close in this (launcher) process
    to ``seconds``, and remember which workers were still running, i.e. were terminated by the
    agent."""
    original = getattr(PContext.close, "_rlhf_original", PContext.close)

    def close(self, death_sig=None, timeout: int = 30) -> None:
        try:
            _terminated_by_agent.update(p for p in self.pids().values() if pid_running(p))
        except Exception:  # bookkeeping only
            pass
        return original(self, death_sig, min(timeout, seconds))

    close._rlhf_original = original
    PContext.close = close


def launcher_args(cfg, overrides: List[str]) -> List[str]:
    lc = cfg.launcher
    return [
        f"--nnodes={lc.nnodes}",
        f"--nproc-per-node={lc.nproc_per_node}",
        f"--node-rank={lc.node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={lc.rdzv_endpoint}",
        f"--rdzv-id={lc.rdzv_id}",
        f"--max-restarts={lc.max_restarts}",
        "-m",
        "rlhf",
        *overrides,
    ]


def _err(msg: str) -> None:
    print(f"rlhf: error: {one_line(msg)}", file=sys.stderr, flush=True)


def _root_cause(failures: dict):
    """(rank, failure) that caused the others. torchelastic's ``get_first_failure`` goes by
    timestamps in whole seconds, and ranks often fail within the same second; so first come
    the failures that are causes (an exit code of their own, then a signal from outside), then
    the consequences: a rank that lost its peer (exit 3), then the ranks the agent terminated."""

    def order(item):
        rank, f = item
        if f.pid in _terminated_by_agent:
            kind = 3
        elif f.exitcode == EXIT_PEER:
            kind = 2
        elif f.exitcode < 0:
            kind = 1
        else:
            kind = 0
        return kind, f.timestamp, rank

    return min(failures.items(), key=order)


def child_failure(e) -> Tuple[int, Optional[str], str]:
    """(exit code, line to print or None, root-cause message) for a ChildFailedError. The line is
    None when a worker already printed that message (workers say so in their error file)."""
    rank, root = _root_cause(e.failures)
    if root.exitcode > 0:
        code = root.exitcode
    elif root.exitcode < 0:
        # killed by a signal: 128 + its number, as a shell says
        code = 128 + -root.exitcode
    else:
        code = 128 + 1
    data = root.error_file_data if isinstance(root.error_file_data, dict) else {}
    if "rlhf" in data:  # our worker's own message
        msg = str(data.get("message"))
    elif root.exitcode < 0:
        msg = f"worker rank {rank} (pid {root.pid}) was killed by {root.signal_name()}"
    else:
        msg = (
            f"worker rank {rank} (pid {root.pid}) exited with code {root.exitcode} (its "
            "traceback is above)"
        )
    printed = {
        str(f.error_file_data.get("message"))
        for f in e.failures.values()
        if isinstance(f.error_file_data, dict) and f.error_file_data.get("rlhf", {}).get("printed")
    }
    line = None if msg in printed else msg
    return code, line, msg


def self_launch(cfg, overrides: List[str]) -> int:
    lc = cfg.launcher
    if lc.max_restarts > 0:
        # torch's agent shares one store server across rendezvous rounds and its workers use it
        # without a per-attempt prefix, so a restarted gloo group reads the dead group's addresses
        # ("connectFullMesh failed ... Connection refused"). Unshared, every attempt gets a new
        # store.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # workers inherit it (rlhf.launcher.watchdog.Heartbeat)
    os.environ[HEARTBEAT_STORE_ENV] = lc.rdzv_endpoint
    _patch_worker_close(shutdown_timeout())
    watch = JobWatch(lc.rdzv_endpoint, lc.rdzv_id).start() if lc.nnodes > 1 else None
    try:
        run(parse_args(launcher_args(cfg, overrides)))
        return 0
    except ChildFailedError as e:  # a worker failed and no restart is left
        code, line, cause = child_failure(e)
        if line:
            _err(line)
        if watch is not None:
            watch.announce(code, cause)
            # if this node hosts the store, let the others read why (JobWatch polls 1/s)
            time.sleep(1.5)
        return code
    except SignalException as e:
        if watch is not None and watch.fired and watch.reason:
            _err(f"stopping: another node gave up: {watch.reason.get('message')}")
            return int(watch.reason.get("code", EXIT_PEER))
        _err(f"the launcher received {e.sigval.name}; its workers were stopped")
        return 128 + int(e.sigval)
    except RendezvousError as e:
        # e.g. the node hosting the rendezvous store went away
        if watch is not None and watch.reason:
            _err(f"stopping: another node gave up: {watch.reason.get('message')}")
            return int(watch.reason.get("code", EXIT_PEER))
        _err(
            f"the rendezvous at {lc.rdzv_endpoint} failed ({type(e).__name__}: "
            f"{one_line(str(e))}); "
            f"a node stopped, or the endpoint is unreachable"
        )
        return EXIT_PEER
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    finally:
        if watch is not None:
            watch.stop()
