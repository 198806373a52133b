"""The kill matrix: each stage SIGKILLed at seeded points — mid-step (after an optimizer step,
before the step ends), mid-save (a checkpoint's shards written, its state file not), mid-export (the
model written into the export's temporary directory, not yet renamed) and, for the PPO family, right
after the switch to inference — then rerun: it resumes and ends bit for bit where the uninterrupted
run ends (fp32: every per-step metric but the timings, and every exported tensor). The kill is
injected at the n-th call of a function (tests/faults/fault_kill.py), not by a timer, so each point
is hit exactly. One cell runs in the default suite; the matrix under ``-m slow``.
"""

import shutil
import signal

import pytest
from safetensors.torch import load_file

from tests.conftest import fault_env, quick_sft_args, run_cli
from tests.reliability.helpers import numbers_by_step

STEP = "rlhf.engine.train:TrainEngine.step"  # an optimizer step
# the second checkpoint's shards are on disk
SAVE = "torch.distributed.checkpoint:save:2:after"
# the export's files, unrenamed
EXPORT = "transformers.modeling_utils:PreTrainedModel.save_pretrained:1:after"
# inference weights built, no token yet
SWITCH = "rlhf.engine.hybrid:HybridEngine.build_inference_model:4:after"
RL = (
    "train.max_steps=4",
    "train.save_every=2",
    "ppo.prompts_per_step=8",
    "ppo.samples_per_prompt=4",
    "ppo.ppo_epochs=2",
    "ppo.minibatches_per_epoch=2",
    "train.eval_every=2",
)
SUPERVISED = ("train.max_steps=8", "train.save_every=3", "train.eval_every=4")
# stage → (earlier stages copied in, overrides, exported model dirs, the mid-step call number)
STAGES = {
    "sft": ((), ("stage=sft",), ("model",), 5),
    "reward": (("sft",), ("stage=reward",), ("model",), 5),
    "dpo": (("sft",), ("stage=dpo",), ("model",), 5),
    "gae": (
        ("sft", "reward"),
        ("stage=ppo", "ppo.min_rm_accuracy=0", *RL),
        ("actor", "critic"),
        19,
    ),
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
        10,
    ),
}


def args(run, stage: str) -> list:
    # fp32, quick data and evaluation, no progress bars (not its stage / steps)
    base = quick_sft_args(run)[2:]
    extra = () if stage in ("gae", "grpo") else SUPERVISED
    return [
        *STAGES[stage][1],
        f"run.dir={run}",
        *[a for a in base if not a.startswith("train.max_steps")],
        *extra,
    ]


def out_dir(run, stage: str):
    return run / ("ppo" if stage in ("gae", "grpo") else stage)


def prepare(src, dst, stage: str):
    dst.mkdir(parents=True)
    for name in STAGES[stage][0]:
        shutil.copytree(src / name, dst / name)
    return dst


def numbers(run, stage: str) -> dict:
    return numbers_by_step(out_dir(run, stage) / "metrics.jsonl")


def assert_same_numbers(got: dict, want: dict) -> None:
    """Every number of the uninterrupted run, exactly (a resumed run also logs its first step)."""
    assert set(want) <= set(got), (sorted(got), sorted(want))
    for step, row in want.items():
        assert {k: got[step].get(k) for k in row} == row, step


def exported(run, stage: str) -> dict:
    return {
        n: load_file(str(out_dir(run, stage) / n / "model.safetensors")) for n in STAGES[stage][2]
    }


@pytest.fixture(scope="module")
def uninterrupted(small_pipeline, tmp_path_factory):
    root, made = tmp_path_factory.mktemp("kill_ref"), {}

    def get(stage: str):
        if stage not in made:
            run = prepare(small_pipeline, root / stage, stage)
            proc = run_cli(*args(run, stage))
            assert proc.returncode == 0, proc.stderr[-3000:]
            made[stage] = run
        return made[stage]

    return get


def points(stage: str) -> list:
    out = [
        ("mid-step", f"{STEP}:{STAGES[stage][3]}:after"),
        ("mid-save", SAVE),
        ("mid-export", EXPORT),
    ]
    if stage in ("gae", "grpo"):
        out.append(("switch", SWITCH))
    return out


CELLS = [(stage, name, point) for stage in STAGES for name, point in points(stage)]
FAST = {("grpo", "mid-save")}


@pytest.mark.parametrize(
    "stage,name,point",
    [
        pytest.param(*c, marks=() if c[:2] in FAST else pytest.mark.slow, id=f"{c[0]}-{c[1]}")
        for c in CELLS
    ],
)
def test_killed_at_a_seeded_point_resumes_bit_for_bit(
    uninterrupted, small_pipeline, tmp_path, stage, name, point
):
    ref = uninterrupted(stage)
    run = prepare(small_pipeline, tmp_path / "run", stage)
    killed = run_cli(*args(run, stage), env=fault_env("kill", point))
    assert killed.returncode == -signal.SIGKILL, (name, killed.returncode, killed.stderr[-2000:])
    assert not (out_dir(run, stage) / "done.json").exists()
    proc = run_cli(*args(run, stage))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_numbers(numbers(run, stage), numbers(ref, stage))
    got, want = exported(run, stage), exported(ref, stage)
    for model in want:
        assert got[model].keys() == want[model].keys()
        assert all(torch_equal(got[model][k], want[model][k]) for k in want[model]), (name, model)


def torch_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
