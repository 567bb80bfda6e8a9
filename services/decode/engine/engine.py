"""The decode engine: N slots decoding together, one (speculative) step at a time.

Contract: ``Engine.load(model_dir, EngineConfig(num_slots=..., max_seq_len=..., ...))`` (options.py;
keyword arguments override single settings); ``slot_buffer(slot)`` is the slot's KV memory in the shared.kvlayout
layout; ``prefill`` or ``inject`` fill a free slot, ``start`` arms it with its first token (already
emitted by the prefill side, not counted in ``max_tokens``), ``step`` runs one decode step over all
active slots and returns the tokens each emitted; ``cancel`` stops a slot, ``release`` frees it.

After ``inject(slot, n)`` of an MTP model the MTP layer's cache must hold positions ``[0, n)`` as
vLLM's MTP prefill writes them (entry i from hidden i and token i+1, the last from the first
generated token); the slot's first step then runs without drafts. Exactness never depends on
that cache (every draft is verified), only the acceptance rate does.

Per step: one model forward over ``[B, 1 + K]`` tokens, sampling, acceptance, the MTP draft pass,
and a single host sync to emit the tokens.

Sampling (sampling.py): every SamplingParams field with vLLM's semantics and order (temperature,
top_k, top_p, min_p, repetition / presence / frequency penalties, logit_bias, allowed_token_ids,
bad words as token-id sequences, min_tokens, seed). Each slot's parameters and state (output counts,
bad-word state) live in ``SamplingBuffers`` on the device, shared with the fast path; the random
numbers are Philox keyed by (seed, position), so a seeded request samples the same tokens alone or
batched, on either path (unseeded requests draw a random seed). Requests whose processors read the
output (penalties, bad words) do not speculate. ``repetition_penalty`` needs the prompt's ids: the
engine keeps those it prefilled itself; after ``inject`` they come in ``prompt_token_ids``.

Fast path (``fast_path="auto"|"on"|"off"``, fastpath.py): a step with exactly one active slot runs
that slot's batch-1 CUDA-graph decoder (services/decode/engine/cuda) instead,
``fast_path_tokens_per_step`` tokens per step with one host sync (DeepSeek family with drafts: one
graph of k MTP drafts + verify per step), cut at stop ids and max_tokens exactly as the reference
step cuts them; both families sample there too (cuda/sampling.py, the reference step's tokens;
with MTP drafts by speculative sampling on device, the reference step's distributions and random
numbers). A Llama-family step over 2..8
active slots that all decode on the fast path runs them together in one batched CUDA-graph decoder
(weights read once per step for every slot; each slot its own cache, length and sampling parameters)
with each slot's tokens as alone; other steps over several slots (more than 8, a slot the fast path
cannot serve, the DeepSeek family) take the reference step. ``auto``
uses it where the engine supports it (CUDA, bfloat16, plain Llama-family blocks without drafts, or
DeepSeek-V3-family blocks) and logs why not otherwise (``fast_path_reason``); ``on``
raises ValueError for an engine it cannot serve. Requests it cannot serve (logprobs
or grammars on the DeepSeek family, drafts on a Llama-family engine, bad words beyond its buffers) take the reference step in either mode, their reason in
``slot_fast_path_reason(slot)``; ``last_step_path`` says which path the last step took ("fast" |
"reference" | "cpu-fused", for every slot it served) and ``last_step_slots`` how many slots it served.
CPU step (``cpu_step="auto"|"off"``, cpustep.py): on the CPU a float32 engine of the Llama family or the
DeepSeek-V3 family (dense attention) runs a step of one token a slot (the reference step's plain decode,
one slot or several; a step verifying drafts token by token, and the MTP layer's drafts) in one native call
a token, compiled for the host, the torch step's math in another order of sums (``"cpu-fused"``); prefills,
and hosts without a C compiler (``model.cpu_step_reason`` says why), take the torch step.
Logprobs (``SamplingParams.logprobs``, logprobs.py): each emitted token's logprob, rank and top n of
the raw logits (vLLM's raw_logprobs: after a grammar's mask, before every other processor), in
``StepOutput.logprobs``; with drafts, each accepted token scored by the target model at its
position. Grammars (``SamplingParams.structured``, grammar.py): compiled at ``start`` (or ahead by
``prepare_grammar``; a bad one raises GrammarError, a ValueError), one xgrammar matcher per slot
advanced through the output so far; each step fills the next-token bitmask and applies it to the
logits before sampling (``xgr.apply_token_bitmask_inplace``); with drafts, one mask per position
after each grammar-valid draft prefix, drafts past it cut before verification (the matcher rolled
back), as vLLM's scheduler does. The grammar lets EOS (or a stop id) through only once complete, so a
constrained request ends with "stop" as in vLLM; once terminated it masks nothing.
On the fast path (Llama family) a request with logprobs (top 20 at most) and/or a grammar takes
a graph for them (fastpath.extras_key: mask, logprobs or both; captured on first use, per slot
alone and per padded size batched): the host writes each grammar's mask into its slot's ``gmask``
row before each replay (one token per step with a grammar), the graph applies the masks before the
sampling kernels (all ones where a row has no grammar) and computes the logprobs after them.
Adaptive drafting (``adaptive_speculation``, on by default; spec_policy.py): each request's steps
draft as many MTP tokens (0..its maximum) as its observed acceptance pays for, against a fixed cost
per draft (a sampled request's one table whatever decodes beside it: where its drafts were decides its seeded
draws; a greedy request prices a draft dearer while its steps run beside other slots, as the fast path's
batched drafting step costs, and the reference step's batches alike); drafts that
are not accepted turn drafting off for a backoff, then a probe measures again. A reference step
drafts the most any of its slots asks for (each slot verifies only the drafts it asked for). On an
engine whose steps run on the CPU no draft count pays even if every draft is accepted
(spec_policy.can_pay), so its requests do not draft at all unless drafting is fixed.
``spec_counters`` totals the steps that verified drafts, the drafts verified and accepted (per
draft position too), as vLLM's spec-decode metrics.
KV cache dtype (``kv_cache_dtype``, vLLM's ``--kv-cache-dtype`` names): ``auto`` keeps slot K/V in the
model dtype; ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2`` (Llama/Qwen family) keep the bytes vLLM's FP8 KV cache
holds, with the checkpoint's per-layer k/v scales as vLLM reads them, and the layout says so
(kvquant.py): the reference step writes each token's K/V as the vLLM it pairs with writes the prompt's
(on CPU truncated as vLLM's CPU writer, on a GPU rounded to nearest as its CUDA writers: ``fp8_kv_nearest``)
and attends over the dequantized values in float32 as vLLM's CPU attention does. Dense MLA models (DeepSeek family) take
``fp8`` / ``fp8_e4m3``: the latent in E4M3 bytes as vLLM's CUDA MLA backends keep it (rounded to nearest,
one k_scale a layer), attended over dequantized in float32. The fast path (bf16 and FP8-weight
batch-1 steps) writes the same bytes (cuda/kvfp8.py) and reads fp8 * scale in its attention kernels;
several slots in one step (the batched decoder) take the reference step with an FP8 KV cache.
``mtp_draft_vocab=N``: the fast path's MTP drafts propose token ids < N only (its draft head reads N
rows, not the whole vocabulary); output is unchanged, acceptance may drop. The reference step
drafts over the whole vocabulary.
Tensor parallelism (``tp=TensorParallel(rank, size, group)`` to ``load`` / ``from_hf_tensors``, tp.py):
every rank of the group builds its own Engine with the same settings and makes the same calls in the
same order (SPMD, as vLLM's workers do: a node's rank 0 mirrors each call to the others). Each holds
its shard of the weights (``moe_parallel``: routed experts sliced, "tp", or whole per rank, "ep") and
its share of the KV cache (``layout``: the rank's layout, GQA its KV heads, MLA the whole latent; a
writer fills ``slot_buffer`` with that rank's heads); the forward's all-reduces and logits all-gather
give every rank the same full logits, so every rank samples the same tokens and returns the same
StepOutputs. Sampling stays replicated and keyed by (seed, position); an unseeded request gets rank 0's
random seed on every rank (``start`` all-reduces it, one collective, so it too must be called on
every rank), so a node may as well fill the seed in before it mirrors the call. The reference step
only (its CUDA graphs included: NCCL collectives are captured with them); ``fast_path="on"``, FP8
weights, and head counts, intermediate sizes or expert counts that do not divide raise ValueError.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
import torch

from shared.events import KvLayoutSpec, SamplingParams, SpecStats
from shared.kvlayout import FP8_DTYPES, kv_dtype_for_cache, kv_shape_from_hf_config
from shared.log import get_logger

from .cache import TORCH_DTYPES, KvCache, dtype_name
from .kvquant import checkpoint_scales
from .sampling import ReferenceSampler, SamplingBuffers, banned_ids, exponential, resolve, sample
from .cuda.sampling_state import BAD_WORDS, GREEDY, I_FLAGS, I_SEED, READS_OUTPUT, STREAM_ACCEPT, STREAM_DRAFT, \
    TRACK_COUNTS, uniform
from .slots import SlotState, emit
from . import cpustep, logprobs as lpmod
from .grammar import GrammarError, Grammars
from .spec import verify
from .config import parse_config
from .build import build_model, load_params
from .cuda.graph import GraphedFn
from . import fastpath, spec_policy
from .options import EngineConfig
from .tp import TensorParallel, shard_named
from .weights import CheckpointReader, DictReader, hf_to_engine, is_engine_format, iter_engine_params, read_config

_log = get_logger("decode.engine")


@dataclass
class StepOutput:
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | None
    logprobs: list | None = None  # shared.events.TokenLogprobs per token when the request asked for them


def _with_logits(model, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return hidden, model.logits(hidden)


def _config(config: EngineConfig | None, overrides: dict) -> EngineConfig:
    return replace(config or EngineConfig(), **overrides).validate()


def _torch_dtype(dtype, checkpoint_dtype: str) -> torch.dtype:
    if isinstance(dtype, str):
        return TORCH_DTYPES[dtype]
    return dtype or TORCH_DTYPES.get(checkpoint_dtype, torch.float32)


def fp8_kv_nearest(kv_shape, device: torch.device) -> bool:
    """Whether this node writes FP8 KV bytes rounded to nearest, as the vLLM it pairs with writes its prompt's: vLLM's
    CUDA cache writers round (an MLA latent exists in FP8 on CUDA only), its CPU writer truncates; a decode node on
    a GPU pairs with GPU prefills, one on CPU with vLLM's CPU build."""
    return kv_shape.kind == "mla" or device.type == "cuda"


def _kv_scales(config: EngineConfig, raw_config: dict, cfg, reader, converted: bool = False
               ) -> list[tuple[float, float]] | None:
    """vLLM's per-layer FP8 KV scales of the checkpoint (None for a cache in the model dtype)."""
    if config.kv_cache_dtype == "auto":
        return None
    if converted and (raw_config.get("quantization_config") or raw_config.get("compression_config")):
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} takes vLLM's KV scales from the HF checkpoint, "
                         "which a converted checkpoint does not keep: serve the HF checkpoint directory")
    num_layers = kv_shape_from_hf_config(raw_config).num_layers  # MTP layers' scales too (same names)
    return checkpoint_scales(raw_config, num_layers, reader.has, reader.get)


def _shards(cfg, named, tp: TensorParallel | None, config: EngineConfig):
    """The checkpoint's (name, tensor) as this rank holds them (sliced before they reach the device)."""
    if tp is None or tp.size == 1:
        return named
    return shard_named(cfg, named, tp.rank, tp.size, config.moe_parallel)


class Engine:
    def __init__(self, model, cfg, config: EngineConfig, *, model_name: str, raw_config: dict,
                 eos_token_ids: tuple[int, ...] = (), tokenizer_dir: str | Path | None = None,
                 kv_scales: list[tuple[float, float]] | None = None, tp: TensorParallel | None = None):
        """``kv_scales``: each cache layer's (k_scale, v_scale) for an FP8 KV cache (default 1.0); ``tp``:
        this engine's rank of a tensor-parallel group (``model`` built over its shards; None: one rank)."""
        config.validate()
        self.tp = tp or TensorParallel.single()
        model_tp = getattr(model, "tp", TensorParallel.single())
        if (model_tp.rank, model_tp.size) != (self.tp.rank, self.tp.size):
            raise ValueError(f"the model was built for tensor-parallel rank {model_tp.rank} of {model_tp.size}, "
                             f"the engine for rank {self.tp.rank} of {self.tp.size}: build both with the same tp")
        num_spec = config.resolved_num_speculative_tokens(raw_config)
        draft_vocab = config.mtp_draft_vocab
        if draft_vocab is not None and not 0 < draft_vocab <= cfg.vocab_size:
            raise ValueError(f"mtp_draft_vocab must be 1..{cfg.vocab_size} (the vocabulary size), got {draft_vocab}")
        if num_spec and not getattr(model, "has_mtp", False):
            raise ValueError(f"{model_name} has no MTP layer weights: run it with num_speculative_tokens=0")
        num_slots, max_seq_len, fast_path = config.num_slots, config.max_seq_len, config.fast_path
        window = getattr(cfg, "sliding_window", None)
        if window and max_seq_len > window:
            # Full attention equals the model's sliding window up to the window's length; longer
            # contexts would decode differently from the model (and from vLLM), so they go elsewhere.
            _log.warning("max_seq_len_capped", model=model_name, max_seq_len=max_seq_len, sliding_window=window,
                         hint="the decode engine has no sliding-window attention; requests beyond "
                              f"{window} tokens take another node or the standard lane")
            max_seq_len = window
        self.config = config
        self.model, self.cfg, self.model_name = model, cfg, model_name
        self.device, self.dtype = model.embed.device, model.embed.dtype
        self.num_slots, self.max_seq_len, self.num_spec = num_slots, max_seq_len, num_spec
        self.eos_token_ids = eos_token_ids
        self.grammars = Grammars(config.tokenizer or tokenizer_dir, cfg.vocab_size)
        # Without drafts the MTP layer is unused: its cache is neither kept nor part of the layout,
        # which then matches a prefill that runs without the MTP drafter.
        if not self.num_spec and getattr(model, "has_mtp", False):
            model.has_mtp = False
        kv_dtype = kv_dtype_for_cache(config.kv_cache_dtype, dtype_name(self.dtype))
        kv_shape = kv_shape_from_hf_config(raw_config, include_mtp=self.num_spec > 0)
        if kv_dtype in FP8_DTYPES and kv_shape.kind == "mla" and (kv_dtype != "fp8_e4m3" or kv_shape.index_layers):
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r}: an MLA model keeps an FP8 latent as vLLM's "
                             "CUDA MLA backends do, E4M3 (use kv_cache_dtype='fp8'), and a sparse-attention model "
                             f"({cfg.model_type}) its latent in the model dtype (use kv_cache_dtype='auto')")
        if kv_scales is not None:  # the checkpoint's (MTP layers included) for the layers this cache keeps
            kv_scales = (list(kv_scales) + [(1.0, 1.0)] * kv_shape.num_layers)[:kv_shape.num_layers]
        self.cache = KvCache(kv_shape, num_slots, max_seq_len + self.num_spec, self.dtype, self.device,
                             kv_dtype=kv_dtype, scales=kv_scales if kv_dtype in FP8_DTYPES else None,
                             tp_size=self.tp.size, tp_rank=self.tp.rank, kv_nearest=fp8_kv_nearest(kv_shape, self.device))
        model.bind(self.cache)
        if hasattr(model, "attach_cpu_step"):  # the fused CPU step (cpustep.py), where it applies
            model.attach_cpu_step(config.cpu_step)
            if self.device.type == "cpu":
                _log.info("cpu_step", model=model_name, fused=model.cpu_step is not None, reason=model.cpu_step_reason)
        on_cuda = self.device.type == "cuda" and config.use_cuda_graphs
        self._forward = GraphedFn(lambda t, p, s, n: _with_logits(model, model(t, p, s, n)), on_cuda)
        self._mtp = GraphedFn(model.mtp_forward, on_cuda) if getattr(model, "has_mtp", False) else None
        n, dev, vocab = num_slots + 1, self.device, cfg.vocab_size
        self.sampling = SamplingBuffers(n, vocab, dev)  # every slot's sampling parameters and state
        self.sampler = ReferenceSampler(self.sampling)
        # the reference step's sampling tail in one CUDA graph per (batch size, flags): ~300 small kernels
        self._sample = GraphedFn(self.sampler.tokens, on_cuda)
        self.drafts = torch.zeros(n, max(self.num_spec, 1), dtype=torch.long, device=dev)
        self.draft_probs = torch.zeros(n, max(self.num_spec, 1), vocab, device=dev) if self.num_spec else None
        self.prefill_hidden = torch.zeros(n, cfg.hidden_size, dtype=self.dtype, device=dev)
        self.slots = [SlotState() for _ in range(num_slots)]
        self.fast_path_mode = fast_path
        self._fast, self.fast_path_reason = fastpath.setup(fast_path, model, self.device, self.dtype,
                                                           self.num_spec, config.fast_path_options,
                                                           config.fast_path_tokens_per_step,
                                                           draft_vocab=draft_vocab, sampling=self.sampling,
                                                           run_ahead=config.fast_path_run_ahead)
        self.adaptive_spec = config.adaptive_speculation and self.num_spec > 0
        # a step's cost by draft count, in plain steps: fixed per engine, so that a seeded sampled
        # request's draft counts do not follow what decodes beside it (a greedy one's do: _costs)
        # (a CPU engine's own steps: spec_policy.CPU_COST_PER_DRAFT)
        cpu = self.device.type == "cpu" and self._fast is None
        per_draft = spec_policy.CPU_COST_PER_DRAFT if cpu else spec_policy.COST_PER_DRAFT
        self._spec_costs = spec_policy.costs(self.num_spec, per_draft)
        self._spec_costs_sampled = spec_policy.costs(self.num_spec, max(per_draft, spec_policy.SAMPLED_COST_PER_DRAFT))
        # ... and a greedy request's in a batched step (its output never depends on where its drafts were)
        self._spec_costs_batched = spec_policy.costs(self.num_spec, max(per_draft, spec_policy.BATCH_COST_PER_DRAFT))
        if self.adaptive_spec and not spec_policy.can_pay(self._spec_costs):
            fastpath.log.info("adaptive speculation: a draft costs %.2f steps on this engine's CPU step, more than it "
                              "can return; requests decode without drafts (adaptive_speculation=False drafts every "
                              "step)", per_draft)
        # totals over the engine's life (node /metrics): steps that verified drafts, drafts verified,
        # drafts accepted, and accepted drafts per position (1-based: position j accepted j-th)
        self.spec_counters = {"steps": 0, "draft_tokens": 0, "accepted_tokens": 0,
                              "accepted_per_pos": [0] * max(self.num_spec, 1)}
        self.last_step_path: str | None = None  # "fast" | "reference" | "cpu-fused" after a step
        self.last_step_slots = 0  # how many slots the last step served
        with torch.inference_mode():  # build, compile and capture every slot's decoder now, not mid-request
            for slot in range(num_slots if self._fast is not None else 0):
                if not self._fast_build(slot, 0, 0):  # its CUDA warm-up step writes row 0 of an empty slot
                    break
            for size in fastpath.batch_sizes(num_slots) if self._fast is not None and self._fast.batch_at_load else ():
                if not self._fast_build_batch(size):  # captured on the scratch slot
                    break

    @classmethod
    def load(cls, model_dir: str | Path, config: EngineConfig | None = None, *, tp: TensorParallel | None = None,
             **overrides) -> Engine:
        """Load an HF safetensors checkpoint or the engine's converted format; keyword arguments
        replace single settings of ``config`` (EngineConfig fields). ``tp``: this process's rank of a
        tensor-parallel group (it loads only its shards; every rank calls ``load`` alike)."""
        config = _config(config, overrides)
        raw, cfg = read_config(model_dir)
        dtype = _torch_dtype(config.dtype, cfg.torch_dtype)
        params = load_params(_shards(cfg, iter_engine_params(model_dir, cfg), tp, config),
                             torch.device(config.device), dtype)
        eos = set(cfg.eos_token_ids)
        gen_cfg = Path(model_dir) / "generation_config.json"
        if gen_cfg.exists():
            e = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos |= set(e if isinstance(e, list) else [] if e is None else [e])
        return cls(build_model(cfg, params, tp, config.moe_parallel), cfg, config,
                   model_name=config.model_name or Path(model_dir).name, raw_config=raw,
                   eos_token_ids=tuple(sorted(eos)), tokenizer_dir=model_dir,
                   kv_scales=_kv_scales(config, raw, cfg, CheckpointReader(model_dir), is_engine_format(model_dir)),
                   tp=tp)

    @classmethod
    def from_hf_tensors(cls, raw_config: dict, tensors: dict[str, torch.Tensor], config: EngineConfig | None = None,
                        *, tp: TensorParallel | None = None, **overrides) -> Engine:
        """Build from HF-named tensors already in memory (an HF model's state_dict: tests, benchmarks);
        ``tp`` as for ``load``."""
        config = _config(config, overrides)
        cfg = parse_config(raw_config)
        dtype = _torch_dtype(config.dtype, cfg.torch_dtype)
        params = load_params(_shards(cfg, hf_to_engine(cfg, DictReader(tensors)), tp, config),
                             torch.device(config.device), dtype)
        return cls(build_model(cfg, params, tp, config.moe_parallel), cfg, config,
                   model_name=config.model_name or "in-memory", raw_config=raw_config,
                   eos_token_ids=cfg.eos_token_ids, kv_scales=_kv_scales(config, raw_config, cfg, DictReader(tensors)),
                   tp=tp)

    # ------------------------------------------------------------------ slots

    @property
    def layout(self) -> KvLayoutSpec:
        return self.cache.layout

    @property
    def fast_path(self) -> fastpath.FastPath | None:
        """The batch-1 fast path, to read (``tokens_per_step``, its decoders); None where the engine
        runs the reference step only (``fast_path_reason`` says why)."""
        return self._fast

    def slot_buffer(self, slot: int) -> torch.Tensor:
        """uint8 [layout.slot_nbytes]: the slot's KV cache memory (register it with a Transport)."""
        return self.cache.slot_buffer(slot)

    def active_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.state == "active"]

    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.state == "free"]

    def _slot(self, slot: int, *states: str) -> SlotState:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} does not exist: this engine has slots 0..{self.num_slots - 1}")
        s = self.slots[slot]
        if states and s.state not in states:
            raise RuntimeError(f"slot {slot} is {s.state}, expected {' or '.join(states)}")
        return s

    def _check_len(self, num_tokens: int) -> None:
        if not 0 < num_tokens < self.max_seq_len:
            raise ValueError(f"{num_tokens} tokens do not fit max_seq_len {self.max_seq_len}: raise --max-seq-len")

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int]) -> torch.Tensor:
        """Run the prompt through the model into the slot's cache; float32 logits [vocab] of its last position."""
        s = self._slot(slot, "free", "done")
        self._check_len(len(token_ids))
        tokens = torch.tensor([token_ids], device=self.device)
        positions = torch.arange(len(token_ids), device=self.device)[None]
        slot_ids = torch.tensor([slot], device=self.device)
        num_keys = self._num_keys(len(token_ids))
        hidden = self.model(tokens, positions, slot_ids, num_keys)
        if getattr(self.model, "has_mtp", False) and len(token_ids) > 1:
            self.model.mtp_forward(tokens[:, 1:], positions[:, :-1], hidden[:, :-1], slot_ids, num_keys)
        self.prefill_hidden[slot] = hidden[0, -1]
        self.slots[slot] = SlotState(state="ready", seq_len=len(token_ids), has_prefill_hidden=True,
                                     prompt_ids=list(token_ids))
        return self.model.logits(hidden[0, -1])

    def inject(self, slot: int, num_tokens: int) -> None:
        """Adopt ``num_tokens`` tokens of KV already written into slot_buffer(slot)."""
        self._slot(slot, "free", "done")
        self._check_len(num_tokens)
        self.slots[slot] = SlotState(state="ready", seq_len=num_tokens)

    @torch.inference_mode()
    def start(self, slot: int, first_token_id: int, sampling: SamplingParams) -> None:
        """Arm a ready slot: it decodes from ``first_token_id`` at the next step."""
        s = self._slot(slot, "ready")
        if sampling.seed is None and self.tp.size > 1:  # every rank must draw the same random numbers
            seed = self.tp.first_rank_int(random.getrandbits(63), self.device)
            sampling = msgspec.structs.replace(sampling, seed=seed)
        req = resolve(sampling, vocab=self.cfg.vocab_size, eos_token_ids=self.eos_token_ids, seq_len=s.seq_len,
                      prompt_ids=s.prompt_ids)
        if not 0 <= first_token_id < self.cfg.vocab_size:
            raise ValueError(f"first_token_id {first_token_id} is outside the vocabulary")
        stop = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_token_ids))
        asked = sampling.num_speculative_tokens
        k = self.num_spec if asked is None else min(self.num_spec, asked)
        if req.flags & READS_OUTPUT:  # they read the output, drafts included: no drafts
            k = 0
        if self.adaptive_spec and not spec_policy.can_pay(self._costs(req.plain_greedy)):
            k = 0  # no draft count can pay on this engine (its steps run on the CPU): plain steps from the first
        s.drafting = spec_policy.Drafting(k) if self.adaptive_spec and k else None
        if sampling.logprobs is not None and not 0 <= sampling.logprobs <= self.cfg.vocab_size:
            raise ValueError(f"invalid sampling parameters: logprobs must be 0..{self.cfg.vocab_size} or absent, "
                             f"got {sampling.logprobs}")
        grammar = self._grammar(sampling, first_token_id, k) if sampling.structured is not None else None
        s.extra["fast_path_reason"] = self.fast_path_reason or fastpath.request_reason(
            req.plain_greedy, k, self._fast is not None and self._fast.spec_ok,
            self._fast is not None and self._fast.sample_ok, req.fast_path_limit(),
            logprobs=sampling.logprobs, grammar=grammar is not None,
            extras_ok=self._fast is not None and self._fast.extras_ok)
        if self._fast is not None and s.extra["fast_path_reason"]:
            fastpath.log.debug("slot %d decodes on the reference step: %s", slot, s.extra["fast_path_reason"])
        if self._fast is not None:
            self._fast.forget(slot)
        s.state, s.pending, s.max_tokens, s.stop_token_ids, s.num_spec = "active", first_token_id, sampling.max_tokens, frozenset(stop), k
        s.sampling, s.output_ids = req, list(sampling.output_token_ids) + [first_token_id]
        self.sampling.arm(slot, req, s.output_ids, s.seq_len + 1)
        s.num_valid_drafts, s.is_greedy = 0, req.plain_greedy
        s.num_logprobs, s.grammar = sampling.logprobs, grammar
        if k and s.has_prefill_hidden and (self._fast is None or s.extra["fast_path_reason"]):
            # the reference step's first drafts (the fast path drafts from the prefill's hidden itself; a
            # reference step that takes the slot over later verifies none of them and drafts anew)
            slot_ids = torch.tensor([slot], device=self.device)
            tokens = torch.tensor([[first_token_id]], device=self.device)
            positions = torch.tensor([[s.seq_len - 1]], device=self.device)
            num_keys = self._num_keys(s.seq_len + self.num_spec)
            hidden, logits = self._mtp(tokens, positions, self.prefill_hidden[slot][None, None], slot_ids, num_keys)
            self._draft(slot_ids, hidden[:, 0], logits[:, 0], torch.tensor([s.seq_len], device=self.device),
                        num_keys, s.is_greedy, req.flags)
            s.num_valid_drafts = k

    def _grammar(self, sampling: SamplingParams, first_token_id: int, num_spec: int):
        """The request's matcher, advanced through the output so far (raises GrammarError)."""
        spec = sampling.structured
        compiled = self.grammars.compile(spec)
        g = self.grammars.matcher(compiled, set(sampling.stop_token_ids) | set(self.eos_token_ids), num_spec,
                                  reasoning_end=spec.reasoning_end_token_id if spec.gated else -1)
        so_far = list(sampling.output_token_ids) + [first_token_id]
        if not g.accept(so_far):
            raise GrammarError(f"the output so far (token ids {so_far[-8:]} last) does not match the "
                               f"{sampling.structured.kind} grammar: the prefill must sample under the same grammar")
        return g

    def prepare_grammar(self, sampling: SamplingParams) -> None:
        """Compile the request's grammar into the compiler's cache ahead of ``start`` (off the step's
        path; any error is raised again by ``start``)."""
        if sampling.structured is not None:
            try:
                self.grammars.compile(sampling.structured)
            except Exception:  # noqa: BLE001 - start raises it again, with the request's context
                pass

    def cancel(self, slot: int) -> None:
        """Stop decoding the slot (its tokens so far stand); the slot stays taken until release."""
        s = self._slot(slot)
        if s.state in ("active", "ready"):
            s.state = "done"

    def release(self, slot: int) -> None:
        """Free the slot for the next request."""
        self._slot(slot)
        self.slots[slot] = SlotState()
        if self._fast is not None:
            self._fast.forget(slot)

    def slot_fast_path_reason(self, slot: int) -> str | None:
        """Why the slot's request decodes on the reference step (None: on the fast path, alone or in a
        batched fast step with up to 7 other such slots)."""
        s = self._slot(slot, "active", "done")
        return s.extra.get("fast_path_reason")

    def spec_stats(self, slot: int) -> SpecStats:
        s = self._slot(slot)
        return SpecStats(num_steps=s.num_steps, num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens)

    # ------------------------------------------------------------------ decode

    def _num_keys(self, needed: int) -> int:
        """Cache prefix a step attends to. On CUDA a power of two (>= 256) covering ``needed``
        positions, so CUDA graphs exist per bucket and short contexts do not read the whole cache;
        elsewhere (no graphs) exactly ``needed``: keys past it are masked out anyway, and gathering
        and masking them cost a CPU step ~7% on the tiny model at short contexts."""
        if self.device.type != "cuda":
            return min(self.cache.max_tokens, needed)
        return min(self.cache.max_tokens, max(256, 1 << (needed - 1).bit_length()))

    def _flags(self, slot_ids: list[int]) -> int:
        """The OR of these slots' sampling flags (host side: which sampling work any row needs)."""
        f = 0
        for i in slot_ids:
            f |= self.slots[i].sampling.flags if self.slots[i].sampling is not None else GREEDY
        return f

    def _banned(self, slot_ids: list[int], flags: int) -> list[list[int]] | None:
        """The ids each slot's bad words ban at its next position (None: no slot has bad words)."""
        if not flags & BAD_WORDS:
            return None
        return [banned_ids(self.slots[i].sampling.bad_words, self.slots[i].output_ids)
                if self.slots[i].sampling is not None else [] for i in slot_ids]

    def _probs(self, slot_ids: torch.Tensor, logits: torch.Tensor, positions: torch.Tensor, flags: int,
               banned: list[list[int]] | None = None) -> torch.Tensor:
        """Processed distributions [B, T, V] of logits [B, T, V] whose sampled tokens take positions [B, T]."""
        b, t, v = logits.shape
        rows = slot_ids[:, None].expand(b, t).reshape(-1)
        per_row = [ids for ids in banned for _ in range(t)] if banned is not None else None
        return self.sampler.probs(logits.reshape(b * t, v), rows, positions.reshape(-1), flags, per_row).view(b, t, v)

    def _draft(self, slot_ids: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor,
               next_pos: torch.Tensor, num_keys: int, all_greedy: bool = False, flags: int = 0,
               k: int | None = None) -> None:
        """Draw K drafts per slot from the MTP head, recycling its hidden for drafts 2..K (the first
        MTP layer serves every draft, as DeepSeek-V3 runs its single one recursively).

        hidden/logits [B, ...] are the MTP outputs at position next_pos - 1 (whose input token is
        the pending token at next_pos); draft j lands at position next_pos + j. Positions past the
        cache (drafts beyond max_seq_len, never emitted) are clamped to its last row.
        """
        greedy = (self.sampling.iparams[slot_ids, I_FLAGS] & GREEDY) != 0
        seeds = self.sampling.iparams[slot_ids, I_SEED]
        drafts, probs = [], []
        k = self.num_spec if k is None else k
        for j in range(k):
            if all_greedy:  # greedy acceptance never reads the draft distribution
                d = logits.argmax(dim=-1)
            else:
                position = next_pos + 1 + j  # of draft j (the pending token is at next_pos)
                q = self._probs(slot_ids, logits[:, None], position[:, None], flags)[:, 0]
                d = sample(q, exponential(seeds, position, q.shape[-1], STREAM_DRAFT), greedy)
                probs.append(q)
            drafts.append(d)
            if j + 1 < k:
                pos = (next_pos + j).clamp(max=self.cache.max_tokens - 1)[:, None]
                h, lg = self._mtp(d[:, None], pos, hidden[:, None], slot_ids, num_keys)
                hidden, logits = h[:, 0], lg[:, 0]
        self.drafts[slot_ids, :k] = torch.stack(drafts, dim=1)
        if probs:
            self.draft_probs[slot_ids, :k] = torch.stack(probs, dim=1)

    @torch.inference_mode()
    def step(self) -> dict[int, StepOutput]:
        """One decode step over every active slot: {slot: StepOutput}; then each drafting request's
        next draft count (spec_policy) and the speculation totals."""
        active = self.active_slots()
        if not active:
            return {}
        if not self.num_spec:
            return self._step(active)
        before = {i: (self.slots[i].num_draft_tokens, self.slots[i].num_accepted_tokens) for i in active}
        out = self._step(active)
        self._account_spec(active, before)
        return out

    def _costs(self, greedy: bool, batched: bool = False) -> list[float]:
        """The draft-count cost table of a greedy or a sampling request on this engine (a greedy one's whose step ran
        beside other slots: the batched step's)."""
        if not greedy:
            return self._spec_costs_sampled
        return self._spec_costs_batched if batched else self._spec_costs

    def _account_spec(self, active: list[int], before: dict) -> None:
        c = self.spec_counters
        for i in active:
            s = self.slots[i]
            verified, accepted = s.num_draft_tokens - before[i][0], s.num_accepted_tokens - before[i][1]
            if verified > 0:
                c["steps"] += 1
                c["draft_tokens"] += verified
                c["accepted_tokens"] += accepted
                for j in range(min(accepted, len(c["accepted_per_pos"]))):
                    c["accepted_per_pos"][j] += 1
            if s.drafting is not None and s.state == "active":
                k = s.drafting.observe(verified, accepted, self._costs(s.is_greedy, batched=len(active) > 1))
                s.num_valid_drafts = min(s.num_valid_drafts, k)  # drafts drawn beyond it are not verified

    def _step(self, active: list[int]) -> dict[int, StepOutput]:
        self.last_step_slots = len(active)
        if len(active) > 1 and self._fast_batch_ready(active):
            self.last_step_path = "fast"
            results = self._fast.step_batch([(i, self.slots[i]) for i in active], self.max_seq_len,
                                            self.prefill_hidden)
            return {i: self._fast_output(i, out, reason) for i, (out, reason) in zip(active, results)}
        if len(active) == 1 and self._fast_ready(active[0]):
            self.last_step_path = "fast"
            s = self.slots[active[0]]
            out, reason = self._fast.step(active[0], s, self.max_seq_len,
                                          self.prefill_hidden[active[0]] if s.has_prefill_hidden else None)
            return {active[0]: self._fast_output(active[0], out, reason)}
        self.last_step_path = "reference"  # or cpustep.PATH, once the forward has run
        if self._fast is not None:
            self._fast.drop()  # a fast step run ahead for these slots: discarded, its counts undone
        # drafts this step verifies and draws: the most any slot asks for (0: a plain forward, no MTP)
        dev, k, b = self.device, max(self.slots[i].spec_k for i in active), len(active)
        slot_ids = torch.tensor(active, device=dev)
        seq = torch.tensor([self.slots[i].seq_len for i in active], device=dev)
        pending = torch.tensor([self.slots[i].pending for i in active], device=dev)
        bitmask = self._grammar_masks(active, slot_ids, k) if any(self.slots[i].grammar for i in active) else None
        all_greedy = all(self.slots[i].is_greedy for i in active)
        if k:
            num_valid = torch.tensor([min(self.slots[i].num_valid_drafts, k) for i in active], device=dev)
            tokens = torch.cat([pending[:, None], self.drafts[slot_ids][:, :k]], dim=1)  # [B, 1+K]
            positions = seq[:, None] + torch.arange(k + 1, device=dev)
        else:  # a plain step: nothing to append or verify (a few host ops less a token on the CPU path)
            tokens, positions = pending[:, None], seq[:, None]
        num_keys = self._num_keys(max(self.slots[i].seq_len for i in active) + 2 * k + 1)
        hidden, self.last_logits = self._forward(tokens, positions, slot_ids, num_keys)  # logits [B, 1+K, V] f32
        if getattr(self.model, "fused", False):
            self.last_step_path = cpustep.PATH
        if bitmask is not None:  # forbidden tokens -inf before sampling and logprobs, as vLLM
            import xgrammar as xgr

            masked = [r for r, i in enumerate(active) if self.slots[i].grammar is not None]
            rows_k = [r * (k + 1) + j for r in masked for j in range(k + 1)]
            xgr.apply_token_bitmask_inplace(self.last_logits.view(b * (k + 1), -1), bitmask.to(dev, non_blocking=True),
                                            indices=rows_k)
        rows = torch.arange(b, device=dev)
        if all_greedy and not k:
            num_accepted, nxt = None, self.last_logits[:, 0].argmax(dim=-1)
        elif all_greedy:  # no vocab-sized sampling work: compare drafts with the target argmax
            target = self.last_logits.argmax(dim=-1)  # [B, 1+K]
            ok = (tokens[:, 1:] == target[:, :k]) & (torch.arange(k, device=dev)[None] < num_valid[:, None])
            num_accepted = ok.long().cumprod(dim=-1).sum(dim=-1)
            nxt = target[rows, num_accepted]
        else:
            flags, seeds = self._flags(active), self.sampling.iparams[slot_ids, I_SEED]
            banned = self._banned(active, flags)
            if k:
                probs = self._probs(slot_ids, self.last_logits, positions + 1, flags, banned)
                noise = exponential(seeds, seq + 1, probs.shape[-1])
                accept = uniform(seeds[:, None], torch.zeros_like(positions[:, :k]), positions[:, :k] + 1, STREAM_ACCEPT)
                greedy = (self.sampling.iparams[slot_ids, I_FLAGS] & GREEDY) != 0
                num_accepted, nxt = verify(probs, self.draft_probs[slot_ids], tokens[:, 1:], num_valid, accept, noise,
                                           greedy)
            else:
                num_accepted = torch.zeros(b, dtype=torch.long, device=dev)
                sample_fn = self._sample if banned is None else self.sampler.tokens  # bad words: host lists
                nxt = sample_fn(self.last_logits[:, 0], slot_ids, seq + 1, flags, *([banned] if banned else []))
            if flags & TRACK_COUNTS:  # the penalties' output counts (rows with penalties have no drafts)
                track = torch.tensor([bool(self.slots[i].sampling.flags & TRACK_COUNTS) for i in active], device=dev)
                self.sampling.add_tokens(slot_ids, nxt, track)
        if k:
            mtp_tokens = torch.cat([tokens[:, 1:], nxt[:, None]], dim=1).scatter(1, num_accepted[:, None], nxt[:, None])
            h, lg = self._mtp(mtp_tokens, positions, hidden, slot_ids, num_keys)
            self._draft(slot_ids, h[rows, num_accepted], lg[rows, num_accepted], seq + num_accepted + 1, num_keys,
                        all_greedy, self._flags(active), k)
        if num_accepted is None:
            num_accepted = torch.zeros(b, dtype=torch.long, device=dev)
            if not any(self.slots[i].num_logprobs is not None for i in active):  # the plain greedy step
                return {slot: self._emit(slot, [0, t]) for slot, t in zip(active, nxt.tolist())}  # the one sync
        lps = self._logprobs(active, tokens, num_accepted, nxt, k)
        host = torch.cat([num_accepted[:, None], tokens[:, 1:], nxt[:, None]], dim=1).tolist()  # the one sync
        return {slot: self._emit(slot, row, lps.get(slot), k) for slot, row in zip(active, host)}

    def _fast_output(self, slot: int, out: list[int], reason: str | None) -> StepOutput:
        lps = self.slots[slot].extra.pop("fast_logprobs", None)
        return StepOutput(token_ids=out, finish_reason=reason, logprobs=lps[:len(out)] if lps is not None else None)

    def _grammar_masks(self, active: list[int], slot_ids: torch.Tensor, k: int) -> torch.Tensor:
        """int32 bitmask [B * (1 + K), ceil(V / 32)] (host) of the step's positions: each grammar
        slot's next-token mask after the pending token and after each grammar-valid prefix of its
        drafts (the drafts past it are not verified: num_valid_drafts is cut, as vLLM's scheduler
        cuts them); rows of other slots allow everything."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(active) * (k + 1), self.cfg.vocab_size)
        drafts = self.drafts[slot_ids][:, :k].tolist() if k else [[] for _ in active]
        for r, i in enumerate(active):
            s = self.slots[i]
            if s.grammar is not None:
                s.num_valid_drafts = s.grammar.fill_through(drafts[r][:min(s.num_valid_drafts, k)], bitmask,
                                                            r * (k + 1))
        return bitmask

    def _logprobs(self, active: list[int], tokens: torch.Tensor, num_accepted: torch.Tensor,
                  nxt: torch.Tensor, k: int) -> dict[int, list]:
        """{slot: [TokenLogprobs per candidate token]} of the slots that asked: position j's token is
        draft j for j < accepted, then the next token, each scored under the target logits there."""
        want = [(r, i) for r, i in enumerate(active) if self.slots[i].num_logprobs is not None]
        if not want:
            return {}
        rows = torch.tensor([r for r, _ in want], device=self.device)
        cand = torch.cat([tokens[:, 1:], nxt[:, None]], dim=1).scatter(1, num_accepted[:, None], nxt[:, None])
        n = max(self.slots[i].num_logprobs for _, i in want)
        logits = self.last_logits[rows]  # [W, 1+K, V]
        lp, rank, top_lp, top_ids = lpmod.compute(logits.reshape(-1, logits.shape[-1]), cand[rows].reshape(-1), n)
        lp, rank = lp.view(len(want), k + 1).tolist(), rank.view(len(want), k + 1).tolist()
        top_lp, top_ids = top_lp.view(len(want), k + 1, n).tolist(), top_ids.view(len(want), k + 1, n).tolist()
        out = {}
        for w, (_, i) in enumerate(want):
            m = self.slots[i].num_logprobs
            out[i] = lpmod.to_wire(lp[w], rank[w], [t[:m] for t in top_lp[w]], [t[:m] for t in top_ids[w]])
        return out

    def _emit(self, slot: int, row: list[int], logprobs: list | None = None, k: int = 0) -> StepOutput:
        s = self.slots[slot]
        a, drafts, nxt = row[0], row[1:-1], row[-1]
        # the drafts this step drew for this request's next step: as many as it asked for (a batch
        # with a slot asking for more drew more; they stay unused, as they would be alone)
        drawn = min(s.spec_k, k)
        s.num_steps += 1
        s.num_draft_tokens += min(s.num_valid_drafts, k)
        out, reason = emit(s, drafts[:a] + [nxt], self.max_seq_len)
        s.num_accepted_tokens += max(0, len(out) - 1)
        s.num_valid_drafts = drawn
        if s.grammar is not None and not s.grammar.accept(out):
            fastpath.log.warning("slot %d: token ids %s left the grammar; it stops constraining", slot, out)
            s.grammar.is_terminated = True
        if reason is not None:
            s.state = "done"
        return StepOutput(token_ids=out, finish_reason=reason,
                          logprobs=logprobs[:len(out)] if logprobs is not None else None)

    def _fast_ready(self, slot: int) -> bool:
        """Whether the slot decodes on the fast path now; under "auto" a failure to build or capture
        its decoder turns the fast path off for the engine (logged, recorded) and the step goes on."""
        s = self.slots[slot]
        if self._fast is None or s.extra.get("fast_path_reason") is not None:
            return False
        return self._fast_build(slot, s.pending, s.seq_len)

    def _fast_batch_ready(self, active: list[int]) -> bool:
        """Whether these slots decode together on the fast path now (each one can, and the batch fits)."""
        if self._fast is None or not self._fast.batch_ok or len(active) > self._fast.max_batch:
            return False
        if not all(self._fast_ready(i) for i in active):
            return False
        return self._fast_build_batch(fastpath.padded_batch(len(active)))

    def _fast_build_batch(self, size: int) -> bool:
        return self._fast_build(None, 0, 0, batch=size)

    def _fast_build(self, slot: int | None, token: int, pos: int, batch: int = 0) -> bool:
        try:
            if batch:
                self._fast.prepare_batch(batch)
            else:
                self._fast.prepare(slot, token, pos)
        except Exception as e:  # noqa: BLE001 - auto promises a working engine, on promises the fast path
            if self.fast_path_mode == "on":
                raise
            self._fast, self.fast_path_reason = None, f"fast path failed to build: {type(e).__name__}: {e}"
            fastpath.log.warning("decode fast path off, reference step in use: %s", self.fast_path_reason)
            for other in self.slots:
                if other.state in ("active", "ready"):
                    other.extra["fast_path_reason"] = self.fast_path_reason
            return False
        return True
