"""Worker side of the connector: copy a claimed request's blocks into a staging slot, hand it on.

``wait_for_save`` runs after the step's forwards (target and MTP draft), so the blocks of a
request whose prompt completed this step hold its whole prompt KV. For each ``SaveRequest`` it
converts every registered cache (main layers, then MTP layers, by layer index; a sparse-attention
layer's latent cache, then its indexer's key cache) with its layout adapter into the segments of
its layer in the reserved staging slot, marks the slot SENDING and queues it for the sender;
it never touches the network and never blocks on it. On a GPU the staging slots are GPU memory
and the copies are queued on the step's stream; the sender waits for them before it writes.

Under vLLM tensor parallelism (services.prefill.parallel) each rank's worker stages its own rank's
layout (``layout_spec(..., tp_size, tp_rank)``: its share of the KV heads, the ones vLLM's cache
on that rank holds) into its own staging pool, with its own slot state file (``staging.rank_path``). MLA ranks
other than 0 stage nothing (rank 0 writes the latent every rank holds). A GQA model whose KV heads
do not split over the ranks is refused: logged at start, every request reported not handed off.
The failures the scheduler decided (the same on every rank) are reported by rank 0 only.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
import time

import torch
from shared.kvlayout import (
    DSA_TYPES, DTYPE_SIZES, FP8_DTYPES, KvShape, dsa_indexer_layers, kv_dtype_for_cache, layout_spec,
)
from shared.tracing import build_tracer_provider, context_from_traceparent
from shared.transport import create_transport

from services.prefill.config import ExpressConfig
from services.prefill.layouts import MLA_BACKENDS, LayerAdapter, adapter_for, kernel_block_ids
from services.prefill.layouts_dsa import (
    INDEXER_BACKENDS, SPARSE_MLA_BACKENDS, DsaIndexerKeys, sparse_mla_adapter,
)
from services.prefill.parallel import split_refusal, stages, vllm_tensor_parallel
from services.prefill.publisher import Publisher
from services.prefill.scheduler import SaveRequest
from services.prefill.sender import Sender, SendJob
from services.prefill.staging import FREE, SENDING, SlotStates, StagingPool, rank_path

# A child of vLLM's logger, so lines appear in vLLM's log with its format.
log = logging.getLogger("vllm.expresslane.prefill")

_workers_here: dict[str, "ExpressWorker"] = {}  # engine id -> its worker in this process, host-memory caches


def extraction_done(engine_id: str) -> None:
    """Where vLLM's scheduler runs in the worker's process (the "uni" executor the CPU build runs),
    it calls this before planning a step: the last step's extraction has read its blocks when this
    returns, before any of the next step's cache updates (vLLM zeroes and copies some blocks before
    it binds the step's connector metadata, where the worker waits otherwise)."""
    worker = _workers_here.get(engine_id)
    if worker is not None:
        worker.wait_extracted()


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


def _backend_name(layer) -> str:
    """The attention backend of a layer of vLLM's static forward context (CPU_ATTN when absent).
    Attention layers carry ``attn_backend``; the DSA indexer's cache only ``get_attn_backend()``."""
    if layer is None:
        return "CPU_ATTN"
    backend = getattr(layer, "attn_backend", None)
    if backend is None:
        backend = layer.get_attn_backend()
    return backend.get_name()


class ExpressWorker:
    """The connector's worker side in one vLLM worker process. ``tp``: (tensor-parallel size, this
    rank); None asks vLLM (services.prefill.parallel.vllm_tensor_parallel)."""

    def __init__(self, config: ExpressConfig, vllm_config, kv_cache_config, engine_id: str,
                 tp: tuple[int, int] | None = None) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.engine_id = engine_id
        self.tp_size, self.tp_rank = tp if tp is not None else vllm_tensor_parallel()
        # MLA ranks other than 0 stage nothing: no staging memory, no slot states, no bus client
        self.stages = stages("mla" if vllm_config.model_config.use_mla else "gqa", self.tp_rank)
        self.refusal = ""  # set at register_kv_caches when the heads do not split over the ranks
        self.max_tokens = config.staging_max_tokens or vllm_config.model_config.max_model_len
        # (name, cache, group, layer) by layer index: layer counts the model's cache layers from 0
        self.layers: list[tuple[str, torch.Tensor, int, int]] = []
        self.adapters: list[LayerAdapter] | None = None
        self.pool: StagingPool | None = None
        self.sender: Sender | None = None
        self.transports: dict = {}
        # Our own provider (service "prefill"), not vLLM's global one; it exports only where
        # OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT says so.
        self.tracer = build_tracer_provider("prefill").get_tracer("expresslane.prefill")
        self.states: SlotStates | None = None
        self.publisher: Publisher | None = None
        self._extractor: ThreadPoolExecutor | None = None  # host-memory KV caches: see wait_for_save
        self._extracting: Future | None = None
        if self.stages:
            self.states = SlotStates(rank_path(config.stats_file(engine_id), self.tp_rank), config.staging_slots)
            name = f"prefill-{engine_id[:8]}" + (f"-tp{self.tp_rank}" if self.tp_size > 1 else "")
            self.publisher = Publisher(config.nats_url, name=name, auth=config.bus_auth())

    # ---------------------------------------------------------------- start-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        group_of = {}
        for g, group in enumerate(self.kv_cache_config.kv_cache_groups if self.kv_cache_config else []):
            for name in group.layer_names:
                group_of[name] = g
        ctx = self.vllm_config.compilation_config.static_forward_context
        indexer = {n: _backend_name(ctx.get(n)) in INDEXER_BACKENDS if ctx.get(n) is not None
                   else n.endswith("indexer.k_cache") for n in kv_caches}
        names = sorted(kv_caches, key=lambda n: (_layer_index(n), indexer[n]))  # latent, then index keys
        rank = {idx: i for i, idx in enumerate(sorted({_layer_index(n) for n in names}))}
        self.layers = [(n, kv_caches[n], group_of.get(n, 0), rank[_layer_index(n)]) for n in names]
        self.shape = self._kv_shape(len(rank))
        self.layers = self._indexer_caches_to_stage(self.layers, indexer)
        dtype = str(self.layers[0][1].dtype).removeprefix("torch.")
        model_dtype = str(self.vllm_config.model_config.dtype).removeprefix("torch.")
        cache_dtype = self.vllm_config.cache_config.cache_dtype
        if cache_dtype != "auto" and not self.shape.index_layers:
            # vLLM's FP8 KV cache (GQA K/V, a dense MLA latent; uint8): staged as its bytes, in the layout's FP8 dtype
            dtype = kv_dtype_for_cache(cache_dtype, model_dtype)
        if self.shape.kind == "mla" and dtype not in DTYPE_SIZES:
            # sparse attention's quantized latent cache (fp8_ds_mla, fp8): its adapter stages it dequantized
            dtype = model_dtype
        if not self.stages:
            log.info("expresslane: tensor-parallel rank %d of %d holds the same MLA latent as rank 0, "
                     "which hands it over; this rank stages nothing", self.tp_rank, self.tp_size)
            return
        self.refusal = split_refusal(self.shape.kind, self.shape.num_kv_heads, self.tp_size)
        if self.refusal:
            log.error("expresslane: %s", self.refusal)
            self.sender = Sender({}, None, self.states, self.publisher, self.config.transfer_timeout_s,
                                 tracer=self.tracer)
            return
        self.spec = layout_spec(self.shape, dtype, self.max_tokens, self.tp_size, self.tp_rank)
        self.segment_index = {(s.layer, s.name): i for i, s in enumerate(self.spec.segments)}
        # Staging on the KV cache's device: on a GPU the extraction is a device-to-device gather
        # and the transport writes GPU memory into the decode node's GPU memory.
        device = str(self.layers[0][1].device)
        self.pool = StagingPool(self.spec, self.config.staging_slots, device=device)
        if device == "cpu":
            self._extractor = ThreadPoolExecutor(1, "expresslane-extract")
            _workers_here[self.engine_id] = self
        agent_name = self.config.nixl_agent_name
        if agent_name and self.tp_size > 1:  # one NIXL agent per rank, each its own name
            agent_name = f"{agent_name}-tp{self.tp_rank}"
        for name in self.config.transports:
            t = create_transport(name, host=self.config.mooncake_host,
                                 protocol=self.config.mooncake_protocol,
                                 agent_name=agent_name, receives=False, device=device)
            t.register(self.pool.addr, self.pool.nbytes)
            self.transports[name] = t
        self.sender = Sender(self.transports, self.pool, self.states, self.publisher,
                             self.config.transfer_timeout_s, tracer=self.tracer,
                             checksum=self.config.kv_checksum,
                             fault_flip_every=self.config.fault_flip_kv_byte_every)
        log.info("expresslane: layers %s", [(n, tuple(t.shape), str(t.dtype)) for n, t, _, _ in self.layers])
        split = ""
        if self.tp_size > 1:
            split = f", tensor-parallel rank {self.tp_rank} of {self.tp_size}"
            if self.spec.kv_heads:
                spec = self.spec
                split += f" (KV heads from {spec.kv_head_start}: {spec.kv_heads} of {spec.kv_heads_total})"
        log.info("expresslane: %d layers, staging %d x %d bytes (%d tokens), transports %s, stats %s, "
                 "kv checksum %s%s", len(self.layers), self.config.staging_slots, self.spec.slot_nbytes,
                 self.max_tokens, ",".join(self.transports), self.states.path,
                 "on" if self.config.kv_checksum else "off", split)
        if self.config.fault_flip_kv_byte_every:
            log.warning("expresslane: FAULT INJECTION on: every %d-th transfer's KV is corrupted after "
                        "its checksum", self.config.fault_flip_kv_byte_every)

    def _kv_shape(self, num_layers: int) -> KvShape:
        hf = self.vllm_config.model_config.hf_text_config
        if self.vllm_config.model_config.use_mla:
            dsa = getattr(hf, "model_type", "") in DSA_TYPES
            return KvShape(kind="mla", num_layers=num_layers, kv_lora_rank=int(hf.kv_lora_rank),
                           qk_rope_head_dim=int(hf.qk_rope_head_dim),
                           index_head_dim=int(getattr(hf, "index_head_dim", 128)) if dsa else 0,
                           index_layers=dsa_indexer_layers(hf.to_dict(), num_layers) if dsa else ())
        mc = self.vllm_config.model_config
        # the model's KV heads, not this rank's share (layout_spec splits them); a stand-in config
        # without get_total_num_kv_heads runs one rank, where both are the same
        total = getattr(mc, "get_total_num_kv_heads", None)
        num_kv_heads = total() if total is not None else mc.get_num_kv_heads(self.vllm_config.parallel_config)
        return KvShape(kind="gqa", num_layers=num_layers, num_kv_heads=num_kv_heads,
                       head_dim=mc.get_head_size())

    def _indexer_caches_to_stage(self, layers: list, indexer: dict[str, bool]) -> list:
        """The registered caches the decode slot has a segment for. vLLM may keep an indexer cache
        for a layer that the checkpoint's ``indexer_types`` call "shared" (it reads only
        ``index_topk_pattern`` / ``index_topk_freq``); the slot has none there, so it is not sent.
        A layer the slot expects index keys for must have an indexer cache."""
        keep = [entry for entry in layers if not indexer[entry[0]] or entry[3] in self.shape.index_layers]
        dropped = [entry[0] for entry in layers if entry not in keep]
        if dropped:
            log.warning("expresslane: indexer caches %s belong to layers the decode slot keeps no index "
                        "keys for (the checkpoint's indexer_types); they are not handed over", dropped)
        missing = sorted(set(self.shape.index_layers) - {e[3] for e in keep if indexer[e[0]]})
        if missing:
            raise ValueError(f"sparse attention: layers {missing} keep index keys in the decode slot, but "
                             "vLLM registered no indexer cache for them")
        return keep

    def _resolve_adapters(self) -> list[LayerAdapter]:
        """Each registered cache's adapter from its attention backend (and CPU kernel family, or
        the sparse-MLA layer's kv cache dtype)."""
        ctx = self.vllm_config.compilation_config.static_forward_context
        hf = self.vllm_config.model_config.hf_text_config
        rope_dim = int(getattr(hf, "qk_rope_head_dim", 0) or 0)
        rope_interleave = bool(getattr(hf, "rope_interleave", True))
        from vllm.platforms import current_platform

        fp8_dtype = current_platform.fp8_dtype()  # e4m3fnuz on ROCm's MI300, e4m3fn elsewhere
        adapters = []
        index_interleave = bool(getattr(hf, "indexer_rope_interleave", False))
        if getattr(hf, "model_type", "") == "glm_moe_dsa" and not index_interleave:
            log.warning("expresslane: glm_moe_dsa without indexer_rope_interleave in its config: vLLM ropes "
                        "the indexer's keys half-split, the decode engine (as HF) interleaved; the handed-over "
                        "index keys will not be the ones the decode node computes")
        for name, cache, _, _ in self.layers:
            layer = ctx.get(name)
            backend = _backend_name(layer)
            if backend in INDEXER_BACKENDS:
                # vLLM ropes the indexer GPT-J style only where the config sets indexer_rope_interleave;
                # the engine keeps GLM's keys de-interleaved, DeepSeek-V3.2's half-split.
                adapters.append(DsaIndexerKeys(
                    index_head_dim=self.shape.index_head_dim, rope_dim=rope_dim,
                    deinterleave_rope=index_interleave,
                    shuffled=bool(getattr(layer, "uses_shuffled_layout", False)), fp8_dtype=fp8_dtype))
                continue
            if backend in SPARSE_MLA_BACKENDS:
                k_scale = getattr(layer, "_k_scale_float", 1.0)
                adapters.append(sparse_mla_adapter(str(getattr(layer, "kv_cache_dtype", "auto")),
                                                   rope_dim=rope_dim, kv_lora_rank=int(hf.kv_lora_rank),
                                                   rope_interleave=rope_interleave, k_scale=k_scale,
                                                   fp8_dtype=fp8_dtype))
                continue
            isa = getattr(layer, "isa", None)
            if backend == "CPU_ATTN" and isa is None:
                from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

                isa = _get_attn_isa(cache.dtype, cache.shape[2], cache.shape[3] // 2)
            if (backend in MLA_BACKENDS and getattr(self, "spec", None) is not None and self.spec.dtype in FP8_DTYPES
                    and fp8_dtype != torch.float8_e4m3fn):
                raise ValueError(f"an FP8 MLA latent in {fp8_dtype} (this platform's FP8) is not the OCP E4M3 a "
                                 "decode slot keeps: serve with --kv-cache-dtype auto")
            adapters.append(adapter_for(backend, isa=isa, rope_dim=rope_dim, rope_interleave=rope_interleave))
        log.info("expresslane: layout adapters %s", sorted({type(a).__name__ for a in adapters}))
        return adapters

    # ---------------------------------------------------------------- per step
    def wait_for_save(self, saves: list[SaveRequest]) -> None:
        """Stage this step's claimed requests and queue their writes. With the KV cache in host
        memory the copies run on the extraction thread, beside the step's sampling and output (the
        first token no longer waits for them: ~0.4 ms of a tiny model's prefill on 2 cores);
        :meth:`wait_extracted`, before the next forward, keeps them ahead of any write into the
        blocks they read. On a GPU they are queued on the stream and return at once anyway."""
        if not self.stages:
            return  # MLA rank > 0: rank 0 hands the latent over, and reports its failures
        if self._extractor is None:
            self._save(saves)
            return
        self.wait_extracted()  # one step's at a time, in step order
        self._extracting = self._extractor.submit(self._save, saves)

    def wait_extracted(self) -> None:
        """Return once the last step's extraction has read the KV cache (its blocks may be given
        to another request when the step ends; the next forward writes them only after this)."""
        pending, self._extracting = self._extracting, None
        if pending is not None:
            try:
                pending.result()
            except Exception:  # each save's own failures are reported in _save; never fail vLLM's step
                log.exception("expresslane: extraction thread failed")

    def _save(self, saves: list[SaveRequest]) -> None:
        for save in saves:
            if save.handoff is None:
                continue  # unparseable params: reported in the response, nowhere to send an event
            try:
                self._save_one(save)
            except Exception as exc:  # never into vLLM's step, never the other saves' slots
                log.exception("expresslane: handing off %s failed", save.request_id)
                if save.staging_slot >= 0:  # _save_one gives the slot up last: it still holds it
                    self.states.set(save.staging_slot, FREE)
                try:
                    self.sender.submit(SendJob(save.handoff, -1, 0, fail_reason=f"hand-off failed: {exc}"))
                except Exception:
                    log.exception("expresslane: could not report the failed hand-off of %s", save.request_id)

    def _save_one(self, save: SaveRequest) -> None:
        """One claimed request's staging and send (or its KvFailed). The staging slot is given up
        (freed, or handed to the sender) by each path's last step, so a raise leaves it held."""
        reason = save.fail_reason or self.refusal
        if reason or save.staging_slot < 0:
            if self.tp_rank == 0:  # the same on every rank: one KvFailed for the request
                self.sender.submit(SendJob(save.handoff, -1, 0, fail_reason=reason))
            if save.staging_slot >= 0:
                self.states.set(save.staging_slot, FREE)
            return
        try:
            with self.tracer.start_as_current_span(
                    "prefill.extract", context=context_from_traceparent(save.handoff.traceparent),
                    attributes={"expresslane.request_id": save.handoff.request_id,
                                "expresslane.num_tokens": save.num_tokens}):
                extract_ms = self._stage(save)
        except Exception as exc:
            log.exception("expresslane: extraction failed for %s", save.request_id)
            self.sender.submit(SendJob(save.handoff, -1, 0, fail_reason=f"extraction failed: {exc}"))
            self.states.set(save.staging_slot, FREE)
            return
        self.states.set(save.staging_slot, SENDING)
        self.sender.submit(SendJob(save.handoff, save.staging_slot, save.num_tokens, extract_ms))  # it frees it

    def _stage(self, save: SaveRequest) -> float:
        t0 = time.perf_counter()
        if self.adapters is None:
            self.adapters = self._resolve_adapters()
        n = save.num_tokens
        views = self.pool.segment_views(save.staging_slot, n)
        block_tables: dict[tuple[int, int], torch.Tensor] = {}
        for (_, cache, group, layer), adapter in zip(self.layers, self.adapters):
            kernel_block_size = adapter.block_size(cache)
            key = (group, kernel_block_size)
            if key not in block_tables:
                manager_block_size = self.kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size
                ids = kernel_block_ids(save.block_ids[group], manager_block_size, kernel_block_size, n)
                block_tables[key] = torch.tensor(ids, dtype=torch.long, device=cache.device)
            out = [views[self.segment_index[(layer, name)]] for name in adapter.segments]
            if self.shape.kind == "gqa":  # this rank's heads (all of them at TP 1)
                out = [v.view(n, self.spec.kv_heads, self.shape.head_dim) for v in out]
            adapter(cache, block_tables[key], n, out)
        return (time.perf_counter() - t0) * 1e3

    def shutdown(self) -> None:
        if self._extractor is not None:
            _workers_here.pop(self.engine_id, None)
            self._extractor.shutdown(wait=True)
        if self.sender is not None:
            self.sender.close()
        if self.publisher is not None:
            self.publisher.close()
        for t in self.transports.values():
            try:
                t.close()
            except Exception:
                pass
        if self.states is not None:
            self.states.close()
