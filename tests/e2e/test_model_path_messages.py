"""model.path that is not there, or not a whole model: one line that says which (exit 2), never the
hub's "couldn't connect to huggingface.co" for a local path, nor a message cut off mid-sentence."""

import json

import pytest

from tests.conftest import ROOT, run_cli


def no_tokenizer(tmp):
    """A directory with a model's config.json but no tokenizer files."""
    d = tmp / "config_only"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 100,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
            }
        )
    )
    return str(d)


CASES = [
    # a relative path under a directory that exists here reads as org/name, but is a missing run
    (
        "missing_relative_path",
        lambda tmp: "tests/no_such_run",
        "model.path=tests/no_such_run: no such directory",
    ),
    (
        "missing_deep_relative_path",
        lambda tmp: "runs/no_such_run/sft/model",
        "model.path=runs/no_such_run/sft/model: no such directory",
    ),
    # a hub id, offline, not in the cache
    (
        "hub_id_offline",
        lambda tmp: "no-such-org/no-such-model",
        "model.path=no-such-org/no-such-model: no such directory, and no hub model "
        "no-such-org/no-such-model in the "
        "local cache (working offline: HF_HUB_OFFLINE=1)",
    ),
    (
        "config_without_tokenizer",
        no_tokenizer,
        ": no tokenizer files (tokenizer.json / tokenizer_config.json / tokenizer.model / "
        "vocab.json / ...) in ",
    ),
]


@pytest.mark.parametrize("name, make_path, fragment", CASES, ids=[c[0] for c in CASES])
def test_model_path_error_is_one_complete_line(tmp_path, name, make_path, fragment):
    path = make_path(tmp_path)
    run = tmp_path / "run"
    proc = run_cli(
        "stage=sft",
        f"run.dir={run}",
        f"model.path={path}",
        "logger.progress=false",
        env={"HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr[-2000:]
    assert "huggingface.co" not in proc.stderr and "Traceback" not in proc.stderr
    if name == "config_without_tokenizer":
        assert errors[0] == f"rlhf: error: model.path={path}{fragment}{path}"
    else:
        assert not (ROOT / path).exists()
    assert not run.exists()
