"""The tensor-parallel shards (tp.py), table-tested: which rows / columns / experts each rank holds of
every engine parameter, the per-rank sizes the models build with, and the splits that are refused.
Pure: no process group. Each test weight's entries name their own row (or column), so a shard says
where it came from."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.decode.engine.config import ModelConfig
from services.decode.engine.options import EngineConfig
from services.decode.engine.quant import parse_quant
from services.decode.engine.tp import TensorParallel, plan, shard_params

GQA = ModelConfig(model_type="llama", family="gqa", vocab_size=5, hidden_size=2, intermediate_size=4, num_layers=1,
                  num_heads=4, rms_norm_eps=1e-6, rope={"rope_type": "default", "rope_theta": 1e4},
                  max_position_embeddings=64, num_kv_heads=2, head_dim=3)
# q LoRA, one dense layer then MoE, 4 routed experts of 4 + one shared expert, one MTP layer
MLA = ModelConfig(model_type="deepseek_v3", family="mla", vocab_size=6, hidden_size=2, intermediate_size=6,
                  num_layers=2, num_heads=4, rms_norm_eps=1e-6, rope={"rope_type": "default", "rope_theta": 1e4},
                  max_position_embeddings=64, q_lora_rank=3, kv_lora_rank=2, qk_nope_head_dim=1,
                  qk_rope_head_dim=1, v_head_dim=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4,
                  num_shared_experts=1, first_k_dense_replace=1, num_mtp_layers=1)


def rows(n: int, cols: int = 2) -> torch.Tensor:
    """[n, cols]: row i holds i."""
    return torch.arange(n, dtype=torch.float32)[:, None].expand(n, cols).contiguous()


def columns(n: int, r: int = 2) -> torch.Tensor:
    """[r, n]: column j holds j."""
    return torch.arange(n, dtype=torch.float32)[None].expand(r, n).contiguous()


def ids(t: torch.Tensor, dim: int = 0) -> list[int]:
    """Which source rows (dim 0) or columns (dim -1) a shard of ``rows``/``columns`` holds."""
    line = t[:, 0] if dim == 0 else t[0]
    return [int(v) for v in line]


# q rows 0..11 (4 heads of 3), k rows 12..17, v rows 18..23 (2 heads of 3 each)
@pytest.mark.parametrize("rank, q, k, v", [(0, range(0, 6), range(12, 15), range(18, 21)),
                                           (1, range(6, 12), range(15, 18), range(21, 24))])
def test_fused_qkv_gives_each_rank_its_q_heads_then_its_kv_heads(rank, q, k, v):
    got = shard_params(GQA, {"layers.0.wqkv": rows(24), "layers.0.bqkv": torch.arange(24.0)}, rank, 2)
    assert got["layers.0.wqkv"].shape == (12, 2) and got["layers.0.wqkv"].is_contiguous()
    assert ids(got["layers.0.wqkv"]) == [*q, *k, *v]
    assert got["layers.0.bqkv"].tolist() == [*q, *k, *v]


@pytest.mark.parametrize("rank, gate_up, down", [(0, [0, 1, 4, 5], [0, 1]), (1, [2, 3, 6, 7], [2, 3])])
def test_fused_gate_up_gives_each_rank_its_slice_of_both_halves(rank, gate_up, down):
    got = shard_params(GQA, {"layers.0.w_gate_up": rows(8), "layers.0.w_down": columns(4)}, rank, 2)
    assert ids(got["layers.0.w_gate_up"]) == gate_up  # gate rows 0..3, up rows 4..7
    assert ids(got["layers.0.w_down"], -1) == down and got["layers.0.w_down"].is_contiguous()


@pytest.mark.parametrize("size, rank, wo", [(2, 0, range(0, 6)), (2, 1, range(6, 12)), (4, 3, range(9, 12))])
def test_wo_is_row_parallel_by_heads(size, rank, wo):
    cfg = replace(GQA, num_kv_heads=4)
    assert ids(shard_params(cfg, {"layers.0.wo": columns(12)}, rank, size)["layers.0.wo"], -1) == list(wo)


@pytest.mark.parametrize("vocab, size, rank, expected", [
    (5, 2, 0, [0, 1, 2]), (5, 2, 1, [3, 4, 0]),  # padded to 6: the last row of rank 1 is a zero row
    (6, 2, 1, [3, 4, 5]), (5, 4, 3, [0, 0]), (5, 4, 2, [4, 0]),
])
def test_lm_head_is_vocab_parallel_padded_to_a_multiple_of_the_ranks(vocab, size, rank, expected):
    cfg = replace(GQA, vocab_size=vocab, num_kv_heads=4)
    head = rows(vocab) + 1  # 1-based so a padding row (0) stands out
    got = shard_params(cfg, {"lm_head": head}, rank, size)["lm_head"]
    assert [int(v) - 1 if v else 0 for v in got[:, 0]] == expected
    assert got.shape == (plan(cfg, rank, size).vocab_rows, 2)
    if rank == size - 1 and vocab % size:
        assert not got[-1].any()


def test_replicated_parameters_are_the_same_tensors_and_a_tied_head_is_cut_from_the_embedding():
    embed = rows(5)
    params = {"embed": embed, "lm_head": embed, "final_norm": torch.ones(2), "layers.0.attn_norm": torch.ones(2),
              "layers.0.q_norm": torch.ones(3), "layers.0.bo": torch.ones(2)}
    got = shard_params(GQA, params, 1, 2)
    assert all(got[n] is params[n] for n in params if n != "lm_head")
    assert ids(got["lm_head"]) == [3, 4, 0]


def test_one_rank_is_the_identity():
    params = {"layers.0.wqkv": rows(24), "lm_head": rows(5)}
    got = shard_params(GQA, params, 0, 1)
    assert all(got[n] is params[n] for n in params)


@pytest.mark.parametrize("name, make, dim, rank0, rank1", [
    ("layers.0.wq_b", lambda: rows(8), 0, [0, 1, 2, 3], [4, 5, 6, 7]),  # 4 heads of qk 2: rows by head
    ("layers.0.w_uk", lambda: rows(4), 0, [0, 1], [2, 3]),  # [H, nope, r]: dim 0
    ("layers.0.w_uv", lambda: rows(4), 0, [0, 1], [2, 3]),
    ("layers.0.wo", lambda: columns(4), -1, [0, 1], [2, 3]),  # columns by head (v_head_dim 1)
    ("layers.0.w_gate_up", lambda: rows(12), 0, [0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]),  # dense, I = 6
    ("layers.1.shared_gate_up", lambda: rows(8), 0, [0, 1, 4, 5], [2, 3, 6, 7]),
    ("layers.1.shared_down", lambda: columns(4), -1, [0, 1], [2, 3]),
    ("mtp.0.block.wo", lambda: columns(4), -1, [0, 1], [2, 3]),
    ("mtp.0.head", lambda: rows(6), 0, [0, 1, 2], [3, 4, 5]),
])
def test_mla_heads_and_dense_slices(name, make, dim, rank0, rank1):
    for rank, expected in ((0, rank0), (1, rank1)):
        assert ids(shard_params(MLA, {name: make()}, rank, 2)[name], dim) == expected


@pytest.mark.parametrize("name", ["layers.0.wq_a", "layers.0.q_a_norm", "layers.0.wkv_a", "layers.0.kv_a_norm",
                                  "layers.1.router", "layers.1.router_bias", "layers.0.idx_wq_b", "layers.0.idx_wk",
                                  "layers.0.idx_weights", "mtp.0.eh_proj", "mtp.0.embed", "mtp.0.enorm",
                                  "mtp.0.head_norm"])
def test_mla_latent_router_indexer_and_mtp_glue_are_replicated(name):
    t = rows(4)
    assert shard_params(MLA, {name: t}, 1, 2)[name] is t


def _experts(e: int, n: int, k: int) -> torch.Tensor:
    """[E, N, K]: entry (e, i, j) = 100 e + 10 i + j."""
    return (100 * torch.arange(e)[:, None, None] + 10 * torch.arange(n)[None, :, None]
            + torch.arange(k)[None, None]).float()


def test_expert_parallel_gives_each_rank_whole_experts():
    gate_up, down = _experts(4, 8, 2), _experts(4, 2, 4)
    for rank in (0, 1):
        got = shard_params(MLA, {"layers.1.experts_gate_up": gate_up, "layers.1.experts_down": down}, rank, 2, "ep")
        assert torch.equal(got["layers.1.experts_gate_up"], gate_up[2 * rank: 2 * rank + 2])
        assert torch.equal(got["layers.1.experts_down"], down[2 * rank: 2 * rank + 2])


def test_tensor_parallel_experts_slice_every_expert_like_a_dense_mlp():
    gate_up, down = _experts(4, 8, 2), _experts(4, 2, 4)  # I = 4: gate rows 0..3, up rows 4..7
    got = shard_params(MLA, {"layers.1.experts_gate_up": gate_up, "layers.1.experts_down": down}, 1, 2, "tp")
    assert got["layers.1.experts_gate_up"].shape == (4, 4, 2) and got["layers.1.experts_down"].shape == (4, 2, 2)
    assert got["layers.1.experts_gate_up"][3, :, 0].tolist() == [320, 330, 360, 370]
    assert got["layers.1.experts_down"][2, 1].tolist() == [212, 213]


@pytest.mark.parametrize("cfg, rank, size, moe, expected", [
    (GQA, 1, 2, "tp", dict(heads=2, kv_heads=1, intermediate=2, vocab_rows=3)),
    (GQA, 0, 1, "tp", dict(heads=4, kv_heads=2, intermediate=4, vocab_rows=5)),
    (MLA, 1, 2, "tp", dict(heads=2, kv_heads=0, intermediate=3, moe_intermediate=2, shared_intermediate=2,
                           experts=4, first_expert=0, vocab_rows=3)),
    (MLA, 1, 2, "ep", dict(heads=2, moe_intermediate=4, shared_intermediate=2, experts=2, first_expert=2)),
    (replace(MLA, intermediate_size=8), 3, 4, "ep", dict(heads=1, intermediate=2, experts=1, first_expert=3,
                                                         shared_intermediate=1)),
])
def test_plan_sizes(cfg, rank, size, moe, expected):
    p = plan(cfg, rank, size, moe)
    assert {k: getattr(p, k) for k in expected} == expected
    assert p.vocab == cfg.vocab_size


@pytest.mark.parametrize("cfg, size, moe, message", [
    (replace(GQA, num_heads=3, num_kv_heads=1), 2, "tp", r"attention heads \(3\) do not split over 2"),
    (replace(GQA, num_heads=4, num_kv_heads=1), 2, "tp", r"KV heads \(1\) do not split over 2"),
    (replace(GQA, intermediate_size=5), 2, "tp", r"intermediate_size \(5\) do not split"),
    (replace(MLA, intermediate_size=8, moe_intermediate_size=2, num_shared_experts=2), 4, "tp",
     r"moe_intermediate_size \(2\) do not split over 4.*moe_parallel='ep'"),
    (replace(MLA, intermediate_size=8, num_experts=6), 4, "ep",
     r"routed experts \(6\) do not split over 4.*moe_parallel='tp'"),
    (replace(MLA, moe_intermediate_size=3), 2, "ep", r"shared experts' intermediate size \(3\)"),
    (MLA, 2, "xp", r"moe_parallel must be one of tp, ep"),
])
def test_splits_that_do_not_divide_are_refused(cfg, size, moe, message):
    with pytest.raises(ValueError, match=message):
        plan(cfg, 0, size, moe)


def test_an_all_moe_model_needs_no_dense_split_and_one_rank_splits_anything():
    plan(replace(MLA, first_k_dense_replace=0, intermediate_size=7), 0, 2)
    plan(replace(GQA, num_heads=3, num_kv_heads=1, intermediate_size=5), 0, 1)


def test_fp8_checkpoints_are_refused_on_more_than_one_rank():
    quant = parse_quant({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    with pytest.raises(ValueError, match="FP8 weights.*tp=1"):
        plan(replace(GQA, quant=quant), 0, 2)
    plan(replace(GQA, quant=quant), 0, 1)
    with pytest.raises(ValueError, match="FP8"):
        shard_params(GQA, {"layers.0.wo_scale": torch.ones(2)}, 0, 2)


@pytest.mark.parametrize("rank, size", [(2, 2), (-1, 2), (0, 0)])
def test_ranks_that_do_not_exist_are_refused(rank, size):
    with pytest.raises(ValueError, match="does not exist"):
        TensorParallel(rank, size)
    with pytest.raises(ValueError, match="does not exist"):
        plan(GQA, rank, size)


def test_one_rank_collectives_are_identities():
    tp, x = TensorParallel.single(), torch.arange(6.0).view(2, 3)
    assert (tp.rank, tp.size, tp.group) == (0, 1, None)
    assert tp.all_reduce(x) is x and tp.all_gather_last(x) is x and tp.first_rank_int(5, "cpu") == 5


def test_engine_config_validates_moe_parallel():
    assert EngineConfig().moe_parallel == "tp" and EngineConfig(moe_parallel="ep").validate()
    with pytest.raises(ValueError, match="moe_parallel must be one of tp, ep"):
        EngineConfig(moe_parallel="expert").validate()
