"""A prefill of p tensor-parallel ranks hands a request's KV to a decode node of d ranks, for real:
each prefill rank is the connector's worker (``ExpressWorker``) over a vLLM-layout cache holding its
own rank's KV heads, staging into its own pool and writing with its own Mooncake engine (TCP) into
d receive buffers, each registered by its own engine and laid out as its decode rank's slot
(``layout_spec(..., d, r)``); ``KvReady`` goes over a real nats-server. Every decode buffer must end
up byte-equal to the slot a decode rank of its heads expects, built from the full-heads cache
(bytes past the prompt untouched), and exactly the expected ``KvReady`` messages arrive: one per
writing prefill rank (GQA: every rank; MLA: rank 0, which holds the whole latent as every rank
does), with the rank, the number of writing ranks and the bytes it wrote; checksums only when one
writer fills one buffer. Staging slots are reserved as the scheduler does, through every rank's
state file, and are all free again after."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from services.prefill.config import ExpressConfig
from services.prefill.parallel import staging_ranks
from services.prefill.scheduler import SaveRequest
from services.prefill.staging import FREE, RankSlotStates
from shared import subjects
from shared.bus import Bus
from shared.events import KvFailed, KvMessage, KvReady, RankTarget, SlotTarget, TransferTarget
from shared.handoff import Handoff
from shared.kvchecksum import CHECKSUM_ALGO
from shared.kvlayout import KvShape, held_heads, layout_spec
from shared.transport import create_transport

H, D, LAYERS = 4, 8, 2  # GQA: KV heads, head size, layers
LORA, ROPE = 16, 8  # MLA: latent and rope sizes
BLOCK, NUM_BLOCKS = 16, 6
BLOCKS = [4, 1, 3]  # the request's block table, out of order
N = 37  # prompt tokens: three blocks, the last one partly
STAGING_MAX, DECODE_MAX = 48, 64  # staging and decode slots hold different token counts
FILL = 0xEE  # what a decode buffer holds where nothing was written
SHAPES = {"gqa": KvShape(kind="gqa", num_layers=LAYERS, num_kv_heads=H, head_dim=D),
          "mla": KvShape(kind="mla", num_layers=LAYERS, kv_lora_rank=LORA, qk_rope_head_dim=ROPE)}
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def full_caches(kind: str) -> list[torch.Tensor]:
    """Per layer, the cache a one-rank vLLM holds: FLASH_ATTN's [2, NB, B, H, D] (GQA) or FlashMLA's
    [NB, B, LORA + ROPE] (MLA, k_pe roped GPT-J style), random float32."""
    gen = torch.Generator().manual_seed(7)
    shape = (2, NUM_BLOCKS, BLOCK, H, D) if kind == "gqa" else (NUM_BLOCKS, BLOCK, LORA + ROPE)
    return [torch.randn(shape, generator=gen) for _ in range(LAYERS)]


def rank_caches(kind: str, full: list[torch.Tensor], p: int, r: int) -> dict[str, torch.Tensor]:
    """What rank r of p holds: its heads (GQA), the whole latent (MLA)."""
    if kind == "mla":
        return {name: cache.clone() for name, cache in zip(NAMES, full)}
    n = H // p
    return {name: cache[:, :, :, r * n:(r + 1) * n].contiguous() for name, cache in zip(NAMES, full)}


def expected_slot(kind: str, full: list[torch.Tensor], layout) -> torch.Tensor:
    """The decode rank's slot after the hand-off: the first N tokens of its heads (GQA) or the latent
    with k_pe in the engine's order (MLA) in every segment, FILL elsewhere."""
    want = torch.full((layout.slot_nbytes,), FILL, dtype=torch.uint8)
    h0, h1 = held_heads(layout)
    for seg in layout.segments:
        cache = full[seg.layer]
        if kind == "gqa":
            plane = cache[0 if seg.name == "k" else 1].index_select(0, torch.tensor(BLOCKS))
            rows = plane.reshape(-1, H, D)[:N, h0:h1].reshape(N, -1)
        else:
            rows = cache.index_select(0, torch.tensor(BLOCKS)).reshape(-1, LORA + ROPE)[:N]
            pe = rows[:, LORA:]
            rows = torch.cat([rows[:, :LORA], pe[:, 0::2], pe[:, 1::2]], dim=-1)
        data = rows.contiguous().view(torch.uint8).reshape(-1)
        want[seg.offset_bytes:seg.offset_bytes + data.numel()] = data
    return want


def vllm_config(kind: str, p: int):
    """The parts of vLLM's config the worker reads."""
    hf = SimpleNamespace(model_type="llama" if kind == "gqa" else "deepseek_v3", kv_lora_rank=LORA,
                         qk_rope_head_dim=ROPE, to_dict=lambda: {})
    backend = "FLASH_ATTN" if kind == "gqa" else "FLASHMLA"
    layer = SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: backend))
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=STAGING_MAX, hf_text_config=hf, use_mla=kind == "mla",
                                     dtype=torch.float32, get_total_num_kv_heads=lambda: H,
                                     get_num_kv_heads=lambda pc: max(1, H // pc.tensor_parallel_size),
                                     get_head_size=lambda: D),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=p),
        compilation_config=SimpleNamespace(static_forward_context={n: layer for n in NAMES}))


class DecodeNode:
    """d ranks, each a receive buffer (uint8 tensor) registered with its own Mooncake engine."""

    def __init__(self, kind: str, d: int) -> None:
        self.layouts = [layout_spec(SHAPES[kind], "float32", DECODE_MAX, d, r) for r in range(d)]
        self.buffers = [torch.full((lay.slot_nbytes,), FILL, dtype=torch.uint8) for lay in self.layouts]
        self.transports = [create_transport("mooncake") for _ in range(d)]
        for t, buf in zip(self.transports, self.buffers):
            t.register(buf.data_ptr(), buf.numel())

    def target(self, node_id: str) -> TransferTarget:
        ranks = [RankTarget(tp_rank=r, endpoint=t.endpoint, layout=lay,
                            slot=SlotTarget(slot=3, base_addr=buf.data_ptr(), nbytes=buf.numel()))
                 for r, (t, lay, buf) in enumerate(zip(self.transports, self.layouts, self.buffers))]
        return TransferTarget(node_id=node_id, transport="mooncake", endpoint=ranks[0].endpoint,
                              slot=ranks[0].slot, layout=ranks[0].layout, ranks=ranks[1:])

    def close(self) -> None:
        for t in self.transports:
            t.close()


CASES = [("gqa", 1, 1), ("gqa", 1, 2), ("gqa", 2, 1), ("gqa", 2, 2), ("gqa", 2, 4), ("mla", 2, 2)]


@pytest.mark.parametrize("kind,p,d", CASES, ids=[f"{k}-p{p}-d{d}" for k, p, d in CASES])
async def test_every_decode_rank_gets_exactly_its_heads(nats_url, tmp_path, kind, p, d):
    from services.prefill.worker import ExpressWorker

    node_id = f"tp-{kind}-p{p}-d{d}"
    full = full_caches(kind)
    stats = str(tmp_path / "staging")
    scheduler_states = RankSlotStates(stats, 2, staging_ranks(kind, p), create=True)
    config = ExpressConfig(nats_url=nats_url, staging_slots=2, staging_max_tokens=STAGING_MAX,
                           stats_path=stats, kv_checksum=True)
    groups = [SimpleNamespace(layer_names=NAMES, kv_cache_spec=SimpleNamespace(block_size=BLOCK))]
    bus = await Bus.connect(nats_url, name="test-tp-handoff")
    got: asyncio.Queue = asyncio.Queue()

    async def on_kv(event, msg) -> None:
        await got.put(event)

    sub = await bus.subscribe(subjects.kv_ready(node_id), on_kv, KvMessage)
    node, workers = DecodeNode(kind, d), []
    try:
        for r in range(p):
            workers.append(ExpressWorker(config, vllm_config(kind, p), SimpleNamespace(kv_cache_groups=groups),
                                         "tp-test", tp=(p, r)))
            workers[-1].register_kv_caches(rank_caches(kind, full, p, r))
        staging_slot = scheduler_states.reserve()  # as the scheduler does, on every staging rank
        handoff = Handoff(request_id="req-1", lease_id="lease-1", generation=2, target=node.target(node_id))
        for w in workers:  # every rank gets the step's metadata
            w.wait_for_save([SaveRequest("vllm-1", handoff, [BLOCKS], N, staging_slot=staging_slot)])

        writers = list(range(p)) if kind == "gqa" else [0]
        events = [await asyncio.wait_for(got.get(), 30) for _ in writers]
        await asyncio.sleep(0.5)
        assert got.empty(), f"more than one KvReady per writing rank: {got.get_nowait()}"
        assert all(isinstance(e, KvReady) for e in events), events
        elt, layer_bytes = 4, (2 * (H // p) * D if kind == "gqa" else LORA + ROPE)
        nbytes = N * LAYERS * layer_bytes * elt * (d if kind == "mla" else 1)  # MLA: rank 0 fills every rank
        assert sorted((e.source_rank, e.source_ranks, e.nbytes, e.num_tokens, e.slot, e.lease_id) for e in events) == [
            (r, len(writers), nbytes, N, 3, "lease-1") for r in writers]
        one_writer_one_buffer = (p, d) == (1, 1)
        for e in events:
            assert bool(e.kv_checksums) == one_writer_one_buffer
            assert e.kv_checksum_algo == (CHECKSUM_ALGO if one_writer_one_buffer else "")

        for r, (layout, buf) in enumerate(zip(node.layouts, node.buffers)):
            want = expected_slot(kind, full, layout)
            assert torch.equal(buf, want), f"decode rank {r} of {d} from {p} prefill ranks"
        assert scheduler_states.snapshot() == [FREE, FREE]  # every rank freed its staging slot
    finally:
        await sub.unsubscribe()
        await bus.close()
        for w in workers:
            w.shutdown()
        node.close()
        scheduler_states.close()


def test_expected_slots_hold_each_head_once():
    """The reference itself: the decode ranks' expected slots together hold every head of the full
    cache, each once (so an image that is wrong for one split cannot pass as right)."""
    full = full_caches("gqa")
    halves = [expected_slot("gqa", full, layout_spec(SHAPES["gqa"], "float32", DECODE_MAX, 2, r)) for r in range(2)]
    whole = expected_slot("gqa", full, layout_spec(SHAPES["gqa"], "float32", DECODE_MAX))
    seg = layout_spec(SHAPES["gqa"], "float32", DECODE_MAX).segments[0]
    k = whole[seg.offset_bytes:seg.offset_bytes + N * seg.bytes_per_token].view(torch.float32).view(N, H, D)
    for r, half in enumerate(halves):
        hs = layout_spec(SHAPES["gqa"], "float32", DECODE_MAX, 2, r).segments[0]
        part = half[hs.offset_bytes:hs.offset_bytes + N * hs.bytes_per_token].view(torch.float32).view(N, H // 2, D)
        assert torch.equal(part, k[:, r * 2:(r + 1) * 2])


async def test_heads_vllm_replicates_are_refused_with_one_kv_failed(nats_url, tmp_path):
    """8 ranks over 4 KV heads: vLLM replicates heads, a decode slot takes each once. Every rank
    refuses (no staging memory), frees its slot; rank 0 alone reports the request failed."""
    from services.prefill.worker import ExpressWorker

    node_id, p = "tp-refused", 8
    stats = str(tmp_path / "staging")
    scheduler_states = RankSlotStates(stats, 1, p, create=True)
    config = ExpressConfig(nats_url=nats_url, staging_slots=1, staging_max_tokens=STAGING_MAX, stats_path=stats)
    groups = [SimpleNamespace(layer_names=NAMES, kv_cache_spec=SimpleNamespace(block_size=BLOCK))]
    bus = await Bus.connect(nats_url, name="test-tp-refused")
    got: asyncio.Queue = asyncio.Queue()

    async def on_kv(event, msg) -> None:
        await got.put(event)

    sub = await bus.subscribe(subjects.kv_ready(node_id), on_kv, KvMessage)
    node, workers = DecodeNode("gqa", 1), []
    try:
        for r in range(2):  # rank 0 and one other: the rest do the same
            workers.append(ExpressWorker(config, vllm_config("gqa", p), SimpleNamespace(kv_cache_groups=groups),
                                         "tp-test", tp=(p, r)))
            workers[-1].register_kv_caches({n: torch.zeros(2, NUM_BLOCKS, BLOCK, 1, D) for n in NAMES})
            assert "replicates them" in workers[-1].refusal and workers[-1].pool is None
        slot = scheduler_states.reserve()
        handoff = Handoff(request_id="req-2", lease_id="lease-2", generation=1, target=node.target(node_id))
        for w in workers:
            w.wait_for_save([SaveRequest("vllm-2", handoff, [BLOCKS], N, staging_slot=slot)])
        event = await asyncio.wait_for(got.get(), 30)
        await asyncio.sleep(0.5)
        assert got.empty() and isinstance(event, KvFailed) and "replicates them" in event.reason
        assert [w.states.get(slot) for w in workers] == [FREE, FREE]
    finally:
        await sub.unsubscribe()
        await bus.close()
        for w in workers:
            w.shutdown()
        node.close()
        scheduler_states.close()


def test_without_vllms_process_groups_a_worker_is_rank_0_of_1():
    from services.prefill.parallel import vllm_tensor_parallel

    assert vllm_tensor_parallel() == (1, 0)
