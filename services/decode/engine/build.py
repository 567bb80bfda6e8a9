"""Model construction for the engine: HF-named or converted tensors -> the family's module.

``load_params(named_tensors, device, dtype)`` converts tensors (router biases and FP8 scales stay
float32, FP8 weights stay FP8; tied weights stay one tensor); ``build_model(cfg, params, tp,
moe_parallel)`` builds the family's model on the meta device and assigns them, FP8 scales next to
their weights (fp8.attach). With ``tp`` of more than one rank ``params`` are that rank's shards
(tp.shard_params) and the model holds those shapes and does the collectives.
"""

from __future__ import annotations

import weakref

import torch

from .fp8 import SCALE_SUFFIX, activation_group, attach, is_fp8


def build_model(cfg, params: dict[str, torch.Tensor], tp=None, moe_parallel: str = "tp") -> torch.nn.Module:
    """The family's model over ``params`` (``tp``: a tp.TensorParallel; None: one rank)."""
    if cfg.family == "gqa":
        from .llama import LlamaModel

        with torch.device("meta"):
            model = LlamaModel(cfg, tp=tp)
    else:
        from .deepseek import DeepseekModel

        with torch.device("meta"):
            model = DeepseekModel(cfg, with_mtp=any(n.startswith("mtp.") for n in params), tp=tp,
                                  moe_parallel=moe_parallel)
    scales = {n: t for n, t in params.items() if n.endswith(SCALE_SUFFIX)}
    model.load_state_dict({n: t for n, t in params.items() if n not in scales}, strict=True, assign=True)
    attach(model, scales, cfg.quant.block if cfg.quant is not None else None, activation_group(cfg.quant))
    return model.eval()


def load_params(named_tensors, device, dtype) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {}
    # tied weights (the same tensor yielded twice) stay tied; a weak reference tells a tie from a
    # freed source whose id() the next tensor reuses
    converted: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
    for name, t in named_tensors:
        seen = converted.get(id(t))
        if seen is None or seen[0]() is not t:
            keep_fp32 = name.endswith(("router_bias", SCALE_SUFFIX))
            to = t.dtype if is_fp8(t) else torch.float32 if keep_fp32 else dtype
            seen = converted[id(t)] = (weakref.ref(t), t.to(device=device, dtype=to))
        params[name] = seen[1]
    return params
