"""The inference mode's fused operations: reference PyTorch implementations that run everywhere.

A device-specific fast path may replace any of them behind the same signature.
"""

from rlhf.ops.activation import ACTIVATIONS  # noqa: F401
from rlhf.ops.attention import attend, attend_varlen, varlen_kernel_fits  # noqa: F401
from rlhf.ops.norm import layer_norm, rms_norm  # noqa: F401
from rlhf.ops.rotary import interleave_permutation, rotary_cos_sin  # noqa: F401
from rlhf.ops.sampling import SamplingParams, sample  # noqa: F401
