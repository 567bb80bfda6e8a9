"""Model construction for the engine: HF-named or converted tensors -> the family's module.

``load_params(named_tensors, device, dtype)`` converts tensors (router biases stay float32; tied
weights stay one tensor); ``build_model(cfg, params)`` builds the family's model on the meta device
and assigns them.
"""

from __future__ import annotations

import weakref

import torch


def build_model(cfg, params: dict[str, torch.Tensor]) -> torch.nn.Module:
    if cfg.family == "gqa":
        from .llama import LlamaModel

        with torch.device("meta"):
            model = LlamaModel(cfg)
    else:
        from .deepseek import DeepseekModel

        with torch.device("meta"):
            model = DeepseekModel(cfg, with_mtp=any(n.startswith("mtp.") for n in params))
    model.load_state_dict(params, strict=True, assign=True)
    return model.eval()


def load_params(named_tensors, device, dtype) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {}
    # tied weights (the same tensor yielded twice) stay tied; a weak reference tells a tie from a
    # freed source whose id() the next tensor reuses
    converted: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
    for name, t in named_tensors:
        seen = converted.get(id(t))
        if seen is None or seen[0]() is not t:
            keep_fp32 = name.endswith("router_bias")
            seen = converted[id(t)] = (weakref.ref(t), t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype))
        params[name] = seen[1]
    return params
