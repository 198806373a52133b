"""What a run records about itself (issue 28): peak memory on every metrics line (summary.json,
report.png), gold evaluation that says its size and can be turned off, and the saved configuration
rlhf.eval reads."""

import importlib.util
import json
import logging
import sys
import types

import pytest

from rlhf import host_memory, report, summary
from rlhf.compose import compose_config
from rlhf.errors import ConfigError
from rlhf.outputs.log import MetricsWriter, PeakMemory, Progress
from tests.conftest import ROOT


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_every_metrics_line_has_the_peak_memory_since_the_previous_one(tmp_path):
    w = MetricsWriter(tmp_path / "metrics.jsonl", is_main=True, resume_step=None)
    w.log(1, loss=1.0)
    # touched: resident, then given back before the next line
    block = bytearray(400_000_000)
    block[::4096] = b"\x01" * len(block[::4096])
    del block
    w.log(2, loss=0.5)
    w.log(3, loss=0.25)
    w.close()
    peaks = [r["mem/peak_gb"] for r in _rows(tmp_path / "metrics.jsonl")]
    assert all(p > 0 for p in peaks), peaks
    # the 0.4 GB held for a while between lines 1 and 2
    assert peaks[1] >= peaks[0] + 0.35, peaks
    if PeakMemory().interval:
        # Linux: reset after each line, so line 3 no longer shows it
        assert peaks[2] <= peaks[1] - 0.35, peaks


def test_whole_process_peaks_survive_the_per_line_resets(monkeypatch):
    """bench/stage_peak.py (the benches' peak_rss_gb) reads the process's peak at its end: the
    resets behind mem/peak_gb must not hide a peak from it."""
    from rlhf.outputs import log

    spec = importlib.util.spec_from_file_location("stage_peak", ROOT / "bench" / "stage_peak.py")
    stage_peak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage_peak)
    memory = PeakMemory()
    # the counters start from the current resident set
    memory.read()
    monkeypatch.setattr(log, "_before_resets", {})
    base = host_memory.status_kb("VmRSS") * 1024 / 2**30
    block = bytearray(400_000_000)
    block[::4096] = b"\x01" * len(block[::4096])
    del block
    # the block is in this line's figure, and out of the counters from here on
    memory.read()
    assert stage_peak.peak()["peak_rss_gb"] >= base + 0.35


def test_peak_memory_on_cuda_is_the_device_allocation_reset_per_line(monkeypatch):
    """The device branch (no GPU here): max_memory_allocated in GiB, then a reset for the next
    line."""
    from rlhf.outputs import log

    resets = []
    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        max_memory_allocated=lambda: 3 * 2**30,
        max_memory_reserved=lambda: 4 * 2**30,
        reset_peak_memory_stats=lambda: resets.append(1),
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(log, "_before_resets", {})
    assert PeakMemory().read() == 3.0 and resets == [1]
    assert log.peaks_before_resets() == {"gpu": 3 * 2**30, "gpu_reserved": 4 * 2**30}


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run_with_memory(run):
    _write(
        run / "sft/metrics.jsonl",
        [{"step": s, "loss": 1.0 / s, "mem/peak_gb": m} for s, m in ((1, 1.5), (2, 2.5), (3, 2.0))],
    )
    _write(
        run / "ppo/metrics.jsonl",
        [{"step": s, "reward/mean": 0.1 * s, "mem/peak_gb": 4.0 + s} for s in (1, 2)],
    )
    return run


def test_summary_holds_each_stage_peak_memory_and_copes_without_gold(tmp_path):
    # and no gold/* anywhere (eval.gold_prompts=0)
    run = _run_with_memory(tmp_path)
    s = summary.build_summary(run, {"sft": 1.0})
    assert s["sft"] == {"mem/peak_gb": 2.5}  # the largest, not the last
    assert s["ppo"] == {"reward/mean": 0.2, "mem/peak_gb": 6.0}


def test_report_draws_every_stage_peak_memory(tmp_path):
    import matplotlib.pyplot as plt

    fig = report.figure(_run_with_memory(tmp_path))
    # a panel a stage
    mem = {ax.get_title().split(":")[0]: ax for ax in fig.axes if "peak memory" in ax.get_title()}
    assert list(mem) == ["sft", "ppo"] and [ln.get_label() for ln in mem["sft"].lines] == ["sft"]
    assert list(mem["sft"].lines[0].get_ydata()) == [1.5, 2.5, 2.0]
    plt.close(fig)


def test_progress_counts_other_units(caplog):
    p = Progress(
        total=32,
        initial=0,
        desc="gold",
        bar=False,
        status=True,
        interval=1e9,
        unit="response",
        log=logging.getLogger("test-progress"),
    )
    with caplog.at_level(logging.INFO, logger="test-progress"):
        p.step(n=16)
        p.step(n=16)
    assert [r.getMessage().split(" eta")[0].rsplit(" ", 2)[0] for r in caplog.records] == [
        "gold: 32/32 responses (100%)"
    ]
    assert caplog.records[0].getMessage().split(" eta")[0].endswith("responses/s")


def test_gold_prompts_zero_turns_the_gold_evaluation_off(monkeypatch, caplog):
    from rlhf.runtime import evaluation

    cfg, _ = compose_config(["stage=sft", "eval.gold_prompts=0"])
    assert cfg.eval.gold_prompts == 0
    with pytest.raises(ConfigError, match=r"eval.gold_prompts=-1"):
        compose_config(["stage=sft", "eval.gold_prompts=-1"])

    def never(*a, **k):
        raise AssertionError("no generation with eval.gold_prompts=0")

    monkeypatch.setattr(evaluation, "_said", set())
    with caplog.at_level(logging.INFO, logger="rlhf"):
        for _ in range(3):
            assert evaluation.evaluate_gold(never, None, [], None, cfg.eval, mesh=None) == {}
    assert [r.getMessage() for r in caplog.records if "gold_prompts=0" in r.getMessage()] == [
        "eval.gold_prompts=0: no gold evaluation (no gold/score in metrics.jsonl or summary.json)"
    ]


@pytest.mark.parametrize(
    "n, micro, world", [(16, 256, 1), (10, 3, 1), (10, 3, 4), (7, 2, 3), (3, 8, 4), (0, 4, 2)]
)
def test_global_batch_sizes_count_every_rank(n, micro, world):
    from rlhf.runtime.evaluation import global_batch_sizes
    from rlhf.runtime.stage import rank_batches

    per_rank = [
        list(rank_batches(n, micro, types.SimpleNamespace(rank=r, world_size=world)))
        for r in range(world)
    ]
    assert global_batch_sizes(n, micro, world) == [
        sum(len(b[t]) for b in per_rank) for t in range(len(per_rank[0]))
    ]


def _seeds():
    spec = importlib.util.spec_from_file_location("bench_seeds", ROOT / "bench" / "seeds.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_seeds_figures_without_gold(tmp_path):
    _write(tmp_path / "sft/metrics.jsonl", [{"step": 2, "loss": 1.0}])
    _write(tmp_path / "ppo/metrics.jsonl", [{"step": 2, "reward/mean": 0.5}])
    figs = _seeds().figures(tmp_path, ["sft", "ppo"], {"sft": 1.0, "ppo": 2.0})
    assert figs == {"sft_seconds": 1.0, "ppo_seconds": 2.0, "seconds": 3.0}


def test_eval_reads_the_configuration_of_the_policy_stage_else_the_newest(tmp_path):
    import os

    from rlhf.eval import run_config

    run = tmp_path / "run"
    for i, stage in enumerate(("sft", "ppo")):
        (run / stage).mkdir(parents=True)
        (run / stage / "config.yaml").write_text("stage: x\n")
        os.utime(run / stage / "config.yaml", (1000 + i, 1000 + i))
    assert run_config(run / "sft" / "model", None) == (run / "sft" / "config.yaml").resolve()
    assert run_config(run / "sft" / "model", run) == (run / "sft" / "config.yaml").resolve()
    elsewhere = tmp_path / "other" / "model"
    assert run_config(elsewhere, run) == run / "ppo" / "config.yaml"  # the newest
    assert run_config(elsewhere, None) is None
    assert run_config(elsewhere, tmp_path / "empty") is None


def test_compose_base_stands_under_the_command_line():
    """rlhf.eval's composition: the saved run's data/eval over the defaults, the command line over
    both."""
    base = {
        "data": {"eval_size": 16, "synthetic": {"max_operand": 20}},
        "eval": {"gold_prompts": 4, "gold_samples": 1},
    }
    cfg, _ = compose_config(["stage=sft", "eval.gold_samples=3"], base=base)
    assert (cfg.data.eval_size, cfg.data.synthetic.max_operand) == (16, 20)
    assert (cfg.eval.gold_prompts, cfg.eval.gold_samples) == (4, 3)
