"""Shared helpers: the CLI as a subprocess, the vendored real-data samples (tests/data), a
tiny-model factory."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Small real-data samples vendored with the tests (sources and licences: tests/data/README.md)
REAL_DATA = ROOT / "tests" / "data"

# Where the suite runs its stages and ranks: RLHF_TEST_DEVICE=cpu (default: every rank on CPU/gloo,
# also on a GPU machine) or cuda (engine.device=auto: a GPU per rank where there are enough, else
# the CPU — never two ranks on one GPU). Tests that compare numbers pin fp32 themselves.
TEST_DEVICE = os.environ.get("RLHF_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"RLHF_TEST_DEVICE={TEST_DEVICE!r}: expected cpu or cuda")
ENV = dict(
    os.environ,
    HF_HUB_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
    WANDB_MODE="disabled",
    PYTHONPATH=str(ROOT),
)
if TEST_DEVICE == "cpu":
    ENV["RLHF_DEVICE"] = "cpu"
else:
    ENV.pop("RLHF_DEVICE", None)
for k, v in ENV.items():
    if k in (
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "TOKENIZERS_PARALLELISM",
        "WANDB_MODE",
        "RLHF_DEVICE",
    ):
        os.environ.setdefault(k, v)


def run_worker(
    script, *args: str, nproc: int = 2, timeout: float = 600
) -> subprocess.CompletedProcess:
    """A worker script under torchrun (``nproc`` ranks, standalone) with the test environment; fails
    the test with the end of its stderr unless it exits 0."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
    ]
    proc = subprocess.run(
        [*cmd, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def fault_env(name: str, arg: str = "") -> dict:
    """``env=`` for ``run_cli``: the CLI with the test-only fault ``tests/faults/fault_<name>.py``
    installed (``install(arg)``; tests/faults/sitecustomize.py says how)."""
    return {"PYTHONPATH": f"{ROOT / 'tests' / 'faults'}:{ROOT}", "RLHF_TEST_FAULT": f"{name}:{arg}"}


def run_cli(
    *overrides: str, timeout: float = 600, nproc: int = 1, env: dict | None = None, **popen
) -> subprocess.CompletedProcess:
    """``python -m rlhf <overrides>`` (or torchrun with ``nproc`` ranks) with the test
    environment."""
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "rlhf",
            *overrides,
        ]
    else:
        cmd = [sys.executable, "-m", "rlhf", *overrides]
    return subprocess.run(
        cmd,
        cwd=ROOT,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )


def tool_cli(tool: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m rlhf.<tool> <args>`` (score, eval, generate, ...) with the test environment."""
    return subprocess.run(
        [sys.executable, "-m", f"rlhf.{tool}", *map(str, args)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def score_cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return tool_cli("score", *args, timeout=timeout)


def tree_digest(path: Path) -> dict:
    """{relative path: sha256} of every file under ``path``."""
    out = {}
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def quick_sft_args(run_dir: Path, steps: int = 20) -> list[str]:
    """A bounded SFT run on the embedded task (seconds, not minutes)."""
    return [
        "stage=sft",
        f"run.dir={run_dir}",
        f"train.max_steps={steps}",
        "logger.progress=false",
        # numbers compared across runs: exact on every device
        "engine.precision=fp32",
        "eval.gold_prompts=16",
        "eval.gold_samples=1",
        "data.synthetic.num_records=2000",
        "train.warmup_steps=5",
    ]


@pytest.fixture(scope="session")
def real_data() -> Path:
    """tests/data: HH-RLHF harmless-base test split, GSM8K train and a GSM8K test prefix (in the
    repository)."""
    assert (REAL_DATA / "README.md").is_file(), (
        f"{REAL_DATA} is missing: it is part of the repository"
    )
    return REAL_DATA


@pytest.fixture(scope="session")
def default_sft_run(tmp_path_factory):
    """`python -m rlhf stage=sft run.dir=D` with no other overrides (the embedded default)."""
    run_dir = tmp_path_factory.mktemp("default") / "run"
    proc = run_cli("stage=sft", f"run.dir={run_dir}", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # (the console, for the tests that read it)
    (run_dir.parent / "sft.stderr").write_text(proc.stderr)
    return run_dir


@pytest.fixture(scope="session")
def default_reward_run(default_sft_run):
    """`python -m rlhf stage=reward run.dir=D` with no other overrides, after the default SFT
    run."""
    proc = run_cli("stage=reward", f"run.dir={default_sft_run}", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return default_sft_run


@pytest.fixture(scope="session")
def short_reward_run(default_sft_run, tmp_path_factory):
    """A 600-step reward model (held-out accuracy ~0.95, 40 s) on the default SFT model: for the
    tests of what a trained reward model's export does; the recipe's full 1500 steps are
    ``default_reward_run``'s."""
    run_dir = tmp_path_factory.mktemp("short_reward") / "run"
    reward_from_default_sft(default_sft_run, run_dir, 600)
    return run_dir


def reward_from_default_sft(
    default_sft_run: Path, run_dir: Path, steps: int, *extra: str
) -> subprocess.CompletedProcess:
    """A reward run of ``steps`` steps in ``run_dir`` on a copy of the default SFT run's model."""
    import shutil

    shutil.copytree(default_sft_run / "sft", run_dir / "sft")
    proc = run_cli(
        "stage=reward",
        f"run.dir={run_dir}",
        f"train.max_steps={steps}",
        "logger.progress=false",
        *extra,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def quick_reward(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """A bounded reward run (30 steps) on top of a quick SFT run in ``run_dir``."""
    proc = run_cli(
        "stage=reward",
        f"run.dir={run_dir}",
        "train.max_steps=30",
        "train.save_every=0",
        "logger.progress=false",
        "data.synthetic.num_records=2000",
        *extra,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def killed_at(args: list, marker: Path, timeout: float = 300, nproc: int = 1) -> None:
    """Runs ``python -m rlhf <args>`` (torchrun with ``nproc`` ranks: every process of it) and
    SIGKILLs it as soon as ``marker`` exists (e.g. a checkpoint's trainer_state.json: the checkpoint
    is complete)."""
    cmd = [sys.executable, "-m", "rlhf", *args]
    if nproc > 1:
        cmd[2:3] = [
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "rlhf",
        ]
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + timeout
    while time.time() < deadline and not marker.exists():
        time.sleep(0.05)
    # (torchrun's ranks start sessions of their own: with nproc > 1 every descendant, the deepest
    # first)
    below = _descendants(p.pid) if nproc > 1 else []
    for pid in [*below, p.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    p.wait()


def _descendants(pid: int) -> list:
    """The processes below ``pid``, deepest first (from /proc)."""
    children = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out[::-1]


@pytest.fixture(scope="session")
def small_pipeline(tmp_path_factory):
    """A quick SFT + reward run (seconds) for the PPO mechanics tests."""
    run_dir = tmp_path_factory.mktemp("ppo") / "run"
    assert run_cli(*quick_sft_args(run_dir, steps=60), "train.save_every=0").returncode == 0
    quick_reward(run_dir)
    return run_dir


@pytest.fixture(scope="session")
def user_model(tmp_path_factory, real_data) -> Path:
    """A user's pretrained model: a tiny random-init Llama with a tokenizer trained on the real-data
    samples (HH-RLHF and GSM8K), saved as a Hugging Face directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.data.records import read_examples
    from rlhf.data.tokenizer import train_tokenizer

    hh, _ = read_examples(str(real_data / "hh-rlhf" / "harmless-base-test.jsonl.gz"), "hh")
    gsm, _ = read_examples(str(real_data / "gsm8k" / "train.jsonl.gz"), "gsm8k")
    texts = [
        t for e in hh[:300] + gsm[:300] for t in (e.prompt, e.response, e.chosen, e.rejected) if t
    ]
    tok = train_tokenizer(texts, vocab_size=1200, model_max_length=1024)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("user") / "model"
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path
