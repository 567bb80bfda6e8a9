"""Llama-style GQA decoder (Llama 3 incl. rope scaling, Qwen2 with qkv bias, Qwen3 with q/k norm).

One forward serves prefill, decode and speculative verification: ``tokens [B, T]`` at
``positions [B, T]`` of slots ``slot_ids [B]``; their K/V are written into the slots' caches first,
then every query attends to its slot's cache up to its own position. Static shapes, no host sync.

Tensor parallelism (``tp``, tp.py): the model holds its rank's heads, MLP slice and vocab rows; the
attention and MLP outputs are all-reduced, the logits all-gathered (full vocabulary on every rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import cpustep
from .cache import KvCache
from .config import ModelConfig
from .fp8 import linear
from .kvquant import dequantize, quantize
from .layers import attend, cached_rows, causal_mask, column_major, lone_run, rms_norm, swiglu, write_cache
from .rope import rope_factors, rope_tables, rotate
from .tp import ShardPlan, TensorParallel, gather_vocab, plan


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class GqaBlock(nn.Module):
    PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")  # the block's matrices

    def __init__(self, cfg: ModelConfig, p: ShardPlan):
        super().__init__()
        h, d, nq, nkv = cfg.hidden_size, cfg.head_dim, p.heads, p.kv_heads
        self.attn_norm = _param(h)
        self.wqkv = _param((nq + 2 * nkv) * d, h)
        self.bqkv = _param((nq + 2 * nkv) * d) if cfg.qkv_bias else None
        self.q_norm = _param(d) if cfg.qk_norm else None
        self.k_norm = _param(d) if cfg.qk_norm else None
        self.wo = _param(h, nq * d)
        self.bo = _param(h) if cfg.o_bias else None
        self.mlp_norm = _param(h)
        self.w_gate_up = _param(2 * p.intermediate, h)
        self.w_down = _param(h, p.intermediate)


class LlamaModel(nn.Module):
    """Parameters named as in weights.py (``tp``: this rank's shards of them, tp.py); call :meth:`bind`
    with the cache before the first forward."""

    family = "gqa"
    has_mtp = False

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TensorParallel.single()
        self.plan = p = plan(cfg, self.tp.rank, self.tp.size)
        self.embed = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GqaBlock(cfg, p) for _ in range(cfg.num_layers))
        self.final_norm = _param(cfg.hidden_size)
        self.lm_head = _param(p.vocab_rows, cfg.hidden_size)
        self.cache: KvCache | None = None
        # the fused CPU step (cpustep.py) once attach_cpu_step found it applies, else why not; fused: whether
        # the last forward took it
        self.cpu_step: cpustep.GqaKernel | None = None
        self.cpu_step_reason: str | None = "not attached"
        self.fused = False

    def bind(self, cache: KvCache) -> None:
        """Attach the KV cache and build rope tables for its capacity (and, on the CPU, lay the float32
        projections out for one-token products: :meth:`column_major_projections`)."""
        self.cache = cache
        self.cos, self.sin = rope_tables(self.cfg.rope, self.cfg.head_dim, cache.max_tokens, self.embed.device)
        if self.embed.device.type == "cpu" and self.embed.dtype == torch.float32:
            self.column_major_projections()

    def attach_cpu_step(self, mode: str = "auto") -> None:
        """Use the fused CPU step (cpustep.py) for steps of one token a slot where it applies (after :meth:`bind`;
        ``mode`` "off": never); ``cpu_step_reason`` says why not otherwise."""
        self.cpu_step, self.cpu_step_reason = cpustep.attach(self, self.cache, mode)

    def column_major_projections(self) -> None:
        """The float32 projection weights column-major (layers.column_major: the one-token F.linear's
        faster form on the CPU); an lm_head tied to the embedding keeps its layout."""
        mats = [getattr(blk, n) for blk in self.layers for n in blk.PROJECTIONS]
        if self.lm_head.untyped_storage().data_ptr() != self.embed.untyped_storage().data_ptr():
            mats.append(self.lm_head)
        column_major(mats)

    def _attention(self, i: int, blk: GqaBlock, x: torch.Tensor, cos, sin, mask, slot_ids, positions, n: int,
                   run=None) -> torch.Tensor:
        # cos / sin: rope.rope_factors of x's dtype; mask None: every key of the prefix n visible; run: lone_run's
        cfg, cache = self.cfg, self.cache
        b, t, _ = x.shape
        d, nq, nkv = cfg.head_dim, self.plan.heads, self.plan.kv_heads
        qkv = linear(x, blk.wqkv, blk.bqkv)
        v = qkv[..., (nq + nkv) * d:].view(b, t, nkv, d)
        if blk.q_norm is None:  # q and K rotated in one pass (elementwise: the same values as two)
            q, k = rotate(qkv[..., :(nq + nkv) * d].view(b, t, nq + nkv, d), cos, sin).split([nq, nkv], dim=2)
        else:
            q, k = qkv[..., :nq * d].view(b, t, nq, d), qkv[..., nq * d:(nq + nkv) * d].view(b, t, nkv, d)
            q, k = rms_norm(q, blk.q_norm, cfg.rms_norm_eps), rms_norm(k, blk.k_norm, cfg.rms_norm_eps)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        fmt = cache.kv_format
        if fmt is None:
            write_cache(cache.k_caches[i], slot_ids, positions, k, run)
            write_cache(cache.v_caches[i], slot_ids, positions, v, run)
            keys = cached_rows(cache.k_caches[i], slot_ids, n, run).transpose(1, 2)  # [B, Hkv, n, D]
            values = cached_rows(cache.v_caches[i], slot_ids, n, run).transpose(1, 2)
            out = attend(q.transpose(1, 2), keys, values, mask, d**-0.5)  # [B, T, Hq, D]
        else:  # FP8 KV as vLLM's attention: bytes written as its writer (cache.kv_nearest), read dequantized, in fp32
            ks, vs = cache.scales[i]
            write_cache(cache.k_caches[i], slot_ids, positions, quantize(k, ks, fmt, cache.kv_nearest), run)
            write_cache(cache.v_caches[i], slot_ids, positions, quantize(v, vs, fmt, cache.kv_nearest), run)
            keys = dequantize(cached_rows(cache.k_caches[i], slot_ids, n), ks, fmt).transpose(1, 2)
            values = dequantize(cached_rows(cache.v_caches[i], slot_ids, n), vs, fmt).transpose(1, 2)
            out = attend(q.float().transpose(1, 2), keys, values, mask, d**-0.5).to(x.dtype)
        out = out.reshape(b, t, nq * d)
        if self.tp.size == 1:
            return linear(out, blk.wo, blk.bo)
        out = self.tp.all_reduce(linear(out, blk.wo))  # row-parallel: each rank's heads' share
        return out if blk.bo is None else out + blk.bo  # the bias once, after the sum

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                num_keys: int | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [B, T, hidden]; ``num_keys`` > every position (default: all)."""
        self.fused = self.cpu_step is not None and tokens.shape[1] == 1 and not torch.compiler.is_compiling()
        if self.fused:  # one token a slot, each seeing its own prefix: one native call a slot
            return self.cpu_step.forward(tokens.view(-1).tolist(), slot_ids.tolist(), positions.view(-1).tolist())
        n = num_keys or self.cache.max_tokens  # keys attended: a prefix of the cache covering every position
        run = lone_run(slot_ids, positions)  # the CPU's one slot: host ints, sliced cache writes
        x = F.embedding(tokens, self.embed)
        cos, sin = rope_factors(self.cos[positions], self.sin[positions], x.dtype)  # [B, T, 1, D]
        # one token seeing exactly its prefix (the CPU's plain step): no mask, the same attention
        mask = None if run is not None and tokens.shape[1] == 1 and n == run[1] + 1 else causal_mask(positions, n)
        eps = self.cfg.rms_norm_eps
        for i, blk in enumerate(self.layers):
            x = x + self._attention(i, blk, rms_norm(x, blk.attn_norm, eps), cos, sin, mask, slot_ids, positions, n,
                                    run)
            x = x + self.tp.all_reduce(swiglu(rms_norm(x, blk.mlp_norm, eps), blk.w_gate_up, blk.w_down))
        return rms_norm(x, self.final_norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> float32 logits [..., vocab] (every rank: the whole vocabulary)."""
        return gather_vocab(self.tp, linear(hidden, self.lm_head).float(), self.cfg.vocab_size)

