"""metrics.jsonl (CONTRACT.md), wandb, progress bars and the console log. Rank 0 writes; others no-op."""
from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from rlhf.fileio import atomic_write_text

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
        """Keeps the lines up to the resume step (none on a fresh run) and opens for appending. Done at
        the first line this run writes, so a rerun that fails before it leaves the old file whole."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
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
    import wandb
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


def progress(total: int, initial: int, enabled: bool, desc: str):
    """A tqdm bar on rank 0 (stderr); a no-op object elsewhere."""
    from tqdm.auto import tqdm
    # In a log file (not a terminal) a bar line every 30 s, not a stream of carriage returns.
    interval = 1.0 if sys.stderr.isatty() else 30.0
    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, dynamic_ncols=True,
                file=sys.stderr, mininterval=interval, maxinterval=max(interval, 10.0))
