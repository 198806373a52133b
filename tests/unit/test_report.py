"""summary.json (docs/contract.md keys) and report.png from a run directory's metrics."""

import json
import struct

from rlhf import report, summary


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in records) + '{"step": 9, "loss": 1.0', encoding="utf-8"
    )


def _png_size(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def _run(tmp_path):
    _write(
        tmp_path / "sft/metrics.jsonl",
        [{"step": s, "loss": 5.0 / (s + 1)} for s in range(1, 50)]
        + [{"step": 50, "eval/loss": 0.3, "gold/score": 0.4, "gold/score_greedy": 0.8}],
    )
    _write(
        tmp_path / "reward/metrics.jsonl",
        [{"step": s, "loss": 0.7 - s / 100, "accuracy": 0.5} for s in range(1, 30)]
        + [{"step": 30, "eval/accuracy": 0.95, "eval/loss": 0.2}],
    )
    _write(
        tmp_path / "ppo/metrics.jsonl",
        [{"step": 0, "gold/score": 0.4}]
        + [
            {
                "step": s,
                "reward/mean": s / 20,
                "kl/mean": s / 40,
                "time/train_s": 1.0,
                "time/generate_s": 0.1,
            }
            for s in range(1, 21)
        ]
        + [{"step": 20, "gold/score": 0.75, "gold/score_greedy": 0.9}],
    )
    return tmp_path


def test_summary_has_the_contract_keys_and_last_values(tmp_path, capsys):
    run = _run(tmp_path)
    summary.main(
        [
            str(run),
            "--seconds",
            "sft=1.5",
            "--seconds",
            "reward=2",
            "--seconds",
            "ppo=3",
            "--seconds",
            "total=6.5",
        ]
    )
    s = json.loads((run / "summary.json").read_text())
    assert s["sft"]["gold/score"] == 0.4 and s["sft"]["eval/loss"] == 0.3
    assert s["reward"]["eval/accuracy"] == 0.95
    assert (
        s["ppo"]["gold/score"] == 0.75
        and s["ppo"]["kl/mean"] == 0.5
        and s["ppo"]["reward/mean"] == 1.0
    )
    assert s["seconds"] == {"sft": 1.5, "reward": 2.0, "ppo": 3.0, "total": 6.5}
    out = capsys.readouterr().out
    assert "gold/score" in out and "report.png" in out
    # a fourth column: peak memory
    assert _png_size((run / "report.png").read_bytes()) == (2000, 800)


def test_report_draws_the_curves(tmp_path):
    full = report.render(_run(tmp_path / "full"))
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    # no stage ran yet: every panel says "no data", nothing crashes
    empty = report.render(empty_dir)
    assert _png_size(full) == _png_size(empty)
    # curves, legends and ticks add real content
    assert len(full) > len(empty) + 10_000
    series = report.read_series(tmp_path / "full/ppo/metrics.jsonl")
    assert series["gold/score"] == ([0, 20], [0.4, 0.75])  # the torn last line is skipped


def test_dpo_stage_in_summary_and_report(tmp_path, capsys):
    run = _run(tmp_path)
    _write(
        run / "dpo/metrics.jsonl",
        [
            {
                "step": 0,
                "eval/loss": 0.69,
                "eval/rewards/accuracy": 0.0,
                "eval/rewards/margin": 0.0,
                "gold/score": 0.4,
            }
        ]
        + [
            {
                "step": s,
                "loss": 0.7 - s / 100,
                "rewards/accuracy": 0.5 + s / 100,
                "rewards/margin": s / 10,
                "logps/chosen": -2.0,
                "logps/rejected": -2.0 - s,
            }
            for s in range(1, 30)
        ]
        + [
            {
                "step": 30,
                "eval/loss": 0.3,
                "eval/rewards/accuracy": 0.95,
                "eval/rewards/margin": 2.0,
                "eval/logps/chosen": -1.5,
                "eval/logps/rejected": -20.0,
                "gold/score": 0.7,
                "gold/score_greedy": 0.9,
            }
        ],
    )
    summary.main([str(run), "--seconds", "sft=1", "--seconds", "dpo=2"])
    s = json.loads((run / "summary.json").read_text())
    assert s["dpo"] == {
        "gold/score": 0.7,
        "gold/score_greedy": 0.9,
        "eval/rewards/accuracy": 0.95,
        "eval/rewards/margin": 2.0,
    }
    assert "dpo" in capsys.readouterr().out
    # a third row: the DPO curves
    assert _png_size((run / "report.png").read_bytes()) == (2000, 1200)


def test_report_draws_the_ensemble_disagreement_and_the_gate(tmp_path):
    run = _run(tmp_path)
    rows = [
        {"step": s, "reward/mean": s / 20, "kl/mean": s / 40, "reward/ensemble_std": 0.2 + s / 50}
        for s in range(1, 13)
    ]
    _write(
        run / "ppo/metrics.jsonl", rows + [{"step": 12, "gate/stopped": 1.0, "gate/best_step": 8.0}]
    )
    fig = report.figure(run)
    kl = [
        ax
        for ax in fig.axes
        if ax.get_title().startswith("PPO kl/mean, and the reward models' disagreement")
    ]
    assert len(kl) == 1
    labels = [ln.get_label() for ax in fig.axes for ln in ax.lines]
    assert "ensemble disagreement (std)" in labels and "the gate stopped the run" in labels


def test_memory_has_a_panel_per_stage_each_on_its_own_steps_and_every_title_fits(tmp_path):
    run = _run(tmp_path)
    for stage, steps in (("sft", 3000), ("reward", 1500), ("ppo", 80)):
        rows = [{"step": s, "mem/peak_gb": 0.5} for s in range(1, steps + 1, max(1, steps // 50))]
        path = run / stage / "metrics.jsonl"
        path.write_text(
            path.read_text().rsplit("\n", 1)[0] + "\n" + "".join(json.dumps(r) + "\n" for r in rows)
        )
    fig = report.figure(run)
    fig.canvas.draw()
    panels = {
        ax.get_title().split(":")[0]: ax for ax in fig.axes if "peak memory" in ax.get_title()
    }
    assert set(panels) == {"sft", "reward", "ppo"}
    assert panels["ppo"].get_xlim()[1] < 100 < panels["sft"].get_xlim()[1]
    assert all(ax.get_ylabel() == "GiB" for ax in panels.values())
    box = fig.bbox
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        t = ax.title.get_window_extent(renderer)
        assert box.x0 <= t.x0 and t.x1 <= box.x1 and t.y1 <= box.y1, ax.get_title()


def test_data_without_gold_get_the_held_out_reward_and_length_and_the_answers_side_by_side(
    tmp_path, capsys
):
    run = _run(tmp_path)
    rm = run / "reward/metrics.jsonl"
    rm.write_text(
        rm.read_text().rsplit("\n", 1)[0] + '\n{"step": 30, "eval/baseline_length": 0.44}\n'
    )
    evals = [
        {
            "step": s,
            "eval/reward_greedy": m,
            "eval/reward_greedy_std": 0.5,
            "eval/response_tokens_greedy": n,
        }
        for s, m, n in ((0, 0.1, 40.0), (10, 0.4, 38.0), (20, 0.9, 35.0))
    ]
    _write(
        run / "ppo/metrics.jsonl",
        [{"step": s, "reward/mean": s / 20} for s in range(1, 21)] + evals,
    )
    answers = [
        {
            "step": s,
            "kind": "eval_reward",
            "index": i,
            "prompt": f"\n\nHuman: q{i}|x\n\nAssistant:",
            "response": a,
        }
        | {"reward": r, "tokens": 3}
        for s, a, r in ((0, "old\nanswer", -0.25), (20, "new answer", 1.5))
        for i in (1, 0)
    ]
    answers.append(
        {"step": 20, "kind": "eval_greedy", "index": 0, "prompt": "p", "response": "r", "gold": 1.0}
    )
    _write(run / "ppo/samples.jsonl", answers)
    fig = report.figure(run)
    panel = [ax for ax in fig.axes if ax.get_title().startswith("Held-out greedy answers")]
    assert len(panel) == 1
    labels = [ln.get_label() for ax in fig.axes for ln in ax.lines]
    assert {"reward-model score", "answer tokens", "longer wins (0.440)"} <= set(labels)
    report.main([str(run)])
    assert "answers.md" in capsys.readouterr().out
    table = (run / "answers.md").read_text().splitlines()
    assert (
        table[0] == "# Held-out prompts: the policy at PPO step 0 (the SFT policy) and at step 20"
    )
    assert table[-2:] == [
        "| 0 | Human: q0\\|x<br><br>Assistant: | old<br>answer | -0.25 | new answer | 1.50 |",
        "| 1 | Human: q1\\|x<br><br>Assistant: | old<br>answer | -0.25 | new answer | 1.50 |",
    ]


def test_no_answers_table_without_two_evaluations_of_held_out_answers(tmp_path):
    run = _run(tmp_path)
    assert report.answers_table(run) is None  # no samples.jsonl
    row = {
        "step": 0,
        "kind": "eval_reward",
        "index": 0,
        "prompt": "p",
        "response": "r",
        "reward": 0.0,
    }
    _write(run / "ppo/samples.jsonl", [row])
    assert report.answers_table(run) is None
    report.write_report(run)
    assert not (run / "answers.md").exists()


def test_a_distilled_students_distance_to_its_teacher_is_drawn(tmp_path):
    run = _run(tmp_path)
    rows = [
        {"step": s, "reward/mean": -1 / s, "kl/mean": 0.0, "distill/reverse_kl_seq": 3.0 / s}
        for s in range(1, 9)
    ]
    _write(run / "ppo/metrics.jsonl", rows)
    fig = report.figure(run)
    (kl,) = [
        ax
        for ax in fig.axes
        if ax.get_title().startswith("PPO kl/mean, and the distance to the teacher")
    ]
    assert "reverse KL to the teacher" in [ln.get_label() for ln in kl.lines]


def test_asynchronous_rollouts_draw_the_trainer_and_the_worker_busy(tmp_path):
    run = _run(tmp_path)
    rows = [
        {"step": s, "reward/mean": 0.1, "kl/mean": 0.0, "time/train_s": 0.3, "async/wait_s": 0.2,
         "async/worker_idle_share": 0.1, "async/trainer_idle_share": 0.4}
        for s in range(1, 9)
    ]  # fmt: skip
    _write(run / "ppo/metrics.jsonl", rows)
    fig = report.figure(run)
    (times,) = [
        ax
        for ax in fig.axes
        if ax.get_title() == "PPO seconds per step; trainer and rollout worker busy"
    ]
    assert "trainer waiting for rollouts" in [ln.get_label() for ln in times.lines]
    (busy,) = [ax for ax in fig.axes if ax is not times and ax.bbox.bounds == times.bbox.bounds]
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in busy.lines}
    assert lines["worker busy"] == [0.9] * 8 and lines["trainer busy"] == [0.6] * 8


def test_a_moe_models_expert_load_is_drawn_per_layer(tmp_path):
    run = _run(tmp_path)
    rows = [
        {"step": s, "loss": 1.0 / s, "moe/load_max_mean": 1.5, "moe/load_max_mean/0": 1.2}
        | {"moe/load_max_mean/1": 1.8}
        for s in range(1, 9)
    ]
    _write(run / "sft/metrics.jsonl", rows)
    fig = report.figure(run)
    twins = [ax for ax in fig.axes if ax.get_ylabel() == "expert load, max ÷ mean"]
    assert len(twins) == 1 and len(twins[0].lines) == 3  # two layers and their mean
    assert max(twins[0].lines[1].get_ydata()) == 1.8
