"""Run the Triton kernels on CPU through Triton's interpreter (set before any kernel is defined).

The interpreter converts float32 to bfloat16 by truncation, where the GPU rounds to nearest even;
the patch below makes the interpreter round like the GPU so kernels and torch twins agree to fp32
summation order, not to a systematic one-ulp bias.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as _interp  # noqa: E402

_orig_cast = _interp.InterpreterBuilder.cast_impl


def _cast_rne(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        bf = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
        return _interp.TensorHandle(bf.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
    return _orig_cast(self, src, dst_type)


_interp.InterpreterBuilder.cast_impl = _cast_rne
