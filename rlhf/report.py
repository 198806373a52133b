"""report.png of a run: the curves of every stage that has metrics (docs/contract.md, run
    directory).

    python -m rlhf.report RUN_DIR            # writes RUN_DIR/report.png (and RUN_DIR/answers.md)

Panels: SFT loss (train and eval; a Mixture-of-Experts model's expert load per layer beside it);
reward-model loss and held-out accuracy beside its text-only
baselines; gold score (sampled, and greedy dashed) per PPO (and DPO) step with the SFT policy's gold
score as the baseline, and agentic runs' tool-use rate (rollouts and held-out episodes) on the same
axis — data without a gold rule get the reward model's score of held-out greedy answers and their
length there instead; peak memory of every stage (``mem/peak_gb``); PPO reward/mean, kl/mean (with a
reward-model ensemble's disagreement, a distilled student's reverse KL to its teacher, and where the
gate stopped the run) and seconds per PPO step. A run with a DPO
stage gets a third row: DPO loss, implicit-reward accuracy and margin, and the summed log-probs of
chosen and rejected responses (falling chosen log-probs are DPO's known failure). answers.md: the
held-out prompts PPO's evaluations kept, the SFT and the PPO policy's answers side by side.
scripts/run_all.sh writes both after summary.json.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from rlhf.config import stage_names
from rlhf.outputs.fileio import atomic_write_bytes

Series = Dict[str, Tuple[List[int], List[float]]]
# held-out prompts with the SFT and the PPO policy's answers side by side
ANSWERS_FILE = "answers.md"


def read_records(path: Path) -> List[dict]:
    """The records of a JSONL file (none if it is absent); unreadable lines (a crash mid-write) are
    skipped."""
    out = []
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_series(metrics_file: Path) -> Series:
    """key → (steps, values) from a metrics.jsonl (``read_records``)."""
    out: Series = {}
    for rec in read_records(metrics_file):
        step = rec.get("step")
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)):
                steps, vals = out.setdefault(k, ([], []))
                steps.append(step)
                vals.append(float(v))
    return out


def _plot(ax, series: Series, key: str, label: str, **kw) -> bool:
    if key not in series:
        return False
    steps, vals = series[key]
    ax.plot(steps, vals, label=label, **kw)
    return True


def render(run_dir: Path) -> bytes:
    """The PNG bytes of the report (matplotlib, headless)."""
    fig = figure(run_dir)
    # after figure(): the Agg backend is chosen there
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)  # 8-point legends legible at 100%
    plt.close(fig)
    return buf.getvalue()


def figure(run_dir: Path):
    """The report's matplotlib figure (its panels are its axes, named by their titles)."""
    # lazy: 0.5-0.8 s to import (measured); rlhf.summary --help and a summary without a report skip
    # it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # rlhf.config.STAGE_TABLE: every stage's peak memory; the panels of these four
    stages = stage_names()
    series = {s: read_series(run_dir / s / "metrics.jsonl") for s in stages}
    sft, rm, ppo, dpo = (series[s] for s in ("sft", "reward", "ppo", "dpo"))
    rows = 3 if dpo else 2
    fig = plt.figure(figsize=(20, 4 * rows))
    grid = fig.add_gridspec(rows, 4)
    axes = [[fig.add_subplot(grid[r, c]) for c in range(3)] for r in range(rows)]
    (a_sft, a_rm, a_gold), (a_rew, a_kl, a_time) = axes[:2]

    a_sft.set_title("SFT loss")
    _plot(a_sft, sft, "loss", "train")
    _plot(a_sft, sft, "eval/loss", "held-out", marker="o")
    a_sft.set_yscale("log")
    if "moe/load_max_mean" in sft:
        _moe_load(a_sft, sft)

    _rm_panel(a_rm, rm)
    _gold_panel(a_gold, sft, ppo, dpo)
    _reward_panel(a_rew, ppo)
    _kl_panel(a_kl, ppo)
    _time_panel(a_time, ppo)
    mem_axes = _memory_panels(fig, grid[:2, 3], series, stages)  # beside the first two rows
    if dpo:
        _dpo_row(axes[2], dpo)

    _finish(axes, mem_axes, a_rew, ppo)
    fig.suptitle(f"rlhf run: {run_dir}")
    fig.tight_layout()
    return fig


def _rm_panel(a_rm, rm: Series) -> None:
    """The reward model's training loss, and its held-out accuracy beside the text baselines'."""
    a_rm.set_title("Reward model")
    _plot(a_rm, rm, "loss", "train loss", alpha=0.6)
    if "eval/accuracy" in rm:
        acc = a_rm.twinx()
        _plot(acc, rm, "eval/accuracy", "held-out accuracy", color="tab:red", marker="o")
        acc.set_ylim(0, 1.03)
        acc.set_ylabel("held-out accuracy", color="tab:red")
        for key, label, style in (
            ("eval/baseline_length", "longer wins", ":"),
            ("eval/baseline_bag_of_words", "bag of words", "-."),
        ):
            if key in rm:
                acc.axhline(
                    rm[key][1][-1],
                    color="gray",
                    linestyle=style,
                    label=f"{label} ({rm[key][1][-1]:.3f})",
                )
        acc.legend(fontsize=8, loc="center right")


def _gold_panel(a_gold, sft: Series, ppo: Series, dpo: Series) -> None:
    """Held-out gold (sampled and greedy) of PPO and DPO against SFT's, tool use, or the reward
    model's held-out view where there is no gold rule."""
    if dpo:
        a_gold.set_title("Gold score on held-out prompts (PPO / DPO step)")
    else:
        a_gold.set_title("Gold score on held-out prompts (PPO step)")
    _plot(a_gold, ppo, "gold/score", "PPO, sampled", marker="o")
    _plot(a_gold, ppo, "gold/score_greedy", "PPO, greedy", linestyle="--", marker=".")
    _plot(a_gold, dpo, "gold/score", "DPO, sampled", marker="s", color="tab:brown")
    _plot(
        a_gold,
        dpo,
        "gold/score_greedy",
        "DPO, greedy",
        linestyle="--",
        marker=".",
        color="tab:olive",
    )
    if "gold/score" in sft:
        base = sft["gold/score"][1][-1]
        a_gold.axhline(base, color="gray", linestyle=":", label=f"SFT, sampled ({base:.3f})")
        a_gold.axhline(base + 0.3, color="green", linestyle=":", label="SFT + 0.3")
    if "gold/score_greedy" in sft:
        greedy = sft["gold/score_greedy"][1][-1]
        a_gold.axhline(greedy, color="gray", linestyle="-.", label=f"SFT, greedy ({greedy:.3f})")
    # agentic runs: how often the episodes call a tool (the rollouts', and the held-out episodes')
    _plot(a_gold, ppo, "env/tool_use", "tool use, rollouts", color="tab:cyan", alpha=0.8)
    _plot(
        a_gold,
        ppo,
        "gold/tool_use",
        "tool use, held-out",
        color="tab:cyan",
        marker="^",
        linestyle="none",
    )
    # a greedy gold of 1.0 stays visible above the frame line
    a_gold.set_ylim(0, 1.03)
    if "gold/score" not in ppo and "eval/reward_greedy" in ppo:
        # no gold rule: the reward model's view
        _heldout_reward(a_gold, ppo)


def _reward_panel(a_rew, ppo: Series) -> None:
    """PPO's reward against the rollouts' gold, and their correlation."""
    a_rew.set_title("PPO reward/mean, and how it tracks the gold rule")
    _plot(a_rew, ppo, "reward/mean", "reward/mean")
    _plot(a_rew, ppo, "reward/gold", "gold of the rollouts", color="tab:green")
    if "reward/gold_corr" in ppo:
        # falling correlation = the policy exploits the reward model's errors
        corr = a_rew.twinx()
        _plot(corr, ppo, "reward/gold_corr", "corr(reward model, gold)", color="tab:red", alpha=0.7)
        corr.set_ylim(-1, 1)
        corr.set_ylabel("correlation", color="tab:red")
        # one legend for both axes, on the twin (drawn above the reward axis, whose own legend it
        # hides)
        corr.legend(
            a_rew.lines + corr.lines,
            [ln.get_label() for ln in a_rew.lines + corr.lines],
            fontsize=8,
            loc="lower right",
        )


def _finish(axes: list, mem_axes: list, a_rew, ppo: Series) -> None:
    """Axis labels, legends ("no data" on an empty panel) and grids."""
    for ax in [ax for row in axes for ax in row] + mem_axes:
        # not the twin axes (their legends are set)
        if ax in mem_axes and ax.lines:  # the title names the stage and the axis
            ax.grid(alpha=0.3)
            continue
        ax.set_xlabel("step")
        if ax is a_rew and "reward/gold_corr" in ppo:
            # its lines are in the twin axis's legend
            continue
        if ax.lines:
            ax.legend(fontsize=8, loc="best")
        else:
            ax.text(
                0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray"
            )
        ax.grid(alpha=0.3)


def _moe_load(ax, sft: Series) -> None:
    """A Mixture-of-Experts SFT: each MoE layer's expert load (max ÷ mean tokens per expert, 1 =
    balanced) on a twin axis of the loss panel, the layers' mean bold."""
    load = ax.twinx()
    layers = sorted(
        (k for k in sft if k.startswith("moe/load_max_mean/")), key=lambda k: int(k.rsplit("/")[-1])
    )
    for k in layers:
        _plot(load, sft, k, "", color="tab:purple", alpha=0.25, linewidth=0.8)
    _plot(
        load, sft, "moe/load_max_mean", "expert load, max ÷ mean (layers thin)", color="tab:purple"
    )
    load.set_ylabel("expert load, max ÷ mean", color="tab:purple")
    load.legend(load.lines[-1:], [load.lines[-1].get_label()], fontsize=8, loc="upper right")


def _time_panel(ax, ppo: Series) -> None:
    """PPO's seconds per step by phase; with asynchronous rollouts the trainer's and the worker's
    busy shares over time on a twin axis (1 − their idle shares)."""
    ax.set_title("PPO seconds per step")
    for key, label in (
        ("time/generate_s", "generate"),
        ("time/score_s", "score"),
        ("time/train_s", "train"),
        ("time/switch_s", "switch"),
        ("time/env_s", "environment"),
        ("async/wait_s", "trainer waiting for rollouts"),
    ):
        _plot(ax, ppo, key, label)
    if "async/worker_idle_share" in ppo:
        ax.set_title("PPO seconds per step; trainer and rollout worker busy")
        busy = ax.twinx()
        for key, label, color in (
            ("async/trainer_idle_share", "trainer busy", "black"),
            ("async/worker_idle_share", "worker busy", "tab:red"),
        ):
            if key in ppo:
                steps, idle = ppo[key]
                busy.plot(steps, [1 - x for x in idle], label=label, color=color, linestyle=":")
        busy.set_ylim(0, 1.03)
        busy.set_ylabel("busy share", color="tab:red")
        busy.legend(fontsize=8, loc="center right")


def _kl_panel(ax, ppo: Series) -> None:
    """PPO's KL to the reference per step, with what watches over-optimisation beside it: a
    reward-model ensemble's disagreement, a distilled student's reverse KL to its teacher, where the
    gate stopped."""
    ax.set_title("PPO kl/mean (nats per response)")
    _plot(ax, ppo, "kl/mean", "kl/mean", color="tab:purple")
    if "reward/ensemble_std" in ppo:
        # the reward models' disagreement: over-optimisation without gold
        ax.set_title("PPO kl/mean, and the reward models' disagreement")
        dis = ax.twinx()
        _plot(dis, ppo, "reward/ensemble_std", "ensemble disagreement (std)", color="tab:orange")
        dis.set_ylabel("members' std (normalised)", color="tab:orange")
        dis.legend(fontsize=8, loc="center right")
    if "distill/reverse_kl_seq" in ppo:
        # on-policy distillation: the student's distance to its teacher
        ax.set_title("PPO kl/mean, and the distance to the teacher (nats per response)")
        _plot(ax, ppo, "distill/reverse_kl_seq", "reverse KL to the teacher", color="tab:brown")
    if "gate/stopped" in ppo:
        ax.axvline(
            ppo["gate/stopped"][0][0], color="red", linestyle=":", label="the gate stopped the run"
        )


def _heldout_reward(ax, ppo: Series) -> None:
    """Data without a gold rule: the reward model's score of the greedy answers to held-out prompts
    (± its spread over them) and, on a twin axis, their mean length (a score that rises with the
    length alone is length hacking)."""
    ax.set_title("Held-out greedy answers: reward-model score, length (PPO step)")
    steps, mean = ppo["eval/reward_greedy"]
    _plot(ax, ppo, "eval/reward_greedy", "reward-model score", marker="o", color="tab:blue")
    if "eval/reward_greedy_std" in ppo and len(ppo["eval/reward_greedy_std"][1]) == len(mean):
        std = ppo["eval/reward_greedy_std"][1]
        lo, hi = [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)]
        ax.fill_between(steps, lo, hi, color="tab:blue", alpha=0.15, label="± std over the prompts")
    ax.set_ylim(auto=True)
    ax.relim()
    ax.autoscale()
    if "eval/response_tokens_greedy" in ppo:
        length = ax.twinx()
        _plot(
            length,
            ppo,
            "eval/response_tokens_greedy",
            "answer tokens",
            color="tab:gray",
            marker="s",
        )
        length.set_ylabel("mean answer tokens", color="tab:gray")
        length.set_ylim(bottom=0)
        length.legend(fontsize=8, loc="lower right")


def answers_table(run_dir: Path) -> Optional[str]:
    """Markdown: each held-out prompt kept by PPO's evaluations (samples.jsonl, kind
    ``eval_reward``) with the greedy answer of the policy PPO started from (its first evaluation:
    the SFT policy) beside its last one's, and the reward model's score of each; None without two
    such evaluations."""
    rows: Dict[int, Dict[int, dict]] = {}
    for rec in read_records(run_dir / "ppo" / "samples.jsonl"):
        if rec.get("kind") == "eval_reward":
            rows.setdefault(rec["step"], {})[rec["index"]] = rec
    if len(rows) < 2:
        return None
    first, last = min(rows), max(rows)
    out = [
        f"# Held-out prompts: the policy at PPO step {first} (the SFT policy) and at step {last}",
        "",
        "Greedy answers; score: the reward model's (normalised as in training). From "
        "ppo/samples.jsonl.",
        "",
        f"| # | prompt (its end) | step {first} answer | score | step {last} answer | score |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i in sorted(set(rows[first]) & set(rows[last])):
        a, b = rows[first][i], rows[last][i]
        cells = (
            _cell(a["prompt"][-300:]),
            _cell(a["response"]),
            f"{a['reward']:.2f}",
            _cell(b["response"]),
        )
        out.append(f"| {i} | " + " | ".join(cells) + f" | {b['reward']:.2f} |")
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    """``text`` in one Markdown table cell."""
    return text.strip().replace("|", "\\|").replace("\n", "<br>")


def _memory_panels(fig, cell, series: dict, stages) -> list:
    """Peak memory in ``cell``: one panel per stage that logged it, each on its own steps (the
    axes)."""
    mem_stages = [st for st in stages if "mem/peak_gb" in series[st]] or [None]
    cells = cell.subgridspec(len(mem_stages), 1, hspace=0.7)
    axes = []
    for i, st in enumerate(mem_stages):
        ax = fig.add_subplot(cells[i, 0])
        axes.append(ax)
        if st is None:
            ax.set_title("Peak memory of rank 0")
            continue
        _plot(ax, series[st], "mem/peak_gb", st, marker=".")
        ax.set_title(f"{st}: peak memory of rank 0 by step", fontsize=10)
        ax.set_ylabel("GiB")
        ax.set_ylim(0, 1.1 * max(series[st]["mem/peak_gb"][1]) or 1.0)
    return axes


def _dpo_row(row, dpo: Series) -> None:
    a_loss, a_acc, a_lp = row
    a_loss.set_title("DPO loss")
    _plot(a_loss, dpo, "loss", "train", alpha=0.6)
    _plot(a_loss, dpo, "eval/loss", "held-out", marker="o")
    a_acc.set_title("DPO implicit rewards: accuracy (margin, right axis)")
    _plot(a_acc, dpo, "rewards/accuracy", "train accuracy", alpha=0.6)
    _plot(a_acc, dpo, "eval/rewards/accuracy", "held-out accuracy", marker="o")
    a_acc.set_ylim(0, 1.03)
    if "rewards/margin" in dpo:
        margin = a_acc.twinx()
        _plot(margin, dpo, "rewards/margin", "train margin", color="tab:red", alpha=0.5)
        _plot(margin, dpo, "eval/rewards/margin", "held-out margin", color="tab:red", marker="o")
        margin.set_ylabel("margin β·(log-ratio chosen − rejected)", color="tab:red")
        margin.legend(fontsize=8, loc="center right")
    a_lp.set_title("DPO policy log-probs of the responses (summed)")
    _plot(a_lp, dpo, "logps/chosen", "chosen", color="tab:green", alpha=0.6)
    _plot(a_lp, dpo, "logps/rejected", "rejected", color="tab:red", alpha=0.6)
    _plot(a_lp, dpo, "eval/logps/chosen", "held-out chosen", color="tab:green", marker="o")
    _plot(a_lp, dpo, "eval/logps/rejected", "held-out rejected", color="tab:red", marker="o")


def write_report(run_dir: Path) -> Path:
    """report.png, and answers.md where PPO's evaluations kept held-out answers to set side by
    side."""
    out = run_dir / "report.png"
    atomic_write_bytes(out, render(run_dir))
    table = answers_table(run_dir)
    if table is not None:
        atomic_write_bytes(run_dir / ANSWERS_FILE, table.encode("utf-8"))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rlhf.report")
    ap.add_argument("run_dir", type=Path)
    args = ap.parse_args(argv)
    print(f"report: {write_report(args.run_dir)}")
    if (args.run_dir / ANSWERS_FILE).is_file():
        print(f"answers: {args.run_dir / ANSWERS_FILE}")


if __name__ == "__main__":
    main()
