"""Run the fast path's Triton kernels on CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` is set while Triton and the package define their functions, then replaced by
Triton's in-process knob (processes other tests start do not inherit it). The interpreter converts float32 to bfloat16 by truncation where the GPU rounds to
nearest even; the patch below makes it round like the GPU, so kernels and their torch twins agree
up to fp32 summation order.
"""

import os
import sys

_had = os.environ.get("TRITON_INTERPRET")
_late = "triton" in sys.modules and not _had  # triton.language already defined as compiled functions
os.environ["TRITON_INTERPRET"] = "1"  # read when triton.language and our kernels are defined
import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as _interp  # noqa: E402

# the kernel modules, defined now as interpreted functions (the package loads its modules on first use)
from services.decode.engine.cuda import attention, fp8, gemv, kernel_helpers, llama, mla, mla_decoder, moe, smallops  # noqa: E402,F401

triton.knobs.runtime.interpret = True  # keep interpreting after the variable is gone
if _late:  # triton.language was defined compiled (another test imported it first): interpret its helpers
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    _interpreted: dict = {}

    def _call_interpreted(self, *args, **kwargs):
        fn = _interpreted.setdefault(self.fn, InterpretedFunction(self.fn))
        return fn(*args, **kwargs)

    JITFunction.__call__ = _call_interpreted
if _had is None:  # processes other tests start must not inherit it
    del os.environ["TRITON_INTERPRET"]

torch.set_num_threads(1)

_orig_cast = _interp.InterpreterBuilder.cast_impl


def _cast_rne(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        bf = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
        return _interp.TensorHandle(bf.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
    return _orig_cast(self, src, dst_type)


_interp.InterpreterBuilder.cast_impl = _cast_rne
_orig_fp_to_fp = _interp.InterpreterBuilder.create_fp_to_fp


def _fp_to_fp8_rne(self, src, dst_type, rounding_mode):
    # the interpreter's float32 -> float8_e4m3 conversion loses an exponent step where rounding
    # carries into it (142 -> 72, not 144); torch's conversion rounds as the GPU's cvt.rn.satfinite
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
        f8 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.float8_e4m3fn)
        return _interp.TensorHandle(f8.view(torch.uint8).numpy(), tl.float8e4nv)
    return _orig_fp_to_fp(self, src, dst_type, rounding_mode)


_interp.InterpreterBuilder.create_fp_to_fp = _fp_to_fp8_rne

