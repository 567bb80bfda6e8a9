"""The prefill's tensor-parallel split, as the connector sees it.

vLLM runs one connector worker per tensor-parallel rank; each holds its own KV cache:

- GQA: rank ``r`` of ``p`` holds KV heads ``[r * H / p, (r + 1) * H / p)`` of the model's ``H``
  (shared.kvlayout's split), so each rank stages and writes its own heads, and all ``p`` ranks
  announce a ``KvReady``. vLLM replicates heads instead when ``H < p`` (and cannot split them when
  ``p`` does not divide ``H``): such a prefill is refused, with the reason, for every request.
- MLA: every rank holds the whole latent, so only rank 0 stages and writes (to every decode rank);
  the other ranks keep no staging memory and announce nothing.

Pure apart from :func:`vllm_tensor_parallel`, which asks vLLM.
"""

from __future__ import annotations


def vllm_tensor_parallel() -> tuple[int, int]:
    """(tensor-parallel size, this process's rank) from vLLM's process groups; (1, 0) where they
    are not initialised (one worker, or no vLLM: a stand-in or a test)."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return 1, 0
    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank())


def split_refusal(kind: str, num_kv_heads: int, tp_size: int, pp_size: int = 1) -> str:
    """Why a prefill of ``tp_size`` ranks (and ``pp_size`` pipeline stages) cannot hand its KV over
    ("" when it can)."""
    if pp_size > 1:  # each stage holds its own layers, numbered from 0, and would send them as the first ones
        return (f"express lane off on this prefill: vLLM's --pipeline-parallel-size {pp_size} splits the "
                f"layers over stages and a hand-off carries a request's whole KV from one; run vLLM "
                f"without pipeline parallelism (tensor parallelism is supported)")
    if kind != "gqa" or tp_size == 1 or (num_kv_heads >= tp_size and num_kv_heads % tp_size == 0):
        return ""
    how = "replicates them on every rank" if num_kv_heads < tp_size else "cannot split them evenly"
    return (f"express lane off on this prefill: vLLM's --tensor-parallel-size {tp_size} over {num_kv_heads} "
            f"KV heads {how}, and a decode slot takes each KV head once; run vLLM with a "
            f"--tensor-parallel-size that divides {num_kv_heads}")


def staging_ranks(kind: str, tp_size: int) -> int:
    """How many ranks stage (and hold staging slot states): every rank for GQA, rank 0 for MLA."""
    return tp_size if kind == "gqa" else 1


def stages(kind: str, tp_rank: int) -> bool:
    """Whether rank ``tp_rank`` stages and writes KV (MLA: rank 0 only, the latent is whole on each)."""
    return kind == "gqa" or tp_rank == 0
