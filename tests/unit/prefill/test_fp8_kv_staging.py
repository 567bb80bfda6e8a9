"""vLLM's FP8 KV cache bytes reach the decode slot unchanged: the staging pool of an FP8 layout is
bytes, the CPU layout adapter copies vLLM's uint8 cache into it as it is (no round trip through the
model dtype), and the sender refuses a prefill and a decode slot whose KV dtypes differ with a reason
that names the flag to change."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine.kvquant import quantize
from services.prefill.layouts import CpuAmx, CpuVec
from services.prefill.sender import layout_mismatch
from services.prefill.staging import StagingPool
from shared.kvlayout import KvShape, layout_spec
from tests.fixtures.cpu_isa import needs_vllm_cpu_fp8_kv, skip_unless_vllm_isa

SHAPE = KvShape(kind="gqa", num_layers=1, num_kv_heads=2, head_dim=32)


@needs_vllm_cpu_fp8_kv
@pytest.mark.parametrize("isa,adapter", [("vec", CpuVec), ("amx", CpuAmx)])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("t,b", [(40, 32), (150, 128)])  # 128: the vec adapter's block-by-block copy
def test_cpu_adapters_stage_vllm_fp8_bytes_unchanged(fmt, isa, adapter, t, b):
    ops = pytest.importorskip("vllm._custom_ops")
    skip_unless_vllm_isa(isa)
    h, d = SHAPE.num_kv_heads, SHAPE.head_dim
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(2, t, h, d, generator=gen) * 4).bfloat16()
    cache = torch.zeros(4, h, b, 2 * d, dtype=torch.uint8)  # vLLM's registered FP8 cache of one layer
    kc, vc = cache.view(4, h, 2 * b, d).chunk(2, dim=2)
    blocks = [3, 1]  # the request's blocks, out of order
    slots = torch.tensor([blocks[i // b] * b + i % b for i in range(t)])
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, 0.5, 0.25, fmt)  # AMX's packing: scalar code
    pool = StagingPool(layout_spec(SHAPE, fmt, max_tokens=256), num_slots=1)
    views = [x.view(t, h, d) for x in pool.segment_views(0, t)]
    assert all(x.dtype == torch.uint8 for x in views)
    adapter()(cache, torch.tensor(blocks), t, views)
    assert torch.equal(views[0], quantize(k, 0.5, fmt))
    assert torch.equal(views[1], quantize(v, 0.25, fmt))


@pytest.mark.parametrize("ours,theirs,flags", [
    ("fp8_e4m3", "bfloat16", ("decode --kv-cache-dtype fp8_e4m3", "vLLM --kv-cache-dtype auto")),
    ("bfloat16", "fp8_e4m3", ("decode --kv-cache-dtype auto", "vLLM --kv-cache-dtype fp8_e4m3")),
    ("fp8_e5m2", "fp8_e4m3", ("decode --kv-cache-dtype fp8_e5m2", "vLLM --kv-cache-dtype fp8_e4m3")),
])
def test_kv_dtype_mismatch_says_what_to_change(ours, theirs, flags):
    reason = layout_mismatch(layout_spec(SHAPE, ours, 16), layout_spec(SHAPE, theirs, 16), 10)
    assert reason.startswith("layout mismatch") and all(f in reason for f in flags), reason
    assert layout_mismatch(layout_spec(SHAPE, ours, 16), layout_spec(SHAPE, ours, 16), 10) == ""
