"""Wire contract: every message that travels over NATS, as msgspec Structs.

Rules (changelog at the bottom):
- Every message is a tagged Struct (``tag_field="type"``) encoded as JSON, so ``nats sub 'xl.>'``
  is readable. Tags are never reused; new fields get defaults, so older readers keep decoding
  (unknown fields are ignored by msgspec).
- ``PROTOCOL_VERSION`` travels in every node's availability and every claim, and is checked at claim
  time with :func:`check_protocol`.
- Trace context does not live here: ``traceparent`` travels in NATS headers (see shared.bus).
- Times are milliseconds since the epoch (``*_ms``) or durations with their unit in the name.
"""

from __future__ import annotations

from typing import Literal

import msgspec

# 1: first version.
#    Later, same version (defaults, so older peers keep decoding): KvReady.kv_checksums,
#    kv_checksum_algo, checksum_ms (opt-in KV integrity, shared.kvchecksum).
#    SamplingParams.logprobs, .structured (StructuredOutput); TokensGenerated.logprobs
#    (TokenLogprobs): logprobs and grammars on the express lane.
#    StructuredOutput kind "structural_tag" (.structural_tag: the tag's JSON text as vLLM hands it
#    to xgrammar): tool_choice required/named under vLLM's strict tool calling.
#    StructuredOutput.reasoning_start_token_id, .reasoning_end_token_id, .reasoning_ended: a grammar
#    after a think-tag reasoning; a node older than these fields constrains from the first token and
#    fails such a request at its start (invalid_grammar), and an older prefill connector drops them:
#    upgrade decode nodes and prefill connectors before routers.
PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A peer speaks a protocol version this build does not."""


def check_protocol(version: int, peer: str) -> None:
    """Raise ProtocolError with what to do when ``version`` is not ours."""
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{peer} speaks expresslane protocol {version}, this build speaks {PROTOCOL_VERSION}: "
            "run the same expresslane version on the router, coordinator, prefill and decode nodes"
        )


class Event(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=False):
    """Base of every wire message."""


# ---------------------------------------------------------------- shared pieces (untagged)


class StructuredOutput(msgspec.Struct, kw_only=True):
    """A grammar that constrains every token the decode node samples, built with xgrammar exactly as
    vLLM's xgrammar backend builds it from the same request (so both lanes allow the same tokens).

    ``kind`` says which one field holds the grammar: ``json`` (``json_schema``: the schema as JSON
    text; also tool_choice required/named, whose schema the router derives as vLLM does),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (``choices``: one of these strings),
    ``grammar`` (EBNF, as vLLM passes it to xgrammar), ``structural_tag`` (``structural_tag``: the
    tag's JSON text exactly as vLLM hands it to xgrammar, legacy ``structures``/``triggers`` form or
    the ``format`` form; vLLM's tool parsers build one for tool_choice required/named under
    ``VLLM_ENFORCE_STRICT_TOOL_CALLING``, its default). ``any_whitespace`` is vLLM's
    ``not disable_any_whitespace``. The matcher first accepts ``SamplingParams.output_token_ids``
    then ``DecodeStart.first_token_id`` (the prefill sampled it under the same grammar).

    With a think-tag reasoning parser (vLLM's ``--reasoning-parser`` deepseek_r1, ernie45, deepseek_v3:
    ``reasoning_end_token_id`` >= 0) the grammar constrains the answer after the reasoning, as vLLM's
    structured-output manager does: tokens up to and including the first end token are neither masked
    nor fed to the grammar, unless the prompt ended the reasoning already (``reasoning_ended``: vLLM's
    ``is_reasoning_end`` of the prompt, ``prompt_ends_reasoning``). None: not known yet; whoever holds
    the prompt's token ids (the prefill connector, or the router from the first token's event) sets it
    before the decode starts (``with_prompt``).
    """

    kind: Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
    json_schema: str = ""
    regex: str = ""
    choices: list[str] = []
    grammar: str = ""
    structural_tag: str = ""
    any_whitespace: bool = True
    reasoning_start_token_id: int = -1
    reasoning_end_token_id: int = -1  # -1: no reasoning gate, the grammar constrains from the first token
    reasoning_ended: bool | None = None

    @property
    def gated(self) -> bool:
        """Whether tokens before the reasoning's end go unconstrained (a gate, still closed at the prompt)."""
        return self.reasoning_end_token_id >= 0 and not self.reasoning_ended

    def with_prompt(self, prompt_token_ids: list[int]) -> StructuredOutput:
        """This grammar with ``reasoning_ended`` decided from the prompt where a gate has it unknown."""
        if self.reasoning_end_token_id < 0 or self.reasoning_ended is not None or not prompt_token_ids:
            return self  # (no ids: left unknown, for a holder of them)
        ended = prompt_ends_reasoning(prompt_token_ids, self.reasoning_start_token_id, self.reasoning_end_token_id)
        return msgspec.structs.replace(self, reasoning_ended=ended)


def prompt_ends_reasoning(token_ids: list[int], start_id: int, end_id: int) -> bool:
    """vLLM's think-tag ``is_reasoning_end`` (BaseThinkingReasoningParser): the last start or end token
    among ``token_ids`` is an end token."""
    for t in reversed(token_ids):
        if t == start_id:
            return False
        if t == end_id:
            return True
    return False


class SamplingParams(msgspec.Struct, kw_only=True):
    """What the decode engine needs to sample, with vLLM's meaning and order (every default is off).

    ``max_tokens`` and ``min_tokens`` count tokens still to generate on this node (the first token,
    sampled by the prefill, and tokens of earlier legs are not counted). Temperature below 1e-5 is
    greedy (the argmax of the processed logits). Penalties follow vLLM: ``repetition_penalty`` over
    the prompt's and the output's tokens, ``presence_penalty``/``frequency_penalty`` over the
    output's; the output is ``output_token_ids`` (earlier legs), then the first token, then this
    node's tokens. ``prompt_token_ids`` is needed for ``repetition_penalty`` != 1 when the node did
    not prefill the prompt itself. ``bad_words_token_ids``: token-id sequences (vLLM's tokenized
    ``bad_words``); ``min_tokens`` suppresses ``stop_token_ids`` and the model's EOS ids.
    ``seed`` keys the counter-based random numbers (None: a random seed per request).
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = []
    min_tokens: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None  # None: the node's default; 0: off
    prompt_token_ids: list[int] | None = None  # the request's prompt (for repetition_penalty)
    output_token_ids: list[int] = []  # completion tokens before this leg's first token (migration)
    # Log-probabilities (vLLM's ``logprobs``): None off; n >= 0: each generated token's logprob and
    # rank, plus the n most likely tokens, of the model's raw distribution (vLLM's default
    # ``logprobs_mode=raw_logprobs``: before penalties, temperature and masks), in float32.
    logprobs: int | None = None
    structured: StructuredOutput | None = None


class KvSegment(msgspec.Struct, kw_only=True):
    """One region of a slot's receive buffer: token t of this region starts at
    ``slot base + offset_bytes + t * token_stride_bytes`` and is ``bytes_per_token`` long."""

    layer: int
    name: str  # "k", "v" (GQA) or "kv_latent" (MLA: normalized latent, then roped k_pe)
    offset_bytes: int
    token_stride_bytes: int
    bytes_per_token: int


class KvLayoutSpec(msgspec.Struct, kw_only=True):
    """The decode engine's native KV layout of one slot (see shared.kvlayout)."""

    layout_version: int
    kind: Literal["gqa", "mla"]
    dtype: str  # torch dtype name without the prefix: "float32", "bfloat16"
    num_layers: int  # attention layers with a cache, MTP layers included
    max_tokens: int
    slot_nbytes: int
    segments: list[KvSegment]
    # Tensor parallelism (shared.kvlayout): the slot belongs to rank ``tp_rank`` of ``tp_size``
    # ranks. GQA: each token of a "k"/"v" segment holds KV heads [kv_head_start, kv_head_start +
    # kv_heads) of the model's ``kv_heads_total`` (0: all of them, an older peer). MLA: every rank
    # holds the whole latent (the head fields stay 0).
    tp_size: int = 1
    tp_rank: int = 0
    kv_head_start: int = 0
    kv_heads: int = 0
    kv_heads_total: int = 0


class SlotTarget(msgspec.Struct, kw_only=True):
    """Where a sender writes one slot's KV."""

    slot: int
    base_addr: int
    nbytes: int


class RankTarget(msgspec.Struct, kw_only=True):
    """One further rank of a tensor-parallel decode node: where its share of a slot's KV goes."""

    tp_rank: int
    endpoint: str
    slot: SlotTarget
    layout: KvLayoutSpec
    nixl_metadata_b64: str = ""


class TransferTarget(msgspec.Struct, kw_only=True):
    """Everything a prefill sender needs to write one leased slot one-sidedly."""

    node_id: str
    transport: Literal["mooncake", "nixl"]
    endpoint: str  # mooncake: session id "host:rpc_port"; nixl: agent name
    slot: SlotTarget
    layout: KvLayoutSpec
    nixl_metadata_b64: str = ""  # nixl: the receiving agent's metadata
    # A tensor-parallel node's ranks 1..tp_size-1 (the fields above are rank 0's): a sender writes
    # each rank the KV its layout holds (shared.kvlayout.tp_write_ops). Empty: one rank.
    ranks: list[RankTarget] = []

    def rank_targets(self) -> list[RankTarget]:
        """Every rank's target, rank 0 first."""
        first = RankTarget(tp_rank=0, endpoint=self.endpoint, slot=self.slot, layout=self.layout,
                           nixl_metadata_b64=self.nixl_metadata_b64)
        return [first, *self.ranks]


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int


class SpecStats(msgspec.Struct, kw_only=True):
    """Speculative-decoding counters of one request."""

    num_steps: int = 0  # verify steps run
    num_draft_tokens: int = 0  # draft tokens proposed
    num_accepted_tokens: int = 0  # draft tokens accepted


# ---------------------------------------------------------------- coordinator: claims


class ClaimRequest(Event, tag="claim"):
    request_id: str
    model: str  # the served name
    num_prompt_tokens: int
    max_tokens: int
    protocol_version: int = PROTOCOL_VERSION
    transports: list[str] = msgspec.field(default_factory=lambda: ["mooncake", "nixl"])
    wait_ms: int = 2000  # how long the claim may wait in the queue for a free slot
    tenant: str = ""
    # The model's other names (checkpoint path, its directory); matched with shared.models.serves.
    model_aliases: list[str] = []
    # The prefill vLLM's --kv-cache-dtype (auto, fp8, fp8_e4m3, fp8_e5m2, ...): only a node whose slots
    # keep KV in that dtype is paired (shared.kvlayout.kv_cache_dtype_flag); "": not known, any node.
    kv_cache_dtype: str = ""
    # Nodes where an earlier leg of this request failed (a migration's claim): never granted there,
    # even while the coordinator still counts them live (a killed node is live until its heartbeats
    # are missed, and the failed leg's slot is free again once the router cancels it).
    exclude_nodes: list[str] = []


class ClaimGranted(Event, tag="claim_granted"):
    request_id: str
    lease_id: str
    generation: int
    node_id: str
    expires_at_ms: int
    target: TransferTarget


class ClaimRejected(Event, tag="claim_rejected"):
    request_id: str
    reason: str
    retry_after_ms: int = 0


ClaimReply = ClaimGranted | ClaimRejected


# ---------------------------------------------------------------- decode node: availability


class RankEndpoints(msgspec.Struct, kw_only=True):
    """What one further rank of a tensor-parallel decode node registered: its receive buffers."""

    tp_rank: int
    endpoints: dict[str, str]
    slots: list[SlotTarget]
    layout: KvLayoutSpec
    nixl_metadata_b64: str = ""


class NodeAvailable(Event, tag="node_available"):
    node_id: str
    model: str
    protocol_version: int
    total_slots: int
    free_slots: list[int]
    transports: list[str]
    endpoints: dict[str, str]  # transport -> endpoint (see TransferTarget.endpoint)
    slots: list[SlotTarget]
    layout: KvLayoutSpec
    heartbeat_interval_ms: int
    seq: int
    sent_at_ms: int
    nixl_metadata_b64: str = ""
    # Tokens a request may hold (prompt + output); the layout keeps room for drafts beyond it.
    # 0 from older nodes: the layout's max_tokens.
    max_seq_len: int = 0
    # A tensor-parallel node's ranks 1..N-1 (the fields above are rank 0's); empty: one rank.
    ranks: list[RankEndpoints] = []
    # The slot release that made the node beat now (at most one; empty in periodic beats): the
    # coordinator may free a decoding lease's slot on it at once; the same SlotReleased still
    # follows through the report stream, which stays the record (docs/design/slot-release.md).
    released: list["SlotReleased"] = []

    @property
    def capacity_tokens(self) -> int:
        """Prompt + output tokens one slot of this node can hold."""
        return self.max_seq_len or self.layout.max_tokens


class NodeDraining(Event, tag="node_draining"):
    node_id: str
    sent_at_ms: int


NodeMessage = NodeAvailable | NodeDraining


# ---------------------------------------------------------------- prefill -> decode: KV ready


class KvReady(Event, tag="kv_ready"):
    request_id: str
    lease_id: str
    generation: int
    node_id: str
    slot: int
    num_tokens: int  # tokens of state written (the prompt)
    layout_version: int
    nbytes: int
    extract_ms: float = 0.0
    transfer_ms: float = 0.0
    # Opt-in integrity (shared.kvchecksum): one sum per written segment, in segment order, of the
    # bytes written; empty: unchecked (older prefills, or the option off).
    kv_checksums: list[int] = []
    kv_checksum_algo: str = ""
    checksum_ms: float = 0.0
    # A tensor-parallel prefill's ranks each write their share and announce it: this is rank
    # ``source_rank`` of ``source_ranks``; the node injects once every source rank announced.
    source_rank: int = 0
    source_ranks: int = 1


class KvFailed(Event, tag="kv_failed"):
    request_id: str
    lease_id: str
    generation: int
    node_id: str
    slot: int
    reason: str


KvMessage = KvReady | KvFailed


# ---------------------------------------------------------------- router -> decode: start


class DecodeStart(Event, tag="decode_start"):
    request_id: str
    lease_id: str
    generation: int
    slot: int
    first_token_id: int
    num_prompt_tokens: int
    sampling: SamplingParams
    # Tokens already streamed to the client beyond the first (migration); 0 for a fresh request.
    num_tokens_already_sent: int = 0
    # How many times the request moved to another node before this leg (0: its first leg).
    migration: int = 0


# ---------------------------------------------------------------- decode -> router: tokens


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One generated token's log-probability, its rank (1: the most likely) and the ``n`` most
    likely tokens with theirs, most likely first (``SamplingParams.logprobs``). JSON has no -inf: a
    token a grammar forbids travels with -9999.0 (what vLLM's OpenAI server renders for it). ``rank``
    as vLLM counts it: the tokens with a logprob >= this one's (ties included)."""

    logprob: float
    rank: int
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class TokensGenerated(Event, tag="tokens"):
    request_id: str
    index: int  # position of token_ids[0] among the completion's tokens (the first token is 0)
    token_ids: list[int]
    # Parallel to token_ids when the request asked for logprobs, else empty.
    logprobs: list[TokenLogprobs] = []


class PrefillToken(Event, tag="prefill_token"):
    """The prefill's first token, from inside vLLM the moment its scheduler has it (before vLLM's
    own response carries it): the router streams it to the client at once. Published only for legs
    whose hand-off asked for it (``Handoff.start``); ``finish_reason`` "stop" when vLLM stopped on
    the token (EOS or a stop id), "length" when the leg's ``max_tokens=1`` ended it.
    ``prompt_token_ids``: the prompt as vLLM tokenized it."""

    request_id: str
    token_id: int
    finish_reason: Literal["stop", "length"]
    prompt_token_ids: list[int] = []


class RequestFinished(Event, tag="finished"):
    request_id: str
    finish_reason: Literal["stop", "length", "cancelled"]
    usage: Usage
    spec: SpecStats = msgspec.field(default_factory=SpecStats)
    decode_ms: float = 0.0


class RequestFailed(Event, tag="failed"):
    request_id: str
    reason: str
    retryable: bool = True


TokenMessage = TokensGenerated | RequestFinished | RequestFailed | PrefillToken


class CancelRequest(Event, tag="cancel"):
    request_id: str
    reason: str = "client_disconnected"
    # The sender never asked a prefill to write this request's KV (it gave up while claiming):
    # a lease granted meanwhile has no writer to fence against and frees its slot at once.
    is_before_prefill: bool = False


# ---------------------------------------------------------------- decode -> coordinator


class DecodeStarted(Event, tag="decode_started"):
    request_id: str
    lease_id: str
    generation: int
    node_id: str
    slot: int


class SlotReleased(Event, tag="slot_released"):
    request_id: str
    lease_id: str
    generation: int
    node_id: str
    slot: int
    outcome: Literal["completed", "failed", "cancelled"]
    reason: str = ""


ReportMessage = DecodeStarted | SlotReleased


# ---------------------------------------------------------------- coordinator: lifecycle

HandoffState = Literal[
    "queued", "claimed", "kv_ready", "decoding", "completed", "failed", "cancelled", "rejected"
]
TERMINAL_STATES = frozenset({"completed", "failed", "cancelled", "rejected"})


class HandoffEvent(Event, tag="handoff"):
    request_id: str
    state: HandoffState
    at_ms: int
    lease_id: str = ""
    generation: int = 0
    node_id: str = ""
    slot: int = -1
    reason: str = ""


# ---------------------------------------------------------------- decoding

AnyEvent = (
    ClaimRequest
    | ClaimGranted
    | ClaimRejected
    | NodeAvailable
    | NodeDraining
    | KvReady
    | KvFailed
    | DecodeStart
    | PrefillToken
    | TokensGenerated
    | RequestFinished
    | RequestFailed
    | CancelRequest
    | DecodeStarted
    | SlotReleased
    | HandoffEvent
)

_encoder = msgspec.json.Encoder()
_any_decoder = msgspec.json.Decoder(AnyEvent)


def encode(event: Event) -> bytes:
    """Encode one wire message as JSON bytes."""
    return _encoder.encode(event)


def decode_any(data: bytes) -> Event:
    """Decode any wire message; raises msgspec.ValidationError / DecodeError on bad input."""
    return _any_decoder.decode(data)


def decoder(kind: type) -> msgspec.json.Decoder:
    """A decoder for one message type or union (build once, reuse)."""
    return msgspec.json.Decoder(kind)
