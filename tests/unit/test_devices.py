"""Device choice (engine.device, engine.precision=auto) and the CPU-side guard against device
mixing: sampling on fake CUDA logits, one PPO iteration in-process under ``DeviceDiscipline``."""

import shutil

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from rlhf.config import EngineConfig
from rlhf.engine.draws import row_draws
from rlhf.engine.mesh import choose_device, precision_of
from rlhf.errors import ConfigError
from rlhf.ops import SamplingParams, sample
from rlhf.ops.attention import attend
from tests.device_guard import DeviceDiscipline, DeviceError


def test_device_choice(monkeypatch):
    monkeypatch.delenv("RLHF_DEVICE", raising=False)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert choose_device("cpu", 0, 1) == torch.device("cpu")
    assert choose_device("auto", 0, 1).type == ("cuda" if gpus else "cpu")
    # how the suite pins the CPU on a GPU machine
    monkeypatch.setenv("RLHF_DEVICE", "cpu")
    assert choose_device("auto", 0, 1) == torch.device("cpu")
    monkeypatch.setenv("RLHF_DEVICE", "tpu")
    with pytest.raises(ConfigError, match="RLHF_DEVICE"):
        choose_device("auto", 0, 1)
    with pytest.raises(ConfigError, match=r"engine.device=cuda"):  # never two ranks on one GPU
        choose_device("cuda", 0, gpus + 1)
    with pytest.raises(ConfigError, match=r"engine.device"):
        EngineConfig(device="gpu")


def test_precision_auto_is_fp32_on_cpu_and_explicit_values_stay():
    cpu = torch.device("cpu")
    assert EngineConfig().precision == "auto"
    assert precision_of(EngineConfig(), cpu) == "fp32"
    assert precision_of(EngineConfig(precision="bf16"), cpu) == "bf16"
    assert precision_of(EngineConfig(precision="fp32"), torch.device("cuda", 0)) == "fp32"


@pytest.mark.parametrize(
    "params",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9), dict(temperature=0.0)],
)
def test_sampling_on_device_logits_with_a_cpu_generator(params):
    """The first GPU run died here: a CPU generator drawing into a CUDA tensor. Logits on a second
    device type (``meta``: no data, but device checks as strict as CUDA's — a CPU tensor meeting a
    meta one raises) stand in for CUDA; the rows' draws are made on the CPU and moved; the guard
    also names a draw whose generator is on another device."""
    sp = SamplingParams(**params)
    with DeviceDiscipline():
        logits = torch.empty(4, 50, device="meta")
        u = row_draws(range(4), 3, 0, logits.device)[:, :1] if sp.temperature > 0 else None
        tokens, logp = sample(logits, sp, u, ban=3)
        assert tokens.device.type == "meta" and logp.device.type == "meta"


def test_the_guard_catches_a_cross_device_draw_and_an_implicit_device():
    gen = torch.Generator(device="cpu").manual_seed(0)
    with DeviceDiscipline():
        with pytest.raises(DeviceError, match="generator"):
            torch.rand((4, 1), generator=gen, device=torch.device("meta"))
    with FakeTensorMode(allow_non_fake_inputs=True), DeviceDiscipline():
        with pytest.raises(DeviceError, match="generator"):  # and on (fake) CUDA tensors
            torch.rand((4, 1), generator=gen, device=torch.device("cuda"))
    import rlhf.algorithms.ppo as A

    with DeviceDiscipline() as guard:
        # project code that names no device fails at its own line
        A.whiten(torch.ones(2, 3, device="cpu"), torch.ones(2, 3, device="cpu"))
        assert guard.calls >= 2
        code = compile("torch.zeros(3)", A.__file__, "eval")  # as if written in rlhf/
        with pytest.raises(DeviceError, match="without a device"):
            eval(code, {"torch": torch})


def test_pure_rl_functions_keep_the_device_of_their_inputs():
    """GAE, rewards, group estimators and whitening on meta tensors: any CPU tensor they made
    themselves would meet the meta inputs and raise."""
    import rlhf.algorithms.ppo as A
    from rlhf.algorithms.estimators import advantages
    from rlhf.config import AlgorithmConfig

    m = torch.ones(8, 5, device="meta")
    scores, kl, values = (
        torch.empty(8, device="meta"),
        torch.empty(8, 5, device="meta"),
        torch.empty(8, 5, device="meta"),
    )
    with DeviceDiscipline():
        for est in ("gae", "rloo", "grpo"):
            # (whitening reads its statistics back: checked on CPU below)
            alg = AlgorithmConfig(estimator=est, whiten_advantages=False)
            adv, _ = advantages(alg, scores, kl, values, m, 4, 0.05)
            assert adv.device.type == "meta", est
        assert A.discounted_returns(kl, m).device.type == "meta"


def test_gqa_folded_attention_equals_enable_gqa():
    """The CUDA path (query groups folded into the query length) computes what enable_gqa does."""
    g = torch.Generator(device="cpu").manual_seed(0)
    B, H, KV, T, S, d = 3, 8, 2, 5, 9, 16
    q = torch.randn(B, H, T, d, generator=g, device="cpu")
    k, v = (torch.randn(B, KV, S, d, generator=g, device="cpu") for _ in range(2))
    allowed = torch.rand(B, 1, T, S, generator=g, device="cpu") > 0.3
    allowed[..., -1] = True
    mask = torch.zeros(B, 1, T, S, device="cpu").masked_fill(~allowed, float("-inf"))
    ref = attend(q, k, v, mask, fold_groups=False)
    assert torch.allclose(attend(q, k, v, mask, fold_groups=True), ref, atol=1e-6)
    one = mask[:, :, -1:]  # a decode step: one query row
    assert torch.allclose(
        attend(q[:, :, -1:], k, v, one, fold_groups=True),
        attend(q[:, :, -1:], k, v, one, fold_groups=False),
        atol=1e-6,
    )


def test_half_precision_decode_step_folds_on_cpu():
    """A bf16 decode step (one query a row, q a strided view of the fused QKV output as the
    inference mode passes it) takes the folded call by default and agrees with enable_gqa's within
    bf16 rounding; fp32 keeps the reference call."""
    g = torch.Generator(device="cpu").manual_seed(1)
    B, H, KV, S, d = 4, 9, 3, 11, 16
    qkv = torch.randn(B, (H + 2 * KV) * d, generator=g)
    k, v = (torch.randn(B, KV, S, d, generator=g) for _ in range(2))
    allowed = torch.rand(B, 1, 1, S, generator=g) > 0.3
    allowed[..., -1] = True
    mask = torch.zeros(B, 1, 1, S).masked_fill(~allowed, float("-inf"))
    q32 = qkv[:, : H * d].view(B, 1, H, d).transpose(1, 2)
    assert torch.equal(attend(q32, k, v, mask), attend(q32, k, v, mask, fold_groups=False))
    bf = [t.to(torch.bfloat16) for t in (q32, k, v, mask)]
    out = attend(*bf)
    assert torch.equal(out, attend(*bf, fold_groups=True))
    ref = attend(*(t.float() for t in bf), fold_groups=False)
    assert (out.float() - ref).abs().max() < 2e-2


@pytest.mark.parametrize(
    "variant",
    [
        # hybrid engine, GAE with the reward model and a rule reward, running normalisation
        [],
        [
            "engine.hybrid=false",
            "algorithm.ptx_coef=0.1",
            "ppo.ema_decay=0.9",
            "algorithm.entropy_coef=0.01",
        ],
    ],
)
def test_one_ppo_iteration_names_every_device(small_pipeline, tmp_path, variant):
    """SFT/reward outputs from the CLI, then PPO in this process under the guard: generation
    (sampled and greedy gold), scoring, rewards, GAE, whitening, micro-batched updates, PPO-ptx,
    the EMA actor, a checkpoint, export."""
    from rlhf.compose import compose_config
    from stages import ppo

    run = tmp_path / "run"
    shutil.copytree(small_pipeline, run)
    cfg, _ = compose_config(
        [
            "stage=ppo",
            f"run.dir={run}",
            "ppo.min_rm_accuracy=0",
            "train.max_steps=1",
            "ppo.prompts_per_step=4",
            "ppo.samples_per_prompt=2",
            "ppo.ppo_epochs=1",
            "ppo.minibatches_per_epoch=2",
            "ppo.micro_batch_per_rank=3",
            "ppo.reward_fn=rlhf.rewards.gold",
            "algorithm.reward_norm=running",
            "logger.progress=false",
            "eval.gold_prompts=4",
            "eval.gold_samples=2",
            "train.save_every=1",
            "data.synthetic.num_records=2000",
            "engine.device=cpu",
            *variant,
        ]
    )
    with DeviceDiscipline() as guard:
        ppo.run(cfg)
    # the guard saw the project's tensor factories
    assert guard.calls > 10
    assert (run / "ppo" / "actor" / "model.safetensors").is_file()
