"""The GQA (Llama-family) batch-1 decode step on the fast path, and its torch reference (built from
reference.py, the kernels' torch twins).

``GqaDecoder`` owns the step's device buffers (token, position, residual stream, q, attention output,
MLP activation, logits) and runs one decode step as a fixed sequence of launches that reads the token
and position from device tensors and advances them on device, so the whole step (or several steps)
can be captured in one CUDA graph and replayed with no host sync per token.

Per layer, with every GEMV on Triton (``backends`` all "triton"), six launches:
  1. norm + QKV GEMV (+ bias) + rope + K/V cache write  (gemv_qkv_rope)
  2-3. split-K attention over the slot's KV, merge      (DecodeAttention; one launch, the last split
       merging, with ``FastOptions.attn_one_launch``)
  4. o_proj GEMV (+ bias) + residual add                (gemv, BIAS, RESIDUAL)
  5. norm + gate/up GEMV + SiLU-mul                     (gemv_silu)
  6. down GEMV + residual add                           (gemv, RESIDUAL)
With PDL each kernel starts during its predecessor's tail and reads before its wait only what no
kernel in flight writes: weights, and (the QKV GEMV from layer 1 on; the one-launch attention) the
position, its rope row and the cache rows of earlier steps.
then final norm + lm_head GEMV (fp32 logits) and on-device greedy argmax. A projection whose backend
is "cublas" runs torch.matmul (torch.addmm with a bias) instead, with the small fused kernels of
``smallops`` around it.

Model variants (the engine's reference step accepts them all): Qwen2's q/k/v bias (and an o_proj
bias) is added to the fp32 sum in the GEMV's epilogue, before its one rounding. Qwen3's per-head q/k
RMSNorm needs a whole head, which a QKV GEMV program (2 x block_n rows of one head) does not hold:
with ``FastOptions.qk_norm_in`` "attention" launch 1 writes q and K as projected and the
attention kernel normalises + rotates them as it loads them (no extra launch); "qkv" has the QKV GEMV
write q and k heads as projected to a scratch row, and the last of a head's programs to finish (a
per-head counter, atomically counted and reset) normalises + rotates the whole head into q and the K
cache (no extra launch, and the attention is the Llama one; the default); "kernel" runs a plain QKV GEMV and one small
norm + rope + cache-write kernel (smallops.rope_cache_write), one launch more.
Rope scaling (linear, llama3, yarn incl. its attention factor) lives in the cos/sin tables; tied
embeddings are the same tensor as embed and lm_head.

Weights are the engine's fused per-layer tensors (names in engine/weights.py); KV caches are the slot's views
in the shared.kvlayout layout, per layer K and V each ``[max_tokens, num_kv_heads, head_dim]``.

Tensor parallelism (``tp``, engine/tp.py, more than one rank): the model holds this rank's heads, MLP
slice and vocabulary rows. The o and down GEMVs are row-parallel: rank 0 adds the residual (and the o
bias) in the epilogue as alone, the other ranks write their partial sums into the residual buffer,
and one all-reduce of that buffer (captured in the step's graph) leaves ``residual + sum of parts``
on every rank. The lm_head's greedy partials (max, row) of every rank are gathered (rows offset to
the global vocabulary) before the argmax finish; a sampled step gathers the logits first, so every
rank samples the whole vocabulary and takes the same token.

FP8 KV cache (``kv_format`` fp8_e4m3 | fp8_e5m2, ``kv_scales`` per layer (k_scale, v_scale)): the caches are
uint8, vLLM's FP8 bytes (engine/kvquant.py); the step writes its K/V row as kvquant.quantize does
(kvfp8.fp8_kv_bits in the QKV epilogue or the rope kernel) and the attention reads fp8 * scale
(kvfp8.fp8_kv_load). Qwen3's q/k norm then runs in its own kernel (``qk_norm_in`` "kernel"): the attention
prologue's normalisation of the raw K row needs a bf16 row in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from . import gemv
from . import smallops
from . import reference
from .attention import DecodeAttention
from .kvfp8 import kv_cache_setup

PROJECTIONS = ("qkv", "o", "gate_up", "down", "lm_head")


@dataclass
class GqaLayer:
    attn_norm: torch.Tensor  # [H]
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    wo: torch.Tensor  # [H, Hq D]
    mlp_norm: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [2 I, H]
    w_down: torch.Tensor  # [H, I]
    bqkv: torch.Tensor | None = None  # [(Hq + 2 Hkv) D] (Qwen2)
    bo: torch.Tensor | None = None  # [H]
    q_norm: torch.Tensor | None = None  # [D] (Qwen3)
    k_norm: torch.Tensor | None = None  # [D]


@dataclass
class GqaModel:
    layers: list[GqaLayer]
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float

    @property
    def hidden(self) -> int:
        return self.embed.shape[1]

    @property
    def intermediate(self) -> int:
        return self.layers[0].w_down.shape[1]

    def weight_bytes(self) -> int:
        """Bytes a batch-1 step reads from weights (one embedding row, not the table)."""
        per_layer = sum(t.numel() * t.element_size() for l in self.layers for t in vars(l).values() if t is not None)
        return per_layer + self.lm_head.numel() * self.lm_head.element_size() + self.embed[0].numel() * 2


@dataclass
class FastOptions:
    """Backend per projection ("triton" | "cublas") and kernel tile choices."""

    backends: dict[str, str] = field(default_factory=lambda: {p: "triton" for p in PROJECTIONS})
    tiles: dict[str, tuple[int, int, int]] = field(default_factory=lambda: {
        "qkv": (8, 256, 4, 6), "o": (16, 256, 4, 6), "gate_up": (4, 512, 4, 6), "down": (16, 512, 4, 5),
        "lm_head": (32, 256, 4, 4)})  # (block_n, block_k, num_warps, num_stages): best on H200, bench run 3
    # the same for FP8 weights (cuda/fp8.py): a row is half the bytes, so the tiles that keep enough bytes in
    # flight differ; best of bench/gpu_fp8_gemv.py's sweep on H200 (FP8_DYNAMIC activations). gate/up: 3 stages,
    # not 6, so that its 448 programs are resident in one wave and its input's prologue (norm, activation scale)
    # runs once (run G16 on the H100, in the step: 3.519 against 3.615 ms). Since the QKV and gate/up inputs are
    # rounded once (fp8_round_once) no program has a prologue to repeat, and smaller row tiles spread those GEMVs
    # over more programs: QKV 8 rows (384 programs, not 192 in 1.45 waves) -22 us a Llama-3-8B step, gate/up 16 rows
    # -12 us on the H100 (run G44); both together 2.701 -> 2.671 ms on the H200 (run G45)
    fp8_tiles: dict[str, tuple[int, int, int, int]] = field(default_factory=lambda: {
        "qkv": (8, 512, 4, 3), "o": (16, 512, 4, 3), "gate_up": (16, 256, 4, 3), "down": (16, 1024, 4, 3)})
    # the batched step's GEMVs (cuda/batch.py rows_gemv: mode 1 = W @ x^T on tensor cores over the rows
    # padded to 16, block_n >= 16): per projection the best of bench/decode_gpu_batch.py's sweep at 2 and 8
    # rows on H200 (run B3; the run's end-to-end numbers took (32, 128, 4, 6) everywhere)
    batch_tiles: dict[str, tuple[int, int, int, int]] = field(default_factory=lambda: {
        "qkv": (64, 64, 4, 8), "o": (32, 256, 4, 4), "gate_up": (64, 64, 4, 8), "down": (32, 256, 4, 4),
        "lm_head": (32, 128, 4, 6)})
    batch_mode: int = 1
    num_splits: int = 16  # attention: 16 splits of 64-token blocks: best at 1K on H200
    block_s: int = 64
    # (num_splits, block_s) of the attention over an FP8 KV cache (None: the two above): 32 splits of 128-token
    # blocks, best of run K1's sweep at 32K on H200 (233 tok/s against 189 with 16 x 64: a 1-byte tile with its
    # fp8 -> bf16 conversion needs more programs and bytes in flight)
    fp8_kv_attn: tuple[int, int] | None = (32, 128)
    # warps of the attention's split kernel; None: 8 where it normalises q/k in its prologue (Qwen3: +0.3-0.5%
    # in runs Q8a, Q8b and Q12 on H200, its reductions spread over more warps), else 4 (Llama, Qwen2: -0.4%
    # with 8 in Q12)
    attn_warps: int | None = None
    # programmatic dependent launch (the next kernel's first weight tile overlaps our tail; -2.8% per step
    # on H200): None = on for sm_90+ CUDA devices
    pdl: bool | None = None
    # where Qwen3's q/k RMSNorm + rope run next to a Triton QKV GEMV: "qkv" (the QKV GEMV's last program of each
    # head; the attention is then Llama's: Qwen3-8B +0.7% over "attention" on H200, run N1) | "attention" (the
    # split kernel's prologue; the FP8 QKV GEMV's form under "qkv" too) | "kernel" (a launch of its own)
    qk_norm_in: str = "qkv"
    # with qk_norm_in="attention" (two-launch attention): the split kernel loads V row pos in its prologue and
    # stores the normalised K row pos after its loop, so its loop's first loads wait on no store (run Q8)
    qk_pos_row_prologue: bool = True
    attn_combine_warps: int = 4  # the two-launch attention's merge kernel
    # one-token attention as one launch (K/V prefetched before the PDL wait, the last split merging);
    # False: split kernel + merge kernel (the general path MLA and multi-token queries take). Off: on the H200
    # it cost +0.2 ms a step with a serial merge (run F1) and +0.15-0.18 ms with the straight-line one on every
    # Llama-family shape (run N2, bench/NOTES-gpu.md)
    attn_one_launch: bool = False
    # the batched step's rope + K/V write in its QKV GEMV's epilogue (rows_qkv_rope); False: rope_rows after.
    # Off: on the H200 the epilogue's paired-row tile made the 4-row step 38-48 us slower than the extra launch
    # (runs F2 and B5, bench/NOTES-gpu.md)
    batch_fused_rope: bool = False
    # weight tiles each GEMV program (batch-1: after its first, loaded outright; batched: from the first)
    # prefetches into L2 before its PDL wait (0, 1, 2 or 4; a hint: results unchanged; only with PDL).
    # Off: 2 tiles cost +0.12 ms a batch-1 step on the H200 (run F1)
    prefetch_tiles: int = 0
    # the QKV and gate/up GEMVs' RMSNorm folded into their weight stream (W @ round(x * nw) and sum(x^2) in one
    # loop, the sums scaled by 1 / rms after it) instead of reduced before it: the stream starts right after the
    # PDL wait, at the cost of HF's rounding points (results move by ~1 ulp of the model dtype; the batched step
    # folds it the same way). On: +1.9% Qwen3-8B, +1.1% Llama-3-8B on the H200 (run N4, bench/NOTES-gpu.md)
    norm_late: bool = True
    # FP8 checkpoints (cuda/fp8.py): the rope + q / K / V stores in the FP8 QKV GEMV's epilogue (one launch
    # a layer, as the bf16 step); False: gemv_fp8 + rope_cache_write
    fp8_qkv_rope: bool = True
    # FP8 checkpoints with FP8_DYNAMIC activations: the QKV and gate/up inputs normed and rounded once a layer
    # (fp8.round_token, one small launch each) instead of by every program of the GEMV (its prologue's two
    # reductions over the input, then a rounding a K tile); the same values. H100, run G41: a Llama-3-8B step
    # 3.456 -> 3.337 ms (0.782 -> 0.810 of roofline)
    fp8_round_once: bool = True
    # FP8_DYNAMIC activations, two-launch attention: the o and down inputs' activation scale from the largest
    # |value| of each attention head's output / each SiLU GEMV program's rows, which those kernels store beside
    # their output, instead of a reduction over the whole input (4096 / 14336 values) in every o / down program;
    # the same values. H100, run G43: a Llama-3-8B step 3.340 -> 3.330 ms (gathered by atomics instead, G42: slower)
    fp8_amax_carry: bool = True

    def attn_num_warps(self, qk_norm_in_attention: bool) -> int:
        """The split kernel's warps (``attn_warps``, or its default for where q/k norm runs)."""
        if self.attn_warps is not None:
            return self.attn_warps
        return 8 if qk_norm_in_attention else 4

    def attn_tile(self, kv_fmt: int) -> tuple[int, int]:
        """The attention's (num_splits, block_s) over a cache of this format (kvfp8.kv_fmt)."""
        return (self.fp8_kv_attn or (self.num_splits, self.block_s)) if kv_fmt else (self.num_splits, self.block_s)


def folds_norm(opt: FastOptions, name: str, has_q_norm: bool, kv_fmt: int) -> bool:
    """Whether projection ``name`` ("qkv" / "gate_up") of a bf16 layer takes its RMSNorm folded into its GEMV
    (``opt.norm_late``): not on cuBLAS, and for a Qwen3 QKV only where its q/k norm runs in the attention or the
    QKV GEMV's last programs (the "kernel" form, and the attention form over an FP8 cache, take the plain GEMV
    with the norm first). One rule for the one-token and the batched step, so that a row decodes alike in both."""
    if not opt.norm_late or opt.backends.get(name, "triton") == "cublas":
        return False
    if name == "qkv" and has_q_norm:
        return opt.qk_norm_in == "qkv" or (opt.qk_norm_in == "attention" and not kv_fmt)
    return True


class GqaDecoder:
    """One slot's batch-1 decode step; ``step()`` is capturable (no host sync, no allocation by us)."""

    def __init__(self, model: GqaModel, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 cos: torch.Tensor, sin: torch.Tensor, options: FastOptions | None = None,
                 max_steps: int = 4096, kv_format: str | None = None,
                 kv_scales: list[tuple[float, float]] | None = None, tp=None, kv_nearest: bool = False):
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        self.tp = tp if tp is not None and tp.size > 1 else None  # engine/tp.TensorParallel of 2+ ranks
        self.is_first_rank = self.tp is None or self.tp.rank == 0
        self.opt = options or FastOptions()
        self.kv_fmt, self.kv_scales, self.kv_inv = kv_cache_setup(kv_format, kv_scales, len(model.layers), k_caches,
                                                                  kv_nearest)
        dev, dt = model.embed.device, model.embed.dtype
        if self.opt.pdl is None:
            self.opt = replace(self.opt, pdl=dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9)
        if dt != torch.bfloat16:
            raise ValueError(f"the fast CUDA path runs bfloat16 models, got {dt}: use the engine's torch path")
        if model.head_dim & (model.head_dim - 1) or model.head_dim < 16:
            raise ValueError(f"head_dim {model.head_dim}: the fast path's kernels need a power of two >= 16")
        if self.opt.qk_norm_in not in ("attention", "qkv", "kernel"):
            raise ValueError(f"qk_norm_in must be 'attention', 'qkv' or 'kernel', got {self.opt.qk_norm_in!r}")
        self.cos, self.sin = cos.to(device=dev, dtype=dt).contiguous(), sin.to(device=dev, dtype=dt).contiguous()
        hq, hkv, d = model.num_q_heads, model.num_kv_heads, model.head_dim
        h, inter, vocab = model.hidden, model.intermediate, model.lm_head.shape[0]
        self.token = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int32, device=dev)
        self.step_idx = torch.zeros(1, dtype=torch.int64, device=dev)
        self.out_tokens = torch.zeros(max_steps, dtype=torch.int64, device=dev)
        self.residual = torch.zeros(h, dtype=dt, device=dev)
        self.xn = torch.zeros(h, dtype=dt, device=dev)
        self.query = torch.zeros(hq * d, dtype=dt, device=dev)
        self.attn_out = torch.zeros(hq * d, dtype=dt, device=dev)
        self.act = torch.zeros(inter, dtype=dt, device=dev)
        self.tmp = torch.zeros(max((hq + 2 * hkv) * d, 2 * inter, h), dtype=dt, device=dev)
        self.qk_count = torch.zeros(hq + hkv, dtype=torch.int32, device=dev)  # qk_norm_in "qkv": per-head counts
        self.logits = torch.zeros(vocab, dtype=torch.float32, device=dev)
        self.num_parts = -(-vocab // self.opt.tiles["lm_head"][0])
        self.amax_val = torch.zeros(self.num_parts, dtype=torch.float32, device=dev)
        self.amax_idx = torch.zeros(self.num_parts, dtype=torch.int32, device=dev)
        if self.tp is not None:  # every rank's partials / logits, gathered (the step's only other collective)
            n = self.tp.size
            self.row_offset = torch.tensor(self.tp.rank * vocab, dtype=torch.int32, device=dev)
            self.all_val = torch.zeros(n * self.num_parts, dtype=torch.float32, device=dev)
            self.all_idx = torch.zeros(n * self.num_parts, dtype=torch.int32, device=dev)
            self.all_logits = torch.zeros(n * vocab, dtype=torch.float32, device=dev)
        splits, block_s = self.opt.attn_tile(self.kv_fmt)
        self.attn = DecodeAttention(num_q_heads=hq, num_kv_heads=hkv, d_main=d, d_v=d,
                                    num_splits=splits, block_s=block_s,
                                    num_warps=self.opt.attn_num_warps(self._norms_in_attention(0)),
                                    pdl=self.opt.pdl, device=dev,
                                    one_launch=self.opt.attn_one_launch,
                                    pos_row_prologue=self.opt.qk_pos_row_prologue,
                                    combine_warps=self.opt.attn_combine_warps)
        self.sampler = None  # sampling.FastSampler over the slot's sampling row (attach_sampler)

    def attach_sampler(self, state, **kwargs) -> None:
        """Sample in ``step(sample=True)``: vLLM's sampling parameters and logits processors on device
        (sampling.py) with the request parameters held in ``state`` (a sampling_state.SlotSampling, the
        slot's row of the engine's SamplingBuffers, read at every replay); kwargs: FastSampler's sizes."""
        from .sampling import FastSampler, candidate_cap

        vocab = self.model.lm_head.shape[0] * (self.tp.size if self.tp is not None else 1)
        kwargs.setdefault("cap", candidate_cap(vocab))
        self.sampler = FastSampler(state, vocab, self.logits.device, pdl=self.opt.pdl, **kwargs)

    def set_state(self, token_id: int, pos: int) -> None:
        """Host-side (re)start: the token to feed next and its position (= tokens already cached)."""
        self.token.fill_(token_id)
        self.pos.fill_(pos)
        self.step_idx.zero_()
        self.residual.copy_(self.model.embed[token_id])

    def tile_kwargs(self, name: str) -> dict:
        """Launch kwargs of projection `name`: its (block_n, block_k, num_warps, stages) tile and PDL."""
        bn, bk, nw, st = self.opt.tiles[name]
        return dict(block_n=bn, block_k=bk, num_warps=nw, stages=st, pdl=self.opt.pdl,
                    prefetch=self.opt.prefetch_tiles if self.opt.pdl else 0)

    def _cublas(self, name: str) -> bool:
        return self.opt.backends.get(name, "triton") == "cublas"

    def _linear_into(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is None:
            torch.matmul(x.view(1, -1), w.t(), out=out.view(1, -1))
        else:  # the bias joins the fp32 sum before the one rounding, as in the Triton epilogue
            torch.addmm(bias.view(1, -1), x.view(1, -1), w.t(), out=out.view(1, -1))
        return out

    def _qkv(self, i: int) -> tuple | None:
        """Launch 1: q -> self.query, K/V -> the caches at pos; the attention's qk_norm argument (or None)."""
        m, lw, eps = self.model, self.model.layers[i], self.model.eps
        hq, hkv, d = m.num_q_heads, m.num_kv_heads, m.head_dim
        kc, vc = self.k_caches[i], self.v_caches[i]
        heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        norms = dict(q_norm=lw.q_norm, k_norm=lw.k_norm, eps=eps)
        kv = self.kv_kwargs(i)
        if self._cublas("qkv"):
            smallops.rmsnorm(self.residual, lw.attn_norm, self.xn, eps)
            qkv = self._linear_into(self.xn, lw.wqkv, self.tmp[: lw.wqkv.shape[0]], lw.bqkv)
            smallops.rope_cache_write(qkv, self.query, kc, vc, self.pos, self.cos, self.sin, **heads, **norms, **kv)
        elif lw.q_norm is not None and not self._norms_in_attention(i) and not self._norms_in_qkv(i):
            qkv = gemv.gemv(self.residual, lw.wqkv, self.tmp[: lw.wqkv.shape[0]], norm_w=lw.attn_norm, eps=eps,
                            bias=lw.bqkv, **self.tile_kwargs("qkv"))
            smallops.rope_cache_write(qkv, self.query, kc, vc, self.pos, self.cos, self.sin, **heads, **norms,
                                      pdl=self.opt.pdl, **kv)
        else:  # q/k norm (Qwen3): normalised + rotated by the GEMV's last program of each head, or else
            # written as projected and normalised + rotated by the attention kernel
            in_qkv = self._norms_in_qkv(i)
            gemv.gemv_qkv_rope(self.residual, lw.wqkv, lw.attn_norm, eps, self.query, kc, vc, self.pos,
                               self.cos, self.sin, **heads, bias=lw.bqkv, rope=lw.q_norm is None,
                               pos_early=i > 0, **self.tile_kwargs("qkv"), **kv,
                               norm_late=folds_norm(self.opt, "qkv", lw.q_norm is not None, self.kv_fmt),
                               qk_norm=(lw.q_norm, lw.k_norm, self.tmp, self.qk_count) if in_qkv else None)
            if lw.q_norm is not None and not in_qkv:
                return (lw.q_norm, lw.k_norm, eps, self.cos, self.sin)
        return None

    def _norms_in_qkv(self, i: int) -> bool:
        """Whether ``_qkv``'s GEMV normalises + rotates layer i's q/k heads (Qwen3, ``qk_norm_in`` "qkv")."""
        return (self.model.layers[i].q_norm is not None and not self._cublas("qkv") and self.opt.qk_norm_in == "qkv"
                and not self._norms_in_attention(i))

    def _norms_in_attention(self, i: int) -> bool:
        """Whether ``_qkv`` leaves layer i's q/k RMSNorm + rope (Qwen3) to the attention's prologue."""
        return (self.model.layers[i].q_norm is not None and not self._cublas("qkv")
                and self.opt.qk_norm_in == "attention" and not self.kv_fmt)

    def kv_kwargs(self, i: int) -> dict:
        """The K/V writers' FP8 arguments for layer i (kv_fmt, inv_k, inv_v)."""
        return dict(kv_fmt=self.kv_fmt, inv_k=self.kv_inv[i][0], inv_v=self.kv_inv[i][1])

    def attend(self, i: int, qk_norm, quant: tuple[torch.Tensor, torch.Tensor] | None = None,
               amax: torch.Tensor | None = None) -> None:
        """Launches 2-3: the attention of layer i over the slot's cache into ``attn_out`` (``quant``: also rounded
        to FP8 a head at a time; ``amax``: each head's largest |value|; DecodeAttention's)."""
        m = self.model
        ks, vs = self.kv_scales[i]
        self.attn(self.query, self.k_caches[i], self.v_caches[i], self.pos, self.attn_out,
                  stride_kt=m.num_kv_heads * m.head_dim, stride_vt=m.num_kv_heads * m.head_dim, qk_norm=qk_norm,
                  kv_fmt=self.kv_fmt, k_scale=ks, v_scale=vs, quant=quant, amax=amax)

    def layer(self, i: int) -> None:
        """One transformer layer on the residual stream ``self.residual`` (in place)."""
        m, lw, eps = self.model, self.model.layers[i], self.model.eps
        qk_norm = self._qkv(i)
        self.attend(i, qk_norm)
        if self._cublas("o"):
            self._add_part(self._linear_into(self.attn_out, lw.wo, self.tmp[: m.hidden], self._first(lw.bo)))
        else:
            gemv.gemv(self.attn_out, lw.wo, self.residual, residual=self._first(self.residual),
                      bias=self._first(lw.bo), **self.tile_kwargs("o"))
        self._reduce()
        if self._cublas("gate_up"):
            smallops.rmsnorm(self.residual, lw.mlp_norm, self.xn, eps)
            gu = self._linear_into(self.xn, lw.w_gate_up, self.tmp[: lw.w_gate_up.shape[0]])
            smallops.silu_mul(gu, self.act)
        else:
            gemv.gemv_silu(self.residual, lw.w_gate_up, self.act, norm_w=lw.mlp_norm, eps=eps,
                           norm_late=folds_norm(self.opt, "gate_up", False, self.kv_fmt), **self.tile_kwargs("gate_up"))
        if self._cublas("down"):
            self._add_part(self._linear_into(self.act, lw.w_down, self.tmp[: m.hidden]))
        else:
            gemv.gemv(self.act, lw.w_down, self.residual, residual=self._first(self.residual),
                      **self.tile_kwargs("down"))
        self._reduce()

    def _first(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` on the first rank (alone: always); None on the others (a row-parallel GEMV adds the
        residual and the bias once, on rank 0, before the all-reduce sums the parts)."""
        return t if self.is_first_rank else None

    def _add_part(self, part: torch.Tensor) -> None:
        """residual += part (rank 0, or alone); the others' residual buffer holds their part."""
        if self.is_first_rank:
            self.residual.add_(part)
        else:
            self.residual.copy_(part)

    def _reduce(self) -> None:
        """Tensor-parallel: residual = the sum of every rank's residual buffer (see the module docstring)."""
        if self.tp is not None:
            self.tp.all_reduce(self.residual)

    def _gathered_logits(self) -> torch.Tensor:
        """The whole vocabulary's logits (this rank's alone: ``logits`` itself)."""
        if self.tp is None:
            return self.logits
        return self.tp.all_gather_into(self.all_logits, self.logits)

    def step(self, sample: bool = False) -> None:
        """One decode step from residual = embed[token] at pos: logits, next token (the greedy argmax,
        or with ``sample`` the attached sampler's token), its embedding into residual, pos += 1."""
        m = self.model
        if sample and self.sampler is None:
            raise ValueError("step(sample=True) needs attach_sampler first")
        for i in range(len(m.layers)):
            self.layer(i)
        if sample:
            if self._cublas("lm_head"):
                smallops.rmsnorm(self.residual, m.final_norm, self.xn, m.eps)
                self.logits.copy_(torch.matmul(self.xn.view(1, -1), m.lm_head.t()).view(-1))
            else:
                gemv.gemv(self.residual, m.lm_head, self.logits, norm_w=m.final_norm, eps=m.eps,
                          **self.tile_kwargs("lm_head"))
            self.sampler.finish(self._gathered_logits(), self.token, self.out_tokens, self.step_idx, self.pos,
                                m.embed, self.residual)
        elif self._cublas("lm_head"):
            smallops.rmsnorm(self.residual, m.final_norm, self.xn, m.eps)
            # bf16 x bf16 -> bf16 on cuBLAS, widened: logits rounded to bf16 (more argmax ties)
            self.logits.copy_(torch.matmul(self.xn.view(1, -1), m.lm_head.t()).view(-1))
            self.token.copy_(torch.argmax(self._gathered_logits(), dim=0, keepdim=True))
            self.out_tokens.index_copy_(0, self.step_idx, self.token)
            self.step_idx.add_(1)
            self.pos.add_(1)
            torch.index_select(m.embed, 0, self.token, out=self.residual.view(1, -1))
        else:
            gemv.gemv(self.residual, m.lm_head, self.logits, norm_w=m.final_norm, eps=m.eps,
                      argmax_parts=(self.amax_val, self.amax_idx), **self.tile_kwargs("lm_head"))
            val, idx, parts = self.amax_val, self.amax_idx, self.num_parts
            if self.tp is not None:  # every rank's (max, row) partials, rows in the global vocabulary
                self.amax_idx.add_(self.row_offset)
                val = self.tp.all_gather_into(self.all_val, self.amax_val)
                idx = self.tp.all_gather_into(self.all_idx, self.amax_idx)
                parts *= self.tp.size
            gemv.greedy_finish(val, idx, parts, self.token, self.out_tokens,
                               self.step_idx, self.pos, m.embed, self.residual, pdl=self.opt.pdl)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """reference.linear with an optional bias added to the fp32 sum before the one rounding (bf16 F.linear)."""
    if b is None:
        return reference.linear(x, w)
    return (x.float() @ w.float().T + b.float()).to(x.dtype)


def _norm_linear(h: torch.Tensor, nw: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float,
                 late: bool) -> torch.Tensor:
    """linear(rmsnorm(h) * nw) (+ b): HF's rounding points, or ``late`` (FastOptions.norm_late) the folded form:
    fp32 W @ round(h * nw) scaled by 1 / rms(h) (+ b), one rounding at the end."""
    if not late:
        return _linear(reference.rms_norm(h, nw, eps), w, b)
    hf = h.float()
    inv = 1.0 / torch.sqrt((hf * hf).mean() + eps)
    y = (w.float() @ (hf * nw.float()).to(h.dtype).float()) * inv
    return (y if b is None else y + b.float()).to(h.dtype)


def reference_layer(model: GqaModel, i: int, h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cos_p: torch.Tensor, sin_p: torch.Tensor, pos: int,
                    norm_late: bool | tuple[bool, bool] = False) -> torch.Tensor:
    """One layer of the torch reference on the residual stream h [H]; writes K/V at pos. ``norm_late``: the QKV
    and gate/up projections (a pair: each its own) take their norm in the folded form (folds_norm)."""
    hq, hkv, d, eps, lw = model.num_q_heads, model.num_kv_heads, model.head_dim, model.eps, model.layers[i]
    qkv_late, gu_late = norm_late if isinstance(norm_late, tuple) else (norm_late, norm_late)
    qkv = _norm_linear(h, lw.attn_norm, lw.wqkv, lw.bqkv, eps, qkv_late).view(hq + 2 * hkv, d)
    q, k = qkv[:hq], qkv[hq:hq + hkv]
    if lw.q_norm is not None:  # Qwen3: per-head RMSNorm before rope
        q, k = reference.rms_norm(q, lw.q_norm, eps), reference.rms_norm(k, lw.k_norm, eps)
    q = reference.rope(q, cos_p, sin_p)
    k_cache[pos] = reference.rope(k, cos_p, sin_p)
    v_cache[pos] = qkv[hq + hkv:]
    o = reference.attention(q[None], k_cache, v_cache, pos, d ** -0.5)[0].reshape(-1)
    h = h + _linear(o, lw.wo, lw.bo)
    gu = _norm_linear(h, lw.mlp_norm, lw.w_gate_up, None, eps, gu_late)
    return h + reference.linear(reference.silu_mul(gu), lw.w_down)


def reference_step(model: GqaModel, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                   cos: torch.Tensor, sin: torch.Tensor, token: int, pos: int,
                   norm_late: bool | tuple[bool, bool] = False) -> torch.Tensor:
    """Plain torch decode step (same rounding points as the fast path; ``norm_late``: as the fast path with
    FastOptions.norm_late); writes K/V at pos; fp32 logits."""
    dt = model.embed.dtype
    cos_p, sin_p = cos[pos].to(dt), sin[pos].to(dt)
    h = model.embed[token]
    for i in range(len(model.layers)):
        h = reference_layer(model, i, h, k_caches[i], v_caches[i], cos_p, sin_p, pos, norm_late)
    x = reference.rms_norm(h, model.final_norm, model.eps)
    return x.float() @ model.lm_head.float().T
