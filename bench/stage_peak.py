"""Runs ``python -m rlhf ARGS...`` in this process and, when it ends, writes this process's peak
memory to OUT_DIR/peak_<rank>.json (bench/ppo.py; one file per rank under torch.distributed.run).

    python bench/stage_peak.py OUT_DIR stage=ppo run.dir=... [key=value ...]

peak_rss_gb: the peak resident set of this process (getrusage ru_maxrss; KiB on Linux) in GiB;
on CUDA also peak_gpu_gb (torch.cuda.max_memory_allocated) and peak_gpu_reserved_gb
(max_memory_reserved, what the caching allocator held) of this process's device. Each counter
is taken with the peaks the stage's metrics lines read before resetting it (``mem/peak_gb`` is the
peak since the previous line: rlhf.outputs.log.PeakMemory), so these stay the whole process's peaks.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def peak() -> dict:
    from rlhf.outputs.log import peaks_before_resets

    before = peaks_before_resets()
    rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, before.get("rss", 0))
    rec = {"rank": int(os.environ.get("RANK", "0")), "peak_rss_gb": rss / 2**30}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        rec["device"] = f"cuda:{torch.cuda.get_device_name()}"
        rec["peak_gpu_gb"] = max(torch.cuda.max_memory_allocated(), before.get("gpu", 0)) / 2**30
        rec["peak_gpu_reserved_gb"] = (
            max(torch.cuda.max_memory_reserved(), before.get("gpu_reserved", 0)) / 2**30
        )
    return rec


def main() -> None:
    out_dir, argv = Path(sys.argv[1]), sys.argv[2:]
    from rlhf.__main__ import main as rlhf_main

    try:
        rlhf_main(argv)
    finally:
        # also on an error exit: the figure of a failed run still says how far it got
        rec = peak()
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"peak_{rec['rank']}.json").write_text(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
    from rlhf.engine.mesh import end_process

    # (a torchrun worker: without finalization, rlhf/engine/mesh.py says why)
    end_process()
