"""A PPO step's metrics.jsonl line from its experience (global means over ranks)."""

from __future__ import annotations

from typing import Dict, List, Optional

from rlhf.algorithms import ppo as ppo_math
from rlhf.data.chat import shown_prompt
from rlhf.engine.mesh import Mesh
from rlhf.rl.episodes import INFO
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
    if "judge_s" in timings:
        # the generative judge's forwards (part of time/score_s)
        row["time/judge_s"] = timings["judge_s"]
    for name, part in {**exp.score_parts, **exp.watch}.items():
        if name == "judge_failed":
            # a generative judge's answers without a readable score, over every rank
            row["judge/parse_failures"] = mesh.sum(float(part.sum()))
            continue
        row[f"reward/{name}"] = mesh.sum(float(part.sum())) / rows
    row.update(exp.extra_metrics)
    if exp.gold is not None:
        # how the reward the policy optimises tracks the truth (reward hacking shows here)
        row["reward/gold"] = mesh.sum(float(exp.gold.sum())) / rows
        if "model" in exp.score_parts:
            row["reward/gold_corr"] = global_corr(exp.score_parts["model"], exp.gold, mesh)
    # the tokens sampled by the weights being updated
    fresh = exp.mask
    if exp.staleness is not None:
        # asynchronous rollouts: how old the sampling weights were
        row.update(staleness_metrics(exp.staleness, exp.mask, mesh))
        fresh = exp.mask * (exp.staleness == 0).float()
    if exp.scored_rows is not None:
        # the rows the update trains on alone were recomputed
        fresh = fresh * exp.scored_rows[:, None].float()
    if exp.rollout_logprobs is not None:
        # what the inference mode sampled with vs the training recompute
        tokens = mesh.sum(float(fresh.sum()))
        if tokens:
            # (older weights' tokens differ by the updates since: not parity)
            diff = (exp.old_logprobs - exp.rollout_logprobs).abs() * fresh
            row["rollout/logprob_abs_diff_mean"] = mesh.sum(float(diff.sum())) / tokens
            row["rollout/logprob_abs_diff_max"] = max(mesh.all_gather_object(float(diff.max())))
            # KL(rollout ‖ train)
            k3 = ppo_math.kl_penalty(exp.rollout_logprobs, exp.old_logprobs, "k3") * fresh
            row["rollout/kl"] = mesh.sum(float(k3.sum())) / tokens
    if exp.env_stats:
        # multi-turn episodes (every generation of the step, dynamic sampling's too)
        row.update(episode_metrics(exp.env_stats, mesh))
    if exp.values is not None:
        row["values/explained_var"] = float(
            ppo_math.explained_variance(
                exp.values, exp.returns, exp.mask, all_reduce=mesh.all_reduce
            )
        )
    return row


def staleness_metrics(stale, mask, mesh: Mesh) -> Dict[str, float]:
    """``async/staleness_mean`` (per policy token) and ``_max`` (the oldest token) over every rank,
    and ``async/tokens_lag<j>``: the policy tokens sampled by weights j updates old, per row."""
    tokens, rows = mesh.sum(float(mask.sum())), mesh.sum(float(mask.shape[0]))
    out = {
        "async/staleness_mean": mesh.sum(float(stale.sum())) / max(tokens, 1.0),
        "async/staleness_max": max(
            mesh.all_gather_object(float(stale.max()) if stale.numel() else 0.0)
        ),
    }
    lags = int(out["async/staleness_max"])
    for j in range(lags + 1):
        out[f"async/tokens_lag{j}"] = mesh.sum(float(((stale == j).float() * mask).sum())) / max(
            rows, 1.0
        )
    return out


def episode_metrics(stats: Dict[str, float], mesh: Mesh) -> Dict[str, float]:
    """Per episode, over every rank: turns, tool calls and their errors / timeouts / limits, the
    share that used a tool, failed or were cut, tokens by source; and the environment's seconds."""
    keys = sorted(stats)
    if mesh.distributed:
        # an environment's own keys: the ranks' rows may not all have had them
        keys = sorted({k for part in mesh.all_gather_object(keys) for k in part})
    total = {k: mesh.sum(stats.get(k, 0.0)) for k in keys}
    n = max(total["rows"], 1.0)
    out = {
        f"env/{k}": total[k] / n
        for k in ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_limits")
    }
    for k in keys:
        if k.startswith(INFO):
            # the environment's own info keys, per episode
            out.setdefault(f"env/{k[len(INFO) :]}", total[k] / n)
    out["env/tool_use"] = total["used_tools"] / n
    out["env/failed"] = total["failed"] / n
    out["env/truncated"] = total["truncated"] / n
    out["tokens/policy"] = total["tokens_policy"] / n
    out["tokens/observation"] = total["tokens_observation"] / n
    out["time/env_s"] = max(mesh.all_gather_object(stats["env_s"]))
    return out


def global_corr(x, y, mesh: Mesh) -> float:
    """Pearson correlation of x and y over every rank's rows (0 when either is constant)."""
    sums = [
        mesh.sum(float(v))
        for v in (x.numel(), x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum())
    ]
    n, sx, sy, sxx, syy, sxy = sums
    cov, vx, vy = sxy - sx * sy / n, sxx - sx * sx / n, syy - sy * sy / n
    if vx > 1e-12 and vy > 1e-12:
        return cov / (vx * vy) ** 0.5
    return 0.0


def rollout_samples(exp: Experience, n: int, chat: Optional[str] = None) -> List[dict]:
    """This rank's first ``n`` rollouts of a step for samples.jsonl: prompt (``shown_prompt``
    under the chat template ``chat``), response, the reward and its parts, the advantage (mean over
    the response's tokens), the gold score and reference where the data has them."""
    rows = []
    for i in range(min(n, len(exp.texts), len(exp.examples))):
        e, m = exp.examples[i], exp.mask[i]
        row = {
            "prompt": shown_prompt(e, chat),
            "response": exp.texts[i],
            "reward": float(exp.scores[i]),
            "parts": {k: float(v[i]) for k, v in exp.score_parts.items()},
            "advantage": float((exp.advantages[i] * m).sum() / m.sum().clamp(min=1.0)),
            "tokens": int(m.sum()),
        }
        if exp.gold is not None:
            row["gold"], row["reference"] = float(exp.gold[i]), e.reference
        rows.append(row)
    return rows


def reward_line(row: Dict[str, float], parts: List[str]) -> str:
    """The progress line's reward: its mean, and what it is made of where it has several parts
    (``-0.844 (rule 0.125, overlong -0.969)``)."""
    mean = f"{row['reward/mean']:.3f}"
    if len(parts) < 2:
        return mean
    return mean + " (" + ", ".join(f"{p} {row[f'reward/{p}']:.3f}" for p in parts) + ")"
