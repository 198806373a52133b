"""summary.json of a run (docs/contract.md) from the stages' metrics, a short table, and report.png.

python -m rlhf.summary RUN_DIR [--seconds stage=S ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlhf import config
from rlhf.outputs.fileio import atomic_write_json
from rlhf.report import read_series, write_report

# every stage: the largest logged value (the stage's peak), not the last
PEAKS = ("mem/peak_gb",)


def last_values(metrics_file: Path, keys, peaks=()) -> dict:
    """The last logged value of each of ``keys`` in a metrics.jsonl, and the largest of each of
    ``peaks``."""
    series = read_series(metrics_file)
    return {
        **{k: series[k][1][-1] for k in keys if k in series},
        **{k: max(series[k][1]) for k in peaks if k in series},
    }


def build_summary(run_dir: Path, seconds: dict, seed=None) -> dict:
    """Per stage of rlhf.config.STAGE_TABLE that logged any: its row's summary_keys (last values)
    and PEAKS."""
    summary = {}
    for stage in config.STAGE_TABLE:
        vals = last_values(run_dir / stage.name / "metrics.jsonl", stage.summary_keys, PEAKS)
        if vals:
            summary[stage.name] = vals
    summary["seconds"] = seconds
    if seed is not None:
        summary["run"] = {"seed": seed}
    return summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rlhf.summary")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--seconds", action="append", default=[], help="stage=seconds")
    ap.add_argument(
        "--seed", type=int, default=None, help="run.seed of the run (recorded in summary.json)"
    )
    args = ap.parse_args(argv)
    seconds = {k: float(v) for k, v in (s.split("=", 1) for s in args.seconds)}
    summary = build_summary(args.run_dir, seconds, args.seed)
    atomic_write_json(args.run_dir / "summary.json", summary)
    print(f"\nrun: {args.run_dir}")
    print(f"{'stage':<8} {'metric':<22} {'value':>10}")
    for stage, vals in summary.items():
        if stage in ("seconds", "run"):
            continue
        for k, v in vals.items():
            print(f"{stage:<8} {k:<22} {v:>10.4f}")
    for k, v in seconds.items():
        print(f"{'time':<8} {k + ' (s)':<22} {v:>10.1f}")
    if args.seed is not None:
        print(f"{'run':<8} {'seed':<22} {args.seed:>10d}")
    print(f"summary: {args.run_dir / 'summary.json'}")
    print(f"report:  {write_report(args.run_dir)}")


if __name__ == "__main__":
    main()
