"""The static decode step (the CUDA decode loop: engine.cuda_graphs) checked on the CPU, where it is
not the default: the same tokens and log-probs as the row-removing loop and HF generate, no host
synchronisation inside a step, a full graph under torch.compile, and the graph path's bookkeeping
(capture before the state is set, replay per span, release) with the CUDA calls stood in for."""

import logging
import weakref

import pytest
import torch
import torch._dynamo

from rlhf.compose import compose_config
from rlhf.config import EngineConfig
from rlhf.engine import decode_static
from rlhf.engine.decode_static import StaticDecoder, bucket
from rlhf.engine.graphs import WARMUP_STEPS
from rlhf.engine.hybrid import decode_loop
from rlhf.errors import ConfigError
from rlhf.ops import SamplingParams
from tests.device_guard import DeviceDiscipline
from tests.infer_helpers import EOS, PAD, mixed_prompts, tiny_model
from tests.sync_guard import HostSyncs
from tests.unit.engine.test_inference import hybrid

NEW = 12
# key spans of 8 slots: the prompts (4-14 tokens) + 12 new tokens cross two or three of them
CHUNK = 8


def eos_prone(family: str, boost: float = 1.0, **kw):
    """A tiny model whose rows end (EOS) at different steps, some before NEW (``boost``: per
    model)."""
    m = tiny_model(family, perturb=True, **kw)
    with torch.no_grad():
        m.lm_head.weight[EOS] += boost * m.lm_head.weight.abs().max()
    return m


def generate(hy, decode: str, sp: SamplingParams, prompts, chunk: int = CHUNK, sync_every: int = 3):
    """One generation through the inference model with the given decode loop (a fresh model)."""
    model = hy.build_inference_model()
    model.decode, model.span_chunk, model.sync_every = decode, chunk, sync_every
    return model, model.generate(prompts, sp, eos_id=EOS, pad_id=PAD)


@torch.no_grad()
def hf_greedy_until_eos(model, prompts, max_new: int) -> torch.Tensor:
    """HF generate, greedy, stopping rows at EOS (pad after it), padded to ``max_new`` columns."""
    from rlhf.engine.infer import left_pad

    ids, mask = left_pad(prompts, PAD)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )[:, ids.shape[1] :]
    return torch.cat([out, out.new_full((out.shape[0], max_new - out.shape[1]), PAD)], 1)


def assert_logprobs_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """fp32: within 4e-6 of each other, relative to the log-prob's size (a few ulps of the logits,
    through the log-softmax: 1.2e-6 seen; the static step's keys span masked slots and its GEMMs
    more rows, which changes roundings)."""
    gap = ((a - b).abs() / b.abs().clamp(min=1.0)).max().item()
    assert gap <= 4e-6, gap


def test_config_keys_and_the_loop_each_device_gets():
    assert EngineConfig().cuda_graphs == "auto" and EngineConfig().decode_sync_every == 8
    cfg = compose_config(["engine.cuda_graphs=off", "engine.decode_sync_every=4"])[0].engine
    assert (cfg.cuda_graphs, cfg.decode_sync_every) == ("off", 4)
    with pytest.raises(ConfigError, match=r"engine.cuda_graphs"):
        EngineConfig(cuda_graphs="on")
    with pytest.raises(ConfigError, match=r"engine.decode_sync_every"):
        EngineConfig(decode_sync_every=0)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert decode_loop(EngineConfig(), cpu, 1) == "dynamic"  # the CPU keeps the row-removing loop
    assert decode_loop(EngineConfig(), cuda, 1) == "graphs"
    assert decode_loop(EngineConfig(), cuda, 2) == "static"  # NCCL all-reduces stay out of graphs
    assert decode_loop(EngineConfig(cuda_graphs="off"), cuda, 1) == "dynamic"
    assert hybrid(tiny_model("llama"))[1].build_inference_model().decode == "dynamic"


def test_buckets_and_spans():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 72]
    key = decode_static.StaticKey.of(5, 13, SamplingParams(max_new_tokens=12), EOS, PAD, chunk=8)
    assert (key.rows, key.length) == (8, 32)
    dec = StaticDecoder(
        hybrid(tiny_model("llama"))[1].build_inference_model(), key, torch.device("cpu")
    )
    assert dec.cache.shape[1:3] == (8, 32) and dec.out_tok.shape == (8, 32)
    assert [dec.span(end) for end in (1, 8, 9, 25, 32)] == [8, 8, 16, 32, 32]


# greedy rows of each end at 3-6 different steps (the EOS boost chosen per model for that)
FAMILIES = {
    "llama": ("llama", dict(boost=1.8)),
    "qwen3": ("qwen3", {}),
    "mistral_window": ("mistral", dict(sliding_window=5)),  # a window shorter than the prompts
    "phi3_partial_rotary": ("phi3", dict(boost=0.6, partial_rotary_factor=0.5)),
}


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_static_greedy_equals_the_row_removing_loop_and_hf(case):
    family, kw = FAMILIES[case]
    model = eos_prone(family, **kw)
    prompts = mixed_prompts(7)  # 7 rows: a bucket of 8, one padding row
    assert len({len(p) for p in prompts}) > 3  # left padding of several lengths
    _, hy = hybrid(model)
    sp = SamplingParams(temperature=0, max_new_tokens=NEW)
    _, ref = generate(hy, "dynamic", sp, prompts)
    ends = set(ref.response_mask.sum(1).tolist())
    # rows end at different steps, some early
    assert len(ends) >= 3 and min(ends) < NEW
    assert torch.equal(ref.responses, hf_greedy_until_eos(model, prompts, NEW))
    for sync_every in (1, 4, 100):
        _, out = generate(hy, "static", sp, prompts, sync_every=sync_every)
        assert torch.equal(out.sequences, ref.sequences) and torch.equal(
            out.response_mask, ref.response_mask
        )
        assert_logprobs_close(out.logprobs, ref.logprobs)
        assert (out.logprobs[ref.response_mask == 0] == 0).all()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_static_sampling_draws_what_the_row_removing_loop_draws(family):
    """Same seed, same rollouts: each running row takes the draw the row-removing loop gives it,
    also across min_new_tokens (EOS banned), top-k/top-p, several samples per prompt."""
    _, hy = hybrid(eos_prone(family))
    sp = SamplingParams(
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        max_new_tokens=NEW,
        min_new_tokens=2,
        samples_per_prompt=2,
        seed=4,
    )
    _, ref = generate(hy, "dynamic", sp, mixed_prompts(5))
    _, out = generate(hy, "static", sp, mixed_prompts(5))
    assert (
        len(set(ref.response_mask.sum(1).tolist())) >= 3 and (ref.response_mask.sum(1) >= 3).all()
    )
    assert torch.equal(out.sequences, ref.sequences)
    assert_logprobs_close(out.logprobs, ref.logprobs)
    _, other = generate(
        hy, "static", SamplingParams(**{**sp.__dict__, "seed": 5}), mixed_prompts(5)
    )
    assert not torch.equal(other.sequences, ref.sequences)


def test_same_shapes_give_the_same_bits():
    """With keys spanning exactly the filled slots and a full bucket running to the end, the static
    step computes what the row-removing loop computes, bit for bit."""
    _, hy = hybrid(tiny_model("llama", perturb=True), inference_kernels="reference")
    sp = SamplingParams(
        temperature=0.8, max_new_tokens=NEW, min_new_tokens=NEW, samples_per_prompt=2, seed=1
    )
    _, ref = generate(hy, "dynamic", sp, mixed_prompts(4))
    _, out = generate(hy, "static", sp, mixed_prompts(4), chunk=1)
    assert torch.equal(out.sequences, ref.sequences) and torch.equal(out.logprobs, ref.logprobs)


def test_the_sync_guard_sees_each_kind_of_synchronisation():
    x = torch.arange(6, device="cpu")
    reads = [
        lambda: x[0].item(),
        lambda: bool(x.any()),
        lambda: int(x[1]),
        lambda: x.tolist(),
        lambda: x.nonzero(),
        lambda: x[x > 2],
        lambda: x.clone().masked_fill_(x > 2, 0).unique(),
        lambda: x[x[1] :],
        lambda: x.masked_select(x > 2),
        lambda: 1 if x[2] > 1 else 0,
    ]
    for read in reads:
        with HostSyncs() as syncs:
            read()
        assert len(syncs.log) == 1 and "test_inference_static.py" in syncs.log[0], syncs.log
    with HostSyncs() as syncs:  # what the static step does instead
        a = x > 2
        (
            x[torch.tensor([1, 2], device="cpu")],
            torch.where(a, x, 0),
            a.long().cumsum(0),
            x.clone().index_fill_(0, x[:1], 7),
        )
    assert syncs.log == []


def test_a_static_step_never_synchronises_with_the_host():
    """Under a guard that records every value read back, data-dependent shape and device copy: none
    in a step; in a whole generation only the every-k-steps check; the row-removing loop, the
    positive control, synchronises every step."""
    _, hy = hybrid(eos_prone("llama"))
    sp = SamplingParams(
        temperature=1.0, top_k=10, top_p=0.9, max_new_tokens=NEW, min_new_tokens=2, seed=2
    )
    model, _ = generate(hy, "static", sp, mixed_prompts(6))
    dec = model._static
    model._kv = list(dec.cache.unbind(0))
    with torch.inference_mode():
        dec.park()
        with HostSyncs() as syncs:
            for span in (8, 16, 24):
                dec.step(model, span)
    assert syncs.log == []
    prompts = mixed_prompts(6)
    for sync_every in (1, 4):
        model.sync_every = sync_every
        with HostSyncs() as syncs:
            model.generate(prompts, sp, eos_id=EOS, pad_id=PAD)
        checks = len([t for t in range(1, NEW - 1) if t % sync_every == 0])
        assert len(syncs.log) == checks and all("decode_static.py" in line for line in syncs.log), (
            syncs.log
        )
    dynamic = hy.build_inference_model()
    with HostSyncs() as syncs:
        dynamic.generate(prompts, sp, eos_id=EOS, pad_id=PAD)
    assert len(syncs.log) >= NEW - 1


def _compile_and_compare(backend: str):
    torch._dynamo.reset()
    _, hy = hybrid(eos_prone("llama"), inference_kernels="reference")
    sp = SamplingParams(temperature=0, max_new_tokens=NEW)
    model, ref = generate(hy, "static", sp, mixed_prompts(6))
    dec = model._static
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    # fullgraph: a graph break is an error; dynamic=False: one graph per span, as CUDA graphs are
    dec.step = torch.compile(dec.step, backend=counting, fullgraph=True, dynamic=False)
    # the same key: the same decoder
    out = model.generate(mixed_prompts(6), sp, eos_id=EOS, pad_id=PAD)
    assert model._static is dec
    spans = {dec.span(ref.prompt_len + t) for t in range(1, NEW)}
    assert len(graphs) == len(spans) >= 2
    torch._dynamo.reset()
    return ref, out


def test_the_static_step_is_one_graph_for_torch_compile():
    """Dynamo traces the whole step (fullgraph=True, dynamic=False), functionalised by AOTAutograd
    (what Inductor would compile); the traced step gives the eager step's tokens and log-probs."""
    ref, out = _compile_and_compare("aot_eager")
    assert torch.equal(out.sequences, ref.sequences) and torch.equal(out.logprobs, ref.logprobs)


@pytest.mark.slow
def test_the_static_step_compiles_with_inductor():
    """The same with Inductor's CPU code (~20 s of compilation): the eager step's greedy tokens."""
    ref, out = _compile_and_compare("inductor")
    assert torch.equal(out.sequences, ref.sequences)
    assert_logprobs_close(out.logprobs, ref.logprobs)


class EagerGraphs:
    """StepGraphs with the CUDA calls stood in for: the warm-up steps run for real (as on a GPU),
    a "capture" keeps the step, a replay runs it."""

    fail = False

    def __init__(self, device):
        self.graphs, self.replayed, self.captured_when_state = {}, [], []

    def capture(self, step, park, spans):
        if EagerGraphs.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        for span in [s for s in spans if s not in self.graphs]:
            for _ in range(WARMUP_STEPS):
                park()
                step(span)
            self.graphs[span] = lambda span=span: step(span)

    def replay(self, span):
        self.replayed.append(span)
        self.graphs[span]()

    def release(self):
        self.graphs.clear()


def test_graph_path_bookkeeping(monkeypatch, caplog):
    """Captures (with their warm-up steps writing into the state) happen before the state is set,
    every span the generation reaches is captured once, replays follow the spans in order, a kept
    decoder reuses its graphs, and a capture that fails falls back to the eager step."""
    monkeypatch.setattr(decode_static, "StepGraphs", EagerGraphs)
    _, hy = hybrid(eos_prone("llama"))
    prompts = mixed_prompts(6)
    for sp in (
        SamplingParams(temperature=0, max_new_tokens=NEW),
        SamplingParams(
            temperature=1.0,
            top_p=0.9,
            max_new_tokens=NEW,
            min_new_tokens=3,
            samples_per_prompt=2,
            seed=3,
        ),
    ):
        _, ref = generate(hy, "dynamic", sp, prompts, sync_every=100)
        model, out = generate(hy, "graphs", sp, prompts, sync_every=100)
        assert torch.equal(out.sequences, ref.sequences)
        assert_logprobs_close(out.logprobs, ref.logprobs)
        graphs = model._static.graphs
        P = ref.prompt_len
        assert graphs.replayed == [model._static.span(P + t) for t in range(1, NEW)]
        assert sorted(graphs.graphs) == sorted(set(graphs.replayed))
        again = model.generate(prompts, sp, eos_id=EOS, pad_id=PAD)
        assert model._static.graphs is graphs and torch.equal(again.sequences, out.sequences)
        cache = weakref.ref(model._static.cache)
        model.release()
        assert model._static is None and cache() is None
    monkeypatch.setattr(EagerGraphs, "fail", True)
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        model, out = generate(hy, "graphs", sp, prompts)
    assert "CUDA graph capture failed" in caplog.text and model._static.graphs is None
    assert torch.equal(out.sequences, ref.sequences)


def test_static_state_lives_with_the_inference_weights():
    """engine.release_inference_cache=true: the static state goes with the weights after each call;
    false: kept and reused while the key (bucket, cache length, sampling) stays, replaced when
    not."""
    for release in (True, False):
        _, hy = hybrid(tiny_model("llama"), release_inference_cache=release)
        hy.decode = "static"
        sp = SamplingParams(temperature=0, max_new_tokens=6)
        hy.generate(mixed_prompts(3), sp)
        if release:
            assert hy._model is None
            continue
        dec = hy._model._static
        hy.generate(mixed_prompts(3), sp)
        assert hy._model._static is dec
        gone = weakref.ref(dec.cache)
        del dec
        hy.generate(mixed_prompts(3), SamplingParams(temperature=0.5, max_new_tokens=6))
        assert gone() is None and hy._model._static.key.temperature == 0.5


def test_static_loop_names_every_device():
    _, hy = hybrid(eos_prone("llama"))
    hy.decode = "static"
    with DeviceDiscipline() as guard:
        hy.generate(
            mixed_prompts(4),
            SamplingParams(temperature=1.0, max_new_tokens=6, samples_per_prompt=2, seed=0),
        )
    assert guard.calls >= 10
