"""A checkpoint is whole or absent: everything it holds (the tokenizer included) is written before
its ``trainer_state.json`` marks it complete and it takes its final name."""

import json

from rlhf.config import EngineConfig, TrainConfig
from rlhf.engine.checkpoint import STATE_FILE, latest_checkpoint, load_checkpoint, save_checkpoint
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import TrainEngine
from tests.infer_helpers import tiny_model


class RecordingTokenizer:
    """Saves one file and records what the checkpoint directory looked like at that moment."""

    def __init__(self, ckpt_dir):
        self.ckpt_dir, self.seen = ckpt_dir, []

    def save_pretrained(self, path):
        path.mkdir(parents=True)
        (path / "tokenizer.json").write_text("{}")
        self.seen.append(
            {
                "dir": path.parent.name,
                "state_written": (path.parent / STATE_FILE).exists(),
                "complete": latest_checkpoint(self.ckpt_dir),
            }
        )


def test_the_tokenizer_is_inside_the_checkpoint_before_it_is_complete(tmp_path):
    mesh = Mesh()
    eng = TrainEngine(
        tiny_model("llama"), mesh, EngineConfig(), TrainConfig(lr=1e-2, warmup_steps=0)
    )
    ckpt_dir = tmp_path / "checkpoints"
    tok = RecordingTokenizer(ckpt_dir)
    extras = []

    def extra(d):  # as the EMA actor is saved
        (d / "ema.bin").write_bytes(b"x")
        extras.append(
            {
                "dir": d.name,
                "state_written": (d / STATE_FILE).exists(),
                "complete": latest_checkpoint(ckpt_dir),
            }
        )

    first = save_checkpoint(
        ckpt_dir, 5, {"actor": eng}, {"stage": "sft"}, mesh, tokenizer=tok, extra=extra
    )
    second = save_checkpoint(
        ckpt_dir, 10, {"actor": eng}, {"stage": "sft"}, mesh, tokenizer=tok, extra=extra
    )
    # written into the temporary directory, before the state file, while the newest complete
    # checkpoint was still the previous one
    for seen in (tok.seen, extras):
        assert [s["dir"].startswith(".step_") for s in seen] == [True, True]
        assert [s["state_written"] for s in seen] == [False, False]
        assert [s["complete"] for s in seen] == [None, first]
    assert latest_checkpoint(ckpt_dir) == second
    assert (second / "tokenizer" / "tokenizer.json").is_file() and (second / "ema.bin").is_file()
    assert json.loads((second / STATE_FILE).read_text())["step"] == 10
    assert load_checkpoint(second, {"actor": eng}, mesh)["stage"] == "sft"
