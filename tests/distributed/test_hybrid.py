"""The hybrid engine on 2 ranks (gloo) with a ZeRO-3 actor, inference_tp_size 1 and 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ENV, ROOT

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("hybrid_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid") / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER), str(out)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "case",
    [f"{f}_tp{tp}" for f in ("llama", "qwen2", "qwen3", "mistral", "phi3") for tp in (1, 2)]
    + ["llama_biases_tp2", "qwen2_window_tp2", "phi3_partial_rotary_tp2", "llama_hf_fsdp"],
)
def test_greedy_tokens_and_logprobs(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert r["inject"] == (case != "llama_hf_fsdp")
        assert r["greedy_equal"], (rank, case)
        if case == "llama_hf_fsdp":
            assert r["logprob_diff"] is None  # HF generate returns no rollout log-probs
        else:
            assert r["logprob_diff"] <= 1e-5, (rank, case, r["logprob_diff"])
        assert r["rows"] == 2 * (4 + rank)  # each rank gets back its own prompts × n


def test_training_after_generate_is_unchanged(results):
    for res in results:
        a, b = res["no_corruption"]
        assert a == b
