"""CUDA graphs of the static decode step (``engine.cuda_graphs=auto`` on CUDA; docs/gpu.md).

One graph per key span, captured when a ``StaticDecoder`` first needs it and replayed for every step
of that span: one launch per token instead of ~15 kernels per layer issued from Python. Capture
rules followed (torch.cuda.graphs, "CUDA Graphs" in the CUDA semantics notes):

- warm-up iterations on a side stream before the first capture (lazy initialisation — cuBLAS
  workspaces, kernel selection — must not happen during a capture);
- the step reads and writes only tensors allocated before the capture (the decoder's state, the
  inference weights, the cache); everything it allocates itself comes from the graphs' private
  pool and no reference to it survives the step, so graphs of different spans share one pool and may
  be replayed in any order;
- nothing in the step synchronises with the host or draws random numbers (the draws are made on the
  CPU generator before the loop and copied into a buffer the graph reads);
- ``capture_error_mode="thread_local"``: the process's other threads (NCCL watchdog, heartbeats)
  may keep calling CUDA while a capture runs.

The graphs, their pool and the decoder's state go with the inference weights (``release``).
Not yet run on a GPU when written (docs/gpu.md).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable

import torch

# eager steps of a span on a side stream before its capture
WARMUP_STEPS = 2


class StepGraphs:
    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}

    def capture(
        self, step: Callable[[int], None], park: Callable[[], None], spans: Iterable[int]
    ) -> None:
        """Captures ``step(span)`` for each span not captured yet. The warm-up steps run for real:
        ``park`` resets the step's counters before each (within the buffers), and the caller sets
        the whole state afterwards."""
        todo = [s for s in spans if s not in self.graphs]
        if not todo:
            return
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for span in todo:
                    for _ in range(WARMUP_STEPS):
                        park()
                        step(span)
            torch.cuda.current_stream(self.device).wait_stream(side)
            for span in todo:
                # (a capture records the kernels without running them)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    step(span)
                self.graphs[span] = graph

    def replay(self, span: int) -> None:
        self.graphs[span].replay()

    def release(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.pool = None
