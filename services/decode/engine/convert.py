"""``expresslane convert-weights SRC DST``: write an HF checkpoint in the engine's own format.

The output (see weights.py) holds the engine's parameters fused and laid out as the engine and
its CUDA step consume them (wqkv, w_gate_up, stacked experts, kv_b split into W_UK/W_UV), in
safetensors shards next to the HF config, so ``Engine.load(DST)`` skips all remapping. FP8 weights
stay FP8 with their float32 ``*_scale`` tensors (``--dtype`` converts the other weights only). Tensors are
streamed shard by shard: memory holds at most one shard.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from .cache import TORCH_DTYPES
from .fp8 import SCALE_SUFFIX, is_fp8
from .weights import ENGINE_MARKER, FORMAT_VERSION, hf_to_engine, is_engine_format, read_config, CheckpointReader

COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def convert(src: str | Path, dst: str | Path, dtype: str = "auto", shard_bytes: int = 4 << 30, progress: bool = True) -> list[str]:
    """Convert ``src`` (HF safetensors directory) into ``dst``; returns the shard file names."""
    from tqdm import tqdm

    src, dst = Path(src), Path(dst)
    if is_engine_format(src):
        raise ValueError(f"{src} is already in the engine's format")
    raw, cfg = read_config(src)
    target = None if dtype == "auto" else TORCH_DTYPES[dtype]
    dst.mkdir(parents=True, exist_ok=True)
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert-weights", disable=not progress)
    shards: list[str] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes, seen = 0, set()

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            name = f"engine-{len(shards):05d}.safetensors"
            save_file(pending, str(dst / name), metadata={"format": "pt"})
            shards.append(name)
            pending, pending_bytes = {}, 0

    for name, t in hf_to_engine(cfg, CheckpointReader(src)):
        if target is not None and t.is_floating_point() and not is_fp8(t) and not name.endswith(("router_bias", SCALE_SUFFIX)):
            t = t.to(target)
        t = t.contiguous().clone() if id(t) in seen else t.contiguous()  # tied weights get their own copy
        seen.add(id(t))
        pending[name] = t
        pending_bytes += t.numel() * t.element_size()
        bar.update(t.numel() * t.element_size())
        if pending_bytes >= shard_bytes:
            flush()
    flush()
    bar.update(max(0, total - bar.n))  # fused and tied tensors do not add up to the source bytes exactly
    bar.close()
    if target is not None:
        raw["torch_dtype"] = raw["dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    for fname in COPIED_FILES:
        if (src / fname).exists():
            shutil.copy2(src / fname, dst / fname)
    marker = {"format_version": FORMAT_VERSION, "model_type": cfg.model_type, "dtype": dtype, "shards": shards}
    (dst / ENGINE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return shards


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="expresslane convert-weights",
        description="Convert an HF safetensors checkpoint (llama, qwen2, qwen3, deepseek_v3) into the decode "
        "engine's fused, pre-laid-out format; the engine loads either.",
    )
    parser.add_argument("src", help="HF checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("dst", help="output directory (created)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *TORCH_DTYPES], help="weight dtype (auto: keep)")
    parser.add_argument("--shard-gib", type=float, default=4.0, help="shard size in GiB (default 4)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        shards = convert(args.src, args.dst, args.dtype, int(args.shard_gib * (1 << 30)), not args.no_progress)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"expresslane convert-weights: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(shards)} shard(s) to {args.dst}")
    return 0
