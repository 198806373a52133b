"""The commands rlhf.migrate prints run: three DeepSpeed-Chat-shaped launch scripts (steps 1, 2, 3;
tests/data/dschat/) migrated together on a user's model and DeepSpeed-Chat-style data (prompt /
chosen / rejected records, as Dahoas/rm-static), each printed command run as printed with only its
size cut (steps, held-out records) — then the two ds_config.json files' commands. The unmapped lists
are checked exactly in tests/unit/migrate/test_migrate.py."""

import json
import shlex

import pytest

from rlhf.data.records import read_examples
from tests.conftest import ROOT, TEST_DEVICE, run_cli, tool_cli

DSC = ROOT / "tests" / "data" / "dschat"
# the size of a test run; everything else is the printed command's
CUT = ["train.max_steps=2", "data.eval_size=16", "eval.gold_prompts=0", "logger.progress=false"]


def commands(*args) -> list:
    proc = tool_cli("migrate", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("python -m rlhf ")]
    return [shlex.split(ln)[3:] for ln in lines]


def run(words, *extra):
    proc = run_cli(*words, *CUT, *extra, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_three_dschat_scripts_migrate_and_run(user_model, real_data, tmp_path):
    pairs, _ = read_examples(str(real_data / "hh-rlhf" / "harmless-base-test.jsonl.gz"), "hh")
    data = tmp_path / "rm-static.jsonl"  # Dahoas/rm-static's columns
    data.write_text(
        "".join(
            json.dumps({"prompt": e.prompt, "chosen": e.chosen, "rejected": e.rejected}) + "\n"
            for e in pairs[:600]
        )
    )
    out = tmp_path / "output"
    sft, reward, ppo = commands(
        f"{DSC}/step1_sft.sh {user_model} {data} {out}/actor",
        f"{DSC}/step2_reward.sh {user_model} {data} {out}/reward",
        f"{DSC}/step3_ppo.sh {out}/actor {out}/reward {data} 3 3 {out}/step3",
    )
    log = run(sft)
    assert "recipe=dschat" in log
    assert (out / "actor" / "sft" / "model" / "config.json").is_file()
    # --enable_tensorboard
    assert any((out / "actor" / "tensorboard").rglob("events.out.tfevents.*"))
    run(reward)
    # a 2-step reward model is no judge: PPO's accuracy floor is lowered, nothing else
    log = run(ppo, "ppo.min_rm_accuracy=0")
    rows = [
        json.loads(x) for x in (out / "step3" / "ppo" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "actor/loss" in r]
    assert steps and all("critic/loss" in r for r in steps)  # GAE with a critic
    saved = (out / "step3" / "ppo" / "config.yaml").read_text()
    assert (
        "kl_coef: 0.1" in saved
        and "whiten_advantages: false" in saved
        and "precision: fp16" in saved
    )
    assert (out / "step3" / "ppo" / "actor_ema" / "config.json").is_file()  # --enable_ema


# ~60 s (fp16 on the CPU); the default run's representative: the three scripts above
@pytest.mark.slow
def test_ds_config_commands_run(tmp_path):
    """ZeRO-3 + fp16 runs as printed (the embedded task: no model given); ZeRO-2 + optimizer offload
    runs as printed on a GPU and, on the CPU, is refused with one line (there is nothing to offload
    to), then runs with the offload off."""
    (fp16,) = commands("--ds-config", str(DSC / "ds_config_zero3_fp16.json"), "--gpus", "1")
    # relative to where it runs: here, the test's directory
    assert "logger.tensorboard_dir=tb_logs/" in fp16
    run(fp16, f"run.dir={tmp_path / 'z3'}", f"logger.tensorboard_dir={tmp_path / 'tb_logs'}")
    assert any((tmp_path / "tb_logs" / "sft").glob("events.out.tfevents.*"))
    rows = [
        json.loads(x) for x in (tmp_path / "z3" / "sft" / "metrics.jsonl").read_text().splitlines()
    ]
    assert any("train/loss_scale" in r for r in rows)
    (offload,) = commands("--ds-config", str(DSC / "ds_config_zero2_offload.json"), "--gpus", "1")
    z2 = f"run.dir={tmp_path / 'z2'}"
    if TEST_DEVICE == "cuda":
        run(offload, z2)
        return
    proc = run_cli(*offload, *CUT, z2)
    assert proc.returncode == 2 and "engine.offload=cpu: this run trains on the CPU" in proc.stderr
    run(offload, z2, "engine.offload=none")
