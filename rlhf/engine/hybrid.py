"""The hybrid engine: one ``generate`` call for the trainer, whichever mode makes the tokens.

``engine.hybrid=true``: switch the actor from ZeRO-3 training mode to the injected inference mode —
gather the FSDP2 shards one decoder layer at a time (bounded extra memory: one gathered layer plus
the inference copy), lay the weights out for ``engine.inference_tp_size``, allocate the KV cache,
generate, release cache and weights, return to training mode. Each phase is timed
(``Generation.timings``). ``engine.hybrid=false``: HF ``generate`` on the training-mode model (the
baseline). A model family without an injection policy also takes that path, with a one-line warning.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator, List, Optional

import torch

from rlhf import seeding
from rlhf.config import EngineConfig
from rlhf.engine.draws import strided_keys
from rlhf.engine.infer import Generation, InferenceModel, finish, left_pad
from rlhf.engine.mesh import DTYPES, inference_dtype_of
from rlhf.engine.rows import take
from rlhf.engine.train import TrainEngine
from rlhf.errors import ConfigError
from rlhf.models.loading import decoder_layers
from rlhf.models.lora import unwrap
from rlhf.models.policies import policy_for
from rlhf.ops import SamplingParams
from rlhf.ops.sampling import prompt_major

log = logging.getLogger("rlhf")


class HybridEngine:
    def __init__(self, engine: TrainEngine, tokenizer, ecfg: EngineConfig):
        self.engine, self.mesh, self.ecfg = engine, engine.mesh, ecfg
        self.eos_id, self.pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        self.policy, reason = policy_for(unwrap(engine.module).config)
        self.tp = ecfg.inference_tp_size
        self.inject = ecfg.hybrid and self.policy is not None
        if ecfg.hybrid and self.policy is None:
            log.warning("hybrid engine: %s; generating with HF generate instead", reason)
        if self.inject and self.tp > 1:
            why = self.policy.check_tp(self.tp)
            if why:
                raise ConfigError(why)
        self.dtype = DTYPES[inference_dtype_of(ecfg, self.mesh.device)]  # of the inference mode
        # kept when engine.release_inference_cache=false
        self._model: Optional[InferenceModel] = None
        # the engine's weights_version when _model was built
        self._model_version = -1
        # > 0 inside ``holding()``: the inference model is kept between calls
        self._hold = 0
        # (tests set it to "static" on the CPU)
        moe = self.policy is not None and self.policy.num_experts > 0
        self.decode = decode_loop(ecfg, self.mesh.device, self.tp, moe)
        # a Mixture-of-Experts model's generations carry each token's experts
        # (``Generation.routing``) for routing replay (rlhf/models/moe.py)
        self.record_routing = False

    @property
    def positions(self) -> int:
        """Positions the policy's learned position table holds (a prompt and its new tokens must
        fit); 0 for rotary positions."""
        return (
            self.policy.max_positions
            if self.policy is not None and self.policy.positions == "learned"
            else 0
        )

    # ---- the one call the trainer makes ----
    def generate(
        self, prompts: List[List[int]], sp: SamplingParams, keys: Optional[List[int]] = None
    ) -> Generation:
        """``sp.samples_per_prompt`` samples of each prompt. Collective: every rank calls it, the
        same number of times; a rank with no prompts takes part with one stand-in row and gets none
        back. ``keys``: each prompt's place in the global list of the call's prompts (default
        ``i·world + rank``: rank r holds prompts r, r+W, … — ``PromptSource``'s layout); a sample's
        draws depend on its key alone (``engine.draws.row_draws``), so the inference mode samples
        the same rollouts on any number of ranks."""
        if not prompts:
            return self.generate([[self.eos_id]], sp, [0]).rows(0, 0)
        if keys is None:
            keys = strided_keys(len(prompts), self.mesh.rank, self.mesh.world_size)
        was_training = self.engine.model.training
        self.engine.model.eval()
        try:
            if self.inject:
                return self._generate_injected(prompts, sp, keys)
            return self._generate_hf(prompts, sp)
        finally:
            self.engine.model.train(was_training)

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Keeps the inference model (weights in the inference layout) between the ``generate``
        calls inside — the turns of a multi-turn rollout, between which the weights do not change —
        and releases it at the end as ``engine.release_inference_cache`` says."""
        self._hold += 1
        try:
            yield
        finally:
            self._hold -= 1
            if not self._hold and self.ecfg.release_inference_cache and self._model is not None:
                self._model.release()
                self._model = None

    def rebuild_inference(self) -> None:
        """Drops the inference model kept between calls (engine.release_inference_cache=false, or
        inside ``holding()``): the next generation builds it afresh from the training weights (the
        rollout-parity guard's ``ppo.rollout_guard=rebuild``). Local to this rank; call it on every
        rank."""
        if self._model is not None:
            self._model.release()
            self._model = None
        self._model_version = -1

    # ---- inference mode ----
    def inference_weights(self, tp: Optional[int] = None, copy=None) -> tuple:
        """``(root, layers)``: the training weights gathered layer by layer into the inference
        layout of TP degree ``tp`` (default the engine's; this TP rank's slices) in the inference
        dtype. ``copy``: a function each layer's (and the root's) dict of tensors goes through while
        it is gathered (a rollout worker's shared copy); without it a tensor may share storage with
        a training weight."""
        tp = tp or self.tp
        root, shards = self.inference_shards(tp, [self.mesh.tp_rank if tp > 1 else 0], copy)
        return root, shards[0]

    @torch.no_grad()
    def inference_shards(self, tp: int, ranks: List[int], copy=None) -> tuple:
        """``(root, [layers of TP rank r for r in ranks])``: ``inference_weights`` for any TP
        ranks' slices at once, one gather per layer (a rollout worker of ``ppo.rollout_tp_size``
        ranks, fed by one trainer); the root weights are whole on every TP rank."""
        module, fsdp, pol = self.engine.module, self.engine.is_fsdp, self.policy
        keep = copy or (lambda d: d)
        shards: List[list] = [[] for _ in ranks]
        # (LoRA: the policy reads each adapted projection as W + B·A·α/r, computed out of place)
        for layer in decoder_layers(module):
            if fsdp:
                layer.unshard()
            for rank, layers in zip(ranks, shards):
                weights = pol.layer_weights(layer, rank, tp).items()
                layers.append(keep({k: v.to(self.dtype) for k, v in weights}))
            if fsdp:
                layer.reshard()
        if fsdp:
            module.unshard()
        root = pol.root_weights(unwrap(module))
        root = keep(
            {
                k: (v.to(self.dtype) if v.is_floating_point() and k != "inv_freq" else v)
                for k, v in root.items()
            }
        )
        if fsdp:
            module.reshard()
        return root, shards

    def build_inference_model(self) -> InferenceModel:
        """Gathers the training weights layer by layer into the inference layout (this TP rank's
        slices)."""
        root, layers = self.inference_weights()
        return inference_model(
            root,
            layers,
            self.policy,
            self.ecfg,
            self.dtype,
            self.decode,
            self.tp,
            self.mesh.tp_group,
        )

    def _generate_injected(
        self, prompts: List[List[int]], sp: SamplingParams, keys: List[int]
    ) -> Generation:
        t0 = time.perf_counter()
        # A TP group generates the prompts of all its ranks together, then each keeps its own.
        per_rank, per_rank_keys = zip(*self.mesh.tp_all_gather_object((prompts, list(keys))))
        # (a stand-in row stays in its group)
        # engine.release_inference_cache=false keeps the inference weights between calls and reuses
        # them while the training weights have not changed (no optimizer step since they were built:
        # e.g. the gold evaluation right after a rollout, or its sampled and greedy passes)
        reuse = self._model is not None and self._model_version == self.engine.weights_version
        if not reuse and self._model is not None:
            # stale: its weights, cache and graphs go first
            self._model.release()
            self._model = None
        model = self._model if reuse else self.build_inference_model()
        t1 = time.perf_counter()
        model.record_routing = self.record_routing
        out = model.generate(
            [p for ps in per_rank for p in ps],
            sp,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            keys=[k for ks in per_rank_keys for k in ks],
            device=self.mesh.device,
        )
        t2 = time.perf_counter()
        if self.ecfg.release_inference_cache and not self._hold:
            model.release()
            del model
        else:
            self._model, self._model_version = model, self.engine.weights_version
        t3 = time.perf_counter()
        if self.tp > 1:
            out = _rows(out, per_rank, self.mesh.tp_rank, sp.samples_per_prompt)
        out.timings = {
            "switch_s": (t1 - t0) + (t3 - t2),
            "gather_s": t1 - t0,
            "generate_s": t2 - t1,
            "release_s": t3 - t2,
        }
        return out

    # ---- baseline: HF generate on the training-mode model ----
    @torch.no_grad()
    def _generate_hf(self, prompts: List[List[int]], sp: SamplingParams) -> Generation:
        t0 = time.perf_counter()
        rows = prompt_major(prompts, sp.samples_per_prompt)
        ids, mask = left_pad(rows, self.pad_id, self.mesh.device)
        kwargs = dict(
            do_sample=sp.temperature > 0,
            max_new_tokens=sp.max_new_tokens,
            min_new_tokens=sp.min_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            top_k=sp.top_k,
            top_p=sp.top_p,
            return_dict_in_generate=True,
            synced_gpus=self.engine.is_fsdp,
        )
        if sp.temperature > 0:
            kwargs["temperature"] = sp.temperature
        device = self.mesh.device
        # the CPU generator only, and the GPU's when generating on one
        rng_devices = []
        if device.type == "cuda":
            rng_devices = [device]
        with torch.random.fork_rng(devices=rng_devices):
            torch.manual_seed(seeding.offset(sp.seed, self.mesh.rank, seeding.RANK))
            out = self.engine.module.generate(input_ids=ids, attention_mask=mask, **kwargs)
        tokens = out.sequences[:, ids.shape[1] :]
        n = sp.max_new_tokens
        if tokens.shape[1] < n:  # HF stops when every row has ended
            tokens = torch.cat(
                [tokens, tokens.new_full((tokens.shape[0], n - tokens.shape[1]), self.pad_id)], 1
            )
        # HF pads after EOS itself; make sure the first EOS closes the response
        res = finish(ids, mask, tokens, None, self.eos_id, self.pad_id)
        res.timings = {
            "switch_s": 0.0,
            "gather_s": 0.0,
            "generate_s": time.perf_counter() - t0,
            "release_s": 0.0,
        }
        return res


def inference_model(
    root, layers, policy, ecfg: EngineConfig, dtype, decode: str, tp: int = 1, tp_group=None
):
    """The inference model over weights in its layout (``HybridEngine.inference_weights``), as
    ``engine.*`` configures it: the hybrid engine's and a rollout worker's."""
    return InferenceModel(
        root,
        layers,
        policy,
        tp=tp,
        tp_group=tp_group,
        dtype=dtype,
        kernels=ecfg.inference_kernels,
        decode=decode,
        sync_every=ecfg.decode_sync_every,
    )


def decode_loop(ecfg: EngineConfig, device: torch.device, tp: int, moe: bool = False) -> str:
    """The inference mode's decode loop (``InferenceModel.decode``): on CUDA with
    engine.cuda_graphs=auto the static step as CUDA graphs (eager with TP > 1: NCCL collectives are
    not captured), else the row-removing loop (the CPU, where it is faster, engine.cuda_graphs=off,
    or a Mixture-of-Experts model: its experts' token counts are read on the host every layer)."""
    if ecfg.cuda_graphs == "off" or device.type != "cuda" or moe:
        return "dynamic"
    return "graphs" if tp == 1 else "static"


def _rows(
    out: Generation, per_rank: List[List[List[int]]], tp_rank: int, samples_per_prompt: int
) -> Generation:
    """This rank's rows of a TP group's generation (``prompt_major``: a prompt's samples
    consecutive)."""
    start = sum(len(p) for p in per_rank[:tp_rank]) * samples_per_prompt
    stop = start + len(per_rank[tp_rank]) * samples_per_prompt
    mine = take(out, slice(start, stop))
    # re-trim the common left padding so that this rank's prompt length is its own
    att, p = mine.attention_mask, mine.prompt_len
    drop = 0
    if stop > start:
        drop = int((att[:, :p].sum(0) == 0).long().cumprod(0).sum())
    return replace(
        mine,
        sequences=mine.sequences[:, drop:],
        attention_mask=att[:, drop:],
        prompt_len=p - drop,
        routing=None if mine.routing is None else mine.routing[:, drop:],
    )
