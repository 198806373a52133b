"""A hub id on a machine that cannot reach the hub: one fast probe, then offline — one clear line
and exit 2 in seconds (the libraries' own retries took ~30 s), the log saying why it works
offline."""

import os
import socket
import sys
import time

import pytest

from rlhf import hub
from tests.conftest import ENV, ROOT


def _closed_port() -> int:
    with socket.socket() as s:
        # a port nothing listens on: connecting is refused at once
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _online_env() -> dict:
    env = {k: v for k, v in ENV.items() if k not in hub.OFFLINE_VARS}
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{_closed_port()}"
    return env


@pytest.mark.parametrize(
    "setting, error",
    [
        (
            "data.path=no-such-org/no-such-data",
            "data.path=no-such-org/no-such-data: not a local file or directory, "
            "and no copy of this hub dataset in the local cache (working offline: the hub "
            "cannot be reached",
        ),
        (
            "model.path=no-such-org/no-such-model",
            "model.path=no-such-org/no-such-model: no such directory, and no hub "
            "model no-such-org/no-such-model in the local cache (working offline: the hub "
            "cannot be reached",
        ),
    ],
)
def test_unreachable_hub_answers_fast_with_one_line(tmp_path, setting, error):
    env = _online_env()
    t0 = time.monotonic()
    proc = subprocess_run(tmp_path, setting, env)
    seconds = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Retrying" not in proc.stderr and "Traceback" not in proc.stderr
    assert "the Hugging Face hub cannot be reached (127.0.0.1:" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rlhf: error: {error}"), last
    assert seconds < 10, seconds
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.safetensors"))


def subprocess_run(tmp_path, setting, env):
    import subprocess

    fmt = ["data.format=hh"] if setting.startswith("data.") else []
    return subprocess.run(
        [sys.executable, "-m", "rlhf", "stage=sft", f"run.dir={tmp_path / 'run'}", setting, *fmt],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_probe_times_out_when_the_resolver_hangs(monkeypatch):
    def hang(*a, **k):
        time.sleep(30)

    monkeypatch.setattr(socket, "create_connection", hang)
    t0 = time.monotonic()
    assert hub._connect("huggingface.co", 443, timeout=0.5) == "timed out"
    assert time.monotonic() - t0 < 1.5


def test_no_hub_id_no_probe(monkeypatch):
    asked = []
    monkeypatch.setattr(hub, "reachable", lambda *a: asked.append(1) or (False, "x"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert hub.settle([]) == "" and not asked
    assert not hub.looks_like_hub_id(os.getcwd()) and not hub.looks_like_hub_id("./x/y")
    assert hub.looks_like_hub_id("Anthropic/hh-rlhf") and hub.looks_like_hub_id("gpt2")
    # a data file's name (mistyped): no probe
    assert not hub.looks_like_hub_id("trian.jsonl", (".jsonl",))


def test_every_setting_that_names_a_hub_id_is_found():
    from omegaconf import OmegaConf

    from rlhf.compose import hub_settings

    dcfg = OmegaConf.create(
        {
            "model": {"path": "Qwen/Qwen2.5-0.5B"},
            "ppo": {
                "reward_model_path": "org/rm-a,org/rm-b",
                "actor_path": None,
                "critic_path": None,
            },
            "data": {
                "path": None,
                "eval_path": "local.jsonl",
                "sources": [{"path": "Anthropic/hh-rlhf"}, {"path": "a.jsonl"}],
            },
            "dpo": {"model_path": None},
            "reward": {"model_path": None},
        }
    )
    assert hub_settings(dcfg) == [
        "model.path=Qwen/Qwen2.5-0.5B",
        "ppo.reward_model_path=org/rm-a",
        "ppo.reward_model_path=org/rm-b",
        "data.sources[0].path=Anthropic/hh-rlhf",
    ]
