"""The decode engine's fast CUDA path: Triton kernels, fused decode steps, the CUDA-graph runner.

Entry points (see each module's docstring for the contract):
- ``GqaModel`` / ``GqaLayer`` / ``GqaDecoder`` (llama.py): batch-1 Llama-family step over the engine's
  fused weights (attn_norm, wqkv, wo, mlp_norm, w_gate_up, w_down; embed, final_norm, lm_head) and a
  slot's K/V views ``[max_tokens, num_kv_heads, head_dim]`` per layer (shared.kvlayout).
- ``GqaBatchDecoder`` (batch.py): the same step for 2..8 slots in one launch sequence (weights read once
  for every row), slots and positions in device tensors; ``RowsDecoder`` there: the rows' control plane
  and step tail it shares with the DeepSeek family's ``MlaBatchDecoder`` (mla_decoder.py).
- ``GraphedFn`` (graph.py): the one CUDA-graph runner (the fast path's steps, the engine's reference
  step); eager on CPU.
- ``gemv``/``attention``/``smallops``/``moe``: the kernels; ``reference``: their torch twins (same
  rounding points), which the engine's reference step shares where the math is the same.
- ``sampling.py``: vLLM's sampling parameters as kernels after the lm_head GEMV (``FastSampler``;
  ``GqaDecoder.attach_sampler``), reading a slot's row of ``sampling_state.SamplingBuffers`` (torch only:
  the layout shared with the engine's reference sampler, and the Philox twin).
- ``mla.py`` / ``mla_decoder.py``: the DeepSeek-V3-family step (absorbed MLA, grouped-expert MoE, MTP
  draft + verify in one graph) over the engine's deepseek.py weights (``prepare_layer``), and its batched
  steps of 2..8 slots: plain (``MlaBatchDecoder``), and each slot with its own MTP drafts
  (``MlaBatchSpecDecoder``).
- ``fp8.py`` / ``fp8block.py``: FP8 weights: per-channel / per-tensor scales on the Llama family
  (``Fp8GqaDecoder``), and block scales (``BlockFp8``, DeepSeek-V3's and Qwen's 128 x 128) read by moe.py's
  GEMVs for both families.

Importing this package needs torch and triton only (no other engine module), so GPU benchmarks can
load it on a machine that has nothing else of the project installed. Submodules load on first use:
``graph`` and ``reference`` need torch alone, so the engine imports them where Triton is missing.
"""

import importlib

_MODULES = ("adapter", "attention", "batch", "fp8", "fp8block", "gemv", "graph", "llama", "mla", "mla_decoder", "moe",
            "reference", "sampling", "sampling_state", "smallops")
_NAMES = {"FastOptions": "llama", "GqaBatchDecoder": "batch", "GqaDecoder": "llama", "GqaLayer": "llama", "GqaModel": "llama",
          "reference_step": "llama", "GraphedFn": "graph"}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
