"""Recipes (conf/recipe, conf/recipe_stage): which one a command line gets, and that a user's
pretrained model gets none of the embedded task's tuning."""

from pathlib import Path

import pytest
import yaml

from rlhf.compose import CONF_DIR, compose_config
from rlhf.config import TrainConfig, stage_names
from rlhf.data.pipeline import StageData
from rlhf.data.records import Example
from rlhf.errors import ConfigError

# the dataclass defaults tuned on the embedded task (beside its recipe files' keys) that a
# pretrained model must not inherit, per stage
TUNED = {
    "sft": ("train.lr", "train.max_steps", "train.warmup_steps", "train.global_batch"),
    "reward": (),
    "ppo": ("ppo.critic_lr",),
    "dpo": (),
}


def value(cfg, key):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


@pytest.mark.parametrize("stage", stage_names())
def test_model_path_alone_gets_the_pretrained_recipe(stage, tmp_path):
    embedded, _ = compose_config([f"stage={stage}"])
    pretrained, _ = compose_config([f"stage={stage}", "model.path=org/some-model"])
    assert embedded.recipe == "embedded" and pretrained.recipe == "pretrained"
    assert "model.path=org/some-model is set" in pretrained.recipe_why
    # every tuned key of the embedded recipe file, and the dataclass defaults tuned on the toy task
    spec = yaml.safe_load((CONF_DIR / "recipe_stage" / "embedded" / f"{stage}.yaml").read_text())
    keys = {
        k
        for k in flat(spec)
        if any(w in k for w in ("lr", "decay", "steps", "len", "tokens", "coef"))
    }
    keys |= set(TUNED[stage])
    survivors = [k for k in sorted(keys) if value(embedded, k) == value(pretrained, k)]
    assert not survivors, (
        f"stage={stage}: the embedded recipe's {survivors} survive with model.path set"
    )


def test_lengths_follow_the_data():
    cfg, _ = compose_config(
        ["stage=ppo", "model.path=org/m", "data.path=x.jsonl", "data.format=hh"]
    )
    assert cfg.ppo.max_new_tokens == cfg.data.max_response_len == 192
    cfg, _ = compose_config(
        [
            "stage=ppo",
            "model.path=org/m",
            "data.path=x.jsonl",
            "data.format=hh",
            "data.max_response_len=300",
        ]
    )
    assert cfg.ppo.max_new_tokens == cfg.eval.max_new_tokens == 300
    embedded, _ = compose_config(["stage=ppo"])
    assert embedded.ppo.max_new_tokens == 16  # the synthetic task's answers


def test_an_explicit_override_wins_and_the_embedded_numbers_stand():
    cfg, _ = compose_config(
        [
            "stage=sft",
            "model.path=org/m",
            "train.lr=0.5",
            "train.max_steps=7",
            "train.warmup_steps=2",
        ]
    )
    assert (cfg.train.lr, cfg.train.max_steps, cfg.train.warmup_steps) == (0.5, 7, 2)
    cfg, _ = compose_config(["stage=sft", "model.path=org/m", "recipe=embedded"])
    assert (
        cfg.recipe == "embedded" and cfg.train.weight_decay == 1.0 and cfg.train.max_steps == 3000
    )
    # today's embedded values, stage by stage (a recipe split that changes them changes every
    # number)
    expect = {
        "sft": (3e-3, 3000, 1.0, 50),
        "reward": (5e-4, 1500, 0.0, 30),
        "ppo": (5e-5, 80, 0.0, 0),
        "dpo": (1e-3, 600, 0.0, 20),
    }
    for stage, numbers in expect.items():
        c, _ = compose_config([f"stage={stage}"])
        assert (
            c.train.lr,
            c.train.max_steps,
            c.train.weight_decay,
            c.train.warmup_steps,
        ) == numbers, stage
    c, _ = compose_config(["stage=ppo"])
    assert (c.algorithm.kl_coef, c.train.eval_every, c.train.save_every, c.ppo.critic_lr) == (
        0.02,
        40,
        20,
        1e-4,
    )
    # the embedded model's shape is the recipe's; the agentic recipe keeps model.*'s defaults
    shapes = {
        r: compose_config(["stage=sft", f"recipe={r}"])[0].model for r in ("embedded", "agentic")
    }
    assert (shapes["embedded"].num_layers, shapes["embedded"].intermediate_size) == (4, 128)
    assert (shapes["agentic"].num_layers, shapes["agentic"].intermediate_size) == (3, 256)


def test_later_stages_keep_the_recipe_of_the_run(tmp_path):
    run = tmp_path / "run"
    (run / "sft").mkdir(parents=True)
    (run / "sft" / "config.yaml").write_text("stage: sft\nrecipe: hh\n")
    cfg, _ = compose_config(["stage=ppo", f"run.dir={run}", "data.path=x.jsonl"])
    assert cfg.recipe == "hh" and str(run / "sft" / "config.yaml") in cfg.recipe_why
    cfg, _ = compose_config(["stage=ppo", f"run.dir={tmp_path / 'fresh'}"])
    assert cfg.recipe == "embedded"


def test_task_recipes_and_their_stages():
    hh, _ = compose_config(["stage=reward", "recipe=hh", "data.path=x.jsonl"])
    assert (hh.data.format, hh.data.split, hh.train.lr) == ("hh", "2,4,4", 9e-6)
    # hh's data, its own sizes
    smol, _ = compose_config(["stage=ppo", "recipe=smollm2_hh", "data.path=x.jsonl"])
    assert (smol.data.format, smol.data.split) == ("hh", "2,4,4")
    # its reward model learns that an empty answer or another prompt's loses
    smol_rm, _ = compose_config(["stage=reward", "recipe=smollm2_hh", "data.path=x.jsonl"])
    assert (smol_rm.reward.contrast, smol_rm.reward.contrast_share) == (["other", "empty"], 0.25)
    assert smol.model.path.endswith("smollm2-135m-instruct")  # the name, or its cached directory
    assert (smol.ppo.use_reward_model, smol.algorithm.estimator, smol.train.max_steps) == (
        True,
        "gae",
        20,
    )
    # the embedded task on a Mixture-of-Experts model: the embedded settings, PPO at its own rate
    for stage in ("sft", "reward", "ppo", "dpo"):
        moe, _ = compose_config([f"stage={stage}", "recipe=embedded_moe"])
        dense, _ = compose_config([f"stage={stage}", "recipe=embedded"])
        assert (moe.model.num_experts, moe.model.experts_per_token, dense.model.num_experts) == (
            4,
            2,
            0,
        )
        assert moe.train.lr == (3e-5 if stage == "ppo" else dense.train.lr)
        assert moe.train.max_steps == dense.train.max_steps
    g, _ = compose_config(["stage=ppo", "recipe=gsm8k_grpo", "data.path=x.jsonl"])
    assert (
        g.algorithm.estimator,
        g.ppo.use_reward_model,
        g.ppo.reward_fn,
        g.ppo.samples_per_prompt,
    ) == (
        "grpo",
        False,
        "rlhf.rewards.gold",
        8,
    )
    with pytest.raises(
        ConfigError,
        match=r"recipe=gsm8k_grpo .recipe=gsm8k_grpo on the command line. has no reward "
        "stage .its stages: sft, ppo.",
    ):
        compose_config(["stage=reward", "recipe=gsm8k_grpo", "data.path=x.jsonl"])
    with pytest.raises(
        ConfigError,
        match=r"unknown recipe 'nope' .expected agentic, dschat, embedded, embedded_moe, "
        r"gsm8k_grpo, gsm8k_tools, hh, pretrained, "
        r"smollm2_arith, smollm2_hh.",
    ):
        compose_config(["recipe=nope"])


@pytest.mark.parametrize(
    "stage,full,lora",
    [("sft", 1e-5, 1e-4), ("reward", 9e-6, 1e-4), ("dpo", 5e-7, 5e-6), ("ppo", 1e-6, 1e-5)],
)
def test_lora_gets_the_recipes_lora_rate_unless_the_command_line_says(stage, full, lora):
    m = ["model.path=/m", "data.path=x.jsonl", "data.format=prompt_chosen_rejected"]
    cfg, _ = compose_config([f"stage={stage}", *m])
    assert cfg.train.lr == full and cfg.lr_why == ""
    cfg, text = compose_config([f"stage={stage}", *m, "model.lora.r=8"])
    # the saved config says so
    assert cfg.train.lr == lora and yaml.safe_load(text)["train"]["lr"] == lora
    assert cfg.lr_why.startswith(f"train.lr={lora:g}: the recipe's rate for LoRA (model.lora.r=8")
    cfg, _ = compose_config([f"stage={stage}", *m, "model.lora.r=8", "train.lr=3e-5"])
    assert cfg.train.lr == 3e-5 and "from the command line" in cfg.lr_why
    # the embedded recipe sets no LoRA rate
    cfg, _ = compose_config(["stage=sft", "model.lora.r=8"])
    assert cfg.train.lr == compose_config(["stage=sft"])[0].train.lr and cfg.lr_why == ""


def test_steps_and_warmup_from_epochs():
    t = TrainConfig(max_steps=None, epochs=2, warmup_steps=None, warmup_ratio=0.05)
    said = t.resolve_steps(1000, 64, "records")
    assert (t.max_steps, t.warmup_steps) == (32, 2) and "train.epochs=2 over 1000 records" in said
    t = TrainConfig(max_steps=None, epochs=1, warmup_steps=None, warmup_ratio=0.1)
    t.resolve_steps(100, 10, "prompts", updates_per_step=4)  # PPO: warmup counts optimizer steps
    assert (t.max_steps, t.warmup_steps) == (10, 4)
    # set: they win, and it is said
    t = TrainConfig(max_steps=5, epochs=3, warmup_steps=1, warmup_ratio=0.5)
    said = t.resolve_steps(1000, 10, "records")
    assert (t.max_steps, t.warmup_steps) == (5, 1)
    assert (
        "train.epochs=3 does not apply" in said and "train.warmup_ratio=0.5 does not apply" in said
    )
    # the embedded recipe: nothing to say
    assert TrainConfig().resolve_steps(1000, 10, "records") is None
    with pytest.raises(ConfigError, match=r"train.max_steps and train.epochs are both null"):
        TrainConfig(max_steps=None, epochs=None)


def test_recipe_files_say_where_their_numbers_come_from():
    """Every pretrained setting names its source (a comment on the line or the file's header)."""
    for path in sorted((CONF_DIR / "recipe_stage" / "pretrained").glob("*.yaml")):
        text = path.read_text()
        assert "Sources" in text, path
        for line in text.splitlines():
            if ":" in line and line.startswith("  ") and not line.strip().startswith("#"):
                key, _, rest = line.strip().partition(":")
                if rest.strip() and "null" not in rest:
                    assert "#" in rest, f"{Path(path).name}: {key} has no source comment"


def test_each_stage_places_the_models_it_builds():
    roles = {}
    for args in (
        ["stage=sft"],
        ["stage=reward"],
        ["stage=dpo"],
        ["stage=dpo", "model.lora.r=4"],
        ["stage=ppo"],
        [
            "stage=ppo",
            "algorithm.estimator=grpo",
            "ppo.use_reward_model=false",
            "ppo.reward_fn=x.y",
            "algorithm.kl_coef=0",
        ],
    ):
        cfg, _ = compose_config(args)
        roles[" ".join(args)] = cfg.roles()
    assert list(roles.values()) == [
        ("actor",),
        ("reward_model",),
        ("actor", "reference"),
        ("actor",),
        ("actor", "critic", "reference", "reward_model"),
        ("actor",),
    ]
    cfg, _ = compose_config(
        [
            "stage=ppo",
            "engine.zero_stage=2",
            "engine.critic.zero_stage=3",
            "engine.reference.offload=cpu",
            "engine.reward_model.precision=bf16",
        ]
    )
    placed = cfg.engine.placements()
    assert placed["actor"][:3] == (2, "none", "auto") and placed["critic"][0] == 3
    assert placed["reference"][:2] == (2, "cpu") and placed["reward_model"][2] == "bf16"
    assert cfg.engine.placement("reference").key("offload") == "engine.reference.offload"
    assert cfg.engine.placement("actor").key("offload") == "engine.offload"
    assert cfg.engine.offloads(("reference",)) and not cfg.engine.offloads(("actor", "critic"))


def test_the_fingerprint_names_the_inputs_and_not_the_dropout():
    """Another reward model or critic of the same shape is another run (no "already done", no resume
    from its checkpoints); model.disable_dropout, which zeroes the config's dropout, is not."""
    from transformers import GPT2Config

    from rlhf.runtime.stage import run_fingerprint

    class Tok:
        def get_vocab(self):
            return {"a": 0}

    cfg, _ = compose_config(["stage=ppo"])
    d = StageData(
        train=[Example("What is 1 + 2?")], eval=[], gold=None, description="d", stage="ppo"
    )
    a = run_fingerprint(GPT2Config(n_layer=2, resid_pdrop=0.1), Tok(), d, cfg, "reward_model=/x")
    b = run_fingerprint(GPT2Config(n_layer=2, resid_pdrop=0.0), Tok(), d, cfg, "reward_model=/x")
    c = run_fingerprint(GPT2Config(n_layer=2, resid_pdrop=0.0), Tok(), d, cfg, "reward_model=/y")
    assert a == b and a != c and c["inputs"] == "reward_model=/y" and a["records"] == d.digest()


def test_a_finished_stage_written_before_the_records_digest_is_still_finished():
    """A done.json written before the fingerprint held the records' digest (ADDED_LATER) is judged
    on the rest: existing finished run directories stay finished; any other missing or differing key
    is another setup."""
    from rlhf.runtime.stage import same_setup

    now = {"model": "m", "data": "synthetic:generated", "records": "r", "lora": "r=8"}
    assert same_setup(dict(now), now)
    assert same_setup({"model": "m", "data": "synthetic:generated", "lora": "r=8"}, now)
    assert not same_setup(
        {"model": "m", "data": "synthetic:generated", "records": "x", "lora": "r=8"}, now
    )
    # lora: no
    assert not same_setup({"model": "m", "data": "synthetic:generated", "records": "r"}, now)
