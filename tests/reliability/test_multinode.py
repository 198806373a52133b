"""Two simulated nodes on loopback (two launchers, launcher.nnodes=2, one worker each) ≡ one node
with two workers: the same world, so the same numbers (fp32, one thread per rank)."""

import pytest

from tests.conftest import quick_sft_args
from tests.reliability.conftest import PPO_STEPS, one_node, two_nodes
from tests.reliability.helpers import Job, max_weight_diff, metrics, numbers

pytestmark = pytest.mark.distributed
# fp32; measured 0.0 (bit-identical) on this machine
TOL = 1e-6


def assert_same_numbers(a_rows, b_rows, keys):
    assert [r["step"] for r in a_rows] == [r["step"] for r in b_rows]
    for a, b in zip(a_rows, b_rows):
        for k in keys & a.keys():
            assert b[k] == pytest.approx(a[k], rel=TOL, abs=TOL), (a["step"], k, a[k], b[k])


def test_ppo_two_nodes_match_one_node(ppo_reference, ppo_two_nodes):
    run, ref = ppo_two_nodes.result(), ppo_reference.result()
    # rank 0 logs it
    assert "world_size=2" in "".join(j.log.read_text() for j in ppo_two_nodes.jobs)
    for name in ("actor", "critic"):
        diff = max_weight_diff(ref / "ppo" / name, run / "ppo" / name)
        print(f"ppo {name}: max |two nodes - one node| = {diff:.3g}")
        assert diff <= TOL, (name, diff)
    a, b = (
        numbers(metrics(ref / "ppo" / "metrics.jsonl")),
        numbers(metrics(run / "ppo" / "metrics.jsonl")),
    )
    assert len([r for r in a if "actor/loss" in r]) == PPO_STEPS
    assert_same_numbers(
        a, b, {"actor/loss", "critic/loss", "reward/mean", "kl/mean", "response/length"}
    )


def test_sft_two_nodes_match_one_node(tmp_path):
    def args(run_dir):
        return [
            *quick_sft_args(run_dir, steps=8),
            "train.save_every=0",
            "engine.threads_per_rank=1",
            "train.log_every=1",
        ]

    ref_dir, two_dir = tmp_path / "one_node", tmp_path / "two_nodes"
    ref = Job(*args(ref_dir), *one_node(2), log=tmp_path / "sft1n.txt")
    nodes = two_nodes(args(two_dir), tmp_path, "sft2n")
    for j in (ref, *nodes):
        assert j.wait(600) == 0, j.tail()
    diff = max_weight_diff(ref_dir / "sft" / "model", two_dir / "sft" / "model")
    print(f"sft: max |two nodes - one node| = {diff:.3g}")
    assert diff <= TOL
    a, b = (
        numbers(metrics(ref_dir / "sft" / "metrics.jsonl")),
        numbers(metrics(two_dir / "sft" / "metrics.jsonl")),
    )
    assert len([r for r in a if "loss" in r]) == 8
    assert_same_numbers(a, b, {"loss", "eval/loss", "grad_norm", "gold/score"})
