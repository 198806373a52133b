"""A fault for the rollout-parity guard: the hybrid engine's inference model, built from the
training weights, gets one weight matrix of one decoder layer perturbed — what a wrong shard, a
stale or corrupted copy or a broken layout would do — while the training weights stay as they are.

``arg``: ``always`` (every build; the default) or ``once`` (the first build only: a rebuild is
healthy), optionally ``:<scale>``, the noise's size relative to the matrix's own std (default 4: a
gross error, a mean log-prob gap of about 0.7 nats per token on the tests' quick models), e.g.
``once:0.05``.

``HybridEngine.build_inference_model`` is wrapped: during a corrupted build the ``InferenceModel``
it constructs receives the layers' weights with ``CORRUPTED`` of layer ``LAYER`` replaced by itself
plus seeded Gaussian noise (out of place: the weights may be the training tensors themselves, in
fp32), before the inference model lays them out (packed kernels included).
"""

from __future__ import annotations

from sitecustomize import after_import

# the MLP's down projection of the first decoder layer
LAYER, CORRUPTED = 0, "w_down"


def install(arg: str) -> None:
    mode, _, scale = (arg or "always").partition(":")
    if mode not in ("always", "once"):
        raise ValueError(f"fault corrupt_inference: {arg!r}: expected always or once[:scale]")
    scale = float(scale or 4.0)
    builds = [0]

    def patch(hybrid) -> None:
        import torch

        original = hybrid.HybridEngine.build_inference_model

        def corrupted(real):
            def make(root, layers, *args, **kwargs):
                w = layers[LAYER][CORRUPTED]
                g = torch.Generator().manual_seed(1234)
                noise = torch.randn(w.shape, generator=g, dtype=torch.float32).to(w.device)
                layers[LAYER][CORRUPTED] = w + (noise * scale * w.float().std()).to(w.dtype)
                return real(root, layers, *args, **kwargs)

            return make

        def build(self):
            builds[0] += 1
            if mode == "once" and builds[0] > 1:
                return original(self)
            real = hybrid.InferenceModel
            hybrid.InferenceModel = corrupted(real)
            try:
                return original(self)
            finally:
                hybrid.InferenceModel = real

        hybrid.HybridEngine.build_inference_model = build

    after_import("rlhf.engine.hybrid", patch)
