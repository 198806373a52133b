"""The Python tool's sandbox: what a call costs, one at a time and many at once, in each isolation
mode this machine allows, and before the kernel isolation (docs/benchmarks.md, `bench:
"sandbox_calls"`).

    python bench/sandbox_calls.py [--calls 60] [--concurrent 16] [--before REV] [--modes root user
    guard]

Each variant runs ``print(1)`` (the start of a call and its end: the code itself takes no time) with
the default limits: ``--calls`` calls one after another (``ms_per_call``: the median call's wall
milliseconds), then ``--calls`` calls from ``--concurrent`` threads at once (``calls_per_s``, as a
batch of tool-using episodes makes them). ``--before REV`` adds the sandbox of that git revision
(rlhf/envs/sandbox.py as one file: the guard in the calling interpreter's child, no launcher
server), loaded from git into this process. Variants: ``before``, then the strongest mode that works
here (``root`` or ``user``) and ``guard``.

Lines ``{"bench": "sandbox_calls", "workload": "print", "variant": <mode|before>, "metric":
"ms_per_call" | "calls_per_s", ...}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import device_label  # noqa: E402

from rlhf.envs.sandbox import Sandbox, isolation  # noqa: E402


def old_sandbox(rev: str):
    """The Sandbox class of rlhf/envs/sandbox.py at ``rev`` (a single, self-contained file then)."""
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:rlhf/envs/sandbox.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="rlhf-bench-")) / "old_sandbox.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("old_sandbox", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_sandbox"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.Sandbox()


def measure(box, calls: int, concurrent: int) -> dict:
    # warm: the first call starts the launcher server
    assert box.run("print(1)").stdout == "1\n"
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        result = box.run("print(1)")
        times.append(time.perf_counter() - start)
        assert result.stdout == "1\n", result
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrent) as pool:
        results = list(pool.map(lambda _: box.run("print(1)"), range(calls)))
    wall = time.perf_counter() - start
    assert all(r.stdout == "1\n" for r in results)
    return {"ms_per_call": 1000 * statistics.median(times), "calls_per_s": calls / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument(
        "--before", default=None, help="a git revision whose rlhf/envs/sandbox.py to compare"
    )
    ap.add_argument(
        "--modes", nargs="*", default=None, help="default: the strongest that works here, and guard"
    )
    args = ap.parse_args()
    variants = []
    if args.before:
        variants.append(("before", old_sandbox(args.before)))
    found = isolation()
    wanted = args.modes or list(dict.fromkeys([found.mode, "guard"]))
    variants += [(mode, Sandbox(mode=mode)) for mode in wanted]
    units = {"ms_per_call": "ms", "calls_per_s": "calls/s"}
    for name, box in variants:
        for metric, value in measure(box, args.calls, args.concurrent).items():
            row = {"bench": "sandbox_calls", "workload": "print", "variant": name, "metric": metric}
            row.update(
                value=round(value, 2),
                unit=units[metric],
                calls=args.calls,
                concurrent=args.concurrent,
            )
            row.update(device=device_label("cpu"), before=args.before)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
