"""Launching ``python -m rlhf`` jobs in the background, finding their worker processes through
/proc, and comparing what they wrote."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

from tests.conftest import ENV, ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# every Job started; tests/reliability/conftest.py ends a test's leftovers
RUNNING: List["Job"] = []


class Job:
    """``python -m rlhf <overrides>`` in the background, stdout+stderr in ``log``."""

    def __init__(self, *overrides: str, log: Path, env: dict | None = None):
        RUNNING.append(self)
        self.log = Path(log)
        self.t0 = time.monotonic()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlhf", *overrides],
                cwd=ROOT,
                env={**ENV, **(env or {})},
                stdout=f,
                stderr=subprocess.STDOUT,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float = 600) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            self.kill_tree()
            raise AssertionError(f"job still running after {timeout} s:\n{self.tail()}") from e

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def error_lines(self) -> List[str]:
        return [
            x
            for x in self.log.read_text(errors="replace").splitlines()
            if x.startswith("rlhf: error:")
        ]

    def kill_tree(self) -> None:
        for pid in list(workers(self.pid).values()) + [self.pid]:
            kill(pid)
        self.proc.wait()


def _stat(pid: int) -> List[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # [state, ppid, ...]; the name may hold spaces
    return text.rsplit(")", 1)[1].split()


def kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    """Running or stopped (a zombie is dead)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def state(pid: int) -> str | None:
    st = _stat(pid)
    return st[0] if st else None


def children(pid: int) -> List[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None and int(st[1]) == pid:
            out.append(int(d))
    return out


def _env_rank(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for e in env:
        if e.startswith(b"RANK="):
            return int(e[5:])
    return None


def workers(launcher_pid: int) -> Dict[int, int]:
    """{global rank: pid} of the workers a launcher (``python -m rlhf launcher.*``) started."""
    return {r: c for c in children(launcher_pid) if (r := _env_rank(c)) is not None}


def wait_until(cond: Callable[[], bool], timeout: float, jobs=(), what: str = "") -> None:
    """Polls ``cond`` (20 ms); fails early when one of ``jobs`` ends first."""
    deadline = time.monotonic() + timeout
    while not cond():
        for j in jobs:
            if j.proc.poll() is not None:
                raise AssertionError(
                    f"job ended (exit {j.proc.returncode}) before {what}:\n{j.tail()}"
                )
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class When:
    """Runs ``action()`` in a thread once ``cond()`` holds (polled every 20 ms, ``timeout`` s at
    most, given up when ``job`` ends first). ``result()`` joins it and re-raises its error."""

    def __init__(
        self,
        cond: Callable[[], bool],
        action: Callable[[], object],
        job: "Job",
        timeout: float,
        what: str,
    ):
        import threading

        self.value, self.error, self.at = None, None, None

        def run():
            try:
                wait_until(cond, timeout, [job], what)
                self.value, self.at = action(), time.monotonic()
            except BaseException as e:  # reported by result()
                self.error = e

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self, timeout: float = 600):
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.value


def weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def max_weight_diff(a_dir: Path, b_dir: Path) -> float:
    a, b = weights(a_dir), weights(b_dir)
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def metrics(path: Path) -> List[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


TIMING_KEYS = ("time/", "samples_per_s", "gen/tokens_per_s", "mem/")


def numbers(rows: List[dict]) -> List[dict]:
    """metrics.jsonl rows without the wall-clock and memory figures (those differ between any two
    runs)."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)} for r in rows]


def numbers_by_step(path: Path, noise: tuple = ()) -> dict:
    """step → every number a metrics.jsonl logged at it (training and evaluation lines merged),
    without the wall-clock and memory figures (``TIMING_KEYS``, any ``*per_s``) and the keys
    starting with ``noise``."""
    out: dict = {}
    for r in metrics(path):
        out.setdefault(r["step"], {}).update(
            {
                k: v
                for k, v in r.items()
                if isinstance(v, (int, float))
                and k not in ("step", "time")
                and not k.startswith(TIMING_KEYS + tuple(noise))
                and "per_s" not in k
            }
        )
    return out


def truncate(path: Path) -> None:
    """Cuts a file to half its length (a write that stopped midway)."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])


def flip_byte(path: Path) -> None:
    """Flips one bit in the middle of a file (storage corruption that keeps its size)."""
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0x10
    Path(path).write_bytes(bytes(data))
