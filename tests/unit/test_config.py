import pytest

from rlhf.config import Config
from rlhf.errors import ConfigError
from rlhf.settings import load_config


def test_defaults_compose_per_stage():
    for stage in ("sft", "reward", "ppo"):
        cfg, text = load_config([f"stage={stage}"])
        assert isinstance(cfg, Config) and cfg.stage == stage
        assert "run:" in text
    cfg, _ = load_config(["stage=sft", "run.dir=x", "train.max_steps=7", "engine.zero_stage=2"])
    assert (cfg.run.dir, cfg.train.max_steps, cfg.engine.zero_stage) == ("x", 7, 2)


@pytest.mark.parametrize("override, fragment", [
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
])
def test_bad_config_is_one_clear_error(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(["stage=sft", override])
    assert fragment in str(e.value)


def test_world_size_checks():
    cfg, _ = load_config(["train.global_batch=10", "train.micro_batch_per_rank=3"])
    with pytest.raises(ConfigError, match="not divisible"):
        cfg.validate_world(2)
    cfg, _ = load_config(["engine.inference_tp_size=2", "train.global_batch=12"])
    with pytest.raises(ConfigError, match="does not divide"):
        cfg.validate_world(3)
    cfg.validate_world(4)


def test_self_launch_arguments():
    from rlhf.launch import launcher_args
    cfg, _ = load_config(["launcher.nproc_per_node=2", "launcher.nnodes=2", "launcher.node_rank=1",
                          "launcher.rdzv_endpoint=127.0.0.1:29511", "launcher.max_restarts=1"])
    args = launcher_args(cfg, ["stage=sft", "run.dir=x"])
    assert args[:7] == ["--nnodes=2", "--nproc-per-node=2", "--node-rank=1", "--rdzv-backend=c10d",
                        "--rdzv-endpoint=127.0.0.1:29511", "--rdzv-id=rlhf", "--max-restarts=1"]
    assert args[7:] == ["-m", "rlhf", "stage=sft", "run.dir=x"]
