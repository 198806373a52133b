"""CPU threads: how many a rank uses, and how its OpenMP threads wait.

Two things made a run collapse on a machine whose cores other processes also use (a laptop with a
browser, a shared CI runner): the thread count came from ``os.cpu_count()`` (every core of the host,
not the ones this process may run on), and OpenMP's idle threads spin for a long while at every
barrier — with a core taken away, the spinning thread holds it while the thread the barrier waits
for sits in the run queue. Measured on the 2-core CPU machine (embedded SFT, 400 steps, two busy
processes beside it; docs/performance.md#threads-on-a-shared-machine): 2 threads with OpenMP's own
spin 209 s, 1 thread 61-65 s, 2 threads with a short spin 81-85 s; idle, all within the machine's
noise of each other.

- ``tame_openmp()``: a short spin before a waiting OpenMP thread sleeps (``GOMP_SPINCOUNT`` for GNU
  OpenMP, which the CPU wheels of torch use; ``KMP_BLOCKTIME`` for Intel's). OpenMP reads them when
  it loads, so ``rlhf/__init__.py`` calls this before anything imports torch. A value the user set
  wins.
- ``usable_cores()``: the cores this process may use — its CPU affinity, and a cgroup CPU quota
  (containers, Slurm, CI runners) where one is set.
- ``fit_to_model()``: with the automatic count, one thread while every model the process trains is
  small (below ``SMALL_MODEL`` parameters): such a model gains next to nothing from more (the
  embedded
  0.5M-parameter model: 1 and 2 threads within this machine's noise idle) and a busy machine takes
  them away (beside two busy processes: 1 thread 61-65 s, 2 threads 81-85 s). A rule of the model,
  not of the load, so a run's numbers never depend on what else the machine was doing.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import MutableMapping, Optional, Tuple

# GNU OpenMP spins 300,000 iterations at a barrier before sleeping when its threads fit the cores,
# 1,000 when they do not ("throttled"): 1,000 always. Measured under load (two busy processes,
# embedded SFT): 1,000 took 1.3x one thread's time in every run, 10,000 1.2x or 2.1x; idle, 1,000 is
# ~7% slower on the embedded model (within this machine's noise) and the same on larger ones.
OPENMP_WAIT = {"GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "1"}


def tame_openmp(environ: Optional[MutableMapping[str, str]] = None) -> None:
    env = os.environ if environ is None else environ
    for key, value in OPENMP_WAIT.items():
        env.setdefault(key, value)


def _cgroup_quota(
    root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")
) -> Optional[float]:
    """CPUs' worth of time the cgroup allows, None without a quota: cgroup v2's ``cpu.max`` of this
    process's own cgroup (``/proc/self/cgroup``: a Slurm job's or a systemd unit's) and of every
    cgroup above it (the smallest wins), else v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``."""
    quotas = []
    rel = ""
    try:
        for line in own.read_text().splitlines():
            if line.startswith("0::"):  # the v2 hierarchy
                rel = line[3:].strip().lstrip("/")
    except OSError:
        pass
    d = root / rel if rel else root
    while True:
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
            if quota != "max":
                quotas.append(int(quota) / int(period))
        except (OSError, ValueError):
            pass
        if d == root or root not in d.parents:
            break
        d = d.parent
    if quotas:
        return min(quotas)
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cores(
    cgroup_root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")
) -> Tuple[int, str]:
    """(cores, why): the number of cores this process may use and what limited it."""
    try:
        affinity = len(os.sched_getaffinity(0))
        why = f"{affinity} in this process's CPU affinity"
    except (AttributeError, OSError):  # not on Linux
        affinity = os.cpu_count() or 1
        why = f"{affinity} cores"
    quota = _cgroup_quota(cgroup_root, own)
    if quota is not None and math.ceil(quota) < affinity:
        return max(1, math.ceil(quota)), f"a cgroup CPU quota of {quota:g} cores ({why})"
    return max(1, affinity), why


def default_threads(local_world: int) -> Tuple[int, str]:
    """(threads, why) for ``engine.threads_per_rank=0``: the usable cores shared by this node's
    ranks."""
    cores, why = usable_cores()
    ranks = max(local_world, 1)
    threads = max(1, cores // ranks)
    shared = f" shared by {ranks} ranks" if ranks > 1 else ""
    return threads, f"{why}{shared}"


# parameters: below it, one thread (fit_to_model)
SMALL_MODEL = 2_000_000
# parameters of the largest model trained in this process so far
_largest = 0


def fit_to_model(n_params: int, cores: int) -> Optional[str]:
    """The automatic thread count (``cores`` of ``default_threads``) for a model of ``n_params``
    being trained: 1 while every such model is small, ``cores`` from the first that is not. Returns
    what the log says when the count changes (None when it stays)."""
    global _largest
    import torch

    _largest = max(_largest, n_params)
    want = 1 if _largest < SMALL_MODEL else cores
    if want == torch.get_num_threads():
        return None
    torch.set_num_threads(want)
    if want == 1:
        return (
            f"1 CPU thread per rank: a model of {n_params / 1e6:.1f}M parameters gains "
            "next to nothing from more "
            f"(below {SMALL_MODEL / 1e6:g}M), and a busy machine would take them away "
            "(engine.threads_per_rank sets it)"
        )
    return f"{want} CPU threads per rank: a model of {n_params / 1e6:.1f}M parameters uses them"
