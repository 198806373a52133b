"""The hybrid engine on 2 ranks (gloo) with a ZeRO-3 actor, inference_tp_size 1 and 2 (MoE
families: whole experts per TP rank; one with expert-parallel training weights)."""

import json
from pathlib import Path

import pytest

from tests.conftest import run_worker

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("hybrid_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid") / "out.json"
    run_worker(WORKER, str(out))
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "case",
    [
        f"{f}_tp{tp}"
        for f in ("llama", "qwen2", "qwen3", "mistral", "phi3", "qwen3_moe", "mixtral", "qwen2_moe")
        for tp in (1, 2)
    ]
    + ["llama_biases_tp2", "qwen2_window_tp2", "phi3_partial_rotary_tp2", "llama_hf_fsdp"]
    + ["mixtral_ep2_tp2"],
)
def test_greedy_tokens_and_logprobs(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert r["inject"] == (case != "llama_hf_fsdp")
        assert r["greedy_equal"], (rank, case)
        if case == "llama_hf_fsdp":
            # HF generate returns no rollout log-probs
            assert r["logprob_diff"] is None
        else:
            assert r["logprob_diff"] <= 1e-5, (rank, case, r["logprob_diff"])
        # each rank gets back its own prompts × n
        assert r["rows"] == 2 * (4 + rank)


def test_training_after_generate_is_unchanged(results):
    for res in results:
        a, b = res["no_corruption"]
        assert a == b
