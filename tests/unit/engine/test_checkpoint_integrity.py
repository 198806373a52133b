"""A checkpoint proves itself: its state file records every other file's size and sha256, a resume
checks them, falls back past a damaged checkpoint (moved aside, never deleted) and refuses a damaged
one it was pointed at; a save that cannot write leaves nothing half-written and every earlier
checkpoint and export intact (exit 4's ``SaveError``)."""

import errno
import hashlib
import io
import json
import logging

import pytest
import torch

from rlhf.config import Config, EngineConfig, TrainConfig
from rlhf.engine import checkpoint as ck
from rlhf.engine.checkpoint import (
    MANIFEST,
    STATE_FILE,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
    write_failure,
    write_hf,
)
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import TrainEngine
from rlhf.errors import ConfigError, SaveError
from rlhf.runtime.stage import (
    DONE_FILE,
    StageContext,
    checkpoint_to_resume,
    finished,
    set_aside_damaged,
)
from tests.conftest import tree_digest
from tests.infer_helpers import tiny_model
from tests.reliability.helpers import flip_byte, truncate

SHARD = "__0_0.distcp"


class Tokenizer:
    def save_pretrained(self, path):
        path.mkdir(parents=True, exist_ok=True)
        (path / "tokenizer.json").write_text('{"vocab": 1}')


@pytest.fixture
def setup(tmp_path):
    """A stage context over ``tmp_path/sft`` and a tiny engine; ``save(step)`` writes a
    checkpoint."""
    mesh = Mesh()
    eng = TrainEngine(
        tiny_model("llama"), mesh, EngineConfig(), TrainConfig(lr=1e-2, warmup_steps=0)
    )
    ctx = StageContext(cfg=Config(), mesh=mesh, out=tmp_path / "sft", cache_dir=tmp_path / "cache")

    def save(step, keep=3):
        return save_checkpoint(
            ctx.ckpt_dir,
            step,
            {"actor": eng},
            {"stage": "sft"},
            mesh,
            keep=keep,
            tokenizer=Tokenizer(),
        )

    return ctx, eng, save


def rlhf_lines(caplog, level=logging.WARNING):
    return [r.getMessage() for r in caplog.records if r.name == "rlhf" and r.levelno >= level]


def test_the_manifest_records_every_file_and_verifies(setup):
    ctx, eng, save = setup
    ckpt = save(5)
    state = json.loads((ckpt / STATE_FILE).read_text())
    files = {
        p.relative_to(ckpt).as_posix(): p
        for p in ckpt.rglob("*")
        if p.is_file() and p.name != STATE_FILE
    }
    assert {SHARD, ".metadata", "rng_rank0.pt", "tokenizer/tokenizer.json"} <= set(files)
    assert set(state[MANIFEST]) == set(files)
    for name, p in files.items():
        data = p.read_bytes()
        assert state[MANIFEST][name] == {
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }, name
    assert verify_checkpoint(ckpt, ctx.mesh) is None
    assert MANIFEST not in load_checkpoint(ckpt, {"actor": eng}, ctx.mesh)  # trainer state only


@pytest.mark.parametrize(
    "damage, file, check",
    [
        (truncate, SHARD, "size"),
        (flip_byte, "rng_rank0.pt", "sha256 differs"),
        (lambda p: p.unlink(), "tokenizer/tokenizer.json", "missing"),
    ],
)
def test_a_damaged_file_is_named_with_the_check_that_failed(setup, damage, file, check):
    ctx, _, save = setup
    ckpt = save(5)
    damage(ckpt / file)
    assert verify_checkpoint(ckpt, ctx.mesh).startswith(f"{file}: {check}")


def test_resume_falls_back_past_a_damaged_checkpoint_and_sets_it_aside(setup, caplog):
    ctx, _, save = setup
    first, second = save(5), save(10)
    truncate(second / SHARD)
    before = tree_digest(second)
    assert checkpoint_to_resume(ctx) == first
    [(damaged, problem)] = ctx.damaged
    assert damaged == second and problem.startswith(f"{SHARD}: size")
    assert second.is_dir(), "verifying only reads: a finished stage's rerun touches nothing"

    with caplog.at_level(logging.WARNING, logger="rlhf"):
        # what resume() does once the run starts writing
        set_aside_damaged(ctx, first)
    [msg] = rlhf_lines(caplog)
    assert str(second) in msg and SHARD in msg and "size" in msg and f"resuming from {first}" in msg
    aside = second.with_name(second.name + ".damaged")
    assert not second.exists() and tree_digest(aside) == before, (
        "moved aside whole, nothing deleted"
    )
    assert latest_checkpoint(ctx.ckpt_dir) == first
    # rotation sees step_<N> directories only
    save(15, keep=1)
    assert aside.is_dir() and not first.exists()


def test_when_no_checkpoint_verifies_the_stage_starts_over(setup, caplog):
    ctx, _, save = setup
    first, second = save(5), save(10)
    flip_byte(first / SHARD)
    (second / ".metadata").unlink()
    assert checkpoint_to_resume(ctx) is None
    assert [c for c, _ in ctx.damaged] == [second, first]
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        set_aside_damaged(ctx, None)
    lines = rlhf_lines(caplog)
    assert len(lines) == 2 and all("the stage starts over" in line for line in lines)
    assert sorted(p.name for p in ctx.ckpt_dir.iterdir()) == [
        "step_00000005.damaged",
        "step_00000010.damaged",
    ]


def test_a_checkpoint_written_before_manifests_is_accepted(setup):
    ctx, _, save = setup
    ckpt = save(5)
    state = json.loads((ckpt / STATE_FILE).read_text())
    del state[MANIFEST]
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    # nothing to check it against: taken as it always was
    flip_byte(ckpt / "rng_rank0.pt")
    assert verify_checkpoint(ckpt, ctx.mesh) is None
    assert checkpoint_to_resume(ctx) == ckpt and ctx.damaged == []


def test_an_explicit_damaged_checkpoint_exits_2_naming_file_and_check(setup):
    ctx, _, save = setup
    save(5)
    ckpt = save(10)
    truncate(ckpt / SHARD)
    ctx.cfg.run.resume = ckpt.name  # relative: inside <stage>/checkpoints
    with pytest.raises(
        ConfigError, match=rf"step_00000010 is damaged \({SHARD}: size \d+ bytes, expected \d+\)"
    ):
        checkpoint_to_resume(ctx)
    assert ckpt.is_dir()


def test_a_finished_stage_with_a_damaged_checkpoint_is_still_done_and_untouched(setup, caplog):
    ctx, _, save = setup
    first, second = save(5), save(10)
    flip_byte(second / SHARD)
    ctx.fingerprint = {"model": "abc"}
    ctx.cfg.train.max_steps = 10
    (ctx.out / "model").mkdir()
    (ctx.out / "model" / "config.json").write_text("{}")
    (ctx.out / DONE_FILE).write_text(
        json.dumps({"step": 10, "fingerprint": ctx.fingerprint, "outputs": ["model"]})
    )
    before = tree_digest(ctx.out)
    assert checkpoint_to_resume(ctx) == first
    with caplog.at_level(logging.INFO, logger="rlhf"):
        assert finished(ctx)
    line = rlhf_lines(caplog, logging.INFO)[-1]
    assert "already done" in line and f"continues it from {first}" in line
    assert tree_digest(ctx.out) == before


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["torch.save", "state file"])
def test_a_save_that_runs_out_of_space_keeps_the_previous_checkpoint(setup, monkeypatch, where):
    ctx, _, save = setup
    first = save(5, keep=1)
    before = tree_digest(first)
    if where == "torch.save":
        # DCP's shards and the RNG file: the first thing written
        monkeypatch.setattr(torch, "save", _no_space)
    else:
        # the last thing written: everything else is there
        monkeypatch.setattr(ck, "atomic_write_json", _no_space)
    with pytest.raises(SaveError) as e:
        save(10, keep=1)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("saving checkpoint step_00000010 failed: ")
    assert "No space left on device" in msg and msg.endswith(f"it resumes from {first}")
    assert e.value.exit_code == 4
    assert [p.name for p in ctx.ckpt_dir.iterdir()] == [first.name], (
        "no temporary directory left, no rotation"
    )
    assert tree_digest(first) == before and verify_checkpoint(first, ctx.mesh) is None


def test_an_export_that_fails_keeps_the_previous_export(tmp_path, monkeypatch):
    model = tiny_model("llama")
    out = tmp_path / "sft" / "model"
    write_hf(model, model.state_dict(), out)
    before = tree_digest(out)

    def half_written(path, **kwargs):
        (path / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(model, "save_pretrained", half_written)
    with pytest.raises(
        SaveError,
        match=f"saving the export {out} failed: .*Input/output error.*starts the stage over",
    ):
        write_hf(model, model.state_dict(), out)
    assert tree_digest(out) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]


def test_the_storage_error_is_found_in_the_forms_a_full_disk_takes():
    class Full(io.BytesIO):
        def write(self, b):
            if self.tell() > 100:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(b)

    with pytest.raises(RuntimeError) as short:
        # torch.save's C++ writer over a Python stream
        torch.save({"a": torch.zeros(1000)}, Full())
    assert write_failure(short.value) == "[Errno 28] No space left on device"
    # safetensors
    rust = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert write_failure(rust) == str(rust)
    # to a path
    cxx = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert "came out short" in write_failure(cxx)
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    except OSError as e:
        dcp_error = CheckpointException("write", {1: _wrap_exception(e)})
    assert write_failure(dcp_error) == "[Errno 122] Disk quota exceeded"
    assert write_failure(ValueError("a bug")) is None
