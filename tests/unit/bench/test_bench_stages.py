"""bench/stages.py runs the SFT, reward and DPO steps and prints the contract's bench lines."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ENV, ROOT

KEYS = {
    "bench",
    "workload",
    "variant",
    "metric",
    "value",
    "unit",
    "world_size",
    "threads_per_rank",
    "torch",
    "device",
}


def test_bench_stages_tiny_prints_schema_lines():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "stages.py"),
            "--workloads",
            "tiny",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--rows",
            "2",
            "--threads",
            "1",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert lines, "no JSON lines on stdout"
    for line in lines:
        assert KEYS <= line.keys(), KEYS - line.keys()
        assert (
            line["bench"] == "stages" and line["workload"] == "tiny" and line["variant"] == "rlhf"
        )
        assert line["device"] == "cpu"
    figures = {(x["stage"], x["metric"]): x["value"] for x in lines}
    for stage in ("sft", "reward", "dpo"):
        assert figures[(stage, "s_per_step")] > 0
        assert figures[(stage, "tokens_per_s")] > 0
        # the tiny workload's rows have one length
        assert figures[(stage, "padding_share")] == 0.0
