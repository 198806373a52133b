"""bench/moe_memory.py: Qwen3-30B-A3B's parameters counted from its config on the meta device (the
published 30.5B, 3.3B active), the ZeRO-3 states per rank 16·Ψ/N, and EP shrinking the gathered
layer by its experts' share."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ENV, ROOT
from tests.unit.bench.test_bench_stages import KEYS


def test_moe_memory_counts_qwen3_30b_a3b():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "moe_memory.py"), "--models", "qwen3-30b-a3b"]
        + ["--ranks", "64", "--ep", "8"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert all(KEYS - {"threads_per_rank", "torch"} <= line.keys() for line in lines)
    fig = {(x["variant"], x["metric"]): x["value"] for x in lines}
    psi = lines[0]["params_dense"] + lines[0]["params_experts"]
    assert abs(psi / 30.5e9 - 1) < 0.01
    assert abs(fig["no_ep", "states_gb"] - 16 * psi / 64 / 1e9) < 1e-6
    assert fig["ep8", "states_gb"] == fig["no_ep", "states_gb"]
    # 128 experts over 8 ranks: a layer gathers its attention and router, and 16 experts
    assert fig["ep64", "layer_gb"] < fig["ep8", "layer_gb"] < fig["no_ep", "layer_gb"] / 5
