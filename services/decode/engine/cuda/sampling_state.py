"""Per-slot sampling state on the device and the counter-based random numbers: the contract between
the engine's reference sampler (engine/sampling.py) and the fast path's sampling kernels (sampling.py).

Torch only (no Triton): the engine imports it where Triton is missing.

A request's parameters (``RequestSampling``, host side) are written once per request into one row
of ``SamplingBuffers`` (device tensors at fixed addresses), which both paths read: a captured graph
serves a new request's parameters without re-capture. Per row:

- ``fparams`` float32: temperature, log(min_p) (-inf: off), top_p, repetition, frequency and
  presence penalties;
- ``iparams`` int64: flags (below), top_k (0: off), seed, ``min_pos`` (stop ids are suppressed
  while the sampled token's position is below it), ``first_out_pos`` (the first output token's
  position: the output so far is positions first_out_pos .. P-1 when sampling position P);
- dense vocabulary vectors: ``bias`` (logit_bias, -inf outside allowed_token_ids), ``prompt_mask``,
  ``counts`` (output token counts, kept up to date by both paths), ``stop_mask`` (the ids
  min_tokens suppresses), ``ban`` (the ids the bad words ban at the next position; fast path);
- bad words for the fast path: ``bad_table`` [MAX_BAD_WORDS, MAX_BAD_WORD_LEN] int32, each word
  right-aligned and padded with -1, ``ring`` [RING] the last output tokens by position (p % RING),
  ``banned`` the ids ``ban`` holds now;
- ``gmask`` int32 [ceil(V / 32)]: the grammar's next-token bitmask (xgrammar's layout: bit i % 32
  of word i // 32 set = token i allowed), written by the host before each fast-path replay of a
  structured request; all ones (-1) otherwise (``arm`` resets it).

Random numbers: Philox4x32-10 keyed by the request's 64-bit seed (low word, high word), counter
(vocabulary index, position of the sampled token, stream, 0); its first output word r gives
``u = (2 * (r >> 9) + 1) * 2**-24``, exact in float32 and strictly inside (0, 1). A sampled token
is ``argmax(x_i - log(-log(u_i)))`` over the kept tokens (x: processed logits / temperature): the
Gumbel-max form of vLLM's ``argmax(p_i / E_i)`` with E = -log(u) ~ Exp(1), the same distribution.
Keyed by (seed, position), a seeded request draws the same numbers on either path, after a
migration, and whatever else shares its batch.

Row reductions over the vocabulary (``row_max``, ``row_sum``, ``row_argmax``, ``row_softmax``,
``row_cumsum``): two-stage where the row splits into 256 / 128 / 64 chunks, for the torch formulations
both paths run on a GPU (the reference sampler, the speculative step's distributions, the verify's argmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SAMPLING_EPS = 1e-5  # vLLM: a temperature below it is greedy

# fparams columns
F_TEMP, F_LOG_MIN_P, F_TOP_P, F_REP, F_FREQ, F_PRES = range(6)
NUM_F = 8
# iparams columns
I_FLAGS, I_TOP_K, I_SEED, I_MIN_POS, I_FIRST_OUT_POS = range(5)
NUM_I = 8

# flags
GREEDY = 1  # temperature < SAMPLING_EPS: argmax of the processed logits
BIAS = 2  # logit_bias or allowed_token_ids: add ``bias``
REP = 4  # repetition_penalty != 1
FREQ_PRES = 8  # frequency_penalty or presence_penalty != 0
MIN_TOKENS = 16  # stop ids suppressed while the position is below min_pos
BAD_WORDS = 32
TOP_K = 64
TOP_P = 128
MIN_P = 256
PROCESSORS = BIAS | REP | FREQ_PRES | MIN_TOKENS | BAD_WORDS  # logits processors (they change greedy too)
TRACK_COUNTS = REP | FREQ_PRES  # penalties read ``counts``
READS_OUTPUT = TRACK_COUNTS | BAD_WORDS  # processors that read the output, drafts included: such requests never draft

# random streams (counter word 2)
STREAM_SAMPLE, STREAM_ACCEPT, STREAM_DRAFT = 0, 1, 2

# fast-path capacities (the reference step has none)
MAX_LOGPROBS = 20  # top logprobs the fast path computes per token (vLLM's default max_logprobs)
MAX_BAD_WORDS = 128
MAX_BAD_WORD_LEN = 16
RING = 16  # >= MAX_BAD_WORD_LEN - 1 prefix tokens

_PHILOX_A, _PHILOX_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_M32 = 0xFFFFFFFF


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * m for int64 a in [0, 2**32) and a 32-bit constant m, exactly
    (16-bit halves: no int64 overflow)."""
    t_hi, t_lo = a * (m >> 16), a * (m & 0xFFFF)  # each < 2**48
    hi = (t_hi + (t_lo >> 16)) >> 16
    lo = (((t_hi & 0xFFFF) << 16) + t_lo) & _M32
    return hi, lo


def philox(seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: int | torch.Tensor, rounds: int = 10) -> torch.Tensor:
    """First output word (int64 in [0, 2**32)) of Philox4x32 with key (seed low, seed high) and counter
    (c0, c1, c2, 0); int64 arguments broadcast together (the Triton twin is sampling.philox_u32)."""
    seed = seed.to(torch.int64)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c0 = c0.to(torch.int64) & _M32
    zero = torch.zeros_like(c0)  # no tensor from a host scalar: the engine captures this in a CUDA graph
    c1 = (c1.to(torch.int64) & _M32) if isinstance(c1, torch.Tensor) else zero + (c1 & _M32)
    c2 = (c2.to(torch.int64) & _M32) if isinstance(c2, torch.Tensor) else zero + (c2 & _M32)
    # broadcast_tensors, not broadcast_shapes: the latter is Python over torch._refs (3x slower a call) and
    # its first call imports sympy (~40k objects, mid-request, into the collector's long-lived generation)
    c0, c1, c2, _ = torch.broadcast_tensors(c0, c1, c2, k0)
    c3 = torch.zeros_like(c0)
    for _ in range(rounds):
        hi_a, lo_a = _mulhilo(c0, _PHILOX_A)
        hi_b, lo_b = _mulhilo(c2, _PHILOX_B)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0


def uniform(seed: torch.Tensor, index: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """float32 U(0, 1) of counter (index, position, stream) under each seed (broadcast)."""
    r = philox(seed, index, position, stream)
    return ((r >> 9) * 2 + 1).to(torch.float32) * (2.0 ** -24)


def gumbel(seed: torch.Tensor, index: torch.Tensor, position: torch.Tensor, stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """-log(E), E = -log(u) ~ Exp(1): argmax(x + gumbel) samples softmax(x)."""
    return -torch.log(-torch.log(uniform(seed, index, position, stream)))


def _chunks(v: int) -> int | None:
    """Chunks a row of v values splits into for two-stage reductions (None: reduce it whole): on a GPU a
    reduction over one row of ~100K values runs in one thread block (~20-40 us); over 256 chunks, then
    over the chunks' results, it spreads over the device. Same results up to float32 summation order."""
    return next((c for c in (256, 128, 64) if v % c == 0 and v // c >= 32), None)


def row_max(x: torch.Tensor) -> torch.Tensor:
    """x.max(dim=-1, keepdim=True).values of [..., V], two-stage where it splits."""
    c = _chunks(x.shape[-1])
    if c is None:
        return x.max(dim=-1, keepdim=True).values
    return x.unflatten(-1, (c, -1)).amax(dim=-1).amax(dim=-1, keepdim=True)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """x.sum(dim=-1, keepdim=True) of [..., V], two-stage where it splits."""
    c = _chunks(x.shape[-1])
    if c is None:
        return x.sum(dim=-1, keepdim=True)
    return x.unflatten(-1, (c, -1)).sum(dim=-1).sum(dim=-1, keepdim=True)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of [..., V] (ties: the lowest index), two-stage where it splits."""
    v = x.shape[-1]
    c = _chunks(v)
    if c is None:
        return x.argmax(dim=-1)
    vals, idx = x.unflatten(-1, (c, -1)).max(dim=-1)  # [..., C]: each chunk's maximum, its first index
    j = vals.argmax(dim=-1, keepdim=True)  # the first chunk holding the maximum
    return (j * (v // c) + idx.gather(-1, j))[..., 0]


def row_softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of [..., V] from the two-stage max and sum."""
    e = torch.exp(x - row_max(x))
    return e / row_sum(e)


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """x.cumsum(dim=-1) of [..., V]: within chunks, then each chunk's offset (the scan over one long row is
    one slow pass on a GPU)."""
    c = _chunks(x.shape[-1])
    if c is None:
        return x.cumsum(dim=-1)
    parts = x.unflatten(-1, (c, -1)).cumsum(dim=-1)  # [..., C, V/C]
    offsets = parts[..., -1].cumsum(dim=-1) - parts[..., -1]  # exclusive scan of the chunks' totals
    return (parts + offsets[..., None]).flatten(-2)


def seed_i64(seed: int) -> int:
    """A seed's 64-bit pattern as a signed int64 (how the buffers hold it)."""
    s = seed & ((1 << 64) - 1)
    return s - (1 << 64) if s >= 1 << 63 else s


def banned_ids(bad_words: list[list[int]], history: list[int]) -> list[int]:
    """vLLM's bad words: the last id of every word whose other ids are the output's last ones (a
    one-id word always; a word longer than the output + 1 never)."""
    out = []
    for word in bad_words:
        if len(word) > len(history) + 1:
            continue
        prefix = word[:-1]
        if not prefix or history[-len(prefix):] == prefix:
            out.append(word[-1])
    return out


@dataclass
class RequestSampling:
    """One request's sampling, resolved (engine/sampling.py ``resolve`` builds it from SamplingParams)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words: list[list[int]] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)  # what min_tokens suppresses
    seed: int = 0
    prompt_ids: list[int] | None = None
    min_pos: int = 0
    first_out_pos: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def flags(self) -> int:
        f = GREEDY if self.greedy else 0
        if self.logit_bias or self.allowed_token_ids is not None:
            f |= BIAS
        if self.repetition_penalty != 1.0:
            f |= REP
        if self.frequency_penalty != 0.0 or self.presence_penalty != 0.0:
            f |= FREQ_PRES
        if self.stop_ids and self.min_pos > 0:
            f |= MIN_TOKENS
        if self.bad_words:
            f |= BAD_WORDS
        if not self.greedy:  # vLLM: greedy requests have no top-k/top-p/min-p
            if self.top_k > 0:
                f |= TOP_K
            if self.top_p < 1.0:
                f |= TOP_P
            if self.min_p > 0.0:
                f |= MIN_P
        return f

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no logits processor: the argmax of the raw logits."""
        return self.flags & (GREEDY | PROCESSORS) == GREEDY

    def fast_path_limit(self) -> str | None:
        """Why the fast path's buffers cannot hold this request (None: they can)."""
        if len(self.bad_words) > MAX_BAD_WORDS:
            return f"{len(self.bad_words)} bad words: the fast path holds {MAX_BAD_WORDS}"
        longest = max((len(w) for w in self.bad_words), default=0)
        if longest > MAX_BAD_WORD_LEN:
            return f"a bad word of {longest} tokens: the fast path holds {MAX_BAD_WORD_LEN}"
        return None

    def log_min_p(self) -> float:
        return math.log(self.min_p) if self.flags & MIN_P else float("-inf")


@dataclass
class SlotSampling:
    """One row of SamplingBuffers: views at fixed addresses (what a decoder's graph reads)."""

    fparams: torch.Tensor
    iparams: torch.Tensor
    bias: torch.Tensor
    prompt_mask: torch.Tensor
    counts: torch.Tensor
    stop_mask: torch.Tensor
    ban: torch.Tensor
    banned: torch.Tensor
    ring: torch.Tensor
    bad_table: torch.Tensor
    gmask: torch.Tensor | None = None


class SamplingBuffers:
    """Every slot's sampling state on the device (module docstring: the layout)."""

    def __init__(self, num_rows: int, vocab: int, device: torch.device | str):
        n, v, dev = num_rows, vocab, torch.device(device)
        self.vocab, self.device = v, dev
        self.fparams = torch.zeros(n, NUM_F, dtype=torch.float32, device=dev)
        self.iparams = torch.zeros(n, NUM_I, dtype=torch.int64, device=dev)
        self.bias = torch.zeros(n, v, dtype=torch.float32, device=dev)
        self.prompt_mask = torch.zeros(n, v, dtype=torch.uint8, device=dev)
        self.counts = torch.zeros(n, v, dtype=torch.int32, device=dev)
        self.stop_mask = torch.zeros(n, v, dtype=torch.uint8, device=dev)
        self.ban = torch.zeros(n, v, dtype=torch.uint8, device=dev)
        self.banned = torch.full((n, MAX_BAD_WORDS), -1, dtype=torch.int32, device=dev)
        self.ring = torch.zeros(n, RING, dtype=torch.int64, device=dev)
        self.bad_table = torch.full((n, MAX_BAD_WORDS, MAX_BAD_WORD_LEN), -1, dtype=torch.int32, device=dev)
        self.gmask = torch.full((n, (v + 31) // 32), -1, dtype=torch.int32, device=dev)

    def row(self, r: int) -> SlotSampling:
        return SlotSampling(self.fparams[r], self.iparams[r], self.bias[r], self.prompt_mask[r], self.counts[r],
                            self.stop_mask[r], self.ban[r], self.banned[r], self.ring[r], self.bad_table[r],
                            self.gmask[r])

    def _ids(self, ids) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.int64).to(self.device, non_blocking=True)

    def arm(self, r: int, req: RequestSampling, history: list[int], next_pos: int) -> None:
        """Write a request into row r: ``history`` is its output so far (the pending token last, at
        position next_pos - 1); ``next_pos`` the position the next sampled token takes."""
        flags = req.flags
        self.gmask[r].fill_(-1)
        self.fparams[r] = torch.tensor([req.temperature, req.log_min_p(), req.top_p, req.repetition_penalty,
                                        req.frequency_penalty, req.presence_penalty, 0.0, 0.0], dtype=torch.float32)
        self.iparams[r] = torch.tensor([flags, req.top_k if flags & TOP_K else 0, seed_i64(req.seed), req.min_pos,
                                        req.first_out_pos, 0, 0, 0], dtype=torch.int64)
        if flags & BIAS:
            bias = self.bias[r]
            if req.allowed_token_ids is not None:
                bias.fill_(float("-inf"))
                bias[self._ids(req.allowed_token_ids)] = 0.0
            else:
                bias.zero_()
            if req.logit_bias:
                ids = self._ids(req.logit_bias.keys())
                vals = torch.tensor(list(req.logit_bias.values()), dtype=torch.float32).to(self.device)
                bias[ids] += vals  # vLLM: logits[ids] += bias after the allowed mask (-inf stays -inf)
        if flags & REP:
            self.prompt_mask[r].zero_()
            if req.prompt_ids:
                self.prompt_mask[r][self._ids(req.prompt_ids)] = 1
        if flags & TRACK_COUNTS:
            self.counts[r].zero_()
            if history:
                self.counts[r].index_add_(0, self._ids(history), torch.ones(len(history), dtype=torch.int32,
                                                                            device=self.device))
        if flags & MIN_TOKENS:
            self.stop_mask[r].zero_()
            self.stop_mask[r][self._ids(req.stop_ids)] = 1
        if flags & BAD_WORDS and req.fast_path_limit() is None:
            table = torch.full((MAX_BAD_WORDS, MAX_BAD_WORD_LEN), -1, dtype=torch.int32)
            for w, word in enumerate(req.bad_words):
                table[w, MAX_BAD_WORD_LEN - len(word):] = torch.tensor(word, dtype=torch.int32)
            self.bad_table[r] = table.to(self.device)
            self.sync_history(r, req, history, next_pos)

    def sync_history(self, r: int, req: RequestSampling, history: list[int], next_pos: int) -> None:
        """Bring the fast path's bad-word state (ring of last tokens, ``ban`` for next_pos) to ``history``."""
        if not req.flags & BAD_WORDS or req.fast_path_limit() is not None:
            return
        ring = torch.zeros(RING, dtype=torch.int64)
        for j, tok in enumerate(reversed(history[-RING:])):
            ring[(next_pos - 1 - j) % RING] = tok
        self.ring[r] = ring.to(self.device)
        self.ban[r].zero_()
        ids = banned_ids(req.bad_words, history)
        self.ban[r][self._ids(ids)] = 1
        banned = torch.full((MAX_BAD_WORDS,), -1, dtype=torch.int32)
        banned[: len(ids)] = torch.tensor(ids, dtype=torch.int32)
        self.banned[r] = banned.to(self.device)

    def add_tokens(self, rows: torch.Tensor, tokens: torch.Tensor, track: torch.Tensor) -> None:
        """counts[rows[i], tokens[i]] += track[i] (the reference step's emitted tokens; no host sync)."""
        self.counts.index_put_((rows, tokens), track.to(torch.int32), accumulate=True)
