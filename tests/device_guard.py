"""A CPU-side guard against device mixing (CI has no GPU).

``DeviceDiscipline`` is a torch function mode that fails a test at the line where the project's own
code (rlhf/, stages/) creates a tensor without naming its device — on a GPU that tensor lands on
the CPU and meets CUDA tensors (the score/reward/whitening crashes of the first GPU run) — or draws
random numbers with a generator on one device into a tensor on another (the sampling crash).
Run code under it on CPU; run pure functions under ``FakeTensorMode`` with ``cuda`` inputs as well.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]
OWN = (str(ROOT / "rlhf") + "/", str(ROOT / "stages") + "/")
FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.tensor,
    torch.as_tensor,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.linspace,
    torch.eye,
}


class DeviceError(AssertionError):
    pass


class DeviceDiscipline(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        # factory calls of the project's code that were checked
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            frame = sys._getframe(1)
            where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            gen = kwargs.get("generator")
            device = kwargs.get("device")
            if (
                gen is not None
                and device is not None
                and torch.device(device).type != gen.device.type
            ):
                raise DeviceError(
                    f"{where}: torch.{func.__name__} draws with a {gen.device} generator into "
                    f"a {torch.device(device)} tensor"
                )
            if frame.f_code.co_filename.startswith(OWN):
                self.calls += 1
                if device is None and not (
                    func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)
                ):
                    raise DeviceError(
                        f"{where}: torch.{func.__name__} without a device (on a GPU this "
                        "tensor lands on the CPU)"
                    )
        return func(*args, **kwargs)
