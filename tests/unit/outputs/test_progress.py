"""Step progress: a status line every interval in a log file (never a redraw per step), and the
bar's postfix never forcing a redraw."""

import logging

from rlhf.outputs.log import Progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_status_line_every_interval_and_at_the_end(caplog):
    clock = Clock()
    p = Progress(
        total=100,
        initial=0,
        desc="sft",
        bar=False,
        status=True,
        interval=30.0,
        clock=clock,
        log=logging.getLogger("test-progress"),
    )
    with caplog.at_level(logging.INFO, logger="test-progress"):
        for i in range(100):
            clock.t += 1.0  # one step per second
            p.step(loss=f"{1.0 / (i + 1):.3f}")
    lines = [r.getMessage() for r in caplog.records]
    # at 30, 60, 90 s and the last step — not 100 redraws
    assert len(lines) == 4
    assert (
        lines[0].startswith("sft: step 30/100 (30%) loss=0.033")
        and "1.00 steps/s eta 1m10s" in lines[0]
    )
    assert lines[-1].startswith("sft: step 100/100 (100%)")


def test_no_status_off_rank_zero(caplog):
    clock = Clock()
    p = Progress(
        total=10,
        initial=0,
        desc="ppo",
        bar=False,
        status=False,
        clock=clock,
        log=logging.getLogger("test-progress"),
    )
    with caplog.at_level(logging.INFO, logger="test-progress"):
        for _ in range(10):
            clock.t += 100.0
            p.step()
    assert not caplog.records


def test_bar_postfix_does_not_force_a_refresh(monkeypatch):
    p = Progress(total=50, initial=0, desc="x", bar=True, status=False)
    refreshes = []
    monkeypatch.setattr(p.bar, "refresh", lambda *a, **k: refreshes.append(1))
    for _ in range(50):
        p.step(loss="0.1")
    p.close()
    # tqdm's own time-based redraws only (mininterval 1 s)
    assert len(refreshes) <= 3
