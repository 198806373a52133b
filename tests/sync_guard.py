"""A CPU-side guard against host synchronisation (CI has no GPU, so no
torch.cuda.set_sync_debug_mode).

``HostSyncs`` records every operation that makes the host wait for the device on a GPU: reading a
value (``.item()``, ``bool()``/``int()``/``float()`` of a tensor, ``.tolist()``, ``.numpy()``,
``aten._local_scalar_dense``), shapes that depend on data (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``, ...) and copies between the device and the CPU. On the CPU these
cost nothing, which is why they must be caught by name: under a CUDA graph capture each one is an
error, and in an eager GPU loop each one stalls the launch queue.
"""

from __future__ import annotations

import sys
from typing import List

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# values read back to Python
READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.nonzero,
    torch.Tensor.nonzero,
}
# ops whose output shape (or result) the host must wait for
DATA_DEPENDENT = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.equal,
    aten.is_nonzero,
    aten.bincount,
    aten.repeat_interleave,
    aten.histc,
}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _where() -> str:
    f = sys._getframe(2)
    while f is not None and ("torch/" in f.f_code.co_filename or __file__ == f.f_code.co_filename):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"


def _tensor_in_slice(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(
        isinstance(p, slice) and any(isinstance(b, torch.Tensor) for b in (p.start, p.stop, p.step))
        for p in parts
    )


class _Functions(TorchFunctionMode):
    def __init__(self, guard: "HostSyncs"):
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = None
        if func in READS:
            what = getattr(func, "__name__", str(func))
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _tensor_in_slice(
            args[1]
        ):
            what = "a slice bound read from a tensor"
        if what is None or self.guard.inside:
            return func(*args, **(kwargs or {}))
        self.guard.log.append(f"{what} at {_where()}")
        # one line per call: not the ops it runs too
        self.guard.inside = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.guard.inside = False


def _boolean_index(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


class _Ops(TorchDispatchMode):
    def __init__(self, guard: "HostSyncs"):
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if self.guard.inside:
            # inside a read the function mode has logged
            return func(*args, **kwargs)
        if packet in DATA_DEPENDENT:
            self.guard.log.append(f"aten.{packet.__name__} at {_where()}")
        elif packet in INDEXING and _boolean_index(args):
            self.guard.log.append(f"aten.{packet.__name__} with a boolean mask at {_where()}")
        elif packet in (aten._to_copy, aten.copy_):
            src = args[1] if packet is aten.copy_ else args[0]
            dst = args[0].device if packet is aten.copy_ else kwargs.get("device") or src.device
            if isinstance(src, torch.Tensor) and (src.device.type == "cpu") != (
                torch.device(dst).type == "cpu"
            ):
                self.guard.log.append(f"a copy {src.device} -> {dst} at {_where()}")
        return func(*args, **kwargs)


class HostSyncs:
    """``with HostSyncs() as syncs: ...`` then ``syncs.log``: one line (what, where) per
    synchronisation."""

    def __init__(self):
        self.log: List[str] = []
        self.inside = False
        self._modes = (_Functions(self), _Ops(self))

    def __enter__(self) -> "HostSyncs":
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
