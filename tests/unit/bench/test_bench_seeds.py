"""bench/seeds.py's validation mode: the unseen seeds it draws itself (outside the tuned ones), and
its lines per set (tuned / unseen) with min / median / max apart; bench/distill.py's time to the
target."""

from __future__ import annotations

import importlib.util
import json

from tests.conftest import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("bench_seeds", ROOT / "bench" / "seeds.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_unseen_seeds_are_drawn_from_the_key_outside_the_tuned_set():
    b = _bench()
    a = b.unseen_seeds(10, "abc123")
    assert a == b.unseen_seeds(10, "abc123")  # the same key draws the same seeds
    assert len(set(a)) == 10 and not set(a) & b.TUNED
    assert all(100 <= s < 10**6 for s in a)
    # another commit, other seeds (overwhelmingly)
    assert set(a).isdisjoint(b.unseen_seeds(10, "abc124"))
    assert {0, 1, 2, 3, 4, 5, 10, 1234, 801015, 789828} <= b.TUNED  # studied seeds are tuned ones


def test_lines_carry_their_set_and_summaries_per_set(tmp_path, monkeypatch, capsys):
    b = _bench()
    figs = {
        0: {"sft_gold": 0.5},
        3: {"sft_gold": 0.7},
        777: {"sft_gold": 0.2},
        888: {"sft_gold": 0.4},
    }
    monkeypatch.setattr(b, "run_stage", lambda stage, seed_dir, seed, *a, **k: 1.0)
    monkeypatch.setattr(b, "figures", lambda seed_dir, *a, **k: dict(figs[int(seed_dir.name[4:])]))
    monkeypatch.setattr(b, "unseen_seeds", lambda n, key: [777, 888][:n])
    monkeypatch.setattr(
        "sys.argv",
        [
            "seeds.py",
            "--seeds",
            "0",
            "3",
            "--unseen",
            "2",
            "--unseen-key",
            "k",
            "--stages",
            "sft",
            "--out",
            str(tmp_path),
        ],
    )
    b.main()
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    per_seed = {(x["variant"], x["set"]) for x in lines if x["variant"].startswith("seed")}
    assert per_seed == {
        ("seed0", "tuned"),
        ("seed3", "tuned"),
        ("seed777", "unseen"),
        ("seed888", "unseen"),
    }
    med = {
        x["set"]: x["value"]
        for x in lines
        if x["variant"] == "median" and x["metric"] == "sft_gold"
    }
    assert med == {"tuned": 0.6, "unseen": 0.3}


def test_distill_bench_counts_training_seconds_to_the_first_evaluation_at_the_target(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_distill", ROOT / "bench" / "distill.py")
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    lines = [
        {"step": 0, "gold/score": 0.2},
        {
            "step": 1,
            "reward/mean": 0.1,
            "time/generate_s": 1.0,
            "time/score_s": 0.5,
            "time/train_s": 2.0,
        },
        {
            "step": 2,
            "reward/mean": 0.2,
            "time/generate_s": 1.0,
            "time/switch_s": 0.5,
            "time/train_s": 2.0,
        },
        # an evaluation's line: not a step's time
        {"step": 2, "gold/score": 0.7, "time/train_s": 99.0},
        {"step": 3, "reward/mean": 0.3, "time/generate_s": 1.0, "time/train_s": 1.0},
        {"step": 3, "gold/score": 0.95},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    points = b.curve(metrics)
    assert points == [(0, 0.2, 0.0), (2, 0.7, 7.0), (3, 0.95, 9.0)]
    assert (
        b.seconds_to(points, 0.6) == 7.0
        and b.seconds_to(points, 0.9) == 9.0
        and b.seconds_to(points, 0.99) is None
    )


def test_distill_bench_on_a_recipe_needs_every_gold_at_its_target(tmp_path):
    """--recipe: the sampled and the greedy gold both at or above their targets."""
    spec = importlib.util.spec_from_file_location("bench_distill", ROOT / "bench" / "distill.py")
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    lines = [
        {"step": 0, "gold/score": 0.05, "gold/score_greedy": 0.3},
        {"step": 1, "reward/mean": 0.1, "time/generate_s": 2.0, "time/train_s": 3.0},
        {"step": 1, "gold/score": 0.6, "gold/score_greedy": 0.5},
        {"step": 2, "reward/mean": 0.1, "time/generate_s": 2.0, "time/train_s": 3.0},
        {"step": 2, "gold/score": 0.55, "gold/score_greedy": 0.65},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    points = b.curve(metrics, b.GOLDS)
    assert points == [(0, (0.05, 0.3), 0.0), (1, (0.6, 0.5), 5.0), (2, (0.55, 0.65), 10.0)]
    # step 1 misses the greedy target, step 2 meets both
    assert b.seconds_to(points, (0.55, 0.6)) == 10.0
    assert b.seconds_to(points, (0.6, 0.6)) is None


def test_distill_bench_takes_the_modes_own_distill_settings_unless_given():
    """--distill-set: the mode's measured default when absent, exactly what is given otherwise
    (nothing, when given empty)."""
    spec = importlib.util.spec_from_file_location("bench_distill", ROOT / "bench" / "distill.py")
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)

    class Args:
        distill_set = None

    assert b.distill_set(Args, b.EMBEDDED_DISTILL) == b.EMBEDDED_DISTILL
    assert "algorithm.gkd_beta=1" in b.EMBEDDED_DISTILL
    Args.distill_set = []
    assert b.distill_set(Args, b.RECIPE_DISTILL) == []
    Args.distill_set = ["train.lr=3e-5"]
    assert b.distill_set(Args, b.RECIPE_DISTILL) == ["train.lr=3e-5"]
