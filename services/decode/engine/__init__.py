"""Expresslane's decode engine: Llama/Qwen GQA and DeepSeek-V3 MLA models, static slot caches in
the shared.kvlayout layout, sampling and exact MTP speculative decoding."""

from .engine import Engine, StepOutput
from .options import EngineConfig

__all__ = ["Engine", "EngineConfig", "StepOutput"]
