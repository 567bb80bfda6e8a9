"""The engine's own settings, one typed object passed to ``Engine.load`` / ``Engine.from_hf_tensors``.

Pure: no torch. ``validate()`` names the setting that is wrong. ``num_speculative_tokens=None``
means one MTP draft per MTP layer of the checkpoint (at most 3), 0 for models without them: the
engine resolves it from the checkpoint's config (``resolved_num_speculative_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FAST_PATH_MODES = ("auto", "on", "off")
CPU_STEP_MODES = ("auto", "off")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's --kv-cache-dtype names (kvquant.py)
MOE_PARALLEL = ("tp", "ep")  # routed experts under tensor parallelism: sliced on every rank, or whole per rank
MAX_SPECULATIVE_TOKENS = 3


@dataclass(frozen=True)
class EngineConfig:
    num_slots: int = 1
    max_seq_len: int = 2048  # tokens per slot (prompt + output)
    device: str = "cpu"
    dtype: Any = None  # torch.dtype or its name; None: the checkpoint's
    # slot K/V: auto keeps the model dtype; fp8 (= fp8_e4m3) / fp8_e5m2 keep vLLM's FP8 bytes (GQA only)
    kv_cache_dtype: str = "auto"
    num_speculative_tokens: int | None = 0  # MTP drafts per step; None: one per MTP layer
    model_name: str | None = None  # None: the checkpoint directory's name
    use_cuda_graphs: bool = True
    fast_path: str = "auto"  # auto | on | off (engine.py)
    fast_path_tokens_per_step: int = 1
    # one token a step: replay the next step's graph before the host reads this one's token (fastpath.py)
    fast_path_run_ahead: bool = True
    # drafts per step follow each request's acceptance (spec_policy.py); False: always num_speculative_tokens
    adaptive_speculation: bool = True
    fast_path_options: Any = None
    mtp_draft_vocab: int | None = None  # fast-path MTP drafts propose ids < N (checked: 1..vocab)
    tokenizer: str | None = None  # the tokenizer's directory for grammars; None: the checkpoint's
    # tensor-parallel engines (Engine.load(..., tp=...), tp.py): "tp" slices every routed expert over the
    # ranks, "ep" gives each rank E / tp whole experts; no effect on one rank or dense models
    moe_parallel: str = "tp"
    # the Llama family's one-token CPU step in one native call (cpustep.py) where it applies; "off": torch's ops
    cpu_step: str = "auto"

    def validate(self) -> EngineConfig:
        """Raise ValueError naming the first setting that is out of range; return self."""
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be 1 or more, got {self.num_slots}")
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be 1 or more, got {self.max_seq_len}")
        if self.fast_path not in FAST_PATH_MODES:
            raise ValueError(f"fast_path must be one of {', '.join(FAST_PATH_MODES)}, got {self.fast_path!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        k = self.num_speculative_tokens
        if k is not None and not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be 0..{MAX_SPECULATIVE_TOKENS}, got {k}")
        if self.moe_parallel not in MOE_PARALLEL:
            raise ValueError(f"moe_parallel must be one of {', '.join(MOE_PARALLEL)}, got {self.moe_parallel!r}")
        if self.cpu_step not in CPU_STEP_MODES:
            raise ValueError(f"cpu_step must be one of {', '.join(CPU_STEP_MODES)}, got {self.cpu_step!r}")
        if self.fast_path_tokens_per_step < 1:
            raise ValueError(f"fast_path_tokens_per_step must be 1 or more, got {self.fast_path_tokens_per_step}")
        return self

    def resolved_num_speculative_tokens(self, raw_config: dict) -> int:
        """Drafts per step: as set, or one per MTP layer of the checkpoint (at most 3)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return min(int(raw_config.get("num_nextn_predict_layers") or 0), MAX_SPECULATIVE_TOKENS)
