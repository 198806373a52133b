"""A user's rule reward through the CLI: an import error is one line; a function that returns one
number for the whole batch, or raises on generated text, stops the run with exit 2 naming it."""

import re

import pytest

from tests.conftest import run_cli

LOG_LINE = re.compile(r"^\[\d\d:\d\d:\d\d rlhf\] ")  # the stage's own progress lines


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    """A tiny random Llama with a tokenizer (no SFT run needed: these runs stop at the rule
    reward)."""
    from tests.e2e.test_tokenizer_pad import raw_model

    return raw_model(tmp_path_factory.mktemp("actor") / "model")


def grpo(tmp_path, actor, *extra):
    return [
        "stage=ppo",
        f"run.dir={tmp_path / 'run'}",
        f"ppo.actor_path={actor}",
        "algorithm.estimator=grpo",
        "ppo.use_reward_model=false",
        "ppo.samples_per_prompt=2",
        "ppo.prompts_per_step=2",
        "ppo.max_new_tokens=4",
        "ppo.ppo_epochs=1",
        "ppo.minibatches_per_epoch=1",
        "train.max_steps=1",
        "train.save_every=0",
        "eval.gold_prompts=0",
        "logger.progress=false",
        "data.synthetic.num_records=200",
        "engine.precision=fp32",
        *extra,
    ]


def error_lines(stderr: str) -> list:
    """The non-empty stderr lines that are not the stage's progress log."""
    return [x for x in stderr.splitlines() if x.strip() and not LOG_LINE.match(x)]


def test_an_unimportable_reward_fn_is_one_line(tmp_path, actor):
    proc = run_cli(*grpo(tmp_path, actor, "ppo.reward_fn=nosuchmodule.fn"), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    # before: Hydra's own 'Error getting callable at nosuchmodule.fn : ...' (three lines) came first
    assert error_lines(proc.stderr) == [
        x for x in proc.stderr.splitlines() if "nosuchmodule" in x
    ], proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]  # the run's only line
    assert line.startswith("rlhf: error: ppo.reward_fn=nosuchmodule.fn: cannot import it: "), line
    assert not (tmp_path / "run").exists()


def test_one_number_for_the_batch_is_refused_before_the_run(tmp_path, actor):
    proc = run_cli(
        *grpo(tmp_path, actor, "ppo.reward_fn=tests.e2e.batch_reward.batch_mean"), timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert error_lines(proc.stderr) == [
        "rlhf: error: ppo.reward_fn=tests.e2e.batch_reward.batch_mean: it returned "
        "1 value for 2 responses; it must return one number per response (got [0.0])"
    ]


def test_a_reward_fn_raising_during_the_run_exits_2_naming_it(tmp_path, actor):
    proc = run_cli(
        *grpo(tmp_path, actor, "ppo.reward_fn=tests.e2e.batch_reward.fails_on_text"), timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("rlhf: error:")]
    assert re.match(
        r"rlhf: error: ppo\.reward_fn=tests\.e2e\.batch_reward\.fails_on_text: calling it "
        r"on a batch "
        r"of 4 responses failed: KeyError: .* at .*tests/e2e/batch_reward\.py:\d+$",
        line,
    ), line
