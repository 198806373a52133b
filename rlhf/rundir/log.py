"""metrics.jsonl (docs/contract.md), wandb, progress bars and the console log. Rank 0 writes; others no-op."""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from tqdm.auto import tqdm

from rlhf.rundir.fileio import atomic_write_text

log = logging.getLogger("rlhf")


def setup_console(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="[%(asctime)s rlhf] %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr, force=True)
    for noisy in ("httpx", "urllib3", "datasets", "torch.distributed", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class MetricsWriter:
    """Appends one JSON object per logged step to ``metrics.jsonl`` (and to wandb when enabled).

    On resume from step S, lines with step > S (written after the checkpoint) are dropped first, so
    the file always describes one consistent run."""

    def __init__(self, path: Path, *, is_main: bool, resume_step: Optional[int], cfg=None, stage: str = ""):
        self.path = Path(path)
        self.is_main = is_main
        self._wandb = None
        if not is_main:
            return
        self._resume_step = resume_step
        self._file = None  # opened (and the old file cut back) at the first line of this run
        if cfg is not None and cfg.logger.wandb != "disabled":
            self._wandb = _init_wandb(cfg, stage)

    def _open(self) -> None:
        """Keeps the lines up to the resume step and opens for appending; on a fresh run an earlier
        run's file becomes metrics.jsonl.prev. Done at the first line this run writes, so a rerun that
        fails before it leaves the old file in place."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self._resume_step is None and self.path.is_file() and self.path.stat().st_size:
            # a fresh run over an earlier one: the earlier metrics move aside, whole, never truncated
            os.replace(self.path, self.path.with_name(self.path.name + ".prev"))
        if self._resume_step is not None and self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line).get("step", 0) <= self._resume_step:
                        kept.append(line)
                except json.JSONDecodeError:
                    continue
        atomic_write_text(self.path, "".join(x + "\n" for x in kept))
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, **metrics) -> None:
        if not self.is_main:
            return
        if self._file is None:
            self._open()
        rec = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in rec.items() if k != "step"}, step=int(step))

    def close(self) -> None:
        if not self.is_main:
            return
        if self._file is None:  # a run that logged nothing still leaves its (empty) file
            self._open()
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def _init_wandb(cfg, stage: str):
    import wandb  # lazy: 0.6-0.9 s to import (measured), only with logger.wandb
    os.environ.setdefault("WANDB_SILENT", "true")
    run_dir = Path(cfg.run.dir)
    return wandb.init(project=cfg.logger.project, mode=cfg.logger.wandb, dir=str(run_dir),
                      name=f"{run_dir.name}-{stage}", group=run_dir.name, job_type=stage,
                      config=_as_dict(cfg), reinit="finish_previous")


def _as_dict(cfg) -> dict:
    try:
        return asdict(cfg)
    except TypeError:
        return {}


def progress(total: int, initial: int, enabled: bool, desc: str, is_main: bool = True):
    """Step progress on rank 0: a tqdm bar in a terminal (``logger.progress``), else — in a log file,
    or with the bar turned off — a one-line status every 30 s; nothing on other ranks."""
    tty = sys.stderr.isatty()
    return Progress(total, initial, desc, bar=enabled and tty and is_main, status=is_main and not (enabled and tty))


class Progress:
    """``step(**postfix)`` once per step. The bar's postfix never forces a redraw (tqdm's
    set_postfix does by default: a redraw per step); the status line reads
    ``sft: step 120/1000 (12%) loss=0.532 3.10 steps/s eta 4m44s``."""

    def __init__(self, total: int, initial: int, desc: str, bar: bool, status: bool, interval: float = 30.0,
                 clock=time.monotonic, log=None):
        self.total, self.done, self.desc = total, initial, desc
        self.status, self.interval, self.clock = status, interval, clock
        self.log = log or logging.getLogger("rlhf")
        self.t0 = self.last = clock()
        self.start = initial
        self.postfix: dict = {}
        self.bar = None
        if bar:
            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, file=sys.stderr,
                            mininterval=1.0)

    def step(self, **postfix) -> None:
        self.done += 1
        self.postfix = postfix
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        elif self.status and (self.clock() - self.last >= self.interval or self.done == self.total):
            self.last = self.clock()
            self.log.info(self.line())

    def line(self) -> str:
        elapsed = max(self.clock() - self.t0, 1e-9)
        rate = (self.done - self.start) / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        post = " ".join(f"{k}={v}" for k, v in self.postfix.items())
        eta_s = "?" if eta == float("inf") else f"{int(eta // 60)}m{int(eta % 60):02d}s"
        return (f"{self.desc}: step {self.done}/{self.total} ({100 * self.done / max(self.total, 1):.0f}%)"
                f"{' ' + post if post else ''} {rate:.2f} steps/s eta {eta_s}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
