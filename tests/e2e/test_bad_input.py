"""Bad input → exit code 2, one line naming what and where, and an earlier good run left untouched."""
import pytest

from tests.conftest import quick_sft_args, run_cli, tree_digest


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("good") / "run"
    proc = run_cli(*quick_sft_args(run_dir, steps=5), "train.save_every=5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


def _files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a", "response": \n')
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    return bad, missing, empty


CASES = [
    ("broken_line", lambda b, m, e: [f"data.path={b}", "data.format=prompt_response"], "bad.jsonl:2: malformed JSON"),
    ("missing_field", lambda b, m, e: [f"data.path={m}", "data.format=prompt_response"],
     "missing.jsonl:2: record has no field 'response'"),
    ("empty_file", lambda b, m, e: [f"data.path={e}", "data.format=prompt_response"], "empty.jsonl: no records"),
    ("unknown_format", lambda b, m, e: [f"data.path={b}", "data.format=csv"], "data.format='csv' is invalid"),
    ("zero_stage_7", lambda b, m, e: ["engine.zero_stage=7"], "engine.zero_stage=7 is invalid"),
    ("model_path_missing", lambda b, m, e: ["model.path=/nonexistent/model"], "model.path=/nonexistent/model: no such"),
    ("not_divisible", lambda b, m, e: ["train.global_batch=10", "train.micro_batch_per_rank=4"], "not divisible"),
]


@pytest.mark.parametrize("name, make_args, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_and_alters_nothing(good_run, tmp_path, name, make_args, fragment):
    before = tree_digest(good_run)
    proc = run_cli(f"run.dir={good_run}", *make_args(*_files(tmp_path)), "logger.progress=false", timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert tree_digest(good_run) == before
