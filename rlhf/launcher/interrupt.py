"""A first SIGINT (Ctrl-C) or SIGTERM (Slurm's warning before it kills a job) asks the stage to stop
at the end of its current step: it saves a checkpoint there and exits 130 / 143 saying where the
rerun resumes. A second signal acts at once (KeyboardInterrupt / termination).

Every rank checks at the same point of each step whether any rank was signalled (one small
all-reduce), so ranks that are all signalled stop together and save one consistent checkpoint.
Under an elastic agent (torchrun, ``python -m rlhf launcher.*``) the agent owns the signals: it
stops its workers with SIGTERM both when the job is cancelled and when a peer has died (where a
collective save would only hang), so workers keep the default handlers there and the stage's
periodic checkpoints (``train.save_every``) are what a rerun resumes from.
"""

from __future__ import annotations

import os
import signal
import threading

import torch

from rlhf.errors import UserError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(UserError):
    """Raised after the checkpoint is saved; ``exit_code`` is 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopRequest:
    def __init__(self):
        self.signum = 0
        self._previous: dict = {}

    def listen(self) -> "StopRequest":
        under_agent = "TORCHELASTIC_RUN_ID" in os.environ
        if threading.current_thread() is threading.main_thread() and not under_agent:
            # handlers live there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        self.signum = signum
        # the next one is not deferred: Ctrl-C again raises KeyboardInterrupt, SIGTERM again
        # terminates
        if signum == signal.SIGINT:
            signal.signal(signum, signal.default_int_handler)
        else:
            signal.signal(signum, signal.SIG_DFL)

    def pending(self, mesh) -> int:
        """The signal any rank received (0 if none); collective when distributed."""
        if not mesh.distributed:
            return self.signum
        t = torch.tensor([float(self.signum)], dtype=torch.float64, device=mesh.device)
        return int(mesh.all_reduce(t, op=torch.distributed.ReduceOp.MAX).item())

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def stop_here(stop: StopRequest, mesh, step: int, save) -> None:
    """At the end of a step: when a stop was requested, ``save(step)`` (returns the checkpoint path,
    or None when it was saved already at this step) and raise ``Interrupted``."""
    signum = stop.pending(mesh)
    if not signum:
        return
    path = save(step)
    name = signal.Signals(signum).name
    stop.close()
    where = ""
    if path:
        where = f" in {path}"
    raise Interrupted(
        f"stopped by {name} after step {step}; checkpoint saved{where}: "
        f"rerun the same command to resume from step {step}",
        signum,
    )


def listen() -> StopRequest:
    return StopRequest().listen()
