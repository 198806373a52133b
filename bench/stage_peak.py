"""Runs ``python -m rlhf ARGS...`` in this process and, when it ends, writes this process's peak
memory to OUT_DIR/peak_<rank>.json (bench/ppo.py; one file per rank under torch.distributed.run).

    python bench/stage_peak.py OUT_DIR stage=ppo run.dir=... [key=value ...]

peak_rss_gb: the peak resident set of this process (getrusage ru_maxrss; KiB on Linux) in GiB;
on CUDA also peak_gpu_gb (torch.cuda.max_memory_allocated) and peak_gpu_reserved_gb
(max_memory_reserved, what the caching allocator held) of this process's device.
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
    rec = {"rank": int(os.environ.get("RANK", "0")),
           "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        rec["device"] = f"cuda:{torch.cuda.get_device_name()}"
        rec["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 2**30
        rec["peak_gpu_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    return rec


def main() -> None:
    out_dir, argv = Path(sys.argv[1]), sys.argv[2:]
    from rlhf.__main__ import main as rlhf_main
    try:
        rlhf_main(argv)
    finally:  # also on an error exit: the figure of a failed run still says how far it got
        rec = peak()
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"peak_{rec['rank']}.json").write_text(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
