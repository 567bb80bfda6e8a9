"""Weight quantization of a checkpoint, read from its ``quantization_config`` as vLLM reads it.

Pure: no torch. ``parse_quant(raw_config) -> QuantSpec | None`` (None: an unquantized checkpoint)
accepts the two FP8 formats vLLM serves most and raises ValueError, saying what to do, for any other:

- ``compressed-tensors`` (llm-compressor), ``format`` "float-quantized": every config group's
  weights are float, 8 bits, symmetric, with strategy "channel" (a ``weight_scale`` of [N, 1]),
  "tensor" (one ``weight_scale``) or "block" (``block_structure``); ``ignore`` lists the modules
  kept in the model dtype. Activation quantization (dynamic per token or static) is the prefill
  engine's business: the decode engine runs weight-only (FP8 weights, bf16 activations).
- ``fp8`` (DeepSeek-V3 style): FP8 weights with ``weight_scale_inv`` per ``weight_block_size``
  block (typically [128, 128]), or one ``weight_scale`` per tensor without a block size;
  ``ignored_layers`` / ``modules_to_not_convert`` stay in the model dtype.

The loader does not match module names against the ignore lists: a weight stored as float8 is
quantized and one stored in another dtype is not, which is what the lists describe. The scale is
the dequantization multiplier in both formats: ``w = fp8 * scale`` (block-wise: per block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STRATEGIES = ("channel", "tensor", "block")


@dataclass(frozen=True)
class QuantSpec:
    method: str  # "compressed-tensors" | "fp8"
    strategy: str  # "channel" | "tensor" | "block"
    block: tuple[int, int] | None = None  # (rows, cols) of a scale block, strategy "block" only
    ignore: tuple[str, ...] = ()
    activations: str = "none"  # "dynamic" | "static" | "none": how the prefill engine quantizes inputs

    @property
    def scale_suffix(self) -> str:
        """Name of a quantized weight's scale tensor next to ``<module>.weight``."""
        return "weight_scale_inv" if self.method == "fp8" and self.strategy == "block" else "weight_scale"


def _unsupported(what: str) -> ValueError:
    return ValueError(f"{what}: the decode engine reads float8 weights quantized with compressed-tensors "
                      "(channel, tensor or block scales) or the fp8 method; serve an FP8 or bf16 checkpoint")


def _compressed_tensors(qc: dict[str, Any]) -> QuantSpec:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _unsupported(f"compressed-tensors format {fmt!r}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _unsupported("compressed-tensors config without config_groups")
    specs = set()
    for name, group in groups.items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
            raise _unsupported(f"compressed-tensors group {name!r} with {w.get('num_bits')}-bit {w.get('type')} weights")
        if not w.get("symmetric", True) or w.get("dynamic", False):
            raise _unsupported(f"compressed-tensors group {name!r} with asymmetric or dynamic weight scales")
        strategy = w.get("strategy")
        if strategy not in STRATEGIES:
            raise _unsupported(f"compressed-tensors group {name!r} with weight strategy {strategy!r}")
        block = tuple(int(x) for x in w["block_structure"]) if strategy == "block" else None
        if strategy == "block" and len(block) != 2:
            raise _unsupported(f"compressed-tensors group {name!r} with block_structure {w['block_structure']}")
        a = group.get("input_activations")
        acts = "none" if not a else "dynamic" if a.get("dynamic") else "static"
        specs.add((strategy, block, acts))
    if len(specs) != 1:
        raise _unsupported(f"compressed-tensors config groups with different weight schemes {sorted(map(str, specs))}")
    strategy, block, acts = specs.pop()
    return QuantSpec("compressed-tensors", strategy, block, tuple(qc.get("ignore") or ()), acts)


def _fp8(qc: dict[str, Any]) -> QuantSpec:
    acts = qc.get("activation_scheme", "dynamic")
    if acts not in ("dynamic", "static"):
        raise _unsupported(f"fp8 activation_scheme {acts!r}")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _unsupported(f"fp8 fmt {fmt!r}")
    ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    block = qc.get("weight_block_size")
    if block is None:
        return QuantSpec("fp8", "tensor", None, ignore, acts)
    if len(block) != 2:
        raise _unsupported(f"fp8 weight_block_size {block}")
    return QuantSpec("fp8", "block", (int(block[0]), int(block[1])), ignore, acts)


def parse_quant(raw: dict[str, Any]) -> QuantSpec | None:
    """The checkpoint's weight quantization from its HF config dict; None when it has none."""
    qc = raw.get("quantization_config") or raw.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fp8(qc)
    raise _unsupported(f"quantization method {method!r}")
