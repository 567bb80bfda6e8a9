"""The CPU's one-token step of the Llama family in one native call (cpustep.c), where the host can build it.

The torch step of one token on the CPU is ~25 ATen ops a layer; on a tiny model each op's
dispatch and allocation cost more than its arithmetic (the tiny Llama's step: ~1.1 ms, of which its nine
projections ~0.15). ``GqaKernel`` runs the same math in one call of a small C function compiled for this
host: what ``LlamaModel.forward`` does for a step of one token a slot (the reference step's plain decode,
one slot or several, each attending to its own prefix), in float32 with column-major projections (what
``bind`` lays out on the CPU), one rank, K/V in float32.

Building: the source is compiled once per host and compiler (``cc -O3 -march=native``; ``$CC`` names
another compiler) into ``$EXPRESSLANE_CACHE_DIR/cpustep`` (default ``~/.cache/expresslane/cpustep``), a
file per source, flags and CPU, written atomically so that processes building at once agree.
``EXPRESSLANE_CPU_STEP=off`` (or ``EngineConfig.cpu_step="off"``) keeps the torch step; where no compiler
is found or the build fails the engine logs why (``cpu_step_unavailable``) and keeps the torch step.
Its steps are reported as the path ``"cpu-fused"`` (``Engine.last_step_path``, the node's metrics).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from shared.log import get_logger

_log = get_logger("decode.engine.cpustep")
SOURCE = Path(__file__).with_name("cpustep.c")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared")
PATH = "cpu-fused"  # Engine.last_step_path of a step this kernel served
_P = ctypes.c_void_p


class _GqaModel(ctypes.Structure):  # cpustep.c's GqaModel, field for field
    _fields_ = [(n, ctypes.c_int64) for n in ("hidden", "heads", "kv_heads", "head_dim", "inter", "layers",
                                              "cache_slot_stride", "cache_token_stride")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float)] + \
               [(n, _P) for n in ("embed", "final_norm", "cos", "sin", "attn_norm", "wqkv", "bqkv", "q_norm",
                                  "k_norm", "wo", "bo", "mlp_norm", "w_gate_up", "w_down", "k_cache", "v_cache",
                                  "scratch")]


_lib_lock = threading.Lock()
_lib: dict[str, object] = {}  # "lib": the loaded library, or "error": why there is none


def _cpu_signature() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def cache_dir() -> Path:
    root = os.environ.get("EXPRESSLANE_CACHE_DIR") or Path.home() / ".cache" / "expresslane"
    return Path(root) / "cpustep"


def build(cc: str | None = None) -> Path:
    """The shared library for this host (built once; later calls return the file). Raises RuntimeError
    saying what to do when no compiler is found or the build fails."""
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc or not shutil.which(cc):
        raise RuntimeError("no C compiler found (cc / gcc, or $CC): install one (Debian: apt-get install gcc) for "
                           "the fused CPU step")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_signature()]).encode())
    out = cache_dir() / f"cpustep-{key.hexdigest()[:20]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} could not build {SOURCE.name} (exit {done.returncode}): "
                               f"{done.stderr.strip()[-400:]}")
        os.replace(tmp, out)  # atomic: a process building at the same time writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def library():
    """The loaded library, or None (its reason in :func:`unavailable_reason`); built on first use."""
    with _lib_lock:
        if not _lib:
            try:
                lib = ctypes.CDLL(str(build()))
                lib.cpustep_gqa.argtypes = [ctypes.POINTER(_GqaModel), ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_int64, _P]
                lib.cpustep_gqa.restype = None
                lib.cpustep_scratch_floats.argtypes = [ctypes.c_int64] * 6
                lib.cpustep_scratch_floats.restype = ctypes.c_int64
                _lib["lib"] = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _lib["error"] = str(exc)
                _log.warning("cpu_step_unavailable", reason=str(exc),
                             hint="the engine keeps the torch step (same tokens, slower on small models); for "
                                  "the fused step install a C compiler and give EXPRESSLANE_CACHE_DIR a writable "
                                  f"directory (now {cache_dir()})")
        return _lib.get("lib")


def unavailable_reason() -> str | None:
    return _lib.get("error")


VECTORS = ("attn_norm", "mlp_norm", "bqkv", "q_norm", "k_norm", "bo")  # a block's 1-D weights (None: absent)


def _pointed_at(model, cache) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """What the C code reads and writes: (the projections, the contiguous rest, the K/V cache views)."""
    mats = [getattr(b, n) for b in model.layers for n in b.PROJECTIONS]
    flat = [model.embed, model.final_norm, model.cos, model.sin]
    flat += [t for b in model.layers for n in VECTORS if (t := getattr(b, n)) is not None]
    return mats, flat, [*cache.k_caches, *cache.v_caches]


def refusal(model, cache) -> str | None:
    """Why ``model`` (a bound LlamaModel) cannot take the fused step, or None when it can."""
    if os.environ.get("EXPRESSLANE_CPU_STEP", "auto").lower() in ("off", "0", "false", "no"):
        return "EXPRESSLANE_CPU_STEP=off"
    if model.embed.device.type != "cpu":
        return "not on the CPU"
    if model.tp.size != 1:
        return "tensor-parallel"
    if cache.kv_format is not None:
        return "FP8 KV cache"
    mats, flat, caches = _pointed_at(model, cache)
    if any(t.dtype != torch.float32 for t in (*mats, *flat, *caches)):
        return "not float32 throughout (FP8 or half-precision weights, or K/V)"
    if any(m.dim() != 2 or m.stride() != (1, m.shape[0]) for m in mats):
        return "projections not column-major"
    return None


class GqaKernel:
    """The fused step over a bound model's tensors (pointers taken once: the weights and the cache never
    move after ``bind``). ``forward(tokens, slots, positions)`` (host lists, one token a slot) -> hidden
    [B, 1, H] after the final norm, each slot's K/V row of its position written into its cache and its
    query attending to its keys 0..position, as the torch step's causal mask has it."""

    def __init__(self, lib, model, cache):
        cfg, p = model.cfg, model.plan
        layers = list(model.layers)
        self.lib, self.hidden = lib, cfg.hidden_size
        # what the C code indexes without checks: token ids, slot rows (the scratch row included), positions
        self.vocab, self.rows, self.max_tokens = model.embed.shape[0], cache.num_slots + 1, cache.max_tokens
        mats, flat, caches = _pointed_at(model, cache)
        if not all(t.is_contiguous() for t in flat):
            raise ValueError("the embedding, norms, biases and rope tables must be contiguous")
        k0 = cache.k_caches[0]
        if any(c.stride() != k0.stride() for c in (*cache.k_caches, *cache.v_caches)) or k0.stride(-1) != 1 \
                or k0.stride(-2) != cfg.head_dim or k0.stride(1) != p.kv_heads * cfg.head_dim:
            raise ValueError("the K/V views are not [rows, tokens, kv_heads, head_dim] with one stride")
        inter = model.layers[0].w_down.shape[1]
        floats = lib.cpustep_scratch_floats(cfg.hidden_size, p.heads, p.kv_heads, cfg.head_dim, inter,
                                            cache.max_tokens)
        self.scratch = torch.zeros(floats, dtype=torch.float32)
        # every tensor the C code points at, and the pointer arrays, live as long as the kernel
        self._keep = [self.scratch, *mats, *flat, *caches]

        def ptrs(name):
            arr = (_P * len(layers))(*[(t.data_ptr() if (t := getattr(b, name)) is not None else None)
                                       for b in layers])
            self._keep.append(arr)
            return ctypes.cast(arr, _P)

        def caches(views):
            arr = (_P * len(views))(*[v.data_ptr() for v in views])
            self._keep.append(arr)
            return ctypes.cast(arr, _P)

        self.m = _GqaModel(
            hidden=cfg.hidden_size, heads=p.heads, kv_heads=p.kv_heads, head_dim=cfg.head_dim, inter=inter,
            layers=len(layers), cache_slot_stride=k0.stride(0), cache_token_stride=k0.stride(1),
            eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5, embed=model.embed.data_ptr(),
            final_norm=model.final_norm.data_ptr(), cos=model.cos.data_ptr(), sin=model.sin.data_ptr(),
            attn_norm=ptrs("attn_norm"), wqkv=ptrs("wqkv"), bqkv=ptrs("bqkv"), q_norm=ptrs("q_norm"),
            k_norm=ptrs("k_norm"), wo=ptrs("wo"), bo=ptrs("bo"), mlp_norm=ptrs("mlp_norm"),
            w_gate_up=ptrs("w_gate_up"), w_down=ptrs("w_down"), k_cache=caches(cache.k_caches),
            v_cache=caches(cache.v_caches), scratch=self.scratch.data_ptr())
        self._m = ctypes.byref(self.m)

    def forward(self, tokens: list[int], slots: list[int], positions: list[int]) -> torch.Tensor:
        out = torch.empty(len(tokens), 1, self.hidden, dtype=torch.float32)
        ptr, row = out.data_ptr(), self.hidden * 4
        for b, (token, slot, pos) in enumerate(zip(tokens, slots, positions, strict=True)):
            if not (0 <= token < self.vocab and 0 <= slot < self.rows and 0 <= pos < self.max_tokens):
                raise IndexError(f"token {token}, slot {slot}, position {pos}: out of range (vocabulary {self.vocab}, "
                                 f"{self.rows} cache rows of {self.max_tokens} tokens)")
            self.lib.cpustep_gqa(self._m, token, slot, pos, ptr + b * row)
        return out


def attach(model, cache, mode: str = "auto") -> tuple[GqaKernel | None, str | None]:
    """(the kernel, None) where ``model`` takes the fused step, else (None, why not); ``mode`` "off" never."""
    if mode == "off":
        return None, "cpu_step='off'"
    reason = refusal(model, cache)
    if reason is not None:
        return None, reason
    lib = library()
    if lib is None:
        return None, unavailable_reason()
    return GqaKernel(lib, model, cache), None
