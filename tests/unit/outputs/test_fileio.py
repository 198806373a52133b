"""Atomic writes and the cleanup of a killed writer's leftovers."""

import os
import subprocess
import sys

from rlhf.outputs.fileio import atomic_write_json, remove_stale_temps, replace_dir, temp_dir_for


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temps_of_dead_writers_are_removed_live_ones_kept(tmp_path):
    dead, live = _dead_pid(), os.getppid()
    (tmp_path / f".step_00000004.tmp-{dead}").mkdir()
    (tmp_path / f".step_00000004.tmp-{dead}" / "shard.distcp").write_bytes(b"x")
    (tmp_path / f".step_00000002.old-{dead}").mkdir()
    (tmp_path / f".trainer_state.json.tmp-{dead}").write_text("{")
    (tmp_path / f".step_00000006.tmp-{live}").mkdir()
    (tmp_path / "step_00000002").mkdir()
    remove_stale_temps(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f".step_00000006.tmp-{live}",
        "step_00000002",
    ]


def test_replace_dir_swaps_whole_directories(tmp_path):
    final = tmp_path / "model"
    for version in (1, 2):
        tmp = temp_dir_for(final)
        atomic_write_json(tmp / "v.json", {"v": version})
        replace_dir(tmp, final)
    assert (final / "v.json").read_text().strip().endswith("}") and '"v": 2' in (
        final / "v.json"
    ).read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
