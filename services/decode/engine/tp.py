"""Tensor parallelism for the engine's reference step: Megatron-style shards over N ranks.

Every rank runs the same Engine calls in the same order (SPMD, as vLLM's workers do), holds a shard of
the weights and its share of the KV cache; the model's forward does the collectives, so every rank
computes the same full logits and takes the same tokens.

- ``TensorParallel(rank, size, group)``: the collectives the models call. ``all_reduce`` sums partial
  outputs (after row-parallel ``wo`` / ``w_down`` / the MoE), ``all_gather_last`` concatenates the
  vocab-parallel logits; ``single()`` is one rank, both identities, no torch.distributed needed.
  Collectives on CUDA tensors go through NCCL and are capturable, so the reference step's CUDA
  graphs stay on.
- ``plan(cfg, rank, size, moe_parallel)`` -> ``ShardPlan``: the sizes one rank holds (the models
  build with them); raises ValueError where the model does not split (and for FP8 checkpoints).
- ``shard_params(cfg, params, rank, size, moe_parallel)`` / ``shard_named``: the rank's slices of
  engine-format parameters (weights.py names). Pure: no torch.distributed.

Sharding, per parameter (``layers.{i}.`` and ``mtp.{j}.block.`` alike):

- GQA: ``wqkv`` / ``bqkv`` rows: the rank's q heads, then its k heads, then its v heads (KV heads
  ``[r*H/tp, (r+1)*H/tp)``, as shared.kvlayout's ``tp_heads``); ``wo`` columns (row-parallel, then
  all-reduce; ``bo`` added once, after it); q/k norms replicated.
- MLA: ``wq`` / ``wq_b`` rows, ``w_uk`` / ``w_uv`` dim 0 by head, ``wo`` columns; ``wq_a``,
  ``wkv_a``, the norms and the sparse-attention indexer replicated (every rank keeps the whole latent,
  so the MLA KV cache is not split).
- Dense MLPs and shared experts: ``*gate_up`` [gate (I rows); up (I rows)] -> the rank's slice of each
  half; ``*down`` columns. Routed experts: ``moe_parallel="tp"`` slices every expert the same way;
  ``"ep"`` gives rank r experts ``[r*E/tp, (r+1)*E/tp)`` whole. The router stays replicated; one
  all-reduce sums the routed and shared experts' partial outputs.
- ``lm_head`` / MTP ``head``: vocab-parallel rows, the vocabulary padded with zero rows to a multiple
  of ``size`` (the gathered logits are cut back to the vocabulary). Embeddings, ``eh_proj`` and every
  norm replicated; a tied lm_head is sliced from the embedding it shares.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .fp8 import SCALE_SUFFIX
from .options import MOE_PARALLEL
from .weights import is_moe_layer


@dataclass(frozen=True)
class TensorParallel:
    """One rank of a tensor-parallel group; ``group`` a torch.distributed ProcessGroup (None: the default group)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} does not exist")

    @classmethod
    def single(cls) -> TensorParallel:
        """No parallelism: the collectives are identities."""
        return cls(0, 1, None)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (contiguous; summed in place), returned."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dim, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        flat = x.contiguous().reshape(-1)
        out = flat.new_empty(self.size * flat.numel())
        # all_gather_single is the newer torch's name of all_gather_into_tensor (which it deprecates)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, flat, group=self.group)
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D ``x`` into ``out`` ([size * len(x)], rank order; preallocated, so a CUDA
        graph can capture it); returns ``out``."""
        if self.size == 1:
            return out.copy_(x)
        import torch.distributed as dist

        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x, group=self.group)
        return out

    def first_rank_int(self, value: int, device: torch.device | str) -> int:
        """Rank 0's ``value`` (a signed 64-bit int) on every rank: one all-reduce, the others adding 0."""
        if self.size == 1:
            return value
        t = torch.tensor([value if self.rank == 0 else 0], dtype=torch.int64, device=device)
        return int(self.all_reduce(t).item())


def gather_vocab(tp: TensorParallel, local: torch.Tensor, vocab: int) -> torch.Tensor:
    """Every rank's vocab-parallel logits [..., vocab_rows] gathered and cut to the vocabulary
    (one rank: ``local`` itself)."""
    if tp.size == 1:
        return local
    full = tp.all_gather_last(local)
    return full if full.shape[-1] == vocab else full[..., :vocab].contiguous()


@dataclass(frozen=True)
class ShardPlan:
    """What one rank holds of a model: per-rank sizes (``size`` 1: the whole model)."""

    rank: int
    size: int
    moe_parallel: str
    heads: int  # attention (query) heads
    kv_heads: int  # GQA KV heads
    intermediate: int  # dense MLP
    moe_intermediate: int  # of each routed expert held ("ep": whole)
    shared_intermediate: int  # the shared experts' fused MLP
    experts: int  # routed experts held ("ep": E / size)
    first_expert: int  # global id of the first one held
    vocab: int  # the model's vocabulary (the gathered logits)
    vocab_rows: int  # lm_head / MTP head rows held: the vocabulary padded to a multiple of size, / size


def _per_rank(total: int, size: int, what: str, hint: str) -> int:
    if total % size:
        raise ValueError(f"{what} ({total}) do not split over {size} tensor-parallel ranks: {hint}")
    return total // size


def plan(cfg, rank: int = 0, size: int = 1, moe_parallel: str = "tp") -> ShardPlan:
    """The sizes rank ``rank`` of ``size`` holds of ``cfg``'s model; ValueError where it does not split."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} of {size} does not exist")
    if moe_parallel not in MOE_PARALLEL:
        raise ValueError(f"moe_parallel must be one of {', '.join(MOE_PARALLEL)}, got {moe_parallel!r}")
    hint = "use a tensor-parallel size that divides it (or tp=1)"
    if size > 1 and cfg.quant is not None:
        raise ValueError(f"{cfg.quant.method} FP8 weights: the engine's tensor-parallel decode runs unquantized "
                         "checkpoints only (FP8 shards are not built yet); serve it with tp=1, or a bf16 checkpoint")
    heads = _per_rank(cfg.num_heads, size, "attention heads", hint)
    kv_heads = _per_rank(cfg.num_kv_heads, size, "KV heads", hint) if cfg.family == "gqa" else 0
    dense = cfg.family == "gqa" or any(not is_moe_layer(cfg, i) for i in range(cfg.num_cache_layers))
    intermediate = _per_rank(cfg.intermediate_size, size, "intermediate_size", hint) if dense else 0
    moe_i, shared_i, experts = cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.num_shared_experts, 0
    if cfg.num_experts:
        shared_i = _per_rank(shared_i, size, "shared experts' intermediate size", hint)
        if moe_parallel == "ep":
            experts = _per_rank(cfg.num_experts, size, "routed experts",
                                "use a tensor-parallel size that divides it, or moe_parallel='tp'")
        else:
            experts = cfg.num_experts
            moe_i = _per_rank(moe_i, size, "moe_intermediate_size",
                              "use a tensor-parallel size that divides it, or moe_parallel='ep'")
    return ShardPlan(rank=rank, size=size, moe_parallel=moe_parallel, heads=heads, kv_heads=kv_heads,
                     intermediate=intermediate, moe_intermediate=moe_i, shared_intermediate=shared_i,
                     experts=experts, first_expert=rank * experts if experts != cfg.num_experts else 0,
                     vocab=cfg.vocab_size, vocab_rows=math.ceil(cfg.vocab_size / size))


def _even(t: torch.Tensor, dim: int, p: ShardPlan) -> torch.Tensor:
    """Rank p.rank's slice of ``size`` equal parts of ``t`` along ``dim``."""
    n = t.shape[dim] // p.size
    return t.narrow(dim, p.rank * n, n)


def _halves(t: torch.Tensor, dim: int, p: ShardPlan) -> torch.Tensor:
    """A fused [gate; up] weight: the rank's slice of each half, fused again."""
    gate, up = t.chunk(2, dim=dim)
    return torch.cat([_even(gate, dim, p), _even(up, dim, p)], dim=dim)


def _qkv(t: torch.Tensor, cfg, p: ShardPlan) -> torch.Tensor:
    """Fused [q; k; v] rows (weight or bias): the rank's q heads, k heads and v heads."""
    d = cfg.head_dim
    q, k, v = t.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], dim=0)
    return torch.cat([_even(q, 0, p), _even(k, 0, p), _even(v, 0, p)], dim=0)


def _vocab(t: torch.Tensor, p: ShardPlan) -> torch.Tensor:
    """lm_head rows [r * rows, (r + 1) * rows) of the vocabulary padded with zero rows."""
    start, stop = p.rank * p.vocab_rows, min((p.rank + 1) * p.vocab_rows, t.shape[0])
    rows = t[start:stop]
    if rows.shape[0] < p.vocab_rows:
        rows = torch.cat([rows, rows.new_zeros(p.vocab_rows - rows.shape[0], *t.shape[1:])])
    return rows


def shard_tensor(cfg, p: ShardPlan, name: str, t: torch.Tensor) -> torch.Tensor:
    """The rank's part of engine parameter ``name`` (``t`` itself where replicated; a copy where cut,
    so that the whole tensor can be freed)."""
    if p.size == 1:
        return t
    if name.endswith(SCALE_SUFFIX):
        raise ValueError(f"{name}: FP8 weights are not sharded for tensor-parallel decode yet; serve with tp=1")
    last = name.rpartition(".")[2]
    if last in ("lm_head", "head"):
        out = _vocab(t, p)
    elif last in ("wqkv", "bqkv"):
        out = _qkv(t, cfg, p)
    elif last in ("wq", "wq_b", "w_uk", "w_uv"):
        out = _even(t, 0, p)
    elif last in ("wo", "w_down", "shared_down"):
        out = _even(t, t.dim() - 1, p)
    elif last in ("w_gate_up", "shared_gate_up"):
        out = _halves(t, 0, p)
    elif last == "experts_gate_up":
        out = _even(t, 0, p) if p.moe_parallel == "ep" else _halves(t, 1, p)
    elif last == "experts_down":
        out = _even(t, 0, p) if p.moe_parallel == "ep" else _even(t, 2, p)
    else:  # embeddings, norms, biases after a reduce, the latent projections, router, indexer, eh_proj
        return t
    return out.clone(memory_format=torch.contiguous_format)


def shard_named(cfg, named: Iterable[tuple[str, torch.Tensor]], rank: int, size: int,
                moe_parallel: str = "tp") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, the rank's part) of each (name, tensor), one at a time (a checkpoint streams through);
    raises ValueError at once where the model does not split."""
    p = plan(cfg, rank, size, moe_parallel)
    return ((name, shard_tensor(cfg, p, name, t)) for name, t in named)


def shard_params(cfg, params: dict[str, torch.Tensor], rank: int, size: int,
                 moe_parallel: str = "tp") -> dict[str, torch.Tensor]:
    """Rank ``rank`` of ``size``'s parameters of an engine-format parameter dict."""
    return dict(shard_named(cfg, params.items(), rank, size, moe_parallel))
