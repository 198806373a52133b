"""World-size invariance over whole short runs, and resume on another world size (fp32, gloo).

For each stage: the same run on 1 process and on 2 ranks (ZeRO-3) logs the same per-step metrics and
exports the same files with the same weights (within float-order noise); then the 2-rank run, cut
after its first checkpoint, resumes on 1 process and ends where the uninterrupted 1-process run
does, its steps after the resume seeing the same samples (their per-step losses / rewards equal the
uninterrupted run's step for step). PPO-GAE runs in the default suite; the other stages, 1 → 2 and
2 → 4 under ``-m slow``.
"""

import shutil

import pytest
from safetensors.torch import load_file

from tests.conftest import run_cli
from tests.reliability.helpers import numbers_by_step

pytestmark = pytest.mark.distributed

STEPS, SAVE = 6, 3
COMMON = (
    f"train.max_steps={STEPS}",
    f"train.save_every={SAVE}",
    "train.keep_checkpoints=4",
    f"train.eval_every={SAVE}",
    "logger.progress=false",
    "engine.precision=fp32",
    "engine.zero_stage=3",
    "eval.gold_prompts=8",
    "eval.gold_samples=2",
    "data.synthetic.num_records=2000",
)
RL = (
    "ppo.prompts_per_step=8",
    "ppo.samples_per_prompt=4",
    "ppo.ppo_epochs=2",
    "ppo.minibatches_per_epoch=2",
)
# stage → (the earlier stages it starts from, its overrides, the exported model directories)
STAGES = {
    "sft": ((), ("stage=sft", "train.warmup_steps=2"), ("model",)),
    "reward": (("sft",), ("stage=reward",), ("model",)),
    "dpo": (("sft",), ("stage=dpo",), ("model",)),
    "gae": (("sft", "reward"), ("stage=ppo", "ppo.min_rm_accuracy=0", *RL), ("actor", "critic")),
    "grpo": (
        ("sft",),
        (
            "stage=ppo",
            "algorithm.estimator=grpo",
            "ppo.use_reward_model=false",
            "ppo.reward_fn=rlhf.rewards.gold",
            *RL,
        ),
        ("actor",),
    ),
}
# GRPO without the KL term, its update over the rows with an advantage alone (ppo.update_rows=live:
# each rank leaves out its own, the micro-batch count agreed)
STAGES["grpo_live"] = (
    ("sft",),
    (*STAGES["grpo"][1], "algorithm.kl_coef=0", "ppo.update_rows=live"),
    ("actor",),
)
# the same with one update a step: the live rows' old log-probs from the update's own forward
STAGES["grpo_live_one"] = (
    ("sft",),
    (
        *(a for a in STAGES["grpo_live"][1] if not a.startswith(("ppo.ppo_epochs", "ppo.minib"))),
        "ppo.ppo_epochs=1",
        "ppo.minibatches_per_epoch=1",
    ),
    ("actor",),
)
# throughput and float noise (besides the timings)
NOISE = ("gen/", "perf/", "rollout/logprob_abs_diff")


def out_dir(run, stage: str):
    return run / ("ppo" if stage in ("gae", "grpo", "grpo_live", "grpo_live_one") else stage)


def run_stage(src, dst, stage: str, nproc: int, *extra):
    earlier, args, _ = STAGES[stage]
    if not dst.exists():
        dst.mkdir(parents=True)
        for name in earlier:
            shutil.copytree(src / name, dst / name)
    proc = run_cli(*args, f"run.dir={dst}", *COMMON, *extra, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def metrics(run, stage: str) -> dict:
    return numbers_by_step(out_dir(run, stage) / "metrics.jsonl", NOISE)


def exported(run, stage: str) -> dict:
    return {
        name: load_file(str(out_dir(run, stage) / name / "model.safetensors"))
        for name in STAGES[stage][2]
    }


def assert_same_run(got, ref, stage: str, after: int = -1) -> None:
    """Per-step metrics (steps > ``after``) within float-order noise, and the same exported tensors
    within 1e-5."""
    m, m_ref = metrics(got, stage), metrics(ref, stage)
    # (a resumed run also logs its first step)
    steps = [s for s in m_ref if s > after]
    assert steps and set(steps) <= set(m), (sorted(m), sorted(m_ref))
    for s in steps:
        assert m_ref[s].keys() <= m[s].keys(), (s, sorted(m_ref[s].keys() - m[s].keys()))
        for k, v in m_ref[s].items():
            assert abs(m[s][k] - v) <= 1e-5 + 1e-4 * abs(v), (stage, s, k, m[s][k], v)
    w, w_ref = exported(got, stage), exported(ref, stage)
    for name in w_ref:
        assert w[name].keys() == w_ref[name].keys(), (
            name,
            sorted(w[name].keys() ^ w_ref[name].keys()),
        )
        diff = max(float((w[name][k] - w_ref[name][k]).abs().max()) for k in w_ref[name])
        assert diff <= 1e-5, (stage, name, diff)


def cut_after_first_checkpoint(run, dst, stage: str) -> None:
    """``dst``: ``run`` as a job killed right after its first checkpoint would have left it (later
    checkpoints, the exports and done.json gone; metrics.jsonl keeps its later lines, which the
    resume drops)."""
    shutil.copytree(run, dst)
    out = out_dir(dst, stage)
    for ckpt in sorted((out / "checkpoints").iterdir())[1:]:
        shutil.rmtree(ckpt)
    for name in STAGES[stage][2]:
        shutil.rmtree(out / name)
    (out / "done.json").unlink()


@pytest.fixture(scope="module")
def runs(small_pipeline, tmp_path_factory):
    """stage → (1-process run, 2-rank run), made on first use."""
    root, made = tmp_path_factory.mktemp("world"), {}

    def get(stage: str):
        if stage not in made:
            one, two = root / f"{stage}_one", root / f"{stage}_two"
            run_stage(small_pipeline, one, stage, 1)
            run_stage(small_pipeline, two, stage, 2)
            made[stage] = (one, two)
        return made[stage]

    return get


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "stage",
    [
        "gae",
        *(
            pytest.param(s, marks=SLOW)
            for s in ("sft", "reward", "dpo", "grpo", "grpo_live", "grpo_live_one")
        ),
    ],
)
def test_two_ranks_follow_one_process_step_for_step(runs, stage):
    one, two = runs(stage)
    assert_same_run(two, one, stage)
    if stage.startswith("grpo_live"):  # rows were left out (each rank its own)
        skipped = [m.get("actor/rows_skipped", 0) for m in metrics(one, stage).values()]
        assert max(skipped) > 0, skipped


@pytest.mark.parametrize(
    "stage", ["gae", *(pytest.param(s, marks=SLOW) for s in ("sft", "reward", "dpo"))]
)
def test_a_two_rank_checkpoint_resumes_on_one_process(runs, stage, tmp_path, small_pipeline):
    one, two = runs(stage)
    cut = tmp_path / "cut"
    cut_after_first_checkpoint(two, cut, stage)
    proc = run_stage(small_pipeline, cut, stage, 1)
    assert (
        f"(step {SAVE})" in proc.stderr and "written by 2 processes, resumed on 1" in proc.stderr
    ), proc.stderr[-3000:]
    assert_same_run(cut, one, stage, after=SAVE)


@SLOW
@pytest.mark.parametrize("stage", ["gae", "dpo"])
def test_a_one_process_checkpoint_resumes_on_two_ranks(runs, stage, tmp_path, small_pipeline):
    one, two = runs(stage)
    cut = tmp_path / "cut"
    cut_after_first_checkpoint(one, cut, stage)
    proc = run_stage(small_pipeline, cut, stage, 2)
    assert "written by 1 process, resumed on 2" in proc.stderr, proc.stderr[-3000:]
    assert_same_run(cut, two, stage, after=SAVE)


@SLOW
def test_a_two_rank_checkpoint_resumes_on_four_ranks(runs, tmp_path, small_pipeline):
    """2 → 4 (PPO-GAE): against an uninterrupted 4-rank run."""
    _, two = runs("gae")
    four = tmp_path / "four"
    run_stage(small_pipeline, four, "gae", 4)
    assert_same_run(four, two, "gae")
    cut = tmp_path / "cut"
    cut_after_first_checkpoint(two, cut, "gae")
    proc = run_stage(small_pipeline, cut, "gae", 4)
    assert "written by 2 processes, resumed on 4" in proc.stderr, proc.stderr[-3000:]
    assert_same_run(cut, four, "gae", after=SAVE)
