"""A claimed request's KV lands in a separate process's receive buffer, in the engine's layout,
equal to what HF transformers computes for the same prompt (real vLLM on CPU, real transports)."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import msgspec
import numpy as np
import pytest
import torch

from shared.handoff import Handoff, parse_status, request_params
from shared import subjects
from shared.bus import Bus
from shared.events import KvFailed, KvMessage, KvReady, SlotTarget, TransferTarget
from shared.kvlayout import kv_shape_from_hf_config, layout_spec
from infra.receiver import ReceiverProcess
from tests.fixtures.prefill import Express

pytestmark = pytest.mark.vllm
VLLM_SERVERS = [Express("llama"), Express("llama", "bfloat16"), Express("deepseek_v3", "bfloat16")]

MAX_TOKENS = 256  # the receiving slot's capacity
PROMPT = [0] + [(17 * i + 5) % 700 + 5 for i in range(150)]  # 151 tokens: two CPU blocks of 128


# ---------------------------------------------------------------- references (HF transformers)
def hf_gqa_kv(model_dir, prompt: list[int]) -> list[torch.Tensor]:
    """[k, v] per layer, each [T, Hkv, D] float32, as HF's cache holds them (after rope)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    segs = []
    for layer in out.past_key_values.layers:
        segs += [layer.keys[0].transpose(0, 1).contiguous(), layer.values[0].transpose(0, 1).contiguous()]
    return segs


def hf_mla_kv(model_dir, prompt: list[int], first_token: int, with_mtp: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """[latent ++ roped k_pe] per layer, [T, 576] float32. HF's cache holds exactly these (keys:
    the normalized latent, values: k_pe after rope, evens then odds); the MTP layer, which HF does
    not run, is computed with HF's own modules loaded from the checkpoint's MTP weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gate_inputs: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: gate_inputs.append(i[0].detach()))
             for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True, output_hidden_states=True)
    for h in hooks:
        h.remove()
    segs = [torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1) for layer in out.past_key_values.layers]
    if with_mtp:
        segs.append(mtp_latent(model_dir, model, out.hidden_states[-1][0], prompt, first_token))
    return segs, routing_is_stable(model, gate_inputs)


def routing_is_stable(model, gate_inputs: list[torch.Tensor], min_margin: float = 1e-3) -> torch.Tensor:
    """[T] bool: tokens whose routed-expert choice has a clear margin in every MoE layer. Where two
    experts score within ``min_margin``, bf16 and fp32 may route differently, so the hidden state
    (and the MTP layer's KV, which reads it) legitimately differs from the fp32 reference."""
    moe_layers = [layer for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    stable = torch.ones(gate_inputs[0].reshape(-1, gate_inputs[0].shape[-1]).shape[0], dtype=torch.bool)
    k = model.config.num_experts_per_tok
    for layer, x in zip(moe_layers, gate_inputs):
        gate = layer.mlp.gate
        scores = torch.sigmoid(x.reshape(-1, x.shape[-1]) @ gate.weight.T) + gate.e_score_correction_bias
        top = scores.sort(dim=-1, descending=True).values
        stable &= (top[:, k - 1] - top[:, k]) > min_margin
    return stable


def mtp_latent(model_dir, model, hidden: torch.Tensor, prompt: list[int], first_token: int) -> torch.Tensor:
    """The MTP layer's cache for the prompt, as vLLM's MTP drafter fills it during prefill: the
    input at position t is (embedding of token t+1, final hidden state t), the last position
    taking the first generated token, the embedding at position 0 masked to zero."""
    from safetensors.torch import load_file
    from transformers import DynamicCache
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RMSNorm

    cfg = model.config
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    w = {k[len(prefix):]: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()
         if k.startswith(prefix)}
    attn = DeepseekV3Attention(cfg, layer_idx=0)
    attn.load_state_dict({k[len("self_attn."):]: v for k, v in w.items() if k.startswith("self_attn.")})
    norms = {}
    for name in ("enorm", "hnorm", "input_layernorm"):
        norms[name] = DeepseekV3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        norms[name].weight.data = w[f"{name}.weight"]
    with torch.no_grad():
        emb = model.model.embed_tokens(torch.tensor(prompt[1:] + [first_token]))
        emb[0] = 0
        x = torch.cat([norms["enorm"](emb), norms["hnorm"](hidden)], dim=-1) @ w["eh_proj.weight"].T
        x = norms["input_layernorm"](x)[None]
        positions = torch.arange(len(prompt))[None]
        cache = DynamicCache()
        attn(x, position_embeddings=model.model.rotary_emb(x, positions), attention_mask=None,
             past_key_values=cache)
    return torch.cat([cache.layers[0].keys[0, 0], cache.layers[0].values[0, 0]], dim=-1)


# ---------------------------------------------------------------- helpers
def decode_layout(model_dir, dtype: str, with_mtp: bool):
    config = json.loads((model_dir / "config.json").read_text())
    return layout_spec(kv_shape_from_hf_config(config, include_mtp=with_mtp), dtype, MAX_TOKENS)


def target_for(rx: ReceiverProcess, layout, node_id: str) -> TransferTarget:
    return TransferTarget(node_id=node_id, transport=rx.transport, endpoint=rx.endpoint,
                          slot=SlotTarget(slot=0, base_addr=rx.addr, nbytes=rx.nbytes), layout=layout,
                          nixl_metadata_b64=rx.metadata_b64)


def received_segments(raw: bytes, layout, num_tokens: int) -> list[torch.Tensor]:
    dtype = getattr(torch, layout.dtype)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = []
    for seg in layout.segments:
        part = buf[seg.offset_bytes: seg.offset_bytes + num_tokens * seg.bytes_per_token]
        out.append(part.view(dtype).view(num_tokens, -1).float())
    return out


class KvEvents:
    """Collects KV-ready / KV-failed events of one node id."""

    def __init__(self) -> None:
        self.events: asyncio.Queue = asyncio.Queue()

    async def start(self, bus: Bus, node_id: str) -> None:
        async def handler(event, msg):
            await self.events.put((event, dict(msg.headers or {})))

        self.sub = await bus.subscribe(subjects.kv_ready(node_id), handler, KvMessage)

    async def next(self, timeout_s: float = 30.0):
        return await asyncio.wait_for(self.events.get(), timeout_s)


async def wait_all_free(prefill, timeout_s: float = 15.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = prefill.stats()
        if stats["free"] == stats["total"] or asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.05)


def handoff_params(rx, layout, node_id: str, traceparent: str = "") -> tuple[Handoff, dict]:
    rid = f"req-{uuid.uuid4().hex[:10]}"
    h = Handoff(request_id=rid, lease_id=f"lease-{rid}", generation=3,
                target=target_for(rx, layout, node_id), traceparent=traceparent)
    return h, request_params(h)


@pytest.fixture
async def bus(nats_url):
    b = await Bus.connect(nats_url, name="test-prefill")
    yield b
    await b.close()


# ---------------------------------------------------------------- the handoff, per model and transport
CASES = [
    # arch, dtype, transport, tolerance (max abs error vs HF fp32); grouped by server, so each
    # vLLM starts once even when the session keeps only three alive
    ("llama", "float32", "mooncake", 1e-4),
    ("llama", "float32", "nixl", 1e-4),
    ("llama", "bfloat16", "mooncake", 6e-2),
    ("deepseek_v3", "bfloat16", "mooncake", 6e-2),
    ("deepseek_v3", "bfloat16", "nixl", 6e-2),
]


@pytest.mark.parametrize("arch,dtype,transport,atol", CASES)
async def test_claimed_kv_lands_in_engine_layout(express_vllm, bus, tmp_path, arch, dtype, transport, atol):
    prefill = express_vllm(arch, dtype)
    layout = decode_layout(prefill.model_dir, dtype, prefill.has_mtp)
    node_id = f"node-{uuid.uuid4().hex[:8]}"
    events = KvEvents()
    await events.start(bus, node_id)
    tp = "00-" + uuid.uuid4().hex + "-" + uuid.uuid4().hex[:16] + "-01"
    rx = ReceiverProcess(transport, layout.slot_nbytes, fill=0xEE)
    try:
        h, params = handoff_params(rx, layout, node_id, traceparent=tp)
        async with httpx.AsyncClient() as client:
            resp = await prefill.complete(client, PROMPT, kv_transfer_params=params)
        status = parse_status(resp["kv_transfer_params"])
        assert status.handed_off is True and status.request_id == h.request_id
        event, headers = await events.next()
        assert isinstance(event, KvReady), event
        assert (event.request_id, event.lease_id, event.generation, event.num_tokens) == (
            h.request_id, h.lease_id, 3, len(PROMPT))
        assert headers["traceparent"].split("-")[1] == tp.split("-")[1]  # same trace
        raw = rx.read(str(tmp_path / "slot"))
        got = received_segments(raw, layout, len(PROMPT))
        first = resp["choices"][0]["token_ids"][0]
        rows = torch.ones(len(PROMPT), dtype=torch.bool)
        if layout.kind == "gqa":
            want = hf_gqa_kv(prefill.model_dir, PROMPT)
        else:
            want, rows = hf_mla_kv(prefill.model_dir, PROMPT, first, prefill.has_mtp)
            assert rows.float().mean() > 0.95  # near-tied routing is rare
        assert len(got) == len(want) == len(layout.segments)
        for i, (g, w) in enumerate(zip(got, want)):
            err = (g - w.reshape(g.shape))[rows].abs().max().item()
            assert err <= atol * max(1.0, w.abs().max().item()), f"segment {i} ({layout.segments[i].name}, layer {layout.segments[i].layer}): max err {err}"
        # Bytes past the prompt are untouched.
        for seg in layout.segments:
            start = seg.offset_bytes + len(PROMPT) * seg.bytes_per_token
            assert set(raw[start: seg.offset_bytes + MAX_TOKENS * seg.bytes_per_token]) == {0xEE}
        assert event.nbytes == sum(len(PROMPT) * s.bytes_per_token for s in layout.segments)
    finally:
        rx.close()
        await events.sub.unsubscribe()
    stats = await wait_all_free(prefill)
    assert stats["free"] == stats["total"], stats
