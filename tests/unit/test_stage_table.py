"""rlhf.config.STAGE_TABLE is the one list of stages: a row added there is what the usage text,
config validation, compose, summary.json, report.png and scripts/run_all.sh's pipeline see."""

import json

import pytest

from rlhf import config as C
from rlhf import summary
from rlhf.errors import ConfigError


@pytest.fixture
def kto(monkeypatch):
    """A fifth stage, in the pipeline, that keeps eval/loss in summary.json."""
    monkeypatch.setattr(
        C,
        "STAGE_TABLE",
        C.STAGE_TABLE + (C.Stage("kto", pipeline=True, summary_keys=("eval/loss",)),),
    )


def test_the_table_as_it_is():
    assert C.stage_names() == ("sft", "reward", "ppo", "dpo")
    assert C.pipeline_stages() == ("sft", "reward", "ppo")
    assert C.stage_choices() == "sft, reward, ppo or dpo"


def test_a_row_is_what_every_list_of_stages_reads(kto, tmp_path, capsys):
    from rlhf.__main__ import main
    from rlhf.compose import choose_recipe, compose_config
    from rlhf.report import figure

    assert C.pipeline_stages() == ("sft", "reward", "ppo", "kto")  # scripts/run_all.sh's default
    main(["--help"])
    out = capsys.readouterr().out
    assert "python -m rlhf stage=sft|reward|ppo|dpo|kto [key=value ...]" in out
    # each stage in a line: stage=ppo runs the whole PPO family
    assert (
        "\n  ppo     RL: PPO, GRPO, RLOO, REINFORCE++ or distillation" in out and "\n  kto" in out
    )
    with pytest.raises(ConfigError, match=r"one of sft, reward, ppo, dpo, kto"):
        C.Config(stage="nope")
    with pytest.raises(
        ConfigError, match=r"unknown stage 'nope.*\(expected sft, reward, ppo, dpo or kto\)"
    ):
        compose_config(["stage=nope"])

    run = tmp_path / "run"
    (run / "kto").mkdir(parents=True)
    (run / "kto" / "config.yaml").write_text("recipe: pretrained\n", encoding="utf-8")
    # an earlier stage's saved config picks the recipe
    overrides, why = choose_recipe([f"run.dir={run}"])
    assert overrides[-1] == "recipe=pretrained" and "kto" in why
    (run / "kto" / "metrics.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in (
                {"step": 1, "loss": 1.0, "mem/peak_gb": 2.0},
                {"step": 2, "eval/loss": 0.5, "mem/peak_gb": 1.0},
            )
        ),
        encoding="utf-8",
    )
    assert summary.build_summary(run, {})["kto"] == {"eval/loss": 0.5, "mem/peak_gb": 2.0}
    fig = figure(run)
    panel = next(ax for ax in fig.axes if "peak memory" in ax.get_title())
    assert [ln.get_label() for ln in panel.lines] == ["kto"]
    import matplotlib.pyplot as plt

    plt.close(fig)
