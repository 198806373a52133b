"""The DeepSpeed-Chat conversion on two ranks (tests/distributed/dschat_worker.py): each checks the
source, rank 0 converts while rank 1 waits, both go on with the same complete directory."""

import json

import pytest

from rlhf.models import dschat
from tests.conftest import run_worker
from tests.distributed import dschat_worker
from tests.unit.models.test_dschat import save_dschat


@pytest.mark.distributed
def test_two_ranks_convert_once(tmp_path):
    """Under torchrun: rank 0 converts while rank 1 waits, both read the same complete directory."""
    src, _ = save_dschat(tmp_path, "opt")
    out = tmp_path / "out"
    out.mkdir()
    run_worker(dschat_worker.__file__, str(src), str(tmp_path / "run"), str(out))
    got = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert got[0] == got[1] and got[0]["path"].startswith(str(tmp_path / "run" / "converted"))
    assert {"model.safetensors", "config.json", dschat.CONVERTED_FILE} <= set(got[0]["files"])
    assert len(list((tmp_path / "run" / "converted").iterdir())) == 1  # no temporary directory left
