"""The decode engine's fast CUDA path: Triton kernels, fused decode steps, CUDA-graph runner.

Entry points (see each module's docstring for the contract):
- ``GqaModel`` / ``GqaLayer`` / ``GqaDecoder`` (llama.py): batch-1 Llama-family step over the engine's
  fused weights (attn_norm, wqkv, wo, mlp_norm, w_gate_up, w_down; embed, final_norm, lm_head) and a
  slot's K/V views ``[max_tokens, num_kv_heads, head_dim]`` per layer (shared.kvlayout).
- ``GraphRunner`` (graph.py): captures ``decoder.step`` into one CUDA graph; eager on CPU.
- ``gemv``/``attention``/``smallops``: the kernels, each with a torch twin for CPU tests.
- ``mla.py`` / ``mla_decoder.py`` / ``moe.py``: the DeepSeek-V3-family step (absorbed MLA, grouped-expert
  MoE, MTP draft + verify in one graph) over the engine's deepseek.py weights (``prepare_layer``).

Importing this package needs torch and triton only (no other engine module), so GPU benchmarks can
load it on a machine that has nothing else of the project installed.
"""

from . import attention, gemv, mla, mla_decoder, moe, smallops
from .graph import GraphRunner
from .llama import FastOptions, GqaDecoder, GqaLayer, GqaModel, reference_step

__all__ = ["FastOptions", "GqaDecoder", "GqaLayer", "GqaModel", "GraphRunner", "reference_step"]
