"""metrics.jsonl (docs/contract.md), wandb, TensorBoard, progress bars and the console log. Rank 0
writes; others no-op."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

from tqdm.auto import tqdm

from rlhf.host_memory import status_kb
from rlhf.outputs.fileio import atomic_write_text
from rlhf.threads import usable_cores

log = logging.getLogger("rlhf")


def setup_console(rank: int) -> None:
    """The log on stderr: rank 0 says everything; other ranks only errors (every rank sees the same
    configuration and data, so their lines and warnings would repeat rank 0's). Hugging Face's own
    progress bars ("Loading weights", "Writing model shards") stay out of the log: the stages report
    their own progress."""
    level = logging.INFO if rank == 0 else logging.ERROR
    logging.basicConfig(
        level=level,
        format="[%(asctime)s rlhf] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    for noisy in ("httpx", "urllib3", "datasets", "torch.distributed", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if rank != 0:
        warnings.simplefilter("ignore")
    quiet_hf_progress()


def quiet_hf_progress() -> None:
    """No Hugging Face progress bars (transformers' and huggingface_hub's), in this process and its
    children."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as hf_logging

        disable_progress_bars()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


class KeepWriting(io.TextIOBase):
    """A console stream whose reader may vanish: ``python -m rlhf ... 2>&1 | tee log`` and Ctrl-C
    ends ``tee`` too, and the next write would raise BrokenPipeError from inside a training step (a
    traceback, exit 1, the stop's checkpoint and message lost). Once the pipe is gone, writes go
    nowhere and the run finishes its stop as it would with a terminal."""

    def __init__(self, stream):
        self._stream = stream
        self._gone = False

    def write(self, text):
        if not self._gone:
            try:
                return self._stream.write(text)
            except (BrokenPipeError, ConnectionResetError):
                self._gone = True
        return len(text)

    def flush(self):
        if not self._gone:
            try:
                self._stream.flush()
            except (BrokenPipeError, ConnectionResetError):
                self._gone = True

    def isatty(self):
        return not self._gone and self._stream.isatty()

    def fileno(self):
        return self._stream.fileno()

    def writable(self):
        return True

    @property
    def encoding(self):
        return self._stream.encoding


def keep_writing() -> None:
    """sys.stdout and sys.stderr as ``KeepWriting`` streams (once per process)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, KeepWriting):
            setattr(sys, name, KeepWriting(stream))


def _clean(v):
    if isinstance(v, dict):  # (a rollout's reward parts)
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, float) and not math.isfinite(v):
        if math.isnan(v):
            return None
        return 1e308 if v > 0 else -1e308
    return v


# mem/peak_gb is in GiB, as the benches' peak_rss_gb / peak_gpu_gb
GIB = 2**30

# The largest peaks PeakMemory read before resetting the counters, in bytes ("rss"; on CUDA "gpu"
# and "gpu_reserved"): a reader of the whole process's peak (bench/stage_peak.py) takes them into
# account, since a reset also lowers what getrusage / torch.cuda.max_memory_* report afterwards.
_before_resets: dict = {}


def peaks_before_resets() -> dict:
    return dict(_before_resets)


def _keep(key: str, value: int) -> None:
    _before_resets[key] = max(_before_resets.get(key, 0), value)


class PeakMemory:
    """The peak memory of this process since the previous ``read()`` (the first: since it started),
    in GiB.

    On CUDA (once this process has initialised it): ``torch.cuda.max_memory_allocated`` of the
    current device — what tensors held at most, not the allocator's reserve — reset after each read.
    Otherwise the peak resident set size: ``VmHWM`` of /proc/self/status, reset to the current RSS
    after each read by writing 5 to /proc/self/clear_refs (Linux). Where that file cannot be written
    (a locked-down /proc) or does not exist (macOS) no reset is possible and the figure is the
    lifetime peak (``VmHWM``, or ``ru_maxrss``), never lower than the previous one; ``interval``
    says which."""

    def __init__(self):
        # False once a reset failed: the figures are lifetime peaks
        self.interval = True

    def read(self) -> float:
        # a process that never imported torch never used CUDA
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            peak = torch.cuda.max_memory_allocated()
            _keep("gpu", peak)
            _keep("gpu_reserved", torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
            return peak / GIB
        kb = status_kb("VmHWM")
        if kb is None:
            import resource

            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.interval = False
            # ru_maxrss is in KiB on Linux, in bytes on macOS
            unit = 1024
            if sys.platform == "darwin":
                unit = 1
            return rss * unit / GIB
        _keep("rss", kb * 1024)
        if self.interval:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # peak RSS := current RSS (Linux >= 4.0)
            except OSError:
                self.interval = False
        return kb * 1024 / GIB


class JsonLines:
    """A run's JSON-lines record (one object with a ``step`` per line), opened at its first line: a
    resume from step S keeps the lines up to S (those written after the checkpoint are dropped, so
    the file describes one consistent run); a fresh run moves an earlier run's file aside to
    ``<name>.prev``, whole. A rerun that fails before writing leaves the old file in place."""

    def __init__(self, path: Path, resume_step: Optional[int]):
        self.path, self.resume_step = Path(path), resume_step
        self._file = None

    @property
    def opened(self) -> bool:
        return self._file is not None

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.resume_step is None and self.path.is_file() and self.path.stat().st_size:
            os.replace(self.path, self.path.with_name(self.path.name + ".prev"))
        if self.resume_step is not None and self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line).get("step", 0) <= self.resume_step:
                        kept.append(line)
                except json.JSONDecodeError:
                    continue
        atomic_write_text(self.path, "".join(x + "\n" for x in kept))
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, rec: dict) -> None:
        if self._file is None:
            self._open()
        self._file.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self, touch: bool = False) -> None:
        """``touch``: a run that wrote nothing still leaves its (empty) file."""
        if self._file is None and touch:
            self._open()
        if self._file is not None:
            self._file.close()


class MetricsWriter:
    """Appends one JSON object per logged step to ``metrics.jsonl`` (and to wandb and TensorBoard
    when enabled), each with ``mem/peak_gb``: rank 0's peak memory since the previous line
    (``PeakMemory``); and what the policy wrote (``samples``) to ``samples.jsonl`` beside it, and to
    wandb and TensorBoard as tables. On resume from step S, lines with step > S are dropped first
    (``JsonLines``)."""

    def __init__(
        self, path: Path, *, is_main: bool, resume_step: Optional[int], cfg=None, stage: str = ""
    ):
        self.path = Path(path)
        self.is_main = is_main
        self._wandb = None
        self._tensorboard = None
        if not is_main:
            return
        self._lines = JsonLines(self.path, resume_step)
        self._samples = JsonLines(self.path.with_name("samples.jsonl"), resume_step)
        self._resume_step = resume_step
        self._memory = PeakMemory()
        log = logging.getLogger("rlhf")
        if cfg is not None and cfg.logger.wandb != "disabled":
            self._wandb = _init_wandb(cfg, stage)
            where = getattr(self._wandb, "url", None) if cfg.logger.wandb == "online" else None
            log.info(
                "wandb (%s): %s",
                cfg.logger.wandb,
                where or getattr(self._wandb, "dir", None) or cfg.run.dir,
            )
        if cfg is not None and cfg.logger.tensorboard:
            tb = Path(cfg.logger.tensorboard_dir or Path(cfg.run.dir) / "tensorboard") / stage
            self._tensorboard = TensorBoard(tb)
            log.info("TensorBoard: %s (tensorboard --logdir %s)", tb, tb.parent)
        self._started = False

    def _start(self) -> None:
        if not self._started:
            self._started = True
            if self._tensorboard is not None:
                self._tensorboard.open(self._resume_step)

    def log(self, step: int, **metrics) -> None:
        if not self.is_main:
            return
        rec = {
            "step": int(step),
            **{k: _clean(v) for k, v in metrics.items()},
            "mem/peak_gb": round(self._memory.read(), 4),
        }
        self._lines.write(rec)
        self._start()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in rec.items() if k != "step"}, step=int(step))
        if self._tensorboard is not None:
            self._tensorboard.log(rec)

    def samples(self, step: int, kind: str, rows: List[dict]) -> None:
        """Rows of what the policy wrote at ``step`` (``kind``: ``eval``, ``eval_greedy``,
        ``rollout``), each a dict of prompt, response and their figures, to samples.jsonl and the
        loggers' tables."""
        if not self.is_main or not rows:
            return
        for row in rows:
            self._samples.write(
                {"step": int(step), "kind": kind, **{k: _clean(v) for k, v in row.items()}}
            )
        self._start()
        columns = list(dict.fromkeys(k for row in rows for k in row))
        table = [[_cell(row.get(c)) for c in columns] for row in rows]
        if self._wandb is not None:
            import wandb

            self._wandb.log(
                {f"samples/{kind}": wandb.Table(columns=columns, data=table)}, step=int(step)
            )
        if self._tensorboard is not None:
            self._tensorboard.text(f"samples/{kind}", columns, table, step)

    def close(self) -> None:
        if not self.is_main:
            return
        self._lines.close(touch=True)
        # an earlier run's: cut back or moved aside
        self._samples.close(touch=self._samples.path.exists())
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _cell(v):
    """A table cell: numbers and text as they are, anything else (reward parts) as compact JSON."""
    if v is None or isinstance(v, (str, int, float)):
        return _clean(v)
    return json.dumps(v, ensure_ascii=False)


class TensorBoard:
    """metrics.jsonl's lines as TensorBoard scalars (``logger.tensorboard``): every number of a line
    under its key at the line's step (NaN where the line holds null), flushed with each line as the
    file is, so a run stopped by a signal or killed keeps every line it wrote. Opened with the file:
    a resume from step S hides the events an earlier run wrote after S (``purge_step``), as the file
    drops those lines; a fresh run moves an earlier run's events aside to ``<stage>.prev``."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self._writer = None

    def open(self, resume_step: Optional[int]) -> None:
        from torch.utils.tensorboard import SummaryWriter  # (lazy: only with logger.tensorboard)

        if resume_step is None and self.dir.is_dir() and any(self.dir.iterdir()):
            prev = self.dir.with_name(self.dir.name + ".prev")
            shutil.rmtree(prev, ignore_errors=True)
            os.replace(self.dir, prev)
        purge = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(log_dir=str(self.dir), purge_step=purge)

    def log(self, rec: dict) -> None:
        step = rec["step"]
        for key, value in rec.items():
            if key == "step" or not (value is None or isinstance(value, (int, float))):
                continue
            self._writer.add_scalar(key, math.nan if value is None else float(value), step)
        self._writer.flush()

    def text(self, tag: str, columns: List[str], table: List[list], step: int) -> None:
        """A table as TensorBoard text (Markdown), under ``tag`` at ``step``."""

        def cell(v) -> str:
            return str(v).replace("|", "\\|").replace("\n", "<br>")

        lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table]
        self._writer.add_text(tag, "\n".join(lines), step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _init_wandb(cfg, stage: str):
    # lazy: 0.6-0.9 s to import (measured), only with logger.wandb
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    run_dir = Path(cfg.run.dir)
    return wandb.init(
        project=cfg.logger.project,
        mode=cfg.logger.wandb,
        dir=str(run_dir),
        name=f"{run_dir.name}-{stage}",
        group=run_dir.name,
        job_type=stage,
        config=_as_dict(cfg),
        reinit="finish_previous",
    )


def _as_dict(cfg) -> dict:
    try:
        return asdict(cfg)
    except TypeError:
        return {}


def progress(
    total: int,
    initial: int,
    enabled: bool,
    desc: str,
    is_main: bool = True,
    unit: str = "step",
    leave: bool = True,
):
    """Step progress on rank 0: a tqdm bar in a terminal (``logger.progress``), else — in a log
    file, or with the bar turned off — a one-line status every 30 s; nothing on other ranks.
    ``unit``: what is counted (``step``, or e.g. ``response``); ``leave=False``: the bar vanishes
    when closed (an evaluation's, under the training bar)."""
    tty = sys.stderr.isatty()
    return Progress(
        total,
        initial,
        desc,
        bar=enabled and tty and is_main,
        status=is_main and not (enabled and tty),
        unit=unit,
        leave=leave,
    )


def _torch_threads() -> int:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else 1


class Pace:
    """Says once when the step rate falls far below the best this run measured while other processes
    take the cores (a load average above the usable cores): the collapse of a shared machine, named
    with its fix. Rates are taken over windows of at least ``window_s`` seconds and ``min_steps``
    steps; two slow windows in a row are needed (an evaluation inside one window is not a
    slowdown)."""

    def __init__(
        self,
        desc: str,
        clock,
        log,
        factor: float = 3.0,
        window_s: float = 30.0,
        min_steps: int = 5,
        load=None,
        cores=None,
        threads=None,
    ):
        self.desc, self.clock, self.log = desc, clock, log
        self.factor, self.window_s, self.min_steps = factor, window_s, min_steps
        self.load = load or (lambda: os.getloadavg()[0])
        self.cores = cores or (lambda: usable_cores()[0])
        self.threads = threads or _torch_threads
        self.mark: Optional[tuple] = None
        self.best = 0.0
        self.slow = 0
        self.warned = False

    def step(self, done: int) -> None:
        now = self.clock()
        if self.mark is None:
            # the first step (compilation, caches) starts the first window
            self.mark = (now, done)
            return
        t0, d0 = self.mark
        if now - t0 < self.window_s or done - d0 < self.min_steps:
            return
        rate = (done - d0) / (now - t0)
        self.mark = (now, done)
        if self.best and rate * self.factor < self.best:
            self.slow += 1
        else:
            self.slow = 0
        self.best = max(self.best, rate)
        if self.slow >= 2 and not self.warned:
            self.warn(rate)

    def warn(self, rate: float) -> None:
        try:
            load, cores = self.load(), self.cores()
        except OSError:
            return
        if load <= cores * 1.25:
            # the machine is not oversubscribed: a slower phase of the run itself
            return
        self.warned = True
        threads = self.threads()
        fix = (
            f"engine.threads_per_rank={max(1, threads // 2)} (this run uses {threads}) "
            "leaves them room"
            if threads > 1
            else "fewer processes on this machine, or a run on other cores (taskset), gives it back"
        )
        self.log.warning(
            "%s: %.2f steps/s, %.1fx slower than earlier in this run (%.2f steps/s), with "
            "a load average "
            "of %.1f on %d usable cores: other processes are using the cores this run needs; %s "
            "(docs/performance.md#threads-on-a-shared-machine)",
            self.desc,
            rate,
            self.best / rate,
            self.best,
            load,
            cores,
            fix,
        )


class Progress:
    """``step(**postfix)`` once per step (``step(n=...)``: n units at once). The bar's postfix never
    forces a redraw (tqdm's set_postfix does by default: a redraw per step); the status line reads
    ``sft: step 120/1000 (12%) loss=0.532 3.10 steps/s eta 4m44s`` (another unit:
    ``gold: 512/1280 responses (40%) 3.10 responses/s eta 3m58s``)."""

    def __init__(
        self,
        total: int,
        initial: int,
        desc: str,
        bar: bool,
        status: bool,
        interval: float = 30.0,
        clock=time.monotonic,
        log=None,
        unit: str = "step",
        leave: bool = True,
    ):
        self.total, self.done, self.desc = total, initial, desc
        self.status, self.interval, self.clock = status, interval, clock
        self.unit = unit
        self.log = log or logging.getLogger("rlhf")
        self.t0 = self.last = clock()
        self.start = initial
        self.postfix: dict = {}
        self.pace = Pace(desc, clock, self.log) if unit == "step" and (bar or status) else None
        self.bar = None
        if bar:
            # tqdm's default unit is "it": steps keep it
            unit_kw = {}
            if unit != "step":
                unit_kw = {"unit": unit}
            self.bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                dynamic_ncols=True,
                file=sys.stderr,
                mininterval=1.0,
                leave=leave,
                **unit_kw,
            )

    def step(self, n: int = 1, **postfix) -> None:
        self.done += n
        self.postfix = postfix
        if self.pace is not None:
            self.pace.step(self.done)
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)
        elif self.status and (self.clock() - self.last >= self.interval or self.done == self.total):
            self.last = self.clock()
            self.log.info(self.line())

    def line(self) -> str:
        elapsed = max(self.clock() - self.t0, 1e-9)
        rate = (self.done - self.start) / elapsed
        eta_s = "?"
        if rate > 0:
            eta = (self.total - self.done) / rate
            eta_s = f"{int(eta // 60)}m{int(eta % 60):02d}s"
        post = "".join(f" {k}={v}" for k, v in self.postfix.items())
        if self.unit == "step":
            count = f"step {self.done}/{self.total}"
        else:
            count = f"{self.done}/{self.total} {self.unit}s"
        return (
            f"{self.desc}: {count} ({100 * self.done / max(self.total, 1):.0f}%)"
            f"{post} {rate:.2f} {self.unit}s/s eta {eta_s}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
