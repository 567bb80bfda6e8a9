"""FP8 versions of tiny checkpoints (``expresslane make-model --quantize SCHEME``), and their
dequantized twins for reference runs.

``quantize_checkpoint(model_dir, scheme, ignore=(), activations="dynamic")`` rewrites the
safetensors of an HF checkpoint directory in place and adds the ``quantization_config`` vLLM reads:

- ``fp8-channel`` / ``fp8-tensor``: compressed-tensors "float-quantized", as llm-compressor writes
  its FP8 schemes: ``<module>.weight`` float8_e4m3fn and ``<module>.weight_scale`` in the
  checkpoint dtype ([N, 1] per output channel, or [1] per tensor); input activations FP8 dynamic
  per token (``activations="dynamic"``, FP8_DYNAMIC) or none (``"none"``, weight-only W8A16).
  ``ignore`` lists ``lm_head`` and the modules left unquantized (exact names or ``re:`` patterns).
- ``fp8-block``: the ``fp8`` method with ``weight_block_size`` [128, 128] as DeepSeek-V3 ships:
  ``<module>.weight`` float8_e4m3fn and ``<module>.weight_scale_inv`` float32 per 128x128 block.

Quantized: the decoder layers' linear projections (attention, dense MLP, experts and shared
experts, MTP blocks). Kept in the checkpoint dtype: embeddings, norms, biases, lm_head, the MoE
router (``mlp.gate``), MTP ``eh_proj`` and ``shared_head`` (unquantized modules in vLLM's models),
and the ``ignore``d modules. Scales are the dequantization multipliers (``w = fp8 * scale``) and
are computed from the absolute maximum of each channel, tensor or block, so a quantized value
never clips.

``dequantize_checkpoint(src, dst, dtype="float32")`` writes ``src`` with every FP8 weight
multiplied out (no quantization_config): the reference an FP8 engine is measured against.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

SCHEMES = ("fp8-channel", "fp8-tensor", "fp8-block")
BLOCK = (128, 128)
QUANTIZED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj",
                     "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def _is_ignored(module: str, ignore: tuple[str, ...]) -> bool:
    for pattern in ignore:
        if pattern.startswith("re:") and re.match(pattern[3:], module) or module == pattern:
            return True
    return False


def quantized_module(name: str, ignore: tuple[str, ...] = ()) -> str | None:
    """The module of tensor ``name`` when the writer quantizes it, else None."""
    if not name.startswith("model.layers.") or not name.endswith(".weight"):
        return None
    module = name[: -len(".weight")]
    if module.rsplit(".", 1)[-1] not in QUANTIZED_MODULES or _is_ignored(module, ignore):
        return None
    return module


def quantize(w, scheme: str, scale_dtype, block: tuple[int, int] = BLOCK):
    """(float8_e4m3fn weight, scale in ``scale_dtype``) of a float weight [N, K] under ``scheme`` (``block``: the
    fp8-block scheme's block)."""
    import torch

    w = w.float()
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    n, k = w.shape
    if scheme == "fp8-block":
        bn, bk = block
        nb, kb = -(-n // bn), -(-k // bk)
        padded = torch.zeros(nb * bn, kb * bk)
        padded[:n, :k] = w
        amax = padded.abs().view(nb, bn, kb, bk).amax(dim=(1, 3))
        scale = (amax / fp8_max).clamp(min=1e-12).to(scale_dtype)
        full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    else:
        amax = w.abs().amax(dim=1, keepdim=True) if scheme == "fp8-channel" else w.abs().amax().reshape(1, 1)
        scale = (amax / fp8_max).clamp(min=1e-12).to(scale_dtype)
        full = scale.float()
        scale = scale if scheme == "fp8-channel" else scale.reshape(1)
    q = (w / full).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return q, scale


def quantization_config(scheme: str, ignore: tuple[str, ...], activations: str = "dynamic",
                        block: tuple[int, int] = BLOCK) -> dict:
    """The ``quantization_config`` of config.json for ``scheme``."""
    if scheme == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block), **({"ignored_layers": list(ignore)} if ignore else {})}
    weights = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False, "group_size": None,
               "strategy": scheme.removeprefix("fp8-"), "block_structure": None, "actorder": None,
               "observer": "minmax", "observer_kwargs": {}}
    inputs = None if activations == "none" else {
        "type": "float", "num_bits": 8, "symmetric": True, "dynamic": True, "group_size": None,
        "strategy": "token", "block_structure": None, "actorder": None, "observer": None, "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None}},
            "ignore": ["lm_head", *ignore], "kv_cache_scheme": None, "sparsity_config": {}}


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def quantize_checkpoint(model_dir: Path | str, scheme: str, ignore: tuple[str, ...] = (),
                        activations: str = "dynamic", block: tuple[int, int] = BLOCK) -> Path:
    """Quantize the checkpoint in ``model_dir`` in place (see the module docstring); returns it. ``block``: the
    fp8-block scheme's block (DeepSeek-V3's 128 x 128 by default; tests of tiny models use smaller ones, which
    the engine reads and vLLM's CPU build may not)."""
    import torch
    from safetensors.torch import load_file, save_file

    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if activations not in ("dynamic", "none"):
        raise ValueError(f"activations must be 'dynamic' or 'none', got {activations!r}")
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{model_dir} is already quantized")
    dtype = getattr(torch, config.get("torch_dtype") or config.get("dtype") or "float32")
    scale_dtype = torch.float32 if scheme == "fp8-block" else dtype
    suffix = "weight_scale_inv" if scheme == "fp8-block" else "weight_scale"
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(str(f))
        out = {}
        for name, t in tensors.items():
            module = quantized_module(name, ignore)
            if module is None or t.dim() != 2:
                out[name] = t
                continue
            out[name], out[f"{module}.{suffix}"] = quantize(t, scheme, scale_dtype, block)
        save_file({k: v.contiguous() for k, v in out.items()}, str(f), metadata={"format": "pt"})
    config["quantization_config"] = quantization_config(scheme, tuple(ignore), activations, block)
    _write_json(model_dir / "config.json", config)
    return model_dir


def dequantize_checkpoint(src: Path | str, dst: Path | str, dtype: str = "float32") -> Path:
    """Write ``src`` (an FP8 checkpoint of quantize_checkpoint's formats) to ``dst`` with every
    weight multiplied out in float32 and stored in ``dtype``; other files are copied."""
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config")
    block = qc.get("weight_block_size")
    target = getattr(torch, dtype)
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(f))
        out = {}
        for name, t in tensors.items():
            if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
                continue
            if t.dtype == torch.float8_e4m3fn:
                module = name[: -len(".weight")]
                s = (tensors.get(f"{module}.weight_scale_inv") if block else tensors[f"{module}.weight_scale"]).float()
                if block:
                    s = s.repeat_interleave(block[0], 0)[: t.shape[0]].repeat_interleave(block[1], 1)[:, : t.shape[1]]
                else:
                    s = s.reshape(-1, 1) if s.numel() > 1 else s.reshape(1, 1)
                t = t.float() * s
            out[name] = t.to(target) if t.is_floating_point() else t
        save_file({k: v.contiguous() for k, v in out.items()}, str(dst / f.name), metadata={"format": "pt"})
    config["torch_dtype"] = dtype
    if "dtype" in config:
        config["dtype"] = dtype
    _write_json(dst / "config.json", config)
    for other in src.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name != "config.json":
            shutil.copy2(other, dst / other.name)
    return dst
