"""``ExpressConnector``: vLLM KV-connector plugin that hands claimed requests to the express lane.

Loaded by a stock vLLM (no fork) with::

    --kv-transfer-config '{"kv_connector": "ExpressConnector",
                           "kv_connector_module_path": "services.prefill.connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"nats_url": "...", "transports": ["mooncake"],
                                                         "staging_slots": 4}}'

(see services.prefill.config for every key, services.prefill.launch for the command that builds
this). A thin facade, as vLLM's own NIXL connector: the scheduler role builds an
``ExpressScheduler`` (claims, block tracking, staging-slot reservation), the worker role an
``ExpressWorker`` (extraction into staging, background sender); each hook forwards to one of them.
Requests without the ``expresslane`` key in ``kv_transfer_params`` are never touched, so the
connector composes with NixlConnector under MultiConnector.

Staging slot states live in the file ``stats_path`` (default
``/dev/shm/expresslane-staging-<engine_id>``; under tensor parallelism one file per staging rank,
``staging.rank_path``); ``services.prefill.staging.read_stats(path)`` or
``expresslane prefill --stats PATH`` shows them.

Tensor parallelism (``--tensor-parallel-size p``, services.prefill.parallel): every rank's worker
hands over its own share of the KV heads (MLA: rank 0 the whole latent). The scheduler reserves a
staging slot only while it is free on every staging rank, and refuses every request, with the
reason, where the model's KV heads do not split over the ranks.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from services.prefill.config import ExpressConfig
from services.prefill.parallel import split_refusal, staging_ranks
from services.prefill.publisher import Publisher
from services.prefill.scheduler import ExpressScheduler, SaveRequest
from services.prefill.staging import RankSlotStates

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# 1: first version (SaveRequest list per step).
METADATA_VERSION = 1


log = logging.getLogger("vllm.expresslane.prefill")


@dataclasses.dataclass
class ExpressConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: the claimed requests to stage now."""

    saves: list[SaveRequest]
    version: int = METADATA_VERSION


def _engine_id(vllm_config: "VllmConfig") -> str:
    return str(vllm_config.kv_transfer_config.engine_id or "default")


class ExpressConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = ExpressConfig.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        engine_id = _engine_id(vllm_config)
        self._scheduler: ExpressScheduler | None = None
        self._worker = None
        self._publisher: Publisher | None = None
        if role == KVConnectorRole.SCHEDULER:
            model = vllm_config.model_config
            kind, tp_size = "mla" if model.use_mla else "gqa", vllm_config.parallel_config.tensor_parallel_size
            refusal = split_refusal(kind, 0 if kind == "mla" else model.get_total_num_kv_heads(), tp_size,
                                    vllm_config.parallel_config.pipeline_parallel_size)
            if refusal:
                log.error("expresslane: %s", refusal)
            states = RankSlotStates(config.stats_file(engine_id), config.staging_slots,
                                    staging_ranks(kind, tp_size), create=True)
            max_tokens = config.staging_max_tokens or model.max_model_len
            self._scheduler = ExpressScheduler(states, max_tokens, refusal)
            from services.prefill import worker as in_process  # the worker of the "uni" executor

            self._extraction_done = lambda: in_process.extraction_done(engine_id)
            # The first token and the decode start leave from here, the moment the scheduler has
            # them (before vLLM's response carries the token), written by this thread (publisher.py).
            self._publisher = Publisher(config.nats_url, name=f"prefill-sched-{engine_id[:8]}",
                                        auth=config.bus_auth())
        else:
            from services.prefill.worker import ExpressWorker

            self._worker = ExpressWorker(config, vllm_config, kv_cache_config, engine_id)

    # ---------------------------------------------------------------- worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # vLLM binds each step's metadata before its forward: the previous step's extraction
        # (a thread, with host-memory caches) must have read its blocks before this forward writes.
        if self._worker is not None:
            self._worker.wait_extracted()
        super().bind_connector_metadata(connector_metadata)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return  # producer only: nothing is ever loaded

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return  # whole blocks are copied once per request in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, ExpressConnectorMetadata) and meta.saves:
            self._worker.wait_for_save(meta.saves)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._publisher is not None:
            self._publisher.close()

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._scheduler.on_alloc(request.request_id, request.kv_transfer_params,
                                 request.num_prompt_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        # The last step's extraction (host-memory caches, this process's worker) has read its blocks
        # before this step's cache updates: vLLM may zero or copy blocks before binding the metadata.
        self._extraction_done()
        sched = self._scheduler
        if not sched.has_work:
            return ExpressConnectorMetadata(saves=[])
        new = [(r.req_id, r.block_ids, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        running = [(rid, cached.new_block_ids[i], cached.num_computed_tokens[i],
                    rid in cached.resumed_req_ids) for i, rid in enumerate(cached.req_ids)]
        saves = sched.on_step(new, running, scheduler_output.num_scheduled_tokens)
        return ExpressConnectorMetadata(saves=saves)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, self._finished(request)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return False, self._finished(request)

    def _finished(self, request: "Request") -> dict[str, Any] | None:
        sched = self._scheduler
        if sched.has_claim(request.request_id):
            reason = request.get_finished_reason()
            messages = sched.on_first_token(request.request_id, list(request.output_token_ids),
                                            str(reason) if reason is not None else None,
                                            request.prompt_token_ids or [])
            if messages and self._publisher.publish_many(messages) == "direct":
                sched.slots.count("first_token_direct")
        return sched.on_finished(request.request_id)
