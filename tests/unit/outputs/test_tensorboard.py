"""logger.tensorboard: every metrics.jsonl line as TensorBoard scalars at its step (read back with
TensorBoard's own EventAccumulator), flushed line by line (a run that never closes keeps them), a
resume hiding what an earlier run wrote after its checkpoint, a fresh run moving old events aside;
and the missing package refused at the configuration (tests/e2e/test_tensorboard.py: through the
CLI)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from rlhf.config import LoggerConfig
from rlhf.errors import ConfigError
from rlhf.outputs.log import MetricsWriter


def events(directory: Path) -> dict:
    """{tag: [(step, value), ...]} as TensorBoard reads the directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def jsonl_as_events(path: Path) -> dict:
    """metrics.jsonl's numbers as TensorBoard stores them: float32, null as NaN."""
    out: dict = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        for k, v in rec.items():
            if k != "step":
                out.setdefault(k, []).append(
                    (rec["step"], float(np.float32(math.nan if v is None else v)))
                )
    return out


def same(a: dict, b: dict) -> bool:
    def key(d):
        return {k: [(s, "nan" if math.isnan(v) else v) for s, v in rows] for k, rows in d.items()}

    return key(a) == key(b)


def cfg(tmp_path: Path, tb_dir=None):
    return SimpleNamespace(
        logger=SimpleNamespace(wandb="disabled", tensorboard=True, tensorboard_dir=tb_dir),
        run=SimpleNamespace(dir=str(tmp_path)),
    )


def test_lines_as_scalars_resume_and_fresh_run(tmp_path):
    path = tmp_path / "sft" / "metrics.jsonl"
    tb = tmp_path / "tensorboard" / "sft"
    w = MetricsWriter(path, is_main=True, resume_step=None, cfg=cfg(tmp_path), stage="sft")
    for step in range(1, 5):
        w.log(
            step,
            loss=1.0 / step,
            lr=3e-3 * step,
            nonfinite=float("nan") if step == 2 else 0.5,
            count=step,
        )
    # not closed (a run killed or stopped by a signal): every line is there already
    got = events(tb)
    assert set(got) == {"loss", "lr", "nonfinite", "count", "mem/peak_gb"}
    assert same(got, jsonl_as_events(path)) and [s for s, _ in got["loss"]] == [1, 2, 3, 4]
    w.close()

    # resumed from the checkpoint of step 2: the file drops steps 3-4, TensorBoard hides them
    w = MetricsWriter(path, is_main=True, resume_step=2, cfg=cfg(tmp_path), stage="sft")
    for step in (3, 4, 5):
        w.log(step, loss=10.0 + step, lr=0.0, nonfinite=0.0, count=step)
    w.close()
    got = events(tb)
    assert same(got, jsonl_as_events(path))
    assert got["loss"] == [(1, 1.0), (2, np.float32(0.5)), (3, 13.0), (4, 14.0), (5, 15.0)]

    # a fresh run over it: the earlier events move aside whole, as metrics.jsonl does
    before = events(tb)
    w = MetricsWriter(path, is_main=True, resume_step=None, cfg=cfg(tmp_path), stage="sft")
    w.log(1, loss=7.0)
    w.close()
    assert events(tb)["loss"] == [(1, 7.0)] and same(events(tb.with_name("sft.prev")), before)

    # logger.tensorboard_dir: <dir>/<stage>
    w = MetricsWriter(
        tmp_path / "ppo" / "metrics.jsonl",
        is_main=True,
        resume_step=None,
        cfg=cfg(tmp_path, str(tmp_path / "tb")),
        stage="ppo",
    )
    w.log(1, x=1.0)
    w.close()
    assert events(tmp_path / "tb" / "ppo")["x"] == [(1, 1.0)]
    # other ranks write nothing
    w = MetricsWriter(
        tmp_path / "r1" / "metrics.jsonl",
        is_main=False,
        resume_step=None,
        cfg=cfg(tmp_path, str(tmp_path / "tb1")),
        stage="ppo",
    )
    w.log(1, x=1.0)
    w.close()
    assert not (tmp_path / "tb1").exists()


def test_missing_package_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard: ImportError
    with pytest.raises(
        ConfigError, match=r"logger.tensorboard=true needs the tensorboard package.*pip install"
    ):
        LoggerConfig(tensorboard=True)
    LoggerConfig(tensorboard=False)  # (only asked for)


def test_samples_as_a_text_table(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = MetricsWriter(
        tmp_path / "ppo" / "metrics.jsonl",
        is_main=True,
        resume_step=None,
        cfg=cfg(tmp_path),
        stage="ppo",
    )
    w.samples(
        10, "rollout", [{"prompt": "What is 2 + 2?", "response": "4|x\nz", "parts": {"rule": 1.0}}]
    )
    w.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "ppo"), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("samples/rollout/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 10
    assert text.splitlines() == [
        "| prompt | response | parts |",
        "| --- | --- | --- |",
        '| What is 2 + 2? | 4\\|x<br>z | {"rule": 1.0} |',
    ]
