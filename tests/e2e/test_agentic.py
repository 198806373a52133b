"""Agentic PPO through the CLI: a user's environment by dotted path plays multi-turn episodes
(metrics by turn and by token source); a broken environment is one line before any model loads, and
one that fails during the run stops it with exit 2 naming it."""

import json

import pytest

from tests.conftest import run_cli
from tests.e2e.test_reward_fn_errors import actor, error_lines, grpo  # noqa: F401 (fixture)

# the embedded task's turns, and tool results as 'R: ...' (the fixture's tokenizer has no template)
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}Q: {{ m['content'] }}\nA:"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}R: {{ m['content'] }}\nA:"
    "{% endif %}{% endfor %}"
)


@pytest.fixture
def template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    return f"data.chat_template={path}"


def metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "ppo" / "metrics.jsonl").read_text().splitlines()]


def test_a_users_environment_plays_several_turns(tmp_path, actor, template):  # noqa: F811
    # the environment's rewards alone (no reward model, no rule): it gives them
    env = ("env.name=tests.e2e.agent_envs.Echo", "env.max_turns=3", template)
    proc = run_cli(
        *grpo(tmp_path, actor, *env),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [m for m in metrics(tmp_path / "run") if "env/turns" in m]
    # a random model rarely stops within 4 tokens: turns end at max_new_tokens (cut) or go on for 3
    assert 1 <= row["env/turns"] <= 3 and row["tokens/policy"] > 0
    assert row["env/failed"] == 0 and "reward/env" in row and "reward/rule" not in row
    assert "the rewards are env.name=tests.e2e.agent_envs.Echo's alone" in proc.stderr
    if row["env/turns"] > 1:
        # the environment answered: its own info keys are metrics
        assert row["tokens/observation"] > 0
        assert (
            0 < row["env/echoes"] <= row["env/turns"]
            and 0 <= row["env/long_turns"] <= row["env/echoes"]
        )


@pytest.mark.parametrize(
    "env, says",
    [
        ("nosuch.Env", "env.name=nosuch.Env: cannot import nosuch"),
        ("tests.e2e.agent_envs.NoStep", "it has no step() method"),
        (
            "single",
            "env.name='single' is invalid: expected auto, single_turn or tools or a dotted path",
        ),
    ],
)
def test_a_broken_environment_is_one_line_before_any_model_loads(
    tmp_path,
    actor,  # noqa: F811
    env,
    says,
):
    proc = run_cli(
        *grpo(tmp_path, actor, f"env.name={env}", "ppo.reward_fn=rlhf.rewards.gold"), timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = error_lines(proc.stderr)
    assert says in line, line
    assert not (tmp_path / "run").exists()


def test_an_environment_that_raises_stops_the_run_naming_it(
    tmp_path,
    actor,  # noqa: F811
    template,
):
    env = (
        "env.name=tests.e2e.agent_envs.Flaky",
        "env.max_turns=2",
        "ppo.reward_fn=rlhf.rewards.gold",
        template,
    )
    # the environment steps on a turn that ended (EOS, 1 in 300 tokens of this random model): 32
    # rows of 64 tokens end some turns whatever the draws (4 rows of 4 tokens often end none), and
    # any failure stops
    cut = ("ppo.prompts_per_step", "ppo.samples_per_prompt", "ppo.max_new_tokens")
    args = [a for a in grpo(tmp_path, actor, *env) if not a.startswith(cut)]
    more = (
        "ppo.prompts_per_step=8",
        "ppo.samples_per_prompt=4",
        "ppo.max_new_tokens=64",
        "env.max_failed_share=0",
    )
    proc = run_cli(*args, *more, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    # (after the loading bars)
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("rlhf: error:")]
    assert "env.name=tests.e2e.agent_envs.Flaky:" in line and "episodes failed" in line, line
    assert "RuntimeError: the tool server is down" in line, line


def test_the_agentic_recipe_runs_sft_then_grpo_with_the_calculator(tmp_path):
    """recipe=agentic, sizes cut: SFT on tool_arith (its gold evaluation plays episodes with the
    calculator), then GRPO episodes; the learning itself is measured by bench/seeds.py."""
    run = tmp_path / "run"
    cut = [
        "logger.progress=false",
        "eval.gold_prompts=8",
        "eval.gold_samples=2",
        "data.synthetic.num_records=400",
    ]
    sft = run_cli(
        "stage=sft",
        "recipe=agentic",
        f"run.dir={run}",
        "train.max_steps=20",
        "train.eval_every=0",
        *cut,
    )
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert any("gold/tool_use" in m for m in metrics_of(run / "sft"))
    ppo = run_cli(
        "stage=ppo",
        f"run.dir={run}",
        "train.max_steps=2",
        "train.eval_every=0",
        "train.save_every=0",
        "ppo.prompts_per_step=4",
        *cut,
    )
    assert ppo.returncode == 0, ppo.stderr[-3000:]
    assert "recipe=agentic" in ppo.stderr and "ppo (grpo)" in ppo.stderr
    rows = metrics_of(run / "ppo")
    assert all(r["env/turns"] >= 1 for r in rows if "env/turns" in r) and any(
        "env/tool_use" in r for r in rows
    )
    assert any("gold/tool_use" in r for r in rows)


def metrics_of(stage_dir):
    return [json.loads(x) for x in (stage_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def other_teacher(actor, tmp_path):  # noqa: F811
    """The actor's weights moved by noise, with its tokenizer: a teacher that disagrees."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(actor)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    out = tmp_path / "teacher"
    shutil.copytree(actor, out)
    model.save_pretrained(out)
    return out


def test_a_teacher_scores_the_policys_tokens_of_multi_turn_episodes(
    tmp_path,
    actor,  # noqa: F811
    template,
    other_teacher,
):
    """On-policy distillation in multi-turn episodes: the teacher's per-token reward covers the
    policy's tokens alone (the environment's observations carry none): its per-sequence sum over its
    per-token mean is the policy tokens an episode."""
    env = ("env.name=tests.e2e.agent_envs.Echo", "env.max_turns=3", template)
    proc = run_cli(
        *grpo(tmp_path, actor, *env, f"ppo.teacher_path={other_teacher}", "ppo.distill_coef=0.5"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [m for m in metrics(tmp_path / "run") if "distill/reverse_kl" in m]
    assert abs(row["distill/reverse_kl"]) > 1e-3
    per_row = row["distill/reverse_kl_seq"] / row["distill/reverse_kl"]
    assert per_row == pytest.approx(row["tokens/policy"], rel=1e-4), row
    assert row["reward/distill"] == pytest.approx(-0.5 * row["distill/reverse_kl_seq"], rel=1e-5)
