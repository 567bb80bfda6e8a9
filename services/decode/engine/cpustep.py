"""The CPU's one-token step in one native call (cpustep.c), where the host can build it: the Llama family
(``GqaKernel``) and the DeepSeek-V3 family with dense attention (``MlaKernel``).

The torch step of one token on the CPU is ~25 ATen ops a layer; on a tiny model each op's
dispatch and allocation cost more than its arithmetic (the tiny Llama's step: ~1.1 ms, of which its nine
projections ~0.15; the tiny DeepSeek-V3's ~2.4 ms). The kernels run the same math in one call of a small C
function compiled for this host: what ``LlamaModel.forward`` / ``DeepseekModel.forward`` do for a step of one
token a slot (the reference step's plain decode, one slot or several, each attending to its own prefix), in
float32 with column-major projections (what ``bind`` lays out on the CPU), one rank, the cache in float32.
A step of a few tokens a slot at consecutive positions (verifying MTP drafts; the MTP layer over them, and
each further draft, with ``MlaKernel.mtp``) takes the tokens one after another, which is what the torch step's
causal mask over them computes; a prefill keeps the torch step.

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


class _MlaModel(ctypes.Structure):  # cpustep.c's MlaModel, field for field
    _fields_ = [(n, ctypes.c_int64) for n in ("hidden", "heads", "nope", "rope", "v_dim", "kv_rank", "q_rank", "layers",
                                              "experts", "top_k", "n_group", "topk_group", "moe_inter",
                                              "shared_inter", "dense_inter", "interleave", "norm_topk",
                                              "cache_slot_stride", "cache_token_stride")] + \
               [(n, ctypes.c_float) for n in ("eps", "scale", "routed_scale")] + \
               [(n, _P) for n in ("embed", "final_norm", "cos", "sin")] + [("mtp_layers", ctypes.c_int64)] + \
               [(n, _P) for n in ("mtp_embed", "enorm", "hnorm", "eh_proj", "head_norm", "attn_norm", "wq", "wq_a",
                                  "q_a_norm", "wq_b", "wkv_a", "kv_a_norm", "w_uk", "w_uv", "wo", "mlp_norm",
                                  "w_gate_up", "w_down", "router", "router_bias", "experts_gate_up", "experts_down",
                                  "shared_gate_up", "shared_down", "kv_cache", "scratch")]


MLA_MAX_GROUPS = MLA_MAX_TOP_K = 64  # cpustep.c's MAX_GROUPS, MAX_TOP_K


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
                lib.cpustep_mla.argtypes = [ctypes.POINTER(_MlaModel), ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_int64, _P]
                lib.cpustep_mla.restype = None
                lib.cpustep_mla_mtp.argtypes = [ctypes.POINTER(_MlaModel), ctypes.c_int64, ctypes.c_int64,
                                                ctypes.c_int64, ctypes.c_int64, _P, _P]
                lib.cpustep_mla_mtp.restype = None
                lib.cpustep_mla_scratch_floats.argtypes = [ctypes.c_int64] * 10
                lib.cpustep_mla_scratch_floats.restype = ctypes.c_int64
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
MLA_MATS = ("wq", "wq_a", "wq_b", "wkv_a", "wo", "w_gate_up", "w_down", "router", "shared_gate_up", "shared_down")
MLA_EXPERTS = ("experts_gate_up", "experts_down")  # stacked [E, N, K], each expert column-major
MLA_DENSE = ("w_uk", "w_uv")  # the absorbed latent products, row-major per head
MLA_VECTORS = ("attn_norm", "q_a_norm", "kv_a_norm", "mlp_norm", "router_bias")
MTP_VECTORS = ("embed", "enorm", "hnorm", "head_norm")  # an MTP layer's, beside its eh_proj and its block's
MAX_TOKENS_A_SLOT = 4  # a step's tokens a slot taken one after another (1 + the most drafts a step verifies)


def _mtp_layers(model, cache) -> list:
    """The MTP layers the fused step serves: those the engine drafts with (their cache rows exist)."""
    if model.family != "mla" or not model.has_mtp or len(cache.kv) < len(model.layers) + len(model.mtp):
        return []
    return list(model.mtp)


def _pointed_at(model, cache) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """What the C code reads and writes: (the projections, the contiguous rest, the cache views)."""
    if model.family == "mla":
        mtp = _mtp_layers(model, cache)
        blocks = [*model.layers, *(m.block for m in mtp)]
        mats = [t for b in blocks for n in MLA_MATS + MLA_EXPERTS if (t := getattr(b, n, None)) is not None]
        mats += [m.eh_proj for m in mtp]
        flat = [model.embed, model.final_norm, model.cos, model.sin]
        flat += [t for b in blocks for n in MLA_DENSE + MLA_VECTORS if (t := getattr(b, n, None)) is not None]
        flat += [getattr(m, n) for m in mtp for n in MTP_VECTORS]
        return mats, flat, cache.kv[:len(blocks)]
    mats = [getattr(b, n) for b in model.layers for n in b.PROJECTIONS]
    flat = [model.embed, model.final_norm, model.cos, model.sin]
    flat += [t for b in model.layers for n in VECTORS if (t := getattr(b, n)) is not None]
    return mats, flat, [*cache.k_caches, *cache.v_caches]


def _column_major(m: torch.Tensor) -> bool:
    """[..., N, K] stored as layers.column_major lays it out (each stacked matrix W^T contiguous)."""
    if m.dim() < 2:
        return False
    n, k = m.shape[-2:]
    return m.stride(-2) == 1 and m.stride(-1) == n and (m.dim() == 2 or m.stride(-3) == n * k)


def _mla_refusal(model) -> str | None:
    cfg = model.cfg
    if cfg.index_topk:
        return "sparse attention (its indexer)"
    if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim > cfg.hidden_size:
        return "a rope dimension the kernel does not take (odd, or wider than the hidden size)"
    if any(b.is_moe for b in (*model.layers, *(m.block for m in model.mtp))):
        if cfg.n_group > MLA_MAX_GROUPS or cfg.num_experts_per_tok > MLA_MAX_TOP_K:
            return f"more than {MLA_MAX_GROUPS} routing groups or {MLA_MAX_TOP_K} experts a token"
        kept = cfg.num_experts // max(cfg.n_group, 1) * min(cfg.topk_group, cfg.n_group)
        if cfg.n_group > 1 and cfg.num_experts % cfg.n_group or kept < cfg.num_experts_per_tok:
            return "routing groups that do not hold the experts a token takes"
    return None


def refusal(model, cache) -> str | None:
    """Why ``model`` (a bound LlamaModel or DeepseekModel) cannot take the fused step, or None when it can."""
    if os.environ.get("EXPRESSLANE_CPU_STEP", "auto").lower() in ("off", "0", "false", "no"):
        return "EXPRESSLANE_CPU_STEP=off"
    if model.embed.device.type != "cpu":
        return "not on the CPU"
    if model.tp.size != 1:
        return "tensor-parallel"
    if cache.kv_format is not None:
        return "FP8 KV cache"
    if model.family == "mla" and (why := _mla_refusal(model)):
        return why
    mats, flat, caches = _pointed_at(model, cache)
    if any(t.dtype != torch.float32 for t in (*mats, *flat, *caches)):
        return "not float32 throughout (FP8 or half-precision weights, or K/V)"
    if not all(_column_major(m) for m in mats):
        return "projections not column-major"
    return None


def _pointers(keep: list, tensors: list) -> ctypes.c_void_p:
    """A C array of the tensors' data pointers (None: NULL), kept alive in ``keep``."""
    arr = (_P * len(tensors))(*[t.data_ptr() if t is not None else None for t in tensors])
    keep.append(arr)
    return ctypes.cast(arr, _P)


class _Kernel:
    """One native call a token over a bound model's tensors (pointers taken once: the weights and the cache never
    move after ``bind``). ``forward(tokens, slots, positions)`` (host lists, one token a slot, or rows of up to
    MAX_TOKENS_A_SLOT tokens at consecutive positions) -> hidden [B, T, H] after the final norm, each token's cache
    row written and its query attending to the rows 0..its position: a slot's tokens one after another, which is
    what the torch step's causal mask over them computes."""

    hidden: int
    vocab: int
    rows: int
    max_tokens: int

    def _call(self, token: int, slot: int, pos: int, out_ptr: int) -> None:
        raise NotImplementedError

    def _each(self, tokens: list, slots: list[int], positions: list, call) -> torch.Tensor:
        rows = [[t] for t in tokens] if tokens and isinstance(tokens[0], int) else tokens
        places = [[p] for p in positions] if positions and isinstance(positions[0], int) else positions
        t = len(rows[0]) if rows else 1
        out = torch.empty(len(rows), t, self.hidden, dtype=torch.float32)
        for row, slot, pos in zip(rows, slots, places, strict=True):  # every row checked before any is written
            if len(row) != t or len(pos) != t or t > MAX_TOKENS_A_SLOT or pos != list(range(pos[0], pos[0] + t)):
                raise ValueError(f"slot {slot}: tokens {row} at positions {pos}: one to {MAX_TOKENS_A_SLOT} tokens "
                                 "a slot, as many in every slot, at consecutive positions")
            for token, p in zip(row, pos):
                if not (0 <= token < self.vocab and 0 <= slot < self.rows and 0 <= p < self.max_tokens):
                    raise IndexError(f"token {token}, slot {slot}, position {p}: out of range (vocabulary "
                                     f"{self.vocab}, {self.rows} cache rows of {self.max_tokens} tokens)")
        ptr, size = out.data_ptr(), self.hidden * 4
        for b, (row, slot, pos) in enumerate(zip(rows, slots, places)):
            for j, (token, p) in enumerate(zip(row, pos)):
                call(b, j, token, slot, p, ptr + (b * t + j) * size)
        return out

    def forward(self, tokens: list, slots: list[int], positions: list) -> torch.Tensor:
        return self._each(tokens, slots, positions, lambda b, j, token, slot, p, out: self._call(token, slot, p, out))


class GqaKernel(_Kernel):
    """The Llama family's fused step (cpustep.c's cpustep_gqa)."""

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
        keep = self._keep = [self.scratch, *mats, *flat, *caches]

        def ptrs(name):
            return _pointers(keep, [getattr(b, name) for b in layers])

        self.m = _GqaModel(
            hidden=cfg.hidden_size, heads=p.heads, kv_heads=p.kv_heads, head_dim=cfg.head_dim, inter=inter,
            layers=len(layers), cache_slot_stride=k0.stride(0), cache_token_stride=k0.stride(1),
            eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5, embed=model.embed.data_ptr(),
            final_norm=model.final_norm.data_ptr(), cos=model.cos.data_ptr(), sin=model.sin.data_ptr(),
            attn_norm=ptrs("attn_norm"), wqkv=ptrs("wqkv"), bqkv=ptrs("bqkv"), q_norm=ptrs("q_norm"),
            k_norm=ptrs("k_norm"), wo=ptrs("wo"), bo=ptrs("bo"), mlp_norm=ptrs("mlp_norm"),
            w_gate_up=ptrs("w_gate_up"), w_down=ptrs("w_down"), k_cache=_pointers(keep, cache.k_caches),
            v_cache=_pointers(keep, cache.v_caches), scratch=self.scratch.data_ptr())
        self._m = ctypes.byref(self.m)

    def _call(self, token: int, slot: int, pos: int, out_ptr: int) -> None:
        self.lib.cpustep_gqa(self._m, token, slot, pos, out_ptr)


class MlaKernel(_Kernel):
    """The DeepSeek-V3 family's fused step with dense attention (cpustep.c's cpustep_mla): q LoRA or not,
    dense first layers, noaux_tc routing in groups, shared experts; and its MTP layers' (:meth:`mtp`,
    cpustep_mla_mtp) where the engine drafts."""

    def __init__(self, lib, model, cache):
        cfg, p = model.cfg, model.plan
        mtp = _mtp_layers(model, cache)
        layers = [*model.layers, *(m.block for m in mtp)]  # the main model's blocks, then the MTP layers'
        self.lib, self.hidden, self.num_mtp = lib, cfg.hidden_size, len(mtp)
        self.vocab, self.rows, self.max_tokens = model.embed.shape[0], cache.num_slots + 1, cache.max_tokens
        mats, flat, caches = _pointed_at(model, cache)
        if not all(t.is_contiguous() for t in flat):
            raise ValueError("the embedding, norms, latent products and rope tables must be contiguous")
        r, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        c0 = caches[0]
        if any(c.stride() != c0.stride() for c in caches) or c0.stride(-1) != 1 or c0.stride(1) != r + rope:
            raise ValueError("the latent views are not [rows, tokens, kv_lora_rank + rope] with one stride")
        moe = [b for b in layers if b.is_moe]
        inters = [p.intermediate if len(moe) < len(layers) else 0, p.moe_intermediate if moe else 0,
                  p.shared_intermediate if moe and cfg.num_shared_experts else 0]
        q_rank = cfg.q_lora_rank or 0
        floats = lib.cpustep_mla_scratch_floats(cfg.hidden_size, p.heads, cfg.qk_nope_head_dim, rope,
                                                cfg.v_head_dim, r, q_rank, cfg.num_experts if moe else 0,
                                                max(inters), cache.max_tokens)
        self.scratch = torch.zeros(floats, dtype=torch.float32)
        keep = self._keep = [self.scratch, *mats, *flat, *caches]

        def ptrs(name):
            return _pointers(keep, [getattr(b, name, None) for b in layers])

        self.m = _MlaModel(
            hidden=cfg.hidden_size, heads=p.heads, nope=cfg.qk_nope_head_dim, rope=rope, v_dim=cfg.v_head_dim,
            kv_rank=r, q_rank=q_rank, layers=len(model.layers), experts=cfg.num_experts if moe else 0,
            top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
            moe_inter=inters[1], shared_inter=inters[2], dense_inter=inters[0], interleave=int(cfg.rope_interleave),
            norm_topk=int(cfg.norm_topk_prob), cache_slot_stride=c0.stride(0), cache_token_stride=c0.stride(1),
            eps=cfg.rms_norm_eps, scale=model.scale, routed_scale=cfg.routed_scaling_factor,
            embed=model.embed.data_ptr(), final_norm=model.final_norm.data_ptr(), cos=model.cos.data_ptr(),
            sin=model.sin.data_ptr(), kv_cache=_pointers(keep, caches), scratch=self.scratch.data_ptr(),
            mtp_layers=len(mtp), mtp_embed=_pointers(keep, [m.embed for m in mtp]),
            eh_proj=_pointers(keep, [m.eh_proj for m in mtp]),
            **{n: _pointers(keep, [getattr(m, n) for m in mtp]) for n in ("enorm", "hnorm", "head_norm")},
            **{n: ptrs(n) for n in MLA_MATS + MLA_EXPERTS + MLA_DENSE + MLA_VECTORS})
        self._m = ctypes.byref(self.m)

    def _call(self, token: int, slot: int, pos: int, out_ptr: int) -> None:
        self.lib.cpustep_mla(self._m, token, slot, pos, out_ptr)

    def mtp(self, j: int, tokens: list, slots: list[int], positions: list, prev: torch.Tensor) -> torch.Tensor:
        """MTP layer j over tokens as :meth:`forward` takes them, ``prev`` [B, T, H] the hidden before each (float32):
        its outputs after the head norm [B, T, H] (deepseek.mtp_forward's recycled hidden), its cache rows written."""
        if not 0 <= j < self.num_mtp:
            raise IndexError(f"MTP layer {j}: this kernel has {self.num_mtp}")
        prev = prev.to(torch.float32).contiguous()
        t = 1 if tokens and isinstance(tokens[0], int) else len(tokens[0]) if tokens else 0
        if tuple(prev.shape) != (len(slots), t, self.hidden):
            raise ValueError(f"prev {tuple(prev.shape)}: ({len(slots)}, {t}, {self.hidden}) expected")
        base, size = prev.data_ptr(), self.hidden * 4

        def call(b, i, token, slot, p, out):
            self.lib.cpustep_mla_mtp(self._m, j, token, slot, p, base + (b * t + i) * size, out)

        return self._each(tokens, slots, positions, call)


def attach(model, cache, mode: str = "auto") -> tuple[_Kernel | None, str | None]:
    """(the kernel, None) where ``model`` takes the fused step, else (None, why not); ``mode`` "off" never."""
    if mode == "off":
        return None, "cpu_step='off'"
    reason = refusal(model, cache)
    if reason is not None:
        return None, reason
    lib = library()
    if lib is None:
        return None, unavailable_reason()
    return (MlaKernel if model.family == "mla" else GqaKernel)(lib, model, cache), None
