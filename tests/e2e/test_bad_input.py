"""Bad input → exit code 2, one line naming what and where, and an earlier good run left untouched.

One table: each case is (name, overrides built from a scratch context, fragment of the error line).
The fragment names WHAT is wrong and WHERE (file:line / file[row], or the config key). Every case
runs the real CLI against the run directory of an earlier good SFT run (or a fresh, never-created
one when the case is about a missing previous stage or an unusable directory); afterwards that
good run's files must be byte-identical and the fresh directory must not exist.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import quick_sft_args, run_cli, tree_digest


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("good") / "run"
    proc = run_cli(*quick_sft_args(run_dir, steps=5), "train.save_every=5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


@dataclass
class Ctx:
    # the earlier good run (has sft/ output and a checkpoint, no reward/)
    good: Path
    tmp: Path  # scratch space of this case

    @property
    def fresh(self) -> Path:
        """A run directory that does not exist (and must still not exist afterwards)."""
        return self.tmp / "fresh_run"

    def file(self, name: str, content) -> Path:
        p = self.tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        elif isinstance(content, list):  # records, one JSON line each
            p.write_text(
                "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in content)
            )
        else:
            p.write_text(content)
        return p

    def data(self, name: str, content, fmt: str, *more: str) -> list:
        return [
            f"run.dir={self.good}",
            f"data.path={self.file(name, content)}",
            f"data.format={fmt}",
            *more,
        ]

    def model_dir(self, config_text) -> Path:
        d = self.tmp / "model"
        d.mkdir(parents=True, exist_ok=True)
        if config_text is not None:
            (d / "config.json").write_text(config_text)
        return d


OK = {"prompt": "a", "response": "b"}
TRUNCATED_CONFIG = '{"model_type": "llama",'


def weak_reward_model(c: Ctx) -> list:
    """A run directory with the good SFT output and a reward model that ranks 0.7 of held-out pairs
    right."""
    run = c.tmp / "weak"
    (run / "reward" / "model").mkdir(parents=True)
    (run / "sft").symlink_to(c.good / "sft")
    shutil.copy(c.good / "sft" / "model" / "config.json", run / "reward" / "model" / "config.json")
    (run / "reward" / "model" / "reward_stats.json").write_text(
        json.dumps({"mean": 0, "std": 1, "eval/accuracy": 0.7})
    )
    return [f"run.dir={run}", "stage=ppo"]


def in_good(c: Ctx, *overrides: str) -> list:
    return [f"run.dir={c.good}", *overrides]


CASES = [
    # ---- data files: syntax ----
    (
        "broken_line",
        lambda c: c.data(
            "bad.jsonl",
            '{"prompt": "a", "response": "b"}\n{"prompt": "a", "response": \n',
            "prompt_response",
        ),
        "bad.jsonl:2: malformed JSON",
    ),
    (
        "non_utf8_bytes",
        lambda c: c.data(
            "latin1.jsonl",
            b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "b"}\n',
            "prompt_response",
        ),
        "latin1.jsonl:2: not valid UTF-8",
    ),
    (
        "malformed_json_array",
        lambda c: c.data(
            "broken.json", '[{"prompt": "a", "response": "b"},\n {"prompt": }]', "prompt_response"
        ),
        "broken.json:2: malformed JSON",
    ),
    (
        "record_not_an_object",
        lambda c: c.data("array.json", json.dumps([OK, 7]), "prompt_response"),
        "array.json[1]: expected a JSON object, got int",
    ),
    (
        "corrupt_gzip",
        lambda c: c.data("corrupt.jsonl.gz", b"not gzip at all", "prompt_response"),
        "corrupt.jsonl.gz: cannot read",
    ),
    (
        "empty_file",
        lambda c: c.data("empty.jsonl", "", "prompt_response"),
        "empty.jsonl: no records",
    ),
    (
        "dir_without_data_files",
        lambda c: in_good(
            c,
            f"data.path={c.file('empty_dir/notes.txt', 'x').parent}",
            "data.format=prompt_response",
        ),
        "empty_dir: directory holds no .jsonl",
    ),
    # ---- data files: records ----
    (
        "missing_field",
        lambda c: c.data("missing.jsonl", [OK, {"prompt": "a"}], "prompt_response"),
        "missing.jsonl:2: record has no field 'response'",
    ),
    (
        "prompt_is_number",
        lambda c: c.data("num.jsonl", [OK, {"prompt": 3, "response": "b"}], "prompt_response"),
        "num.jsonl:2: field 'prompt' must be a string, got int",
    ),
    (
        "prompt_is_list",
        lambda c: c.data("list.jsonl", [OK, {"prompt": ["a"], "response": "b"}], "prompt_response"),
        "list.jsonl:2: field 'prompt' must be a string, got list",
    ),
    (
        "empty_prompt",
        lambda c: c.data("blank.jsonl", [OK, {"prompt": "  ", "response": "b"}], "prompt_response"),
        "blank.jsonl:2: field 'prompt' is empty",
    ),
    (
        "gsm8k_answer_without_marker",
        lambda c: c.data("gsm.jsonl", [{"question": "1+1?", "answer": "2"}], "gsm8k"),
        "gsm.jsonl:1: field 'answer' does not end in '#### <number>'",
    ),
    (
        "hh_without_assistant_turn",
        lambda c: c.data(
            "hh.jsonl",
            [{"chosen": "\n\nHuman: hi", "rejected": "\n\nHuman: hi\n\nAssistant: no"}],
            "hh",
        ),
        "hh.jsonl:1: field 'chosen' has no '\\n\\nAssistant:' turn",
    ),
    # Prompts are truncated from the left by design (README); what truncation cannot fix is a
    # preference pair whose response alone exceeds data.max_response_len: every pair is dropped.
    (
        "response_longer_than_max",
        lambda c: c.data(
            "long.jsonl",
            [{"prompt": "x " * 300, "chosen": "yes " * 40, "rejected": "no " * 40}] * 20,
            "prompt_chosen_rejected",
            "stage=reward",
            "data.max_response_len=4",
        ),
        "longer than data.max_response_len=4",
    ),
    (
        "smaller_than_one_batch",
        lambda c: c.data(
            "small.jsonl",
            [{"prompt": f"p{i}", "response": "r"} for i in range(3)],
            "prompt_response",
        ),
        "small.jsonl): 3 training records, fewer than one batch (train.global_batch=64)",
    ),
    (
        "pairs_format_needed",
        lambda c: c.data("sft_only.jsonl", [OK] * 40, "prompt_response", "stage=reward"),
        "data.format=prompt_response has no preference pairs",
    ),
    # ---- data configuration ----
    ("unknown_format", lambda c: c.data("bad.jsonl", [OK], "csv"), "data.format='csv' is invalid"),
    ("bad_split", lambda c: in_good(c, "data.split='1,2'"), "data.split='1,2' is invalid"),
    (
        "bad_blend_weight",
        lambda c: in_good(
            c,
            f"data.sources=[{{path: {c.file('w.jsonl', [OK])}, format: prompt_response, "
            f"weight: -1}}]",
        ),
        "data.sources[].weight=-1.0 is invalid",
    ),
    (
        "bad_on_bad_record",
        lambda c: in_good(c, "data.on_bad_record=ignore"),
        "data.on_bad_record='ignore' is invalid",
    ),
    # ---- engine and model ----
    ("zero_stage_7", lambda c: in_good(c, "engine.zero_stage=7"), "engine.zero_stage=7 is invalid"),
    (
        "fp16_no_hysteresis",
        lambda c: in_good(c, "engine.precision=fp16", "engine.fp16.hysteresis=0"),
        "engine.fp16.hysteresis=0 is invalid",
    ),
    (
        "tp_not_dividing_world",
        lambda c: in_good(c, "engine.inference_tp_size=2"),
        "engine.inference_tp_size=2 does not divide the world size 1",
    ),
    (
        "heads_not_divisible_by_tp",
        lambda c: in_good(
            c,
            "engine.inference_tp_size=2",
            "model.num_heads=3",
            "model.hidden_size=96",
            "model.num_kv_heads=1",
        ),
        "model.num_heads=3 is invalid: expected a multiple of engine.inference_tp_size=2",
    ),
    (
        "model_path_missing",
        lambda c: in_good(c, "model.path=/nonexistent/model"),
        "model.path=/nonexistent/model: no such",
    ),
    (
        "model_dir_without_config",
        lambda c: in_good(c, f"model.path={c.model_dir(None)}"),
        "model: directory has no config.json",
    ),
    (
        "model_config_not_json",
        lambda c: in_good(c, f"model.path={c.model_dir(TRUNCATED_CONFIG)}"),
        "model: config.json is not valid JSON",
    ),
    (
        "unknown_model_family",
        lambda c: in_good(
            c, f"model.path={c.model_dir(json.dumps({'model_type': 'nosuchfamily'}))}"
        ),
        "unknown model family model_type='nosuchfamily'",
    ),
    # ---- stages and run directory ----
    (
        "reward_without_sft",
        lambda c: ["stage=reward", f"run.dir={c.fresh}"],
        "sft/model: run stage=sft first",
    ),
    (
        "ppo_without_sft",
        lambda c: ["stage=ppo", f"run.dir={c.fresh}"],
        "sft/model: run stage=sft first",
    ),
    (
        "ppo_without_reward",
        lambda c: in_good(c, "stage=ppo"),
        "reward/model: run stage=reward first",
    ),
    (
        "run_dir_below_a_file",
        lambda c: [f"run.dir={c.file('plain_file', 'x') / 'run'}"],
        "plain_file/run: not a writable directory (",
    ),
    (
        "run_dir_is_a_file",
        lambda c: [f"run.dir={c.file('plain_file', 'x')}"],
        "plain_file: not a writable directory (it exists and is not a directory)",
    ),
    # ---- contradictory settings ----
    (
        "not_divisible",
        lambda c: in_good(c, "train.global_batch=10", "train.micro_batch_per_rank=4"),
        "train.global_batch=10 is not divisible by train.micro_batch_per_rank=4",
    ),
    (
        "min_above_max_new_tokens",
        lambda c: in_good(c, "ppo.min_new_tokens=20", "ppo.max_new_tokens=4"),
        "ppo.min_new_tokens=20 is invalid: expected 0..ppo.max_new_tokens=4",
    ),
    (
        "data_path_with_synthetic_format",
        lambda c: in_good(c, f"data.path={c.file('d.jsonl', [OK])}"),
        "is set but data.format=synthetic",
    ),
    (
        "data_path_and_sources",
        lambda c: in_good(
            c,
            f"data.path={c.file('d.jsonl', [OK])}",
            "data.format=prompt_response",
            f"data.sources=[{{path: {c.tmp / 'd.jsonl'}, format: prompt_response}}]",
        ),
        "data.sources are both set",
    ),
    (
        "no_reward_model_and_no_rule",
        lambda c: in_good(c, "stage=ppo", "algorithm.estimator=grpo", "ppo.use_reward_model=false"),
        "ppo.use_reward_model=false needs another reward: a rule (ppo.reward_fn, e.g. "
        "rlhf.rewards.gold), a teacher",
    ),
    # ---- keys, types, values ----
    ("unknown_key", lambda c: in_good(c, "train.nonexistent=1"), "'train.nonexistent'"),
    ("wrong_type", lambda c: in_good(c, "train.max_steps=abc"), "train.max_steps=abc"),
    ("negative_lr", lambda c: in_good(c, "train.lr=-1"), "train.lr=-1.0 is invalid"),
    (
        "negative_max_steps",
        lambda c: in_good(c, "train.max_steps=-3"),
        "train.max_steps=-3 is invalid",
    ),
    ("unknown_stage", lambda c: in_good(c, "stage=foo"), "unknown stage 'foo'"),
    (
        "unknown_estimator",
        lambda c: in_good(c, "algorithm.estimator=foo"),
        "algorithm.estimator='foo' is invalid",
    ),
    (
        "unknown_reward_fn",
        lambda c: in_good(
            c,
            "stage=ppo",
            "algorithm.estimator=grpo",
            "ppo.use_reward_model=false",
            "ppo.reward_fn=rlhf.rewards.nope",
        ),
        "ppo.reward_fn=rlhf.rewards.nope: cannot import",
    ),
    # a reward function with the wrong signature or return: refused before any model is loaded
    (
        "reward_fn_signature",
        lambda c: in_good(
            c,
            "stage=ppo",
            "algorithm.estimator=grpo",
            "ppo.use_reward_model=false",
            "ppo.reward_fn=rlhf.rewards.resolve",
        ),
        "ppo.reward_fn=rlhf.rewards.resolve: it must take (responses, examples, fmt)",
    ),
    (
        "reward_fn_raises",
        lambda c: in_good(
            c,
            "stage=ppo",
            "algorithm.estimator=grpo",
            "ppo.use_reward_model=false",
            "ppo.reward_fn=tests.e2e.nan_reward.raises",
        ),
        "ppo.reward_fn=tests.e2e.nan_reward.raises: calling it on one record failed: KeyError",
    ),
    (
        "weak_reward_model",
        weak_reward_model,
        "held-out accuracy 0.700 (reward_stats.json) is below ppo.min_rm_accuracy=0.9",
    ),
    (
        "negative_token_budget",
        lambda c: in_good(c, "stage=reward", "train.max_tokens_per_micro_batch=-1"),
        "train.max_tokens_per_micro_batch=-1 is invalid: expected a non-negative integer (0 = off)",
    ),
    (
        "grpo_one_sample",
        lambda c: in_good(c, "stage=ppo", "algorithm.estimator=grpo", "ppo.samples_per_prompt=1"),
        "ppo.samples_per_prompt=1 is invalid for algorithm.estimator=grpo",
    ),
]


def test_the_table_is_large_and_unique():
    names = [c[0] for c in CASES]
    assert len(names) >= 20 and len(set(names)) == len(names)


@pytest.mark.parametrize("name, make_args, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_and_alters_nothing(good_run, tmp_path, name, make_args, fragment):
    ctx = Ctx(good=good_run, tmp=tmp_path)
    args = make_args(ctx)
    before = tree_digest(good_run)
    proc = run_cli(*args, "logger.progress=false", timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert tree_digest(good_run) == before
    assert not ctx.fresh.exists(), "a failed run created its run directory"


@pytest.mark.parametrize(
    "stage,key", [("sft", "engine.offload"), ("dpo", "engine.reference.offload")]
)
def test_offload_on_the_cpu_is_refused_not_ignored(stage, key, tmp_path):
    """engine.offload=cpu applies or stops the run: on the CPU there is nothing to offload (exit 2,
    one line naming the key), before any model loads or anything is written."""
    proc = run_cli(
        f"stage={stage}",
        f"run.dir={tmp_path / 'run'}",
        f"{key}=cpu",
        "train.max_steps=1",
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and f"{key}=cpu: this run trains on the CPU" in errors[0], proc.stderr[
        -2000:
    ]
    assert not (tmp_path / "run" / stage).exists()


def test_a_placement_for_a_model_the_stage_does_not_build_is_said_not_refused(tmp_path):
    """scripts/run_all.sh passes every override to every stage: SFT builds no critic, so
    engine.critic.offload=cpu (which the CPU would refuse for a critic) is reported unused."""
    proc = run_cli(
        *quick_sft_args(tmp_path / "run", steps=1),
        "engine.critic.offload=cpu",
        "train.save_every=0",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "engine.critic.* not used: stage=sft places no critic model here" in proc.stderr
