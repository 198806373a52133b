"""A PPO step's metrics.jsonl line from its experience (global means over ranks)."""

from __future__ import annotations

from typing import Dict

from rlhf.algorithms import ppo as ppo_math
from rlhf.engine.mesh import Mesh
from rlhf.rl.experience import Experience


def step_metrics(exp: Experience, train_s: float, mesh: Mesh) -> Dict[str, float]:
    """Rewards, KL, lengths, times and the rollout/training agreement of the step, before the KL
    controller's β and the update's statistics."""
    rows = exp.global_rows
    timings = exp.timings
    gen_s = timings.get("generate_s", 0.0)
    gen_tokens = mesh.sum(float(exp.mask.sum()))
    row = {
        "reward/mean": mesh.sum(float(exp.scores.sum())) / rows,
        "kl/mean": exp.kl_mean,
        "response/length": gen_tokens / rows,
        "time/generate_s": gen_s,
        "time/switch_s": timings.get("switch_s", 0.0),
        "time/score_s": exp.score_s,
        "time/train_s": train_s,
        "gen/tokens_per_s": gen_tokens / max(gen_s, 1e-9),
    }
    for name, part in {**exp.score_parts, **exp.watch}.items():
        row[f"reward/{name}"] = mesh.sum(float(part.sum())) / rows
    row.update(exp.extra_metrics)
    if exp.gold is not None:  # how the reward the policy optimises tracks the truth (reward hacking shows here)
        row["reward/gold"] = mesh.sum(float(exp.gold.sum())) / rows
        if "model" in exp.score_parts:
            row["reward/gold_corr"] = global_corr(exp.score_parts["model"], exp.gold, mesh)
    if exp.rollout_logprobs is not None:  # what the inference mode sampled with vs the training recompute
        tokens = max(gen_tokens, 1.0)
        diff = (exp.old_logprobs - exp.rollout_logprobs).abs() * exp.mask
        row["rollout/logprob_abs_diff_mean"] = mesh.sum(float(diff.sum())) / tokens
        row["rollout/logprob_abs_diff_max"] = max(mesh.all_gather_object(float(diff.max())))
        k3 = ppo_math.kl_penalty(exp.rollout_logprobs, exp.old_logprobs, "k3") * exp.mask  # KL(rollout ‖ train)
        row["rollout/kl"] = mesh.sum(float(k3.sum())) / tokens
    if exp.env_stats:  # multi-turn episodes (every generation of the step, dynamic sampling's too)
        row.update(episode_metrics(exp.env_stats, mesh))
    if exp.values is not None:
        row["values/explained_var"] = float(
            ppo_math.explained_variance(exp.values, exp.returns, exp.mask, all_reduce=mesh.all_reduce)
        )
    return row


def episode_metrics(stats: Dict[str, float], mesh: Mesh) -> Dict[str, float]:
    """Per episode, over every rank: turns, tool calls and their errors / timeouts / limits, the
    share that used a tool, failed or were cut, tokens by source; and the environment's seconds."""
    total = {k: mesh.sum(v) for k, v in sorted(stats.items())}
    n = max(total["rows"], 1.0)
    out = {f"env/{k}": total[k] / n for k in ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_limits")}
    out["env/tool_use"] = total["used_tools"] / n
    out["env/failed"] = total["failed"] / n
    out["env/truncated"] = total["truncated"] / n
    out["tokens/policy"] = total["tokens_policy"] / n
    out["tokens/observation"] = total["tokens_observation"] / n
    out["time/env_s"] = max(mesh.all_gather_object(stats["env_s"]))
    return out


def global_corr(x, y, mesh: Mesh) -> float:
    """Pearson correlation of x and y over every rank's rows (0 when either is constant)."""
    sums = [mesh.sum(float(v)) for v in (x.numel(), x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum())]
    n, sx, sy, sxx, syy, sxy = sums
    cov, vx, vy = sxy - sx * sy / n, sxx - sx * sx / n, syy - sy * sy / n
    if vx > 1e-12 and vy > 1e-12:
        return cov / (vx * vy) ** 0.5
    return 0.0
