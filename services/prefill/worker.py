"""Worker side of the connector: copy a claimed request's blocks into a staging slot, hand it on.

``wait_for_save`` runs after the step's forwards (target and MTP draft), so the blocks of a
request whose prompt completed this step hold its whole prompt KV. For each ``SaveRequest`` it
converts every layer (main layers, then MTP layers, by layer index) with that layer's layout
adapter into the reserved staging slot, marks the slot SENDING and queues it for the sender;
it never touches the network and never blocks on it. On a GPU the staging slots are GPU memory
and the copies are queued on the step's stream; the sender waits for them before it writes.
"""

from __future__ import annotations

import logging
import time

import torch
from shared.kvlayout import KvShape, layout_spec
from shared.tracing import build_tracer_provider, context_from_traceparent
from shared.transport import create_transport

from services.prefill.config import ExpressConfig
from services.prefill.layouts import LayerAdapter, adapter_for, kernel_block_ids
from services.prefill.publisher import Publisher
from services.prefill.scheduler import SaveRequest
from services.prefill.sender import Sender, SendJob
from services.prefill.staging import FREE, SENDING, SlotStates, StagingPool

# A child of vLLM's logger, so lines appear in vLLM's log with its format.
log = logging.getLogger("vllm.expresslane.prefill")


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


class ExpressWorker:
    def __init__(self, config: ExpressConfig, vllm_config, kv_cache_config, engine_id: str) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.engine_id = engine_id
        self.max_tokens = config.staging_max_tokens or vllm_config.model_config.max_model_len
        self.layers: list[tuple[str, torch.Tensor, int]] = []  # (name, cache, group) by layer index
        self.adapters: list[LayerAdapter] | None = None
        self.pool: StagingPool | None = None
        self.sender: Sender | None = None
        self.transports: dict = {}
        # Our own provider (service "prefill"), not vLLM's global one; it exports only where
        # OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT says so.
        self.tracer = build_tracer_provider("prefill").get_tracer("expresslane.prefill")
        self.states = SlotStates(config.stats_file(engine_id), config.staging_slots)
        self.publisher = Publisher(config.nats_url, name=f"prefill-{engine_id[:8]}",
                                   auth=config.bus_auth())

    # ---------------------------------------------------------------- start-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        group_of = {}
        for g, group in enumerate(self.kv_cache_config.kv_cache_groups if self.kv_cache_config else []):
            for name in group.layer_names:
                group_of[name] = g
        names = sorted(kv_caches, key=_layer_index)
        self.layers = [(n, kv_caches[n], group_of.get(n, 0)) for n in names]
        self.shape = self._kv_shape()
        dtype = str(self.layers[0][1].dtype).removeprefix("torch.")
        self.spec = layout_spec(self.shape, dtype, self.max_tokens)
        # Staging on the KV cache's device: on a GPU the extraction is a device-to-device gather
        # and the transport writes GPU memory into the decode node's GPU memory.
        device = str(self.layers[0][1].device)
        self.pool = StagingPool(self.spec, self.config.staging_slots, device=device)
        for name in self.config.transports:
            t = create_transport(name, host=self.config.mooncake_host,
                                 protocol=self.config.mooncake_protocol,
                                 agent_name=self.config.nixl_agent_name, receives=False, device=device)
            t.register(self.pool.addr, self.pool.nbytes)
            self.transports[name] = t
        self.sender = Sender(self.transports, self.pool, self.states, self.publisher,
                             self.config.transfer_timeout_s, tracer=self.tracer,
                             checksum=self.config.kv_checksum,
                             fault_flip_every=self.config.fault_flip_kv_byte_every)
        log.info("expresslane: layers %s", [(n, tuple(t.shape), str(t.dtype)) for n, t, _ in self.layers])
        log.info("expresslane: %d layers, staging %d x %d bytes (%d tokens), transports %s, stats %s, "
                 "kv checksum %s", len(self.layers), self.config.staging_slots, self.spec.slot_nbytes,
                 self.max_tokens, ",".join(self.transports), self.states.path,
                 "on" if self.config.kv_checksum else "off")
        if self.config.fault_flip_kv_byte_every:
            log.warning("expresslane: FAULT INJECTION on: every %d-th transfer's KV is corrupted after "
                        "its checksum", self.config.fault_flip_kv_byte_every)

    def _kv_shape(self) -> KvShape:
        hf = self.vllm_config.model_config.hf_text_config
        num_layers = len(self.layers)
        if self.vllm_config.model_config.use_mla:
            return KvShape(kind="mla", num_layers=num_layers, kv_lora_rank=int(hf.kv_lora_rank),
                           qk_rope_head_dim=int(hf.qk_rope_head_dim))
        mc = self.vllm_config.model_config
        return KvShape(kind="gqa", num_layers=num_layers,
                       num_kv_heads=mc.get_num_kv_heads(self.vllm_config.parallel_config),
                       head_dim=mc.get_head_size())

    def _resolve_adapters(self) -> list[LayerAdapter]:
        """Each layer's adapter from its attention backend (and CPU kernel family)."""
        ctx = self.vllm_config.compilation_config.static_forward_context
        hf = self.vllm_config.model_config.hf_text_config
        adapters = []
        for name, cache, _ in self.layers:
            layer = ctx.get(name)
            backend = layer.attn_backend.get_name() if layer is not None else "CPU_ATTN"
            isa = getattr(layer, "isa", None)
            if backend == "CPU_ATTN" and isa is None:
                from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

                isa = _get_attn_isa(cache.dtype, cache.shape[2], cache.shape[3] // 2)
            adapters.append(adapter_for(backend, isa=isa,
                                        rope_dim=int(getattr(hf, "qk_rope_head_dim", 0) or 0),
                                        rope_interleave=bool(getattr(hf, "rope_interleave", True))))
        log.info("expresslane: layout adapters %s", sorted({type(a).__name__ for a in adapters}))
        return adapters

    # ---------------------------------------------------------------- per step
    def wait_for_save(self, saves: list[SaveRequest]) -> None:
        for save in saves:
            if save.handoff is None:
                continue  # unparseable params: reported in the response, nowhere to send an event
            if save.fail_reason or save.staging_slot < 0:
                self.sender.submit(SendJob(save.handoff, -1, 0, fail_reason=save.fail_reason))
                continue
            try:
                with self.tracer.start_as_current_span(
                        "prefill.extract", context=context_from_traceparent(save.handoff.traceparent),
                        attributes={"expresslane.request_id": save.handoff.request_id,
                                    "expresslane.num_tokens": save.num_tokens}):
                    extract_ms = self._stage(save)
            except Exception as exc:
                log.exception("expresslane: extraction failed for %s", save.request_id)
                self.states.set(save.staging_slot, FREE)
                self.sender.submit(SendJob(save.handoff, -1, 0, fail_reason=f"extraction failed: {exc}"))
                continue
            self.states.set(save.staging_slot, SENDING)
            self.sender.submit(SendJob(save.handoff, save.staging_slot, save.num_tokens, extract_ms))

    def _stage(self, save: SaveRequest) -> float:
        t0 = time.perf_counter()
        if self.adapters is None:
            self.adapters = self._resolve_adapters()
        n = save.num_tokens
        views = self.pool.segment_views(save.staging_slot, n)
        per_layer = 2 if self.shape.kind == "gqa" else 1
        block_tables: dict[tuple[int, int], torch.Tensor] = {}
        for i, ((_, cache, group), adapter) in enumerate(zip(self.layers, self.adapters)):
            kernel_block_size = adapter.block_size(cache)
            key = (group, kernel_block_size)
            if key not in block_tables:
                manager_block_size = self.kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size
                ids = kernel_block_ids(save.block_ids[group], manager_block_size, kernel_block_size, n)
                block_tables[key] = torch.tensor(ids, dtype=torch.long, device=cache.device)
            out = views[i * per_layer : (i + 1) * per_layer]
            if self.shape.kind == "gqa":
                out = [v.view(n, self.shape.num_kv_heads, self.shape.head_dim) for v in out]
            adapter(cache, block_tables[key], n, out)
        return (time.perf_counter() - t0) * 1e3

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.publisher.close()
        for t in self.transports.values():
            try:
                t.close()
            except Exception:
                pass
        self.states.close()
