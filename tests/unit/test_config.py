import pytest

from rlhf.compose import compose_config
from rlhf.config import Config
from rlhf.errors import ConfigError


def test_defaults_compose_per_stage():
    for stage in ("sft", "reward", "ppo", "dpo"):
        cfg, text = compose_config([f"stage={stage}"])
        assert isinstance(cfg, Config) and cfg.stage == stage
        assert "run:" in text
    cfg, _ = compose_config(["stage=sft", "run.dir=x", "train.max_steps=7", "engine.zero_stage=2"])
    assert (cfg.run.dir, cfg.train.max_steps, cfg.engine.zero_stage) == ("x", 7, 2)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("engine.zero_stage=7", "engine.zero_stage=7"),
        ("engine.zero_stage=abc", "engine.zero_stage"),
        ("stage=nope", "unknown stage 'nope'"),
        ("data.format=csv", "data.format='csv'"),
        ("engine.offload=disk", "engine.offload"),
        ("train.global_batch=0", "train.global_batch"),
        ("data.split=1,2", "data.split"),
        ("no.such_key=1", "no"),
        ("data.format=hh", "data.path is required"),
        ("model.num_heads=3", "model.num_heads"),
        (
            "train.max_tokens_per_micro_batch=-1",
            "train.max_tokens_per_micro_batch=-1 is invalid: expected a non-neg",
        ),
        (
            "ppo.max_tokens_per_micro_batch=-8",
            "ppo.max_tokens_per_micro_batch=-8 is invalid: expected a non-neg",
        ),
    ],
)
def test_bad_config_is_one_clear_error(override, fragment):
    with pytest.raises(ConfigError) as e:
        compose_config(["stage=sft", override])
    assert fragment in str(e.value)


def test_world_size_checks(monkeypatch):
    cfg, _ = compose_config(["train.global_batch=10", "train.micro_batch_per_rank=3"])
    with pytest.raises(ConfigError, match="not divisible"):
        cfg.validate_world(2)
    cfg, _ = compose_config(
        ["engine.inference_tp_size=2", "train.global_batch=12", "engine.device=cpu"]
    )
    cfg.validate_world(4)
    # the parallel degrees: checked once, where the mesh is built (before any process group starts)
    from rlhf.engine.mesh import init_mesh

    for key, value in (
        ("WORLD_SIZE", "3"),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "3"),
    ):
        monkeypatch.setenv(key, value)
    with pytest.raises(
        ConfigError, match=r"engine.inference_tp_size=2 does not divide the world size 3"
    ):
        init_mesh(cfg.engine)


def test_self_launch_arguments():
    from rlhf.launcher.launch import launcher_args

    cfg, _ = compose_config(
        [
            "launcher.nproc_per_node=2",
            "launcher.nnodes=2",
            "launcher.node_rank=1",
            "launcher.rdzv_endpoint=127.0.0.1:29511",
            "launcher.max_restarts=1",
        ]
    )
    args = launcher_args(cfg, ["stage=sft", "run.dir=x"])
    assert args[:7] == [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--node-rank=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29511",
        "--rdzv-id=rlhf",
        "--max-restarts=1",
    ]
    assert args[7:] == ["-m", "rlhf", "stage=sft", "run.dir=x"]


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("dpo.beta=0", "dpo.beta=0"),
        ("dpo.loss=hinge", "dpo.loss='hinge'"),
        ("dpo.label_smoothing=0.5", "dpo.label_smoothing"),
        ("dpo.sft_coef=-1", "dpo.sft_coef"),
    ],
)
def test_bad_dpo_config(override, fragment):
    with pytest.raises(ConfigError) as e:
        compose_config(["stage=dpo", override])
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("ppo.lm_head=prompt", "ppo.lm_head='prompt'"),
        ("ppo.update_rows=some", "ppo.update_rows='some'"),
        ("engine.host_malloc=jemalloc", "jemalloc"),
    ],
)
def test_bad_choice(override, fragment):
    with pytest.raises(ConfigError) as e:
        compose_config(["stage=dpo", override])
    assert fragment in str(e.value)


def test_dpo_config_and_its_data_split():
    from rlhf.data.pipeline import split_share_of

    cfg, _ = compose_config(["stage=dpo"])
    assert (
        cfg.dpo.loss == "sigmoid" and cfg.dpo.label_smoothing == 0.0 and cfg.dpo.model_path is None
    )
    with pytest.raises(ConfigError, match=r"applies to dpo.loss=sigmoid"):
        compose_config(["stage=dpo", "dpo.loss=ipo", "dpo.label_smoothing=0.1"])
    compose_config(["stage=dpo", "dpo.loss=ipo"])
    # data.split keeps three weights (sft, reward, ppo); dpo reads pairs: the reward share
    assert [split_share_of(s) for s in ("sft", "reward", "ppo", "dpo")] == [0, 1, 2, 1]
    cfg, _ = compose_config(["stage=dpo", 'data.split="2,4,4"', "data.synthetic.num_records=100"])
    from rlhf.data.pipeline import load_stage_data

    dpo, reward = (load_stage_data(cfg.data, stage, 0).train for stage in ("dpo", "reward"))
    assert len(dpo) == 40 and [e.chosen for e in dpo] == [e.chosen for e in reward]
    with pytest.raises(ConfigError, match="dpo takes the reward share"):
        compose_config(["stage=dpo", 'data.split="1,1,1,1"'])
    with pytest.raises(ConfigError, match="expected sft, reward, ppo or dpo"):
        compose_config(["stage=dop"])


def test_moved_env_keys_are_read_under_their_new_names_with_one_line():
    """ppo.env, ppo.tools, ... moved to env.*: the old names on the command line still work for one
    release, the run saying which key each is now; a moved key in a YAML file names the new one."""
    from rlhf.compose import _did_you_mean, renamed
    from rlhf.config import MOVED_KEYS

    old = [
        "stage=ppo",
        "ppo.tools=[calculator]",
        "+ppo.env_args={a: 1}",
        "ppo.sandbox.cpu_s=3",
        "ppo.env_timeout_s=7",
        "ppo.max_trajectory_tokens=500",
    ]
    now, why = renamed(old)
    assert now == [
        "stage=ppo",
        "env.tools=[calculator]",
        "+env.args={a: 1}",
        "env.sandbox.cpu_s=3",
        "env.timeout_s=7",
        "env.max_trajectory_tokens=500",
    ]
    assert (
        "ppo.sandbox.cpu_s is now env.sandbox.cpu_s" in why and "ppo.tools is now env.tools" in why
    )
    assert renamed(["ppo.env_args_x=1", "ppo.prompts_per_step=8"]) == (
        ["ppo.env_args_x=1", "ppo.prompts_per_step=8"],
        "",
    )
    cfg, _ = compose_config(["stage=ppo", "ppo.tools=[calculator]", "ppo.max_turns=2"])
    assert (cfg.env.name, cfg.env.tools, cfg.env.max_turns) == ("tools", ["calculator"], 2)
    assert cfg.moved_why.startswith("renamed keys: ppo.tools is now env.tools")
    assert compose_config(["stage=ppo", "env.tools=[calculator]"])[0].moved_why == ""
    for key, new in MOVED_KEYS.items():
        assert _did_you_mean(f"Key '{key[4:]}' not in 'PPOConfig'") == f" (it is {new} now)"


def test_eval_reads_a_saved_run_from_before_the_env_group():
    """rlhf.eval carries a saved run's environment: its env group, or the ppo.* keys of a run
    saved before the move, under the new names."""
    from omegaconf import OmegaConf

    from rlhf.eval import env_of

    before = OmegaConf.create(
        {
            "ppo": {
                "tools": ["calculator"],
                "env": "tools",
                "max_turns": 3,
                "max_new_tokens": 48,
                "reward_clip": False,
            }
        }
    )
    assert env_of(before) == {
        "env": {"tools": ["calculator"], "name": "auto", "max_turns": 3},
        "ppo": {"max_new_tokens": 48},
    }
    after = OmegaConf.create(
        {"ppo": {"max_new_tokens": 48}, "env": {"tools": ["calculator"], "name": "tools"}}
    )
    assert env_of(after)["env"] == {"tools": ["calculator"], "name": "auto"}
    assert env_of(OmegaConf.create({"ppo": {"max_new_tokens": 48}, "env": {"tools": []}})) == {}
