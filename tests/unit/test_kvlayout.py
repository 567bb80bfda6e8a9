"""The engine's native KV layout: offsets, sizes and the errors a misconfigured node sees."""

import pytest

from shared.kvlayout import (
    KvShape, kv_cache_dtype_flag, kv_cache_dtypes_pair, kv_dtype_for_cache, kv_shape_from_hf_config, layout_spec, write_ranges,
)

LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "hidden_size": 64}
QWEN3 = {"model_type": "qwen3", "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 1, "hidden_size": 64, "head_dim": 32}
DSV3 = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "num_nextn_predict_layers": 1}


@pytest.mark.parametrize(
    "config, include_mtp, expected",
    [
        (LLAMA, True, KvShape(kind="gqa", num_layers=2, num_kv_heads=2, head_dim=16)),
        (QWEN3, True, KvShape(kind="gqa", num_layers=3, num_kv_heads=1, head_dim=32)),
        (DSV3, True, KvShape(kind="mla", num_layers=3, kv_lora_rank=512, qk_rope_head_dim=64)),
        (DSV3, False, KvShape(kind="mla", num_layers=2, kv_lora_rank=512, qk_rope_head_dim=64)),
    ],
)
def test_shape_from_config(config, include_mtp, expected):
    assert kv_shape_from_hf_config(config, include_mtp=include_mtp) == expected


def test_unknown_model_type_names_supported_ones():
    with pytest.raises(ValueError, match="supported are llama, qwen2, qwen3 and deepseek_v3"):
        kv_shape_from_hf_config({"model_type": "gpt2", "num_hidden_layers": 1})


@pytest.mark.parametrize(
    "shape, dtype, max_tokens, num_segments, bytes_per_token, slot_nbytes",
    [
        # GQA: per layer K then V, each [max_tokens, Hkv, D]
        (KvShape("gqa", 2, num_kv_heads=2, head_dim=16), "float32", 8, 4, 2 * 16 * 4, 4 * 8 * 128),
        (KvShape("gqa", 1, num_kv_heads=8, head_dim=128), "bfloat16", 4, 2, 8 * 128 * 2, 2 * 4 * 2048),
        # FP8 KV (vLLM's --kv-cache-dtype fp8 / fp8_e5m2): one byte per element
        (KvShape("gqa", 1, num_kv_heads=8, head_dim=128), "fp8_e4m3", 4, 2, 8 * 128, 2 * 4 * 1024),
        (KvShape("gqa", 2, num_kv_heads=2, head_dim=16), "fp8_e5m2", 8, 4, 2 * 16, 4 * 8 * 32),
        # MLA: per layer one [max_tokens, 512 + 64] region
        (KvShape("mla", 3, kv_lora_rank=512, qk_rope_head_dim=64), "bfloat16", 16, 3, 576 * 2, 3 * 16 * 1152),
    ],
)
def test_layout_sizes(shape, dtype, max_tokens, num_segments, bytes_per_token, slot_nbytes):
    spec = layout_spec(shape, dtype, max_tokens)
    assert len(spec.segments) == num_segments
    assert all(s.bytes_per_token == bytes_per_token == s.token_stride_bytes for s in spec.segments)
    assert spec.slot_nbytes == slot_nbytes
    # regions tile the slot exactly, in order, without gaps or overlap
    offsets = [s.offset_bytes for s in spec.segments]
    assert offsets == [i * max_tokens * bytes_per_token for i in range(num_segments)]


def test_gqa_segments_are_k_then_v_per_layer():
    spec = layout_spec(KvShape("gqa", 2, num_kv_heads=1, head_dim=4), "float32", 2)
    assert [(s.layer, s.name) for s in spec.segments] == [(0, "k"), (0, "v"), (1, "k"), (1, "v")]


def test_write_ranges_cover_prompt_only():
    spec = layout_spec(KvShape("gqa", 1, num_kv_heads=1, head_dim=4), "float32", 10)
    assert write_ranges(spec, 3) == [(0, 48), (160, 48)]


@pytest.mark.parametrize("num_tokens", [0, 11])
def test_write_ranges_refuse_what_does_not_fit(num_tokens):
    spec = layout_spec(KvShape("gqa", 1, num_kv_heads=1, head_dim=4), "float32", 10)
    with pytest.raises(ValueError, match="max-seq-len"):
        write_ranges(spec, num_tokens)


@pytest.mark.parametrize("dtype, max_tokens, message", [("int8", 4, "not supported"), ("float32", 0, "positive")])
def test_layout_spec_refuses_bad_arguments(dtype, max_tokens, message):
    with pytest.raises(ValueError, match=message):
        layout_spec(KvShape("gqa", 1, num_kv_heads=1, head_dim=4), dtype, max_tokens)


@pytest.mark.parametrize("cache_dtype, model_dtype, layout_dtype, flag", [
    ("auto", "bfloat16", "bfloat16", "auto"),
    ("auto", "float16", "float16", "auto"),
    ("fp8", "bfloat16", "fp8_e4m3", "fp8_e4m3"),  # vLLM's fp8 is E4M3
    ("fp8_e4m3", "float16", "fp8_e4m3", "fp8_e4m3"),
    ("fp8_e5m2", "bfloat16", "fp8_e5m2", "fp8_e5m2"),
    ("bfloat16", "float32", "bfloat16", "auto"),  # vLLM keeps the cache in the dtype named
])
def test_kv_dtype_follows_vllms_kv_cache_dtype(cache_dtype, model_dtype, layout_dtype, flag):
    assert kv_dtype_for_cache(cache_dtype, model_dtype) == layout_dtype
    assert kv_cache_dtype_flag(layout_dtype) == flag


def test_kv_dtypes_without_a_layout_are_refused():
    with pytest.raises(ValueError, match="fp8_per_token_head.*use one of auto, .*fp8_e5m2"):
        kv_dtype_for_cache("fp8_per_token_head", "bfloat16")
    with pytest.raises(ValueError, match="dense MLA in fp8_e4m3 only"):
        layout_spec(KvShape("mla", 1, kv_lora_rank=8, qk_rope_head_dim=8), "fp8_e5m2", 4)
    with pytest.raises(ValueError, match="sparse attention keeps its latent in the model dtype"):
        layout_spec(KvShape("mla", 1, kv_lora_rank=8, qk_rope_head_dim=8, index_head_dim=8, index_layers=(0,)),
                    "fp8_e4m3", 4)


def test_an_fp8_mla_slot_holds_one_byte_per_latent_element():
    shape = KvShape("mla", 2, kv_lora_rank=8, qk_rope_head_dim=4)
    spec = layout_spec(shape, "fp8_e4m3", 5)
    assert spec.dtype == "fp8_e4m3"
    assert [s.bytes_per_token for s in spec.segments] == [12, 12]
    assert spec.slot_nbytes == 2 * 5 * 12 == layout_spec(shape, "bfloat16", 5).slot_nbytes // 2


@pytest.mark.parametrize("cache_dtype, layout_dtype, pairs", [
    ("auto", "bfloat16", True), ("auto", "float32", True),  # model dtypes: the sender compares them
    ("fp8", "fp8_e4m3", True), ("fp8_e4m3", "fp8_e4m3", True), ("fp8_e5m2", "fp8_e5m2", True),
    ("auto", "fp8_e4m3", False), ("fp8", "bfloat16", False), ("fp8_e5m2", "fp8_e4m3", False),
    ("fp8_per_token_head", "fp8_e4m3", False), ("int8", "bfloat16", False),  # no layout for them
    ("bfloat16", "bfloat16", True), ("bfloat16", "float32", False), ("float16", "fp8_e4m3", False),
])
def test_which_prefill_kv_cache_dtype_pairs_with_which_gqa_slot(cache_dtype, layout_dtype, pairs):
    gqa = layout_spec(KvShape("gqa", 1, num_kv_heads=1, head_dim=4), layout_dtype, 4)
    assert kv_cache_dtypes_pair(cache_dtype, gqa) is pairs


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8", "fp8_ds_mla"])
def test_sparse_mla_slots_pair_with_any_cache_dtype_the_prefill_dequantizes(cache_dtype):
    mla = layout_spec(KvShape("mla", 1, kv_lora_rank=8, qk_rope_head_dim=8, index_head_dim=8, index_layers=(0,)),
                      "bfloat16", 4)
    assert kv_cache_dtypes_pair(cache_dtype, mla)


@pytest.mark.parametrize("cache_dtype, layout_dtype, pairs", [
    ("auto", "bfloat16", True), ("fp8", "fp8_e4m3", True), ("fp8_e4m3", "fp8_e4m3", True),
    # an FP8 latent is handed over as its bytes: a bf16 slot cannot take it, nor an FP8 slot a bf16 latent
    ("fp8", "bfloat16", False), ("auto", "fp8_e4m3", False), ("fp8_e5m2", "fp8_e4m3", False),
])
def test_which_prefill_kv_cache_dtype_pairs_with_which_dense_mla_slot(cache_dtype, layout_dtype, pairs):
    mla = layout_spec(KvShape("mla", 1, kv_lora_rank=8, qk_rope_head_dim=8), layout_dtype, 4)
    assert kv_cache_dtypes_pair(cache_dtype, mla) is pairs
