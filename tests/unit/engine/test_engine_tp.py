"""Tensor-parallel decode: two CPU processes (gloo), each loading its rank's shard of a tiny checkpoint,
decode what one process decodes.

One spawn serves the whole module: the parent decodes every scenario with one rank first (tokens,
logits, the prefilled KV), then both ranks run the same calls (SPMD) and save what they saw; the tests
compare. Scenarios: Llama with planted (trained-like) margins, Qwen2 with qkv bias, tied embeddings
and a vocabulary that does not split (padded lm_head shards), Qwen3 with q/k norm, DeepSeek-V3 (q LoRA,
MoE, MTP drafts) with routed experts sliced ("tp") and whole per rank ("ep", with a prompt long
enough for the prefill's per-expert loop), GLM-5's sparse attention (the indexer replicated). Refusals
need no process group: they come at load.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine.tp import TensorParallel
from shared.events import SamplingParams

WORLD = 2
GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7)
UNSEEDED = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9)
PROMPT = [0, 17, 42, 99, 3, 250, 7, 8, 120]
LONG_PROMPT = [(7 * i + 3) % 250 for i in range(70)]  # > 64 tokens: the MoE prefill's per-expert loop


def _slot_tensors(engine: Engine, slot: int, n: int) -> list[torch.Tensor]:
    """The slot's first n tokens per layout segment: [n, kv heads, head_dim] (GQA) or [n, width] (MLA)."""
    buf, lay = engine.slot_buffer(slot), engine.layout
    out = []
    for seg in lay.segments:
        t = buf[seg.offset_bytes: seg.offset_bytes + n * seg.bytes_per_token].view(engine.dtype)
        out.append((t.view(n, lay.kv_heads, -1) if lay.kind == "gqa" else t.view(n, -1)).clone())
    return out


def _write_slot(engine: Engine, slot: int, full: list[torch.Tensor]) -> None:
    """Write one rank's view of whole-model KV (``_slot_tensors`` of a one-rank engine) into its slot:
    the rank's KV heads (GQA) or the whole latent (MLA), at its layout's offsets."""
    buf, lay = engine.slot_buffer(slot), engine.layout
    for seg, t in zip(lay.segments, full, strict=True):
        part = t[:, lay.kv_head_start: lay.kv_head_start + lay.kv_heads] if lay.kind == "gqa" else t
        raw = part.contiguous().view(torch.uint8).flatten()
        buf[seg.offset_bytes: seg.offset_bytes + raw.numel()] = raw


def _layer0(engine: Engine, n: int) -> torch.Tensor:
    """Layer 0's cache of slot 0's first n tokens: K [n, heads held, D] (GQA) or the latent [n, width]."""
    c = engine.cache
    return (c.k_caches[0][0, :n] if engine.layout.kind == "gqa" else c.kv[0][0, :n]).clone()


def _decode(engine: Engine, spec: dict, inject: list[torch.Tensor] | None = None) -> dict:
    """Run a scenario on one engine (one rank or one of several: the same calls either way)."""
    prompt, out = spec["prompt"], {"tokens": []}
    for i, sampling in enumerate(spec["requests"]):
        logits = engine.prefill(0, prompt)
        if i == 0:
            out["prefill_logits"] = logits.clone()
            out["layer0"] = _layer0(engine, len(prompt))
            out["slot"] = _slot_tensors(engine, 0, len(prompt))
        tokens = [int(logits.argmax())]
        engine.start(0, tokens[0], sampling)
        while engine.active_slots():
            tokens += engine.step()[0].token_ids
            if i == 0 and "step_logits" not in out:
                out["step_logits"] = engine.last_logits.clone()
        engine.release(0)
        out["tokens"].append(tokens)
    out["spec"] = {k: engine.spec_counters[k] for k in ("steps", "draft_tokens", "accepted_tokens")}
    if inject is not None:  # another node's prefill: the KV bytes arrive, then inject + start
        first = out["tokens"][0][0]
        _write_slot(engine, 1, inject)
        engine.inject(1, len(prompt))
        engine.start(1, first, spec["requests"][0])
        tokens = [first]
        while engine.active_slots():
            tokens += engine.step()[1].token_ids
        out["injected"] = tokens
    lay = engine.layout
    out["layout"] = (lay.tp_rank, lay.tp_size, lay.kv_head_start, lay.kv_heads, lay.slot_nbytes)
    out["fast_path_reason"] = engine.fast_path_reason
    return out


def _rank_main(rank: int, port: int, job_file: str, out_dir: str) -> None:
    """One rank: join the gloo group, run every scenario on its shard, save what it saw."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=90))
    try:
        tp = TensorParallel(rank, WORLD, dist.new_group(list(range(WORLD))))
        jobs = torch.load(job_file, weights_only=False)
        results = {}
        for name, spec in jobs.items():
            engine = Engine.load(spec["path"], tp=tp, **spec["engine"])
            results[name] = _decode(engine, spec, spec.get("inject"))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SCENARIOS = ["llama_planted", "qwen2", "qwen3", "deepseek_tp", "deepseek_ep", "glm_dsa"]
INJECTED = ["llama_planted", "qwen2", "deepseek_tp"]
ENGINE = dict(num_slots=2, max_seq_len=96, dtype=torch.float32)
MTP = dict(ENGINE, num_speculative_tokens=2, adaptive_speculation=False)  # CPU engines: drafts every step


@pytest.fixture(scope="module")
def runs(tiny_model, hf_checkpoint, tmp_path_factory):
    """{scenario: (one-rank result, [rank 0 result, rank 1 result])}."""
    import tokenizers
    import torch.multiprocessing as mp

    from tests.unit.engine.hf_models import save_checkpoint

    tmp = tmp_path_factory.mktemp("tp")
    planted = tiny_model("llama", plant="tool-call")
    trigger = tokenizers.Tokenizer.from_file(str(planted / "tokenizer.json")).token_to_id("assistant\n")
    qwen2 = tmp / "qwen2-v257"
    save_checkpoint("qwen2", qwen2, vocab_size=257)  # tied embeddings; 257 rows split as 129 + 128 (+1 zero)
    deepseek = hf_checkpoint("deepseek_v3")[0]
    specs = {
        "llama_planted": dict(path=planted, engine=ENGINE, prompt=[5, 300, 41, 600, 77, trigger],
                              requests=[GREEDY]),
        "qwen2": dict(path=qwen2, engine=ENGINE, prompt=PROMPT, requests=[GREEDY]),
        "qwen3": dict(path=hf_checkpoint("qwen3")[0], engine=ENGINE, prompt=PROMPT, requests=[GREEDY, SEEDED]),
        "deepseek_tp": dict(path=deepseek, engine=dict(MTP, moe_parallel="tp"), prompt=PROMPT,
                            requests=[GREEDY, SEEDED]),
        "deepseek_ep": dict(path=deepseek, engine=dict(MTP, moe_parallel="ep", max_seq_len=128),
                            prompt=LONG_PROMPT, requests=[GREEDY, SEEDED]),
        "glm_dsa": dict(path=hf_checkpoint("glm_moe_dsa")[0], engine=MTP, prompt=PROMPT, requests=[GREEDY]),
    }
    single = {name: _decode(Engine.load(spec["path"], **spec["engine"]), spec) for name, spec in specs.items()}
    for name in INJECTED:  # the ranks adopt the one-rank engine's prefilled KV, each its share
        specs[name]["inject"] = single[name]["slot"]
    # every rank also runs an unseeded sampled request: it cannot match one rank, only the other rank
    specs["qwen3"]["requests"] = [GREEDY, SEEDED, UNSEEDED]
    single["llama_planted"]["chain"] = list(range(trigger + 1, trigger + 8))  # the planted tool call's pieces
    job = tmp / "jobs.pt"
    torch.save(specs, job)
    mp.start_processes(_rank_main, args=(_free_port(), str(job), str(tmp)), nprocs=WORLD, join=True,
                       start_method="spawn")
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return {name: (single[name], [r[name] for r in ranks]) for name in specs}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_rank_decodes_the_tokens_of_one_rank(runs, name):
    single, ranks = runs[name]
    for r, got in enumerate(ranks):
        assert got["tokens"][0] == single["tokens"][0], f"greedy, rank {r}"
        assert len(got["tokens"][0]) == GREEDY.max_tokens + 1
        if len(single["tokens"]) > 1:
            assert got["tokens"][1] == single["tokens"][1], f"seeded sampling, rank {r}"
    if name.startswith(("deepseek", "glm")):  # the MTP drafts were drawn, verified and accepted alike
        assert single["spec"]["accepted_tokens"] > 0
        assert all(got["spec"] == single["spec"] for got in ranks)
    if name == "llama_planted":  # the planted tool call came out whole
        assert single["tokens"][0][:7] == single["chain"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_logits_are_the_full_vocabulary_and_match_one_rank(runs, name):
    single, ranks = runs[name]
    for got in ranks:
        assert got["prefill_logits"].shape == single["prefill_logits"].shape
        assert _rel(got["prefill_logits"], single["prefill_logits"]) < 1e-4
        assert got["step_logits"].shape == single["step_logits"].shape
        assert _rel(got["step_logits"], single["step_logits"]) < 1e-4
    assert torch.equal(ranks[0]["step_logits"], ranks[1]["step_logits"])  # gathered: the same bytes


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_rank_caches_its_share_of_the_kv(runs, name):
    single, ranks = runs[name]
    for r, got in enumerate(ranks):
        tp_rank, tp_size, start, heads, nbytes = got["layout"]
        assert (tp_rank, tp_size) == (r, WORLD)
        ref = single["layer0"]
        if name.startswith(("deepseek", "glm")):  # MLA: every rank holds the whole latent
            assert heads == 0 and nbytes == single["layout"][4]
        else:
            total = single["layout"][3]
            assert (start, heads) == (r * total // WORLD, total // WORLD) and nbytes * WORLD == single["layout"][4]
            ref = ref[:, start: start + heads]
        assert got["layer0"].shape == ref.shape
        assert torch.allclose(got["layer0"], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", INJECTED)
def test_injected_kv_decodes_like_one_rank(runs, name):
    single, ranks = runs[name]
    for got in ranks:
        assert got["injected"] == single["tokens"][0]


def test_unseeded_sampling_takes_the_same_seed_on_every_rank(runs):
    _, ranks = runs["qwen3"]
    assert ranks[0]["tokens"][2] == ranks[1]["tokens"][2] and len(ranks[0]["tokens"][2]) == UNSEEDED.max_tokens + 1


def test_ranks_run_the_reference_step(runs):
    _, ranks = runs["deepseek_tp"]  # float32 anyway; the DeepSeek family's fast path is single-GPU
    assert "tensor-parallel decode (tp=2)" in ranks[0]["fast_path_reason"]


# ------------------------------------------------------------------ refusals (no process group needed)

def test_heads_that_do_not_split_are_refused(tiny_model):
    with pytest.raises(ValueError, match=r"attention heads \(3\) do not split over 2 tensor-parallel ranks"):
        Engine.load(tiny_model("qwen2"), tp=TensorParallel(0, 2), **ENGINE)


def test_fp8_checkpoints_are_refused(tiny_model):
    with pytest.raises(ValueError, match="FP8 weights.*tp=1"):
        Engine.load(tiny_model("llama", fp8="fp8-channel"), tp=TensorParallel(1, 2), **ENGINE)


def test_fast_path_on_is_refused_and_auto_says_why(hf_checkpoint):
    path = hf_checkpoint("deepseek_v3")[0]
    with pytest.raises(ValueError, match=r"fast_path='on'.*tensor-parallel decode \(tp=2\)"):
        Engine.load(path, tp=TensorParallel(0, 2), fast_path="on", **ENGINE)
    engine = Engine.load(path, tp=TensorParallel(1, 2), **ENGINE)  # builds without collectives
    assert engine.fast_path is None and "single-GPU" in engine.fast_path_reason
    llama = Engine.load(hf_checkpoint("llama")[0], tp=TensorParallel(1, 2), **ENGINE)
    assert (llama.tp.rank, llama.layout.kv_head_start, llama.layout.kv_heads) == (1, 1, 1)

