"""The engine's side of the fast CUDA decode path (services/decode/engine/cuda): when it applies,
one batch-1 decoder + CUDA graph per slot, and (Llama family) batched decoders that step several
slots in one graph replay.

Contract:
- ``engine_reason(mode, model, device, dtype, num_speculative_tokens)``: why this engine cannot run
  the fast path (``None``: it can). The fast path runs decode steps of bfloat16 models on CUDA: Llama-family models (Llama, Mistral, Qwen2/2.5 with qkv bias, Qwen3 with q/k norm; any rope
  scaling the engine reads, tied embeddings; head_dim a power of two), one token per step, with a
  bf16 or FP8 (fp8_e4m3 / fp8_e5m2, vLLM's bytes and scales) KV cache, one slot or a batch of slots a
  step; and
  DeepSeek-V3-family models (with or without q LoRA; noaux_tc routing, group-limited or in one group;
  normalised top-k weights), with MTP drafts (k drafts + one verify per step, greedy acceptance or
  speculative sampling on device) when the engine has them. On CPU only when asked for with ``mode="on"`` while Triton's interpreter is active (tests).
  A tensor-parallel Llama-family model (``model.tp.size`` > 1) runs its batch-1 step sharded, with the
  collectives in the graph (cuda/llama.py); several slots together, and the DeepSeek family, take the
  reference step under tensor parallelism.
- ``request_reason(greedy, num_spec, spec_ok, sample_ok, sample_limit)``: why a request cannot
  (``None``: it can). Both families also sample on the fast path (``sample_ok``): every sampling
  parameter and logits processor, by the kernels of cuda/sampling.py after the lm_head GEMV, inside
  a second graph per slot (key ``SAMPLED``) that reads the request's parameters from the engine's
  ``SamplingBuffers`` (so a new request needs no re-capture); plain greedy requests (no logits
  processor) keep the argmax graph. A DeepSeek-family request that samples with MTP drafts takes a
  third graph per slot, k sampled drafts + verify (key ``(SPEC_SAMPLED, k)``, captured with the others
  on a GPU; MlaDecoder.spec_step(k, sample=True)): speculative sampling with the reference
  step's distributions and random numbers, whose output keeps the target distribution. Logprobs and
  grammar masks take the reference step on that family.
- ``FastPath.step(slot, slot_state, max_seq_len, prev_hidden)``: one engine step of a lone active
  slot (``prev_hidden``: the prefill's last final-normed hidden, the first MTP draft's input).
- ``FastPath.step_batch([(slot, slot_state), ...], max_seq_len)`` (``batch_ok``: one GPU, and on the
  DeepSeek family dense attention): one engine step of 2..``max_batch`` (8) active slots in one batched
  decoder (cuda/batch.py; cuda/mla_decoder.py's MlaBatchDecoder). A DeepSeek-family batch in which a
  slot drafts takes MlaBatchSpecDecoder instead (``spec_batch_ok``): each slot's drafts (as many as it
  asks for, at most ``batch_spec_k``: the rows, slots x (k + 1), fit 16) verified and its next ones drawn in
  one replay, the MTP layer's rows of every verified token written, one graph per (padded size, k), the
  engine's k captured with the plain graphs; each slot's MTP input is its last hidden wherever its last step
  ran (``_mtp_input``). A batch with a sampled slot drafts by speculative sampling (its own graph per size and
  k, MlaBatchSpecDecoder.step(sample=True)), unless a slot's processors read its output (penalties, bad words)
  or it has a grammar or logprobs: then plain steps (a slot drafts again once alone or in a batch that can,
  from its last batched step's hidden). Each plain replay
  decodes one token of every slot, the weights read once for all, each slot attending to its own cache
  at its own length and sampling with its own parameters (greedy and sampled slots mix: any sampled
  slot takes the batch's sampling graph, where greedy rows take the argmax). One graph (greedy,
  sampled) per padded size 2, 4, 8, captured by ``prepare_batch(size)`` (the engine does it at load);
  the rows' tokens, positions and slots are written to device tensors before each step, so a slot
  joining or leaving changes no graph. ``tokens_per_step`` tokens per step as alone (fewer when a
  slot's max_tokens or max_seq_len leaves less room), one host sync; results cut per slot by slots.emit.
- A DeepSeek-family request that may draft (``num_spec`` > 0) takes plain-step graphs that also write the
  MTP layer's cache row of the pair each step leaves (keys ``PLAIN_ROW`` / ``SAMPLED_ROW``; ``MTP_ROWS``,
  MlaDecoder.mtp_row), alone or in a plain batched step (MlaBatchDecoder.step(mtp_row=True), every row's), so
  adaptive drafting's steps between probes leave no holes for the next drafts.
- ``FastPath.prepare(slot, token, pos)`` builds a slot's decoder and graphs (the engine calls it first,
  so that under ``auto`` a build or capture failure turns the fast path off instead of failing the
  request); ``FastPath.decode(slot, token, pos, n)``: ``n`` greedy tokens after ``token`` at position ``pos``
  (their K/V land in the slot's cache at ``pos .. pos + n - 1``): ``n`` graph replays, then one host
  copy of the ``n`` tokens. The decoder keeps its device state between calls while the caller's
  ``(token, pos)`` continue where it stopped; anything else (a reference step in between, a new
  request) re-arms it from ``(token, pos)`` (and brings the slot's bad-word state to the output so
  far). The first call for a slot builds its decoder over the
  engine's weights and the slot's cache views (no copies) and captures its graph with one warm-up
  step at ``pos``: the engine does it for every slot at load with ``pos`` 0 of the still empty
  slot (later, ``pos`` is the position the first real step writes anyway). A speculative step
  (DeepSeek family, ``spec(slot, token, pos, k, prev_hidden)``) replays one graph of k drafts + verify
  and returns the 1..k+1 tokens it kept; its drafts' cache rows may reach ``pos + k`` (the slot
  layout keeps room for them past max_seq_len).
- Run-ahead (``run_ahead``, on by default with one token per step): a step that leaves its request
  room for more replays the same graph once more before the host reads its token (the token is copied
  to pinned memory and waited for by an event recorded before the extra replay), so the GPU computes
  the next token while the host emits this one, publishes it and comes back. The next engine step
  that continues exactly there (same slot or same batch of slots, same graph, same token and position)
  finds its first replay done; any other step discards it (its cache row is recomputed by whatever
  runs next, stream-ordered; the token it added to the penalty counts is taken out again, the
  bad words' ring resynced at the re-arm). Never with a grammar or logprobs. ``forget(slot)`` (the
  engine's release and start) waits for a step still in flight on the slot, so the slot's memory is
  quiet before a new request's KV is written into it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .slots import SlotState, emit

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
MAX_LOGPROBS = 20  # cuda/sampling_state.MAX_LOGPROBS (torch-only import kept out of this module's top)
MAX_BATCH = 8  # slots of one batched step (cuda/batch.py, cuda/mla_decoder.py's MlaBatchDecoder)
MAX_SPEC_ROWS = 16  # rows of a batched step with drafts, slots x (drafts + 1) (cuda/moe.py's MAX_ROWS)
BATCH_SIZES = (2, 4, 8)  # its padded sizes: plain-step graphs (greedy, sampled; DeepSeek family with drafts: also
# keeping the MTP rows) and, with drafts, the drafting step's (greedy, speculative sampling) each


@dataclass
class _Flight:
    """A replay launched ahead of the host (run-ahead): where it continues and where its token lands."""

    owner: object  # the slot whose batch-1 decoder replayed it, or "batch"
    key: object  # batch-1: the slot's runner key; batched: (padded size, runner key)
    idx: int  # out_tokens index (batched: column) of its token
    done: object  # CUDA event recorded after the replay; None off CUDA (it ran already)
    slots: tuple  # the slots it decodes (batched: the rows', in order)
    expect: tuple = ()  # batched: the (token, position) each row continues from
    counted: tuple = ()  # (slot, its token on device) of rows whose penalty counts took the token

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


def _may_run_ahead(s: SlotState) -> bool:
    """A request whose step may run ahead: no grammar (each mask needs the token before it), no
    logprobs (read with the token). What a discarded step leaves in the sampling state is undone:
    the penalty counts by ``_discard``, the bad words' ring by ``sync_history`` at the next re-arm."""
    return s.grammar is None and s.num_logprobs is None


def _counted(s: SlotState) -> bool:
    """Whether the slot's sampled steps add their token to its penalty counts."""
    if s.is_greedy or s.sampling is None:
        return False
    from .cuda.sampling_state import TRACK_COUNTS

    return bool(s.sampling.flags & TRACK_COUNTS)


def _may_draft(s: SlotState) -> bool:
    """Whether a sampled slot can take speculative sampling's batched step: no processor that reads its own output
    (penalties, bad words: such a request never drafts, and its sampled steps keep their state)."""
    from .cuda.sampling_state import READS_OUTPUT

    return s.sampling is not None and not s.sampling.flags & READS_OUTPUT


def padded_batch(n: int) -> int:
    """The batched graph's size serving n active slots."""
    for b in BATCH_SIZES:
        if n <= b:
            return b
    raise ValueError(f"{n} slots: a batched step takes at most {MAX_BATCH}")


def batch_spec_k(size: int, k: int) -> int:
    """Drafts a slot of a batch of padded ``size`` verifies when k are asked for: the batch's rows (size x (k + 1))
    fit the row-batched kernels' most (cuda/moe.py's MAX_ROWS, 16), or none (a plain batched step)."""
    return max(0, min(k, MAX_SPEC_ROWS // size - 1))


def batch_sizes(num_slots: int) -> list[int]:
    """The padded sizes an engine of num_slots slots can need."""
    return sorted({padded_batch(n) for n in range(2, min(num_slots, MAX_BATCH) + 1)})
SAMPLED = "sampled"  # the runner key of a slot's sampling graph (one token a step)
SPEC_SAMPLED = "spec_sampled"  # ... of a DeepSeek-family slot's k sampled drafts + verify: (SPEC_SAMPLED, k)
# ... of a DeepSeek-family slot's plain step (greedy, sampled) that also writes the MTP layer's cache row
PLAIN_ROW, SAMPLED_ROW = "plain_mtp_row", "sampled_mtp_row"
EXTRAS = "extras"  # ... and of its graphs that also apply a grammar mask and/or compute logprobs:


def extras_key(mask: bool, logprobs: bool) -> tuple:
    """The runner key of a slot's sampling graph with a grammar mask and/or logprobs."""
    return (EXTRAS, mask, logprobs)


def _interpreting() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (tests); False without Triton."""
    try:
        from .cuda.gemv import interpreting
    except ImportError:
        return False
    return interpreting()


def engine_reason(mode: str, model, device: torch.device, dtype: torch.dtype, num_speculative_tokens: int) -> str | None:
    """Why the engine cannot decode on the fast path; None when it can (mode "off" always has a reason)."""
    if mode not in MODES:
        raise ValueError(f"fast_path must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return "fast_path='off'"
    cfg = model.cfg
    family = getattr(model, "family", "")
    tp = getattr(model, "tp", None)
    if tp is not None and tp.size > 1:  # the Llama family's batch-1 step runs sharded (cuda/llama.py)
        if family != "gqa":
            return (f"tensor-parallel decode (tp={tp.size}) of {cfg.model_type} runs the reference step; the "
                    "DeepSeek-family fast path is single-GPU")
        if model.plan.vocab_rows * tp.size != cfg.vocab_size:
            return (f"tensor-parallel decode: vocabulary {cfg.vocab_size} does not split evenly over {tp.size} "
                    "ranks; the fast path's argmax needs equal shards (the reference step pads them)")
    cache = getattr(model, "cache", None)
    if getattr(cache, "kv_format", None) and family not in ("gqa", "mla"):
        return f"KV cache in {cache.kv_format}: FP8 KV is on the fast path for Llama- and DeepSeek-family models"
    if family == "mla":
        if cfg.index_topk and not cfg.q_lora_rank:
            return f"{cfg.model_type}: sparse attention (DSA) without q LoRA is not on the fast path"
        if not cfg.norm_topk_prob:
            return f"{cfg.model_type}: unnormalised top-k weights (norm_topk_prob=false) are not on the fast path"
    elif family == "gqa":
        if num_speculative_tokens:
            return "speculative decoding: the Llama-family fast path decodes one token per step"
        if cfg.head_dim & (cfg.head_dim - 1) or cfg.head_dim < 16:
            return (f"{cfg.model_type}: head_dim {cfg.head_dim} is not on the fast path "
                    "(its kernels need a power of two >= 16)")
    else:
        return f"{cfg.model_type}: the engine drives the fast path for Llama- and DeepSeek-V3-family models only"
    q = getattr(cfg, "quant", None)
    if q is not None:
        channel = family == "gqa" and q.method == "compressed-tensors" and q.strategy in ("channel", "tensor")
        block = q.strategy == "block" and all(b >= 16 and b & (b - 1) == 0 for b in q.block)
        if not (channel or block):
            return (f"{q.method} FP8 weights ({q.strategy} scales{'' if q.block is None else ' %dx%d' % q.block}): "
                    "the fast path reads FP8 as block scales of powers of two >= 16 (DeepSeek-V3's and Qwen's 128x128), and "
                    "as compressed-tensors per-channel or per-tensor scales on Llama-family models")
        if block and family == "gqa" and (cfg.qkv_bias or cfg.o_bias):
            return "block-scaled FP8 with q/k/v or o biases is not on the fast path (the bias is added before rounding)"
        if family == "mla" and getattr(getattr(model, "lm_head", None), "dtype", None) == torch.float8_e4m3fn:
            return "an FP8 lm_head is not on the fast path: keep lm_head in the checkpoint's ignore list"
    if dtype != torch.bfloat16:
        return f"dtype {str(dtype).removeprefix('torch.')}: the fast path runs bfloat16 only"
    if device.type != "cuda" and not (device.type == "cpu" and mode == "on" and _interpreting()):
        return (f"device {device.type}: the fast path's Triton kernels need CUDA "
                "(on CPU only with fast_path='on' under TRITON_INTERPRET, for tests)")
    if (getattr(cache, "kv_format", None) == "fp8_e4m3" and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < (8, 9)):
        cc = "sm_%d%d" % torch.cuda.get_device_capability(device)
        return (f"KV cache in fp8_e4m3 on {cc}: the fast path's attention widens E4M3 with sm_89+ instructions "
                "(Ada, Hopper and later); fp8_e5m2 or a bf16 KV cache stay on the fast path here")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def request_reason(greedy: bool, num_spec: int, spec_ok: bool = False, sample_ok: bool = False,
                   sample_limit: str | None = None, *, logprobs: int | None = None, grammar: bool = False,
                   extras_ok: bool = False) -> str | None:
    """Why a request decodes on the reference path; None when the fast path can serve it.

    ``greedy``: greedy without logits processors (the argmax of the raw logits); ``sample_ok``: the
    engine's fast path samples (both families, with MTP drafts too); ``sample_limit``: why the request's
    parameters do not fit the fast path's sampling buffers (bad words beyond its capacity), if they do not;
    ``logprobs`` (SamplingParams.logprobs: None off) / ``grammar``: the request asks for logprobs
    / a grammar, which the fast path serves where ``extras_ok`` (the top MAX_LOGPROBS at most)."""
    if (logprobs is not None or grammar) and not extras_ok:
        what = " and ".join(w for w, on in (("logprobs", logprobs is not None), ("a grammar", grammar)) if on)
        return f"{what}: this engine's fast path does not compute logprobs or apply grammar masks"
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        return f"logprobs={logprobs}: the fast path computes the top {MAX_LOGPROBS}"
    if not greedy and not sample_ok:
        return ("sampling or logits processors: this engine's fast path decodes plain greedy requests only "
                "(temperature 0, no penalties, bias or bad words)")
    if not greedy and sample_limit:
        return f"sampling parameters beyond the fast path's buffers: {sample_limit}"
    if num_spec and not spec_ok:
        return "speculative decoding requested: the Llama-family fast path decodes one token per step"
    return None


def _captured_or_eager(runner, fn, what: str, rearm):
    """``runner`` with its graph captured, or (capture failed: logged) ``fn`` run eagerly, after ``rearm``
    restores the state the failed warm-up advanced; the step goes on either way."""
    try:
        runner.capture()
        return runner
    except Exception as e:  # noqa: BLE001 - slower, not wrong
        from .cuda.graph import GraphedFn

        log.warning("CUDA graph capture of the %s failed, running it eagerly: %s: %s", what, type(e).__name__, e)
        rearm()
        return GraphedFn(fn, False)


class FastPath:
    """Per-slot fast decoders over one engine model, built on first use and kept for the slot."""

    # a DeepSeek-family request that drafts writes the MTP layer's cache row on its plain steps too (adaptive
    # drafting's steps between probes: MlaDecoder.mtp_row), so its next drafts attend over no holes
    MTP_ROWS: bool = True

    def __init__(self, model, device: torch.device, options=None, tokens_per_step: int = 1, max_steps: int = 256,
                 num_speculative_tokens: int = 0, draft_vocab: int | None = None, sampling=None,
                 run_ahead: bool = True):
        if tokens_per_step < 1:
            raise ValueError(f"fast_path_tokens_per_step must be >= 1, got {tokens_per_step}")
        self.model, self.device, self.options = model, device, options
        self.mla = getattr(model, "family", "") == "mla"
        self.num_spec = num_speculative_tokens if self.mla else 0
        self.spec_ok = self.mla  # the DeepSeek-family step drafts with the MTP layer
        self.sampling = sampling  # the engine's SamplingBuffers: the sampled graph reads slot rows of it
        self.sample_ok = sampling is not None
        # logprobs and grammar masks on the batch-1 Llama-family path (a third graph per slot, captured
        # on a slot's first such request); a batched step holding such a slot takes the reference step
        self.extras_ok = self.sample_ok and not self.mla
        self._host_masks: dict[int, torch.Tensor] = {}  # slot -> its grammar bitmask on the host (pinned)
        self._batch_lp: dict[int, tuple] = {}  # padded size -> (lp_val, lp_ids, pad) of its rows' logprobs
        self.draft_vocab = draft_vocab
        self.tokens_per_step = tokens_per_step
        self.max_steps = max(max_steps, tokens_per_step, 4 * (self.num_spec + 1))  # out_tokens rows; re-armed when full
        self.decoders: dict[int, tuple] = {}  # slot -> (decoder, {drafts k: GraphedFn})
        self.held: dict[int, tuple[int, int, int]] = {}  # slot -> (token, pos, out index) on device
        # several slots in one step (step_batch), on one GPU: the Llama family (bf16 or FP8 weights, bf16 or FP8 KV
        # cache), the DeepSeek family with dense attention (batches draft: spec_batch_ok)
        sparse = bool(getattr(getattr(model, "cfg", None), "index_topk", 0)) if self.mla else False
        self.batch_ok = not sparse and getattr(getattr(model, "tp", None), "size", 1) == 1
        # batch graphs built when the engine loads; a DeepSeek-family batch under Triton's interpreter (tests)
        # at its first use instead (an interpreted warm-up step per graph would slow every load)
        self.batch_at_load = self.batch_ok and (not self.mla or device.type == "cuda")
        self.max_batch = MAX_BATCH if self.batch_ok else 1  # more active slots take the reference step together
        self.batches: dict[int, tuple] = {}  # padded size -> (batch decoder, {graph key: GraphedFn})
        self.synced: dict[int, tuple[int, int]] = {}  # slot -> (token, pos) its bad-word state follows
        # DeepSeek family with drafts: each batched slot's last final-normed hidden (the MTP layer's input one
        # position back) and the position it precedes, so that a slot decoding alone again drafts from it
        self._batch_hidden: torch.Tensor | None = None  # [rows, hidden], a row per slot
        self._batch_hidden_pos: dict[int, int] = {}
        # ... and batches with drafts: each slot's k drafts + verify in one step (MlaBatchSpecDecoder)
        self.spec_batch_ok = self.batch_ok and self.num_spec > 0 and bool(getattr(model, "has_mtp", False))
        # (padded size, k) -> (decoder, {0: greedy GraphedFn, SAMPLED: speculative sampling's})
        self.spec_batches: dict[tuple[int, int], tuple] = {}
        # one replay launched ahead of the host (module docstring): the Llama family, one token a step
        self.run_ahead = run_ahead and not self.mla and tokens_per_step == 1
        self._flight: _Flight | None = None  # at most one engine step ahead
        self._pinned: dict[tuple, torch.Tensor] = {}  # out_tokens shape -> pinned host buffer
        self.ahead_kept = 0  # replays launched ahead that the next step continued
        self.ahead_dropped = 0  # ... and that it discarded (another continuation, a release)

    def _runner(self, dec, runners: dict, k: int, token: int, pos: int, prev_hidden=None):
        if k not in runners:
            from .cuda.graph import GraphedFn

            if k == SAMPLED:
                fn = (lambda: dec.plain_step(sample=True)) if self.mla else (lambda: dec.step(sample=True))
            elif k in (PLAIN_ROW, SAMPLED_ROW):
                fn = lambda sample=k == SAMPLED_ROW: dec.plain_step(sample=sample, mtp_row=True)  # noqa: E731
            elif isinstance(k, tuple) and k[0] == SPEC_SAMPLED:
                fn = lambda drafts=k[1]: dec.spec_step(drafts, sample=True)  # noqa: E731
            elif isinstance(k, tuple) and k[0] == EXTRAS:
                def fn(mask=k[1], logprobs=k[2]):
                    dec.sampler.mask_on, dec.sampler.logprobs_on = mask, logprobs  # what the capture records
                    try:
                        dec.step(sample=True)
                    finally:
                        dec.sampler.mask_on = dec.sampler.logprobs_on = False
            else:
                fn = dec.step if not self.mla else (dec.plain_step if k == 0 else (lambda: dec.spec_step(k)))
            runner = GraphedFn(fn, self.device.type == "cuda", warmup_calls=1, device=self.device,
                               before_capture=lambda: self._arm(dec, token, pos, prev_hidden))
            if isinstance(k, tuple):  # captured mid-request: a failure must not fail the request
                runner = _captured_or_eager(runner, fn, f"slot {k[0]} graph {k[1:]}",
                                            lambda: self._arm(dec, token, pos, prev_hidden))
            else:
                runner.capture()
            runners[k] = runner
        return runners[k]

    def _mtp_rows(self, dec) -> bool:
        """Whether this slot's plain steps write the MTP layer's cache row (``MTP_ROWS``; a DeepSeek-family engine
        that drafts, a dense-attention MTP layer)."""
        return self.MTP_ROWS and self.mla and self.num_spec > 0 and dec.mtp_rows_ok

    def _arm(self, dec, token: int, pos: int, prev_hidden=None) -> None:
        if self.mla:
            dec.set_state(token, pos, prev_hidden)
        else:
            dec.set_state(token, pos)

    def _resume(self, owner, continues) -> _Flight | None:
        """The step in flight if ``owner`` (a slot, or "batch") launched it and ``continues(flight)``
        (it is this step's first replay); any other is discarded."""
        flight, self._flight = self._flight, None
        if flight is None:
            return None
        if flight.owner == owner and continues(flight):
            self.ahead_kept += 1
            return flight
        self._discard(flight)
        return None

    def _discard(self, flight: _Flight) -> None:
        """A step run ahead that nothing continues (its effects are recomputed by what runs next, in
        stream order): its slots re-arm at their next fast step (their bad-word state resynced), and
        the penalty counts lose its token again."""
        self.ahead_dropped += 1
        for slot in flight.slots:
            self.held.pop(slot, None)
            self.synced.pop(slot, None)
        for slot, token in flight.counted:
            self.sampling.counts[slot].index_put_((token,), torch.full_like(token, -1, dtype=torch.int32),
                                                  accumulate=True)

    def drop(self) -> None:
        """The engine steps its slots elsewhere (the reference step): discard a step run ahead."""
        self._resume(None, None)

    def _launch_ahead(self, runner, src: torch.Tensor) -> tuple:
        """Copy ``src`` (this step's tokens) to the host without waiting, replay ``runner`` once more, and
        return (host tokens reader, the extra replay's done event)."""
        if self.device.type != "cuda":
            tokens = src.tolist()
            runner()
            return (lambda: tokens), None
        buf = self._pinned.get(tuple(src.shape))
        if buf is None:
            buf = self._pinned[tuple(src.shape)] = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        buf.copy_(src, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        runner()
        done = torch.cuda.Event()
        done.record()

        def read():
            copied.synchronize()
            return buf.tolist()
        return read, done

    def prepare(self, slot: int, token: int, pos: int):
        """The slot's (decoder, runners), built and captured on first use (errors propagate): the
        one-token step, and the k-draft step of a DeepSeek-family engine with drafts (on a GPU its
        sampled twin too; under Triton's interpreter that one is captured at its first use)."""
        if slot not in self.decoders:
            if self.mla:
                from .cuda.adapter import mla_decoder_from_engine

                dec = mla_decoder_from_engine(self.model, slot, max_draft=max(self.num_spec, 1),
                                              max_steps=self.max_steps, draft_vocab=self.draft_vocab)
            else:
                from .cuda.adapter import gqa_decoder_from_engine

                dec = gqa_decoder_from_engine(self.model, slot, self.options, self.max_steps)
            if self.sample_ok:
                dec.attach_sampler(self.sampling.row(slot))
            self._arm(dec, token, pos)
            runners: dict = {}
            self.decoders[slot] = (dec, runners)
            self._runner(dec, runners, 0, token, pos)
            if self.sample_ok:
                self._runner(dec, runners, SAMPLED, token, pos)
            if self.num_spec and self._mtp_rows(dec):
                self._runner(dec, runners, PLAIN_ROW, token, pos)
                if self.sample_ok and self.device.type == "cuda":
                    self._runner(dec, runners, SAMPLED_ROW, token, pos)
            if self.num_spec:
                self._runner(dec, runners, self.num_spec, token, pos)
                if self.sample_ok and self.device.type == "cuda":  # a sampled request's first step: no capture
                    self._runner(dec, runners, (SPEC_SAMPLED, self.num_spec), token, pos)
            self.held[slot] = (token, pos, 0)
        return self.decoders[slot]

    def _start(self, slot: int, dec, token: int, pos: int, need: int, prev_hidden, s: SlotState | None = None) -> int:
        """Out index where this call's tokens land; re-arms the decoder unless it continues (token, pos)."""
        held = self.held.get(slot)
        if held is not None and held[:2] == (token, pos):
            if held[2] + need <= self.max_steps:
                return held[2]
            self._arm(dec, token, pos, dec.mtp_hidden.clone() if self.mla else None)  # out_tokens full: keep the hidden
            return 0
        self._arm(dec, token, pos, prev_hidden)
        if s is not None and s.sampling is not None and self.sampling is not None:  # steps ran elsewhere since
            self.sampling.sync_history(slot, s.sampling, s.output_ids, pos + 1)
        return 0

    def decode(self, slot: int, token: int, pos: int, n: int, prev_hidden=None, s: SlotState | None = None,
               ahead: bool = False) -> list[int]:
        """``n`` >= 1 tokens following ``token`` (at ``pos``): greedy, or sampled by the slot's sampling row
        when ``s`` (the slot's state) is a request that samples or has logits processors; one host sync.
        A request with logprobs or a grammar takes the slot's extras graph for the two (captured on first
        use: mask, logprobs, or both): its grammar's mask is filled
        on the host and copied to the slot's ``gmask`` row before the replay (so ``n`` is 1 for it), the
        tokens' logprobs land in ``s.extra["fast_logprobs"]``. ``ahead``: the request goes on after these
        tokens and may run ahead (``_may_run_ahead``): replay once more before reading them (run-ahead)."""
        extras = s is not None and (s.num_logprobs is not None or s.grammar is not None)
        sampled = s is not None and not s.is_greedy
        if (sampled or extras) and not self.sample_ok:
            raise ValueError("this fast path decodes plain greedy requests only")
        dec, runners = self.prepare(slot, token, pos)
        rows = s is not None and s.num_spec > 0 and self._mtp_rows(dec)  # a request that drafts, between drafts
        key = (extras_key(s.grammar is not None, s.num_logprobs is not None) if extras
               else (SAMPLED_ROW if rows else SAMPLED) if sampled else PLAIN_ROW if rows else 0)
        if key not in runners:  # captured now, which re-arms the decoder
            self.held.pop(slot, None)
        runner = self._runner(dec, runners, key, token, pos)
        flight = self._resume(slot, lambda f: f.key == key and self.held.get(slot) == (token, pos, f.idx)
                              and f.idx + n <= self.max_steps)
        launched = int(flight is not None)
        idx = flight.idx if launched else self._start(slot, dec, token, pos, n, prev_hidden, s)
        if extras and s.grammar is not None:
            self._write_mask(slot, s.grammar)
        for _ in range(n - launched):
            runner()
        if ahead and self.run_ahead and not extras and n and idx + n < self.max_steps:
            read, done = self._launch_ahead(runner, dec.out_tokens[idx : idx + n])
            counted = ((slot, dec.out_tokens[idx + n : idx + n + 1]),) if key == SAMPLED and _counted(s) else ()
            self._flight = _Flight(slot, key, idx + n, done, (slot,), counted=counted)
            out = read()  # the one sync, on this step's copy only
        else:
            out = dec.out_tokens[idx : idx + n].tolist()  # the one sync
        if extras and s.num_logprobs is not None:
            from . import logprobs as lpmod

            val, ids = dec.sampler.lp_val[idx : idx + n].tolist(), dec.sampler.lp_ids[idx : idx + n].tolist()
            m = s.num_logprobs
            s.extra["fast_logprobs"] = lpmod.to_wire([v[0] for v in val], [i[0] for i in ids],
                                                     [v[1 : 1 + m] for v in val], [i[1 : 1 + m] for i in ids])
        self.held[slot] = (out[-1], pos + n, idx + n)
        self.synced[slot] = (out[-1], pos + n)
        return out

    def _write_mask(self, slot: int, grammar) -> None:
        """The grammar's next-token mask into the slot's gmask row (host fill, one copy)."""
        row = self.sampling.gmask[slot]
        host = self._host_masks.get(slot)
        if host is None:
            host = torch.empty((1, row.shape[0]), dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._host_masks[slot] = host
        grammar.fill(host, 0)
        row.copy_(host[0], non_blocking=True)

    def prepare_batch(self, size: int):
        """The batched decoder of ``size`` rows and its graphs (greedy; sampled where the engine samples),
        built and captured on first use (errors propagate); capture decodes on the scratch slot only."""
        if not self.batch_ok:
            raise ValueError("this fast path decodes one slot per step (sparse attention, or tensor parallel)")
        if size not in self.batches:
            from .cuda.adapter import gqa_batch_decoder_from_engine, mla_batch_decoder_from_engine

            dec = (mla_batch_decoder_from_engine(self.model, size, self.max_steps) if self.mla
                   else gqa_batch_decoder_from_engine(self.model, size, self.options, self.max_steps))
            keys = [0]
            if self.sample_ok:
                self._scratch_greedy(dec)
                dec.attach_samplers(self.sampling)
                keys.append(SAMPLED)
            if self._mtp_rows(dec) and self.device.type == "cuda":  # (interpreted: at their first use)
                keys += [PLAIN_ROW, SAMPLED_ROW] if self.sample_ok else [PLAIN_ROW]
            self.batches[size] = (dec, {})
            for key in keys:
                self._batch_runner(size, key)
            k = batch_spec_k(size, self.num_spec) if self.spec_batch_ok and self.device.type == "cuda" else 0
            if k:  # the engine's own draft count, with the plain graphs (interpreted: at its first use)
                self.prepare_batch_spec(size, k)
                if self.sample_ok:
                    self.prepare_batch_spec(size, k, sampled=True)
        return self.batches[size]

    def _scratch_greedy(self, dec) -> None:
        """What a batched decoder's padded rows (the scratch slot's sampling row) sample: the argmax."""
        from .cuda.sampling_state import GREEDY, I_FLAGS

        self.sampling.iparams[dec.scratch_slot, I_FLAGS] = GREEDY

    def _batch_runner(self, size: int, key):
        """The batched decoder's plain-step graph ``key`` (0, SAMPLED; PLAIN_ROW / SAMPLED_ROW: the step and each
        row's MTP cache row), captured on first use on the scratch slot."""
        dec, runners = self.batches[size]
        if key not in runners:
            from .cuda.graph import GraphedFn

            sample, mtp_row = key in (SAMPLED, SAMPLED_ROW), key in (PLAIN_ROW, SAMPLED_ROW)
            fn = (lambda: dec.step(sample=sample, mtp_row=True)) if mtp_row else (lambda: dec.step(sample=sample))
            runner = GraphedFn(fn, self.device.type == "cuda", warmup_calls=1, device=self.device,
                               before_capture=lambda: dec.set_rows([], [], []))
            runner.capture()
            runners[key] = runner
        return runners[key]

    def prepare_batch_spec(self, size: int, k: int, sampled: bool = False):
        """(the batched decoder of ``size`` rows with ``k`` drafts each, its greedy graph or with ``sampled`` its
        speculative sampling graph), built and captured on first use (errors propagate); capture decodes on the
        scratch slot only."""
        from .cuda.graph import GraphedFn

        if (size, k) not in self.spec_batches:
            from .cuda.adapter import mla_batch_spec_decoder_from_engine

            dec = mla_batch_spec_decoder_from_engine(self.model, size, k, self.draft_vocab)
            self.spec_batches[(size, k)] = (dec, {})
        dec, runners = self.spec_batches[(size, k)]
        key = SAMPLED if sampled else 0
        if key not in runners:
            if sampled:
                if not self.sample_ok:
                    raise ValueError("this fast path decodes plain greedy requests only")
                self._scratch_greedy(dec)
                dec.attach_sampler(self.sampling)
            fn = lambda: dec.step(sample=sampled)  # noqa: E731
            runner = GraphedFn(fn, self.device.type == "cuda", warmup_calls=1, device=self.device,
                               before_capture=lambda: dec.set_rows([], [], [], []))
            if sampled:  # torch's sampling ops in the graph: eager (slower, not wrong) should the capture fail
                runner = _captured_or_eager(runner, fn, f"batch {size} x {k} drafts speculative sampling graph",
                                            lambda: dec.set_rows([], [], [], []))
            else:
                runner.capture()
            runners[key] = runner
        return dec, runners[key]

    def _batch_extras_runner(self, size: int, mask: bool, logprobs: bool):
        """The batched decoder's sampling graph with every row's grammar mask and/or logprobs (rows
        without a grammar hold an all-ones mask), captured on first use on the scratch slot."""
        dec, runners = self.prepare_batch(size)
        key = extras_key(mask, logprobs)
        if key not in runners:
            from .cuda.graph import GraphedFn
            from .cuda.sampling import LP_CHUNK, logprobs_rows
            from .cuda.sampling_state import MAX_LOGPROBS

            if logprobs and size not in self._batch_lp:  # every row's logprobs at once, after the step
                b, v = dec.logits.shape
                k, steps, dev = min(MAX_LOGPROBS, v), dec.out_tokens.shape[1], dec.logits.device
                self._batch_lp[size] = (torch.zeros(b, steps, 1 + k, dtype=torch.float32, device=dev),
                                        torch.zeros(b, steps, 1 + k, dtype=torch.int64, device=dev),
                                        torch.full((b, -(-v // LP_CHUNK) * LP_CHUNK), float("-inf"), device=dev))
            lp_bufs = self._batch_lp.get(size)

            def fn():
                for smp in dec.samplers:
                    smp.mask_on = mask
                try:
                    dec.step(sample=True)
                finally:
                    for smp in dec.samplers:
                        smp.mask_on = False
                if logprobs:
                    logprobs_rows(dec.logits, dec.token, dec.step_idx, *lp_bufs)

            runner = GraphedFn(fn, self.device.type == "cuda", warmup_calls=1, device=self.device,
                               before_capture=lambda: dec.set_rows([], [], []))
            runners[key] = _captured_or_eager(runner, fn, f"batch {size} extras graph {key[1:]}",
                                              lambda: dec.set_rows([], [], []))
        return runners[key]

    def step_batch(self, items: list[tuple[int, SlotState]], max_seq_len: int,
                   prefill_hidden: torch.Tensor | None = None) -> list[tuple[list[int], str | None]]:
        """One engine step of 2..max_batch active slots ``[(slot, state)]`` in one batched decoder: per slot
        (emitted tokens, finish reason), cut as ``step`` cuts them (module docstring). Slots with logprobs
        or a grammar: the batch takes the graph with masks and/or logprobs (one token per step with a
        grammar: each mask needs the token before it), their logprobs in ``s.extra["fast_logprobs"]``.
        A DeepSeek-family batch where a slot drafts: each slot's drafts + verify in one step, greedy or by
        speculative sampling (``_step_batch_spec``; ``prefill_hidden`` [slots, hidden]: each prefilled slot's last
        hidden, the first draft's input of a slot at its first step), unless a slot reads its own output (penalties,
        bad words), has a grammar or logprobs."""
        rooms = [min(s.max_tokens - s.num_generated, max_seq_len - 1 - s.seq_len) for _, s in items]
        masks = any(s.grammar is not None for _, s in items)
        lps = any(s.num_logprobs is not None for _, s in items)
        k = batch_spec_k(padded_batch(len(items)), min(max(s.spec_k for _, s in items), self.num_spec))
        if (k and self.spec_batch_ok and min(rooms) > 0 and not masks and not lps
                and all(s.is_greedy or (self.sample_ok and _may_draft(s)) for _, s in items)):
            return self._step_batch_spec(items, k, max_seq_len, prefill_hidden)
        n = max(0, min(self.tokens_per_step if not masks else 1, *rooms))
        rows: list[list[int]] = [[] for _ in items]
        if n > 0:
            dec, runners = self.prepare_batch(padded_batch(len(items)))
            sampled = any(not s.is_greedy for _, s in items)
            if (sampled or masks or lps) and not self.sample_ok:
                raise ValueError("this fast path decodes plain greedy requests only")
            # a DeepSeek-family batch holding a request that drafts: the graph that keeps the MTP layer's rows too
            keep_mtp = self.mla and any(s.num_spec > 0 for _, s in items) and self._mtp_rows(dec)
            plain = (SAMPLED_ROW if keep_mtp else SAMPLED) if sampled else PLAIN_ROW if keep_mtp else 0
            runner = (self._batch_extras_runner(padded_batch(len(items)), masks, lps) if masks or lps
                      else self._batch_runner(padded_batch(len(items)), plain))
            key = (padded_batch(len(items)), (EXTRAS, masks, lps) if masks or lps else plain)
            slots = tuple(slot for slot, _ in items)
            flight = self._resume("batch", lambda f: f.key == key and f.slots == slots
                                  and f.expect == tuple((s.pending, s.seq_len) for _, s in items)
                                  and f.idx + n <= self.max_steps)
            launched = int(flight is not None)
            col = flight.idx if launched else 0
            if not launched:
                for slot, s in items:  # bad-word state behind (steps ran on the reference path): bring it up
                    if not s.is_greedy and s.sampling is not None and self.synced.get(slot) != (s.pending, s.seq_len):
                        self.sampling.sync_history(slot, s.sampling, s.output_ids, s.seq_len + 1)
                    if s.grammar is not None:
                        self._write_mask(slot, s.grammar)
                dec.set_rows([s.pending for _, s in items], [s.seq_len for _, s in items], list(slots))
            for _ in range(n - launched):
                runner()
            if self.num_spec:  # the MTP layer's input for each slot's next step, should it draft
                self._keep_batch_hidden(dec.hn, dec.slots)
                for slot, s in items:
                    self._batch_hidden_pos[slot] = s.seq_len + n
            src = dec.out_tokens[: len(items), col : col + n]
            if (self.run_ahead and col + n < self.max_steps and all(r > n for r in rooms)
                    and all(_may_run_ahead(s) for _, s in items)):
                read, done = self._launch_ahead(runner, src)
                rows = read()  # the one sync, on this step's copy only
                counted = tuple((slot, dec.out_tokens[r, col + n : col + n + 1]) for r, (slot, s) in enumerate(items)
                                if key[1] in (SAMPLED, SAMPLED_ROW) and _counted(s))
                self._flight = _Flight("batch", key, col + n, done, slots,
                                       tuple((r[-1], s.seq_len + n) for r, (_, s) in zip(rows, items)), counted)
            else:
                rows = src.tolist()  # the one sync
            if lps:
                from . import logprobs as lpmod

                lp_val, lp_ids = self._batch_lp[padded_batch(len(items))][:2]
                for r, (_, s) in enumerate(items):
                    if s.num_logprobs is not None:
                        m = s.num_logprobs
                        val, ids = lp_val[r, :n].tolist(), lp_ids[r, :n].tolist()
                        s.extra["fast_logprobs"] = lpmod.to_wire([v[0] for v in val], [i[0] for i in ids],
                                                                 [v[1 : 1 + m] for v in val],
                                                                 [i[1 : 1 + m] for i in ids])
        results = []
        for (slot, s), tokens in zip(items, rows):
            self.held.pop(slot, None)  # the slot's own decoder did not see these steps: re-armed at its next decode
            if tokens:
                self.synced[slot] = (tokens[-1], s.seq_len + n)
            s.num_steps += max(n, 1)
            s.num_valid_drafts = 0
            out, reason = emit(s, tokens, max_seq_len)
            if s.grammar is not None and not s.grammar.accept(out):
                log.warning("slot %d: token ids %s left the grammar; it stops constraining", slot, out)
                s.grammar.is_terminated = True
            if reason is not None:
                s.state = "done"
            results.append((out, reason))
        return results

    def _step_batch_spec(self, items: list[tuple[int, SlotState]], k: int, max_seq_len: int,
                         prefill_hidden: torch.Tensor | None) -> list[tuple[list[int], str | None]]:
        """One step of 2..max_batch DeepSeek-family slots, each verifying its own drafts (at most ``k``, as many as
        it asks for) and drawing its next ones, in one replay (greedy, or speculative sampling where a slot samples);
        one host sync. Each slot's MTP input is its hidden one position back: kept by its last batched step, its own
        decoder's, or the prefill's (zeros when none is known: its first drafts are then likely rejected, never
        wrong)."""
        sampled = any(not s.is_greedy for _, s in items)
        dec, runner = self.prepare_batch_spec(padded_batch(len(items)), k, sampled)
        for r, (slot, s) in enumerate(items):
            dec.mtp_hidden[r].copy_(self._mtp_input(slot, s, prefill_hidden))
        valid = [min(s.spec_k, k) for _, s in items]
        dec.set_rows([s.pending for _, s in items], [s.seq_len for _, s in items], [slot for slot, _ in items], valid)
        runner()
        self._keep_batch_hidden(dec.mtp_hidden, dec.slots)
        rows = dec.out[: len(items)].tolist()  # the one sync
        results = []
        for (slot, s), row, v in zip(items, rows, valid):
            self.held.pop(slot, None)  # the slot's own decoder did not see this step: re-armed at its next decode
            self.synced.pop(slot, None)
            n = row[0]
            self._batch_hidden_pos[slot] = s.seq_len + n + 1
            s.num_steps += 1
            s.num_draft_tokens += v
            s.num_valid_drafts = 0
            out, reason = emit(s, row[1 : n + 2], max_seq_len)
            s.num_accepted_tokens += max(0, len(out) - 1)
            if reason is not None:
                s.state = "done"
            results.append((out, reason))
        return results

    def _mtp_input(self, slot: int, s: SlotState, prefill_hidden: torch.Tensor | None) -> torch.Tensor:
        """The slot's final-normed hidden one position back of its pending token, wherever its last step left it."""
        kept = self.hidden_after_batch(slot, s.seq_len)
        if kept is not None:
            return kept
        held = self.held.get(slot)
        if held is not None and held[:2] == (s.pending, s.seq_len):  # its last step ran alone on its decoder
            return self.decoders[slot][0].mtp_hidden[0]
        if prefill_hidden is not None and s.has_prefill_hidden and s.num_generated == 0:
            return prefill_hidden[slot]
        return torch.zeros(self.model.cfg.hidden_size, dtype=torch.bfloat16, device=self.device)

    def _keep_batch_hidden(self, hidden: torch.Tensor, slots: torch.Tensor) -> None:
        """After a batched step: each row's final-normed hidden before its slot's next token (a plain step's ``hn``,
        the last of its tokens; a drafting one's ``mtp_hidden``) into its slot's row of ``_batch_hidden``, one copy
        on the stream (the caller records the positions); a slot whose next step runs alone re-arms its decoder's
        MTP input with it (``hidden_after_batch``), a batched drafting step reads it back."""
        rows = int(self.model.cache.scratch_slot) + 1
        if self._batch_hidden is None:
            self._batch_hidden = torch.zeros(rows, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        self._batch_hidden.index_copy_(0, slots.long(), hidden)

    def hidden_after_batch(self, slot: int, pos: int) -> torch.Tensor | None:
        """The slot's MTP input kept by its last batched step, when that step left the slot's next token at
        ``pos`` (a later step elsewhere makes it stale: None)."""
        if self._batch_hidden is None or self._batch_hidden_pos.get(slot) != pos:
            return None
        return self._batch_hidden[slot]

    def spec(self, slot: int, token: int, pos: int, k: int, prev_hidden=None, s: SlotState | None = None) -> list[int]:
        """One k-draft step (DeepSeek family): the 1..k+1 tokens it kept (accepted drafts + one); one sync.
        Greedy, or speculative sampling by the slot's sampling row when ``s`` samples or has logits
        processors."""
        dec, runners = self.prepare(slot, token, pos)
        sampled = s is not None and not s.is_greedy
        if sampled and not self.sample_ok:
            raise ValueError("this fast path decodes plain greedy requests only")
        key = (SPEC_SAMPLED, k) if sampled else k
        if key not in runners:  # a request with fewer drafts than the engine, or its first sampled one:
            self.held.pop(slot, None)  # captured now, which re-arms
        runner = self._runner(dec, runners, key, token, pos, prev_hidden)
        idx = self._start(slot, dec, token, pos, k + 1, prev_hidden, s)
        runner()
        row = torch.cat([dec.out_idx, dec.out_tokens[idx : idx + k + 1]]).tolist()  # the one sync
        n = row[0] - idx
        out = row[1 : 1 + n]
        self.held[slot] = (out[-1], pos + n, row[0])
        return out

    def step(self, slot: int, s: SlotState, max_seq_len: int, prev_hidden=None) -> tuple[list[int], str | None]:
        """One engine step of an active slot: up to tokens_per_step tokens (or one k-draft step),
        never past its max_tokens or max_seq_len, cut at stop ids by slots.emit as the reference step
        cuts them; (emitted tokens, finish reason)."""
        room = min(s.max_tokens - s.num_generated, max_seq_len - 1 - s.seq_len)
        k = min(s.spec_k, self.num_spec)
        if s.num_generated > 0:  # the prefill's hidden serves the first step only; after batched steps, theirs
            prev_hidden = self.hidden_after_batch(slot, s.seq_len)
        if k and room > 0:
            tokens = self.spec(slot, s.pending, s.seq_len, k, prev_hidden, s)
            s.num_steps += 1
            s.num_draft_tokens += k
        else:
            n = min(self.tokens_per_step if s.grammar is None else 1, room)  # a grammar's mask needs each token
            tokens = (self.decode(slot, s.pending, s.seq_len, n, prev_hidden, s, ahead=room > n and _may_run_ahead(s))
                      if n > 0 else [])
            s.num_steps += max(n, 1)
        s.num_valid_drafts = 0  # the reference step's held drafts are stale now: it drafts anew
        out, reason = emit(s, tokens, max_seq_len)
        if s.grammar is not None and not s.grammar.accept(out):
            log.warning("slot %d: token ids %s left the grammar; it stops constraining", slot, out)
            s.grammar.is_terminated = True
        if k and room > 0:
            s.num_accepted_tokens += max(0, len(out) - 1)
        if reason is not None:
            s.state = "done"
        return out, reason

    def forget(self, slot: int) -> None:
        """The slot starts another request (or is released): re-arm its decoder at the next decode, and
        let a step launched ahead on it finish first (a new request's KV may be written into the slot)."""
        if self._flight is not None and slot in self._flight.slots:
            self._flight.wait()
            self._flight = None
            self.ahead_dropped += 1
        self.held.pop(slot, None)
        self.synced.pop(slot, None)
        self._batch_hidden_pos.pop(slot, None)


def setup(mode: str, model, device: torch.device, dtype: torch.dtype, num_speculative_tokens: int,
          options=None, tokens_per_step: int = 1, draft_vocab: int | None = None,
          sampling=None, run_ahead: bool = True) -> tuple[FastPath | None, str | None]:
    """(FastPath or None, reason it is off). Mode "on" raises ValueError where "auto" logs the reason."""
    reason = engine_reason(mode, model, device, dtype, num_speculative_tokens)
    if reason is None:
        return FastPath(model, device, options, tokens_per_step, num_speculative_tokens=num_speculative_tokens,
                        draft_vocab=draft_vocab, sampling=sampling, run_ahead=run_ahead), None
    if mode == "on":
        raise ValueError(f"fast_path='on' cannot run this engine: {reason}; use fast_path='auto' or 'off'")
    if mode == "auto":
        log.info("decode fast path off, reference step in use: %s", reason)
    return None, reason
