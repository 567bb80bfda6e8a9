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
import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as _interp  # noqa: E402

# the kernel modules, defined now as interpreted functions (the package loads its modules on first use)
from services.decode.engine.cuda import attention, dsa, fp8, gemv, kernel_helpers, llama, mla, mla_decoder, moe, smallops  # noqa: E402,F401

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


# A launch patches triton.language's functions with the interpreter's (and restores them at its end);
# the interpreter patches them again at every call of a @triton.jit device function inside the launch
# (round_to_dtype, the reductions' combine functions ...), scanning every member of the modules each
# time although the launch has already patched them: about a fifth of the run time. Within one launch
# a device function whose language modules are already patched skips the repeat (the functions it
# then runs are the same patched ones), so every kernel computes exactly what it computed before.
_orig_patch_lang = _interp._patch_lang
_orig_grid_call = _interp.GridExecutor.__call__
_launch_patched: list = []  # while a launch runs: [the sets of language modules it has patched]
_fn_langs: dict = {}


def _langs(fn) -> frozenset:
    key = id(fn)
    if key not in _fn_langs:
        _fn_langs[key] = (fn, frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core))
    return _fn_langs[key][1]


def _patch_lang_once(fn):
    if not _launch_patched:  # not inside a launch: as the interpreter does
        return _orig_patch_lang(fn)
    langs = _langs(fn)
    if any(langs <= done for done in _launch_patched[0]):
        return _interp._LangPatchScope()  # nothing to restore: the launch's own scope restores
    _launch_patched[0].append(langs)
    return _orig_patch_lang(fn)


def _grid_call(self, *args, **kwargs):
    _launch_patched.append([])
    try:
        return _orig_grid_call(self, *args, **kwargs)
    finally:
        _launch_patched.clear()


_interp._patch_lang = _patch_lang_once
_interp.GridExecutor.__call__ = _grid_call

# The interpreter maps a Triton dtype to its numpy storage dtype by building a table of every dtype at
# each call (for every operand of every op): the same mapping, read from a table built once.
_orig_np_dtype = _interp._get_np_dtype
_np_dtypes: dict = {}


def _np_dtype(tt_dtype):
    elem = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
    if isinstance(tt_dtype, tl.pointer_type) or isinstance(elem, tl.pointer_type):
        return np.dtype(np.uint64)
    if elem not in _np_dtypes:
        _np_dtypes[elem] = _orig_np_dtype(elem)
    return _np_dtypes[elem]


_interp._get_np_dtype = _np_dtype


@triton.jit
def _griddep_noop():
    pass


@pytest.fixture
def pdl_interpreted(monkeypatch):
    """Kernels launched with programmatic dependent launch (PDL=True) under the interpreter: its programs
    run one after another, so griddepcontrol's wait and launch_dependents are no-ops here; what this covers
    is the PDL variants' own code (loads moved before the wait, peeled first iterations)."""
    for mod in (attention, fp8, gemv, mla, moe, smallops):
        for name in ("gdc_wait", "gdc_launch_dependents"):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, _griddep_noop)
    return True
