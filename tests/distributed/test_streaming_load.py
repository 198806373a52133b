"""Streamed loading (rlhf/models/streaming.py): 2 ranks (torchrun, gloo) that each read their part
of a saved model give exactly the parameters and buffers of the model one process loads whole
(today's path), under ZeRO-3, 2, 1 and 0, for causal LMs (sharded checkpoint with an index, bf16 on
disk; tied and untied embeddings grown by the tokenizer's pad; nothing grown), a reward model with a
new seeded head, a critic whose head rank 0 scales, LoRA with a trained copy of the embeddings; rank
0 reads no more than its share; a .bin checkpoint and one Transformers converts on load fall back to
loading whole with their log line."""

import json

import pytest
import torch

from rlhf.engine.mesh import Mesh
from tests.conftest import run_worker
from tests.distributed import streaming_worker as w

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming_models")
    w.make_models(root)
    return root


@pytest.fixture(scope="module")
def two_ranks(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("streaming_out")
    run_worker(w.__file__, str(models), str(out))
    return out


def _record(out, case, zero, rank):
    tag = f"{case}_zero{zero}_rank{rank}"
    return json.loads((out / f"{tag}.json").read_text())


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), (what, set(got) ^ set(want))
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), (what, k)


@pytest.mark.parametrize("case", list(w.CASES))
def test_two_ranks_equal_one_process_loaded_whole(models, two_ranks, case):
    ref = w.build(case, models, Mesh())  # one process: loaded whole, as before
    assert not any(hasattr(p, "_rlhf_source") for p in ref.parameters())
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    buffers = {k: v.detach() for k, v in ref.named_buffers()}
    for zero in w.CASES[case][3]:
        for rank in (0, 1):
            tag = f"{case}_zero{zero}_rank{rank}"
            if rank == 0 or zero < 2:
                # rank 0's full state dict (gathered under FSDP2); DDP: every rank's
                _assert_same(torch.load(two_ranks / f"{tag}_state.pt"), want, tag)
            _assert_same(torch.load(two_ranks / f"{tag}_buffers.pt"), buffers, tag + " buffers")
            record = _record(two_ranks, case, zero, rank)
            if case in w.FALLBACK:
                # rank 0 loaded it whole, as before, and said why
                assert record["read"] == {}, (tag, record["read"])
                if rank == 0:
                    assert [
                        x for x in record["log"] if w.FALLBACK[case] in x and "rank 0 load" in x
                    ], record["log"]
            else:
                # streamed: each rank read from the files
                assert record["read"], tag


def _checkpoint_bytes(folder) -> dict:
    from safetensors import safe_open

    sizes = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                sizes[f"{f.name}:{k}"] = n * {"F32": 4, "BF16": 2}[t.get_dtype()]
    return sizes


@pytest.mark.parametrize("case", ["tied_fits", "untied_sharded", "lora"])
def test_each_rank_reads_its_share(models, two_ranks, case):
    """ZeRO-2/3: each decoder-block tensor is read once over the two ranks, half by each; rank 0
    reads about half of the checkpoint (plus the embeddings once more where the tokenizer grows
    them: the resize reads them whole). ZeRO-0/1: every rank reads every tensor whole."""
    sizes = _checkpoint_bytes(models / w.CASES[case][0])
    total = sum(sizes.values())
    for zero in w.CASES[case][3]:
        reads = [_record(two_ranks, case, zero, r)["read"] for r in (0, 1)]
        layers = [k for k in sizes if ".layers." in k]
        if zero < 2:
            for r in reads:
                assert {k: r.get(k) for k in layers} == {k: sizes[k] for k in layers}, zero
            continue
        for k in layers:
            assert reads[0].get(k, 0) + reads[1].get(k, 0) == sizes[k], (zero, k)
            assert 0 < reads[0].get(k, 0) < sizes[k], (zero, k)
        resize = (
            0
            if case == "tied_fits"
            else sum(v for k, v in sizes.items() if "embed_tokens" in k or "lm_head" in k)
        )
        assert sum(reads[0].values()) <= total / 2 + resize + 0.02 * total, (zero, reads[0], total)
        assert sum(reads[1].values()) <= total / 2 + 0.02 * total, (zero, reads[1], total)
