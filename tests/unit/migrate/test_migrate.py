"""rlhf.migrate: DeepSpeed-Chat launch scripts and ds_config.json files → rlhf command lines, and
the exact list of what has no target (tests/data/dschat/: scripts and configs shaped like
DeepSpeed-Chat's, written for these tests). The printed commands run: tests/e2e/test_migrate.py."""

import json
import shlex

import pytest

from rlhf.compose import compose_config
from rlhf.errors import UserError
from rlhf.migrate.__main__ import main, migrate
from rlhf.migrate.ds_config import CONFIG_TABLE, apply_config
from rlhf.migrate.flags import FLAG_TABLE
from rlhf.migrate.plan import KINDS, Plan
from rlhf.migrate.script import read_script
from tests.conftest import ROOT

DSC = ROOT / "tests" / "data" / "dschat"


def overrides(plan: Plan) -> list:
    return shlex.split(plan.command())[3:]


def unmapped(plan: Plan) -> set:
    return {u.what.split()[0] if u.what.startswith("--") else u.what for u in plan.unmapped}


def three(data="data.jsonl"):
    return migrate(
        [
            f"{DSC}/step1_sft.sh base {data} out/actor",
            f"{DSC}/step2_reward.sh base {data} out/reward",
            f"{DSC}/step3_ppo.sh out/actor out/reward {data} 3 2 out/step3",
        ]
    )


def test_scripts_become_stage_commands_that_compose(tmp_path):
    (tmp_path / "data.jsonl").write_text("{}\n")
    sft, reward, ppo = three(str(tmp_path / "data.jsonl"))
    assert [p.stage for p in (sft, reward, ppo)] == ["sft", "reward", "ppo"]
    for plan in (sft, reward, ppo):
        cfg, _ = compose_config([f"stage={plan.stage}"] + overrides(plan))
        assert cfg.recipe == "dschat" and cfg.data.split == "2,4,4"
        assert cfg.data.format == "prompt_chosen_rejected" and cfg.data.path == str(
            tmp_path / "data.jsonl"
        )
    c, _ = compose_config(["stage=sft"] + overrides(sft))
    # --per_device_train_batch_size 4 × 1 GPU × --gradient_accumulation_steps 2
    assert (c.train.micro_batch_per_rank, c.train.global_batch) == (4, 8)
    assert (c.train.lr, c.train.weight_decay, c.train.scheduler, c.train.min_lr_ratio) == (
        9.65e-6,
        0.0,
        "cosine",
        0.0,
    )
    assert (c.data.max_prompt_len, c.data.max_response_len) == (128, 128)  # --max_seq_len 256
    assert (
        c.engine.precision == "bf16"
        and c.engine.zero_stage == 2
        and c.engine.activation_checkpointing
    )
    assert (
        c.run.dir == "out/actor"
        and c.model.path == "base"
        and c.train.epochs == 1
        and c.train.max_steps is None
    )
    # DeepSpeed-Chat's SFT loss: every token
    assert c.logger.tensorboard and c.data.mask_prompt is False
    c, _ = compose_config(["stage=reward"] + overrides(reward))
    assert c.reward.model_path == "base" and c.train.lr == 5e-5 and c.train.eval_every == 10
    # DeepSpeed-Chat's ds_config
    assert c.engine.precision == "fp16" and c.engine.fp16.loss_scale_window == 100
    c, _ = compose_config(["stage=ppo"] + overrides(ppo))
    # linked: step 3's input paths are steps 1 and 2's --output_dir, so their exports
    assert (
        c.ppo.actor_path == "out/actor/sft/model"
        and c.ppo.reward_model_path == "out/reward/reward/model"
    )
    assert (c.ppo.prompts_per_step, c.ppo.samples_per_prompt, c.ppo.micro_batch_per_rank) == (
        4,
        1,
        2,
    )
    assert (
        c.ppo.minibatches_per_epoch == 2
        and c.ppo.max_new_tokens == 32
        and c.data.max_prompt_len == 192
    )
    assert (c.train.lr, c.ppo.critic_lr, c.train.warmup_steps) == (9.65e-6, 5e-6, 100)
    assert (
        c.engine.actor.zero_stage == 3
        and c.engine.critic.zero_stage == 2
        and c.engine.reward_model.zero_stage == 2
    )
    assert c.engine.reference.zero_stage == 3 and c.ppo.ema_decay == 0.992
    # the dschat recipe: DeepSpeed-Chat's PPO (ppo_trainer.py)
    a = c.algorithm
    assert (a.estimator, a.kl_coef, a.kl_estimator, a.kl_target) == ("gae", 0.1, "k1", None)
    assert (a.reward_norm, a.reward_clip, a.whiten_advantages, a.no_eos_penalty) == (
        "none",
        5.0,
        False,
        0.0,
    )
    assert c.ppo.temperature == 0.0


def test_unmapped_is_exactly_what_has_no_target(tmp_path):
    (tmp_path / "d.jsonl").write_text("{}\n")
    sft, reward, ppo = three(str(tmp_path / "d.jsonl"))
    assert unmapped(sft) == {"--add_eot_token", "--per_device_eval_batch_size", "--deepspeed"}
    assert unmapped(reward) == {
        "--num_padding_at_beginning",
        "--dropout",
        "--per_device_eval_batch_size",
        "--eval_iters",
        "--deepspeed",
    }
    assert unmapped(ppo) == {
        "--num_padding_at_beginning",
        "--print_answers",
        "--tp_gather_partition_size",
        "--align_overflow",
        "--deepspeed",
        # --critic_weight_decay 0.1 equals the actor's: mapped
    }
    kinds = {u.what.split()[0]: u.kind for p in (sft, reward, ppo) for u in p.unmapped}
    assert kinds["--deepspeed"] == "not needed" and kinds["--add_eot_token"] == "no equivalent"
    assert (
        kinds["--dropout"] == "no equivalent"
        and kinds["--tp_gather_partition_size"] == "not needed"
    )
    for p in (sft, reward, ppo):
        assert all(u.kind in KINDS and u.why for u in p.unmapped)


def test_a_dataset_of_unknown_columns_and_an_unknown_flag_are_listed():
    text = "deepspeed main.py --data_path org/unknown-set --model_name_or_path m --frobnicate 3\n"
    (inv,) = read_script(text, "x.sh")
    from rlhf.migrate.__main__ import plan_invocation

    plan = plan_invocation(inv, {}, 2, None, None, "dschat", ROOT)
    assert {u.what for u in plan.unmapped} >= {"--data_path org/unknown-set", "--frobnicate"}
    assert (
        plan.overrides["launcher.nproc_per_node"] == "2"
        and plan.overrides["train.global_batch"] == "32"
    )
    # DeepSpeed-Chat's defaults where the script gives none: step 1's learning rate is 1e-3
    assert plan.overrides["train.lr"] == "0.001" and plan.overrides["engine.precision"] == "fp16"


def test_script_reading_defaults_arguments_and_unresolved():
    text = (DSC / "step3_ppo.sh").read_text()
    (inv,) = read_script(text, "s3", ["a", "b", "d"])  # $4.. not given: the script's defaults
    assert (
        inv.step == "ppo"
        and inv.flags["actor_zero_stage"] == ["3"]
        and inv.flags["output_dir"] == ["./output/step3"]
    )
    assert inv.flags["num_padding_at_beginning"] == ["1"]  # Num_Padding_at_Beginning=1 # comment
    assert inv.flags["actor_learning_rate"] == ["9.65e-6"] and inv.launcher["num_gpus"] == ["1"]
    (inv,) = read_script(text, "s3")
    assert "$1" in inv.unresolved and "$3" in inv.unresolved
    plan = migrate([str(DSC / "step3_ppo.sh")])[0]
    assert any("$1 is the script's caller's" in n for n in plan.notes)


def test_ds_configs_zero2_offload_and_zero3_fp16():
    plan = Plan("sft", "x")
    apply_config(plan, json.loads((DSC / "ds_config_zero2_offload.json").read_text()))
    c, _ = compose_config(["stage=sft"] + overrides(plan))
    assert (
        c.engine.zero_stage,
        c.engine.offload,
        c.train.global_batch,
        c.train.micro_batch_per_rank,
    ) == (
        2,
        "cpu",
        16,
        4,
    )
    assert (
        c.train.lr,
        c.train.betas,
        c.train.weight_decay,
        c.train.scheduler,
        c.train.warmup_steps,
    ) == (
        2e-5,
        [0.9, 0.999],
        0.01,
        "warmup",
        10,
    )
    assert unmapped(plan) == {
        f"ds_config {k}"
        for k in (
            "gradient_accumulation_steps=4",
            "zero_optimization.offload_optimizer.pin_memory=true",
            "zero_optimization.allgather_partitions=true",
            "zero_optimization.allgather_bucket_size=200000000.0",
            "zero_optimization.overlap_comm=true",
            "zero_optimization.reduce_scatter=true",
            "zero_optimization.reduce_bucket_size=200000000.0",
            "zero_optimization.contiguous_gradients=true",
        )
    }
    plan = Plan("dpo", "x")
    apply_config(plan, json.loads((DSC / "ds_config_zero3_fp16.json").read_text()))
    c, _ = compose_config(["stage=dpo"] + overrides(plan))
    f = c.engine.fp16
    assert c.engine.precision == "fp16" and c.engine.zero_stage == 3
    assert (
        f.loss_scale,
        f.initial_scale_power,
        f.loss_scale_window,
        f.hysteresis,
        f.min_loss_scale,
    ) == (
        0,
        12,
        100,
        2,
        1,
    )
    assert (c.train.scheduler, c.train.max_steps, c.train.warmup_steps, c.train.lr) == (
        "warmup_decay",
        50,
        2,
        1e-3,
    )
    assert c.logger.tensorboard
    left = {u.what.split("=")[0].removeprefix("ds_config ") for u in plan.unmapped}
    assert left == {
        "zero_optimization.overlap_comm",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.sub_group_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "tensorboard.job_name",
        # flops_profiler is off: nothing to say about it
    }


def test_every_mapped_key_exists():
    """Each target key of the tables is a key of the configuration (a renamed key would break the
    printed commands); the keys set by rules are checked by composing the commands above."""
    cfg, _ = compose_config(["stage=ppo"])
    keys = {r.rule.key for r in FLAG_TABLE if hasattr(r.rule, "key")}
    keys |= {r.key for r in CONFIG_TABLE.values() if hasattr(r, "key")}
    for key in sorted(keys):
        node = cfg
        for part in key.split("."):
            assert hasattr(node, part), key
            node = getattr(node, part)


def test_cli_errors_and_output(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "missing.sh")])
    assert e.value.code == 2 and "cannot read the script" in capsys.readouterr().err
    (tmp_path / "empty.sh").write_text("echo hi\n")
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "empty.sh")])
    assert e.value.code == 2 and "no DeepSpeed-Chat main.py invocation" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit) as e:
        main(["--ds-config", str(tmp_path / "bad.json")])
    assert e.value.code == 2 and "not JSON" in capsys.readouterr().err
    main([f"{DSC}/step1_sft.sh m d out", "--recipe", "none"])
    out = capsys.readouterr().out
    assert (
        out.startswith("#!/bin/sh")
        and "\npython -m rlhf stage=sft " in out
        and "recipe=" not in out
    )
    assert "# not mapped:" in out and "1 command(s)" in out
    with pytest.raises(UserError):
        migrate([])


def test_the_docs_tables_are_the_code_tables():
    """docs/deepspeed.md shows FLAG_TABLE and CONFIG_TABLE as `python -m rlhf.migrate --tables`
    prints them."""
    from rlhf.migrate.ds_config import config_table_markdown
    from rlhf.migrate.flags import flag_table_markdown

    doc = (ROOT / "docs" / "deepspeed.md").read_text()
    assert flag_table_markdown() in doc and config_table_markdown() in doc


def test_reward_model_subcommand_converts(tmp_path, capsys):
    """`python -m rlhf.migrate reward-model SRC DST`: a DeepSpeed-Chat step-2 output becomes a
    sequence classifier plain Transformers loads, with the v_head as its score (the scores:
    tests/unit/models/test_dschat.py)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from tests.unit.models.test_dschat import save_dschat

    src, rm = save_dschat(tmp_path, "llama")
    main(["reward-model", str(src), str(tmp_path / "out")])
    assert "wrote" in capsys.readouterr().out
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert hf.config.num_labels == 1 and torch.equal(hf.score.weight, rm.v_head.weight)
    with pytest.raises(SystemExit) as e:
        main(["reward-model", str(tmp_path / "nope"), str(tmp_path / "out2")])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1].startswith(
        "rlhf.migrate: error:"
    )


@pytest.mark.parametrize(
    "models",
    ["--model_name_or_path m", "--actor_model_name_or_path a --critic_model_name_or_path c"],
    ids=["sft", "ppo"],
)
def test_hybrid_engine_and_accumulation_are_reported_as_mapped(models):
    from rlhf.migrate.__main__ import plan_invocation

    ppo = "actor" in models
    text = f"deepspeed main.py {models} --enable_hybrid_engine --gradient_accumulation_steps 4\n"
    (inv,) = read_script(text, "x.sh")
    plan = plan_invocation(inv, {}, 1, None, None, "dschat", ROOT)
    notes = [n for n in plan.notes if n.startswith("--gradient_accumulation_steps 4: folded into ")]
    assert len(notes) == 1 and ("ppo.minibatches_per_epoch" in notes[0]) == ppo
    if ppo:
        assert (
            plan.overrides["engine.hybrid"] == "true"
            and plan.setters["engine.hybrid"] == "--enable_hybrid_engine"
        )
    else:  # not a flag of step 1
        assert any(u.what == "--enable_hybrid_engine" for u in plan.unmapped)
