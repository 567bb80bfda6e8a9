"""Sampling on the fast path: vLLM's sampling semantics as Triton kernels after the lm_head GEMV, inside
the captured graph, reading the request's parameters from its slot's ``SlotSampling`` buffers
(sampling_state.py), so a new request needs no re-capture.

The same steps, formulas and random numbers as the engine's reference sampler (engine/sampling.py,
whose docstring gives the semantics): logits processors (allowed ids and logit_bias as one dense
bias, bad words, min_tokens, repetition / frequency / presence penalties), greedy argmax or
temperature, min_p, top_k, top_p, and Gumbel-max over the kept tokens with Philox keyed by
(seed, position). Float32 logits in, the token out, written like the greedy argmax writes it
(``token``, ``out_tokens[step_idx]``, ``step_idx += 1``, ``pos += 1``, the next input's embedding),
and the slot's state advanced (output counts for the penalties; the bad words' ring of recent
tokens and the ids banned at the next position).

No sort over the vocabulary. Six launches per token (greedy requests without processors keep the
decoder's plain argmax and never run these):
  1. process (a program per BLOCK_V ids): processors, x = l / T, per-block max (greedy: argmax);
  2. histogram: with the global max m, S0 = tokens min_p keeps (x - m >= log min_p), their masses
     exp(x - m) per block, and counts per bucket of (m - x) (NB buckets of 1/INV_W nats);
  3. plan + collect: the smallest bucket cut that surely holds everything top-k (count >= k) or top-p
     (a lower bound on the mass >= p * Z) can keep; its tokens (at most CAP) are gathered as
     candidates. Only min_p / temperature: no cut (mode ALL). More than CAP: mode OVER;
  4. rank (candidates, BLOCK_C a program): for each, the number of candidates strictly above it
     (top-k keeps those with fewer than k) and the kept mass Z1 (partial sums). OVER: one program
     finds the exact thresholds by binary search over the float order, started from the buckets
     the histogram brackets them in (~20 passes over the vocabulary: hundreds of us, where the
     candidate path takes ~30 us; it serves nuclei of more than CAP tokens, e.g. top_p alone on a
     nearly flat distribution);
  5. select: top-p keeps a candidate when the kept mass strictly above it is below p * Z1; then
     x + Gumbel over the kept tokens, best per program;
  6. finish (one program): the best of the programs (ties: lowest id), the writes above.
Every sum runs in a fixed order (no float atomics): a seeded request samples the same tokens on
every run.

Logprobs and grammars (``FastSampler.mask_on`` / ``logprobs_on`` set while a graph is captured: the
engine keeps such graphs per slot for requests that ask for them): before step 1, the row's grammar bitmask
(``gmask``, written by the host before the replay) sets every forbidden logit to -inf (one launch,
a no-op for an all-ones mask); after step 6, torch ops on the same logits (capturable):
log_softmax, the sampled token's logprob and rank (tokens with logprob >= its own, as vLLM counts),
the top MAX_LOGPROBS ids and logprobs (``logprobs_rows``: in two stages over chunks of the
vocabulary), into ``lp_val`` / ``lp_ids`` at row ``step_idx - 1`` (the row ``out_tokens`` got):
vLLM's raw logprobs (after the grammar's mask, before every processor). A batched decoder computes
them for all its rows at once after its step (fastpath.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import gdc_launch_dependents, gdc_wait, launch_opts
from . import sampling_state as S

_GREEDY = tl.constexpr(S.GREEDY)
_BIAS = tl.constexpr(S.BIAS)
_REP = tl.constexpr(S.REP)
_FREQ_PRES = tl.constexpr(S.FREQ_PRES)
_MIN_TOKENS = tl.constexpr(S.MIN_TOKENS)
_BAD_WORDS = tl.constexpr(S.BAD_WORDS)
_TOP_K = tl.constexpr(S.TOP_K)
_TOP_P = tl.constexpr(S.TOP_P)
_TRACK = tl.constexpr(S.TRACK_COUNTS)
_F_TEMP = tl.constexpr(S.F_TEMP)
_F_LOG_MIN_P = tl.constexpr(S.F_LOG_MIN_P)
_F_TOP_P = tl.constexpr(S.F_TOP_P)
_F_REP = tl.constexpr(S.F_REP)
_F_FREQ = tl.constexpr(S.F_FREQ)
_F_PRES = tl.constexpr(S.F_PRES)
_I_FLAGS = tl.constexpr(S.I_FLAGS)
_I_TOP_K = tl.constexpr(S.I_TOP_K)
_I_SEED = tl.constexpr(S.I_SEED)
_I_MIN_POS = tl.constexpr(S.I_MIN_POS)
_I_FIRST_OUT = tl.constexpr(S.I_FIRST_OUT_POS)
_STREAM_SAMPLE = tl.constexpr(S.STREAM_SAMPLE)
_RING = tl.constexpr(S.RING)
_MAX_BW = tl.constexpr(S.MAX_BAD_WORDS)
_BW_LEN = tl.constexpr(S.MAX_BAD_WORD_LEN)
_NUM_F = tl.constexpr(S.NUM_F)
_NUM_I = tl.constexpr(S.NUM_I)

MODE_ALL, MODE_CAND, MODE_OVER = 0, 1, 2
_ALL = tl.constexpr(MODE_ALL)
_CAND = tl.constexpr(MODE_CAND)
_OVER = tl.constexpr(MODE_OVER)
_IMAX = tl.constexpr(2147483647)

NUM_BUCKETS = 256
INV_BUCKET_WIDTH = 16.0


# ---------------------------------------------------------------- random numbers (twin: sampling_state.philox)

@triton.jit
def _mulhilo32(a, M: tl.constexpr):
    p = a.to(tl.uint64) * M
    return (p >> 32).to(tl.uint32), (p & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def philox_u32(seed, c0, c1, c2):
    """First word of Philox4x32-10, key (seed low, seed high), counter (c0, c1, c2, 0); c0 a uint32 block."""
    s = seed.to(tl.uint64, bitcast=True)
    k0 = (s & 0xFFFFFFFF).to(tl.uint32)
    k1 = (s >> 32).to(tl.uint32)
    zero = c0 * 0
    c1 = zero + c1
    c2 = zero + c2
    c3 = zero
    for _ in tl.static_range(10):
        hi_a, lo_a = _mulhilo32(c0, 0xD2511F53)
        hi_b, lo_b = _mulhilo32(c2, 0xCD9E8D57)
        c0 = hi_b ^ c1 ^ k0
        c1 = lo_b
        c2 = hi_a ^ c3 ^ k1
        c3 = lo_a
        k0 = ((k0.to(tl.uint64) + 0x9E3779B9) & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((k1.to(tl.uint64) + 0xBB67AE85) & 0xFFFFFFFF).to(tl.uint32)
    return c0


@triton.jit
def uniform(seed, idx, position, stream):
    """U(0, 1) of counter (idx, position, stream), sampling_state.uniform's numbers: idx an int block."""
    r = philox_u32(seed, idx.to(tl.uint32), position.to(tl.uint32), stream)
    return ((r >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def gumbel(seed, idx, position, stream):
    """-log(-log(u)) of counter (idx, position, stream): idx an int block, position/stream scalars."""
    return -tl.log(-tl.log(uniform(seed, idx, position, stream)))


@triton.jit
def _key(x):
    # order-preserving int64 key of a float32 (-0 as +0), in [0, 2**32)
    b = (x + 0.0).to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(b >= 0, b + 2147483648, 2147483647 - (b & 2147483647))


@triton.jit
def _row(row_ptr):
    # the buffers' row this launch reads: row_ptr[0] (a batched decoder's slot; 0 over one row's views)
    return tl.load(row_ptr).to(tl.int64)


# ---------------------------------------------------------------- 1. processors, temperature, block max

@triton.jit
def _process_kernel(logits_ptr, x_ptr, part_max_ptr, part_arg_ptr, scratch_ptr, fp_ptr, ip_ptr, bias_ptr,
                    prompt_ptr, counts_ptr, stop_ptr, ban_ptr, pos_ptr, row_ptr, V,
                    BLOCK: tl.constexpr, NSCRATCH: tl.constexpr):
    pid = tl.program_id(0)
    r = _row(row_ptr)
    fp_ptr += r * _NUM_F
    ip_ptr += r * _NUM_I
    bias_ptr += r * V
    prompt_ptr += r * V
    counts_ptr += r * V
    stop_ptr += r * V
    ban_ptr += r * V
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    vm = offs < V
    l = tl.load(logits_ptr + offs, mask=vm, other=float("-inf"))
    flags = tl.load(ip_ptr + _I_FLAGS)
    position = tl.load(pos_ptr).to(tl.int64) + 1  # of the token sampled now
    if (flags & _BIAS) != 0:  # logit_bias, -inf outside allowed_token_ids
        l = l + tl.load(bias_ptr + offs, mask=vm, other=0.0)
    if (flags & _BAD_WORDS) != 0:
        l = tl.where(tl.load(ban_ptr + offs, mask=vm, other=0) != 0, float("-inf"), l)
    if (flags & _MIN_TOKENS) != 0:
        if position < tl.load(ip_ptr + _I_MIN_POS):
            l = tl.where(tl.load(stop_ptr + offs, mask=vm, other=0) != 0, float("-inf"), l)
    if (flags & _REP) != 0:
        rep = tl.load(fp_ptr + _F_REP)
        c = tl.load(counts_ptr + offs, mask=vm, other=0)
        hit = (tl.load(prompt_ptr + offs, mask=vm, other=0) != 0) | (c > 0)
        l = tl.where(hit, tl.where(l > 0, tl.math.div_rn(l, tl.zeros_like(l) + rep), l * rep), l)
    if (flags & _FREQ_PRES) != 0:
        c = tl.load(counts_ptr + offs, mask=vm, other=0)
        l = l - tl.load(fp_ptr + _F_FREQ) * c.to(tl.float32)
        l = l - tl.load(fp_ptr + _F_PRES) * (c > 0).to(tl.float32)
    if (flags & _GREEDY) == 0:
        temp = tl.load(fp_ptr + _F_TEMP)
        l = tl.math.div_rn(l, tl.zeros_like(l) + temp)
        tl.store(x_ptr + offs, l, mask=vm)
    best = tl.max(l, axis=0)
    arg = tl.argmax(l, axis=0, tie_break_left=True)
    tl.store(part_max_ptr + pid, best)
    tl.store(part_arg_ptr + pid, pid * BLOCK + arg)
    if pid == 0:  # the histogram and counters the next kernels accumulate into
        z = tl.arange(0, NSCRATCH)
        tl.store(scratch_ptr + z, z * 0)


# ---------------------------------------------------------------- 2. min_p set, masses, bucket histogram

@triton.jit
def _s0_and_bucket(x, m, log_min_p, NB: tl.constexpr, INV_W: tl.constexpr):
    # tokens min_p keeps (finite, x - m >= log min_p) and their bucket of m - x (out of range / not kept: NB - 1)
    s0 = (x > float("-inf")) & ((x - m) >= log_min_p)
    bf = tl.where(s0, tl.minimum((m - x) * INV_W, NB - 1.0), NB - 1.0)
    return s0, bf.to(tl.int32)


@triton.jit
def _global_max(part_max_ptr, NP, NP_POW2: tl.constexpr):
    p = tl.arange(0, NP_POW2)
    return tl.max(tl.load(part_max_ptr + p, mask=p < NP, other=float("-inf")), axis=0)


@triton.jit
def _hist_kernel(x_ptr, part_max_ptr, part_z_ptr, scratch_ptr, fp_ptr, ip_ptr, row_ptr, V, NP,
                 BLOCK: tl.constexpr, NP_POW2: tl.constexpr, NB: tl.constexpr, INV_W: tl.constexpr):
    pid = tl.program_id(0)
    r = _row(row_ptr)
    fp_ptr += r * _NUM_F
    ip_ptr += r * _NUM_I
    flags = tl.load(ip_ptr + _I_FLAGS)
    if (flags & _GREEDY) == 0:
        m = _global_max(part_max_ptr, NP, NP_POW2)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < V, other=float("-inf"))
        s0, b = _s0_and_bucket(x, m, tl.load(fp_ptr + _F_LOG_MIN_P), NB, INV_W)
        tl.store(part_z_ptr + pid, tl.sum(tl.where(s0, tl.exp(x - m), 0.0), axis=0))
        tl.atomic_add(scratch_ptr + NB, tl.sum(s0.to(tl.int32), axis=0))  # |S0| (integer: order-free)
        if (flags & (_TOP_K | _TOP_P)) != 0:
            tl.atomic_add(scratch_ptr + tl.arange(0, NB), tl.histogram(b, NB))


# ---------------------------------------------------------------- 3. plan, candidates

@triton.jit
def _plan(scratch_ptr, part_max_ptr, part_z_ptr, fp_ptr, ip_ptr, NP, NP_POW2: tl.constexpr, NB: tl.constexpr,
          INV_W: tl.constexpr, CAP: tl.constexpr):
    flags = tl.load(ip_ptr + _I_FLAGS)
    m = _global_max(part_max_ptr, NP, NP_POW2)
    p = tl.arange(0, NP_POW2)
    z0 = tl.sum(tl.load(part_z_ptr + p, mask=p < NP, other=0.0), axis=0)
    total = tl.load(scratch_ptr + NB)
    k = tl.load(ip_ptr + _I_TOP_K)
    k_active = ((flags & _TOP_K) != 0) & (k < total)
    p_active = (flags & _TOP_P) != 0
    bins = tl.arange(0, NB)
    cnt = tl.load(scratch_ptr + bins)
    cnt = tl.where(bins < NB - 1, cnt, 0)
    cc = tl.cumsum(cnt, 0)
    cut_k = tl.sum((cc < k).to(tl.int32), axis=0)
    # a lower bound of each bucket's mass: its tokens have x - m > -(b + 1) / INV_W; one bucket of margin
    low = cnt.to(tl.float32) * tl.exp(-(bins + 1).to(tl.float32) / INV_W)
    cut_p = tl.sum((tl.cumsum(low, 0) < tl.load(fp_ptr + _F_TOP_P) * z0).to(tl.int32), axis=0) + 1
    cut = tl.minimum(tl.where(k_active, cut_k, cut_p), NB - 1)
    n_c = tl.where(cut < NB - 1, tl.sum(tl.where(bins <= cut, cnt, 0), axis=0), total)
    mode = tl.where(k_active | p_active, tl.where(n_c <= CAP, _CAND, _OVER), _ALL)
    return mode, cut, n_c, k_active.to(tl.int32), p_active.to(tl.int32), m, z0


@triton.jit
def _collect_kernel(x_ptr, part_max_ptr, part_z_ptr, scratch_ptr, cand_x_ptr, cand_i_ptr, plan_i_ptr, plan_f_ptr,
                    fp_ptr, ip_ptr, row_ptr, V, NP, BLOCK: tl.constexpr, NP_POW2: tl.constexpr, NB: tl.constexpr,
                    INV_W: tl.constexpr, CAP: tl.constexpr):
    pid = tl.program_id(0)
    r = _row(row_ptr)
    fp_ptr += r * _NUM_F
    ip_ptr += r * _NUM_I
    flags = tl.load(ip_ptr + _I_FLAGS)
    if (flags & _GREEDY) == 0:
        mode, cut, n_c, k_active, p_active, m, z0 = _plan(scratch_ptr, part_max_ptr, part_z_ptr, fp_ptr, ip_ptr,
                                                          NP, NP_POW2, NB, INV_W, CAP)
        if pid == 0:
            tl.store(plan_i_ptr + 0, mode)
            tl.store(plan_i_ptr + 1, cut)
            tl.store(plan_i_ptr + 2, n_c)
            tl.store(plan_i_ptr + 3, k_active)
            tl.store(plan_i_ptr + 4, p_active)
            tl.store(plan_f_ptr + 0, m)
            tl.store(plan_f_ptr + 1, z0)
        if mode == _CAND:
            offs = pid * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < V, other=float("-inf"))
            s0, b = _s0_and_bucket(x, m, tl.load(fp_ptr + _F_LOG_MIN_P), NB, INV_W)
            member = (s0 & (b <= cut)).to(tl.int32)
            base = tl.atomic_add(scratch_ptr + NB + 1, tl.sum(member, axis=0))
            dst = base + tl.cumsum(member, 0) - 1  # order inside the list is irrelevant: ranks compare values
            tl.store(cand_x_ptr + dst, x, mask=member != 0)
            tl.store(cand_i_ptr + dst, offs, mask=member != 0)


# ---------------------------------------------------------------- 4. top-k ranks (or the exact slow search)

@triton.jit
def _count_at_least(x_ptr, V, m, log_min_p, thr, BLOCK: tl.constexpr):
    # how many min_p-kept tokens have key >= thr (per-lane sums, one reduction: a fixed order)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for b0 in range(0, V, BLOCK):
        offs = b0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < V, other=float("-inf"))
        s0 = (x > float("-inf")) & ((x - m) >= log_min_p)
        acc += (s0 & (_key(x) >= thr)).to(tl.int32)
    return tl.sum(acc, axis=0)


@triton.jit
def _mass_above(x_ptr, V, m, log_min_p, floor_key, thr, BLOCK: tl.constexpr):
    # sum of exp(x - m) over min_p-kept tokens with key >= floor_key and key > thr
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for b0 in range(0, V, BLOCK):
        offs = b0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < V, other=float("-inf"))
        kx = _key(x)
        keep = (x > float("-inf")) & ((x - m) >= log_min_p) & (kx >= floor_key) & (kx > thr)
        acc += tl.where(keep, tl.exp(x - m), 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _edge_key(m, b, INV_W: tl.constexpr):
    # key of the bucket edge m - b / INV_W
    return _key(m - b.to(tl.float32) / INV_W)


@triton.jit
def _exact_threshold(x_ptr, scratch_ptr, V, m, log_min_p, k, k_active, p_active, top_p, cut,
                     BLOCK: tl.constexpr, NB: tl.constexpr, INV_W: tl.constexpr):
    # key threshold of everything top-k and top-p keep: binary searches over the float order, each
    # started from the bucket range the histogram brackets it in (MARGIN keys of slack for rounding)
    MARGIN: tl.constexpr = 256
    vk = k * 0
    if k_active != 0:  # the largest key v with count(key >= v) >= k; it lies in bucket `cut`
        lo = k * 0
        hi = lo + 4294967296
        if cut < NB - 1:
            lo = tl.maximum(_edge_key(m, cut + 1, INV_W) - MARGIN, lo)
            hi = tl.minimum(_edge_key(m, cut, INV_W) + MARGIN, hi)
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            ok = _count_at_least(x_ptr, V, m, log_min_p, mid, BLOCK) >= k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        vk = lo
    vp = k * 0
    if p_active != 0:  # the smallest key v with mass(top-k kept, key > v) < top_p * mass(top-k kept)
        target = top_p * _mass_above(x_ptr, V, m, log_min_p, vk, vk - 1, BLOCK)
        lo = k * 0 - 1
        hi = k * 0 + 4294967295
        if k_active == 0:  # Z1 = Z0: bracket between the buckets' upper and lower mass bounds
            bins = tl.arange(0, NB)
            cnt = tl.where(bins < NB - 1, tl.load(scratch_ptr + bins), 0).to(tl.float32)
            upper = tl.cumsum(cnt * tl.exp(-bins.to(tl.float32) / INV_W), 0)
            below = tl.maximum(tl.sum((upper < target).to(tl.int32), axis=0) - 1, 0)
            hi = tl.minimum(_edge_key(m, below, INV_W) + MARGIN, hi)
            if cut < NB - 1:
                lo = tl.maximum(_edge_key(m, cut + 1, INV_W) - MARGIN, lo)
            if lo >= hi:
                lo = k * 0 - 1
                hi = k * 0 + 4294967295
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            ok = _mass_above(x_ptr, V, m, log_min_p, vk, mid, BLOCK) < target
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid)
        vp = hi
    return tl.maximum(vk, vp)


@triton.jit
def _rank_kernel(x_ptr, cand_x_ptr, keptk_ptr, part_z1_ptr, plan_i_ptr, plan_f_ptr, tau_ptr, scratch_ptr, fp_ptr,
                 ip_ptr, row_ptr, V, BLOCK_C: tl.constexpr, BLOCK_J: tl.constexpr, SLOW_BLOCK: tl.constexpr,
                 NB: tl.constexpr, INV_W: tl.constexpr):
    pid = tl.program_id(0)
    r = _row(row_ptr)
    fp_ptr += r * _NUM_F
    ip_ptr += r * _NUM_I
    flags = tl.load(ip_ptr + _I_FLAGS)
    if (flags & _GREEDY) == 0:
        mode = tl.load(plan_i_ptr + 0)
        n = tl.load(plan_i_ptr + 2)
        k_active = tl.load(plan_i_ptr + 3)
        m = tl.load(plan_f_ptr + 0)
        k = tl.load(ip_ptr + _I_TOP_K)
        if mode == _CAND:
            i = pid * BLOCK_C + tl.arange(0, BLOCK_C)
            im = i < n
            xi = tl.load(cand_x_ptr + i, mask=im, other=float("-inf"))
            kk = im
            if (k_active != 0) & (pid * BLOCK_C < n):
                above = tl.zeros((BLOCK_C,), dtype=tl.int32)
                for j0 in range(0, n, BLOCK_J):
                    j = j0 + tl.arange(0, BLOCK_J)
                    xj = tl.load(cand_x_ptr + j, mask=j < n, other=float("-inf"))
                    above += tl.sum((xj[None, :] > xi[:, None]).to(tl.int32), axis=1)
                kk = im & (above < k)
            tl.store(keptk_ptr + i, kk.to(tl.int8), mask=im)
            tl.store(part_z1_ptr + pid, tl.sum(tl.where(kk, tl.exp(xi - m), 0.0), axis=0))
        if (mode == _OVER) & (pid == 0):
            tau = _exact_threshold(x_ptr, scratch_ptr, V, m, tl.load(fp_ptr + _F_LOG_MIN_P), k, k_active,
                                   tl.load(plan_i_ptr + 4), tl.load(fp_ptr + _F_TOP_P), tl.load(plan_i_ptr + 1),
                                   SLOW_BLOCK, NB, INV_W)
            tl.store(tau_ptr, tau)


# ---------------------------------------------------------------- 5. top-p, Gumbel-max per program

@triton.jit
def _select_kernel(x_ptr, cand_x_ptr, cand_i_ptr, keptk_ptr, part_z1_ptr, part_score_ptr, part_tok_ptr,
                   plan_i_ptr, plan_f_ptr, tau_ptr, fp_ptr, ip_ptr, pos_ptr, row_ptr, V, NP, G,
                   BLOCK_C: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK: tl.constexpr, G_POW2: tl.constexpr):
    pid = tl.program_id(0)
    r = _row(row_ptr)
    fp_ptr += r * _NUM_F
    ip_ptr += r * _NUM_I
    flags = tl.load(ip_ptr + _I_FLAGS)
    if (flags & _GREEDY) == 0:
        mode = tl.load(plan_i_ptr + 0)
        m = tl.load(plan_f_ptr + 0)
        seed = tl.load(ip_ptr + _I_SEED)
        position = tl.load(pos_ptr).to(tl.int64) + 1
        if mode == _CAND:
            n = tl.load(plan_i_ptr + 2)
            i = pid * BLOCK_C + tl.arange(0, BLOCK_C)
            im = i < n
            x = tl.load(cand_x_ptr + i, mask=im, other=float("-inf"))
            idx = tl.load(cand_i_ptr + i, mask=im, other=0)
            kept = tl.load(keptk_ptr + i, mask=im, other=0) != 0
            if (tl.load(plan_i_ptr + 4) != 0) & (pid * BLOCK_C < n):  # top-p
                g = tl.arange(0, G_POW2)
                z1 = tl.sum(tl.load(part_z1_ptr + g, mask=g < G, other=0.0), axis=0)  # the top-k set's mass
                z1 = tl.where(tl.load(plan_i_ptr + 3) != 0, z1, tl.load(plan_f_ptr + 1))  # else all of S0's
                target = tl.load(fp_ptr + _F_TOP_P) * z1
                mass = tl.zeros((BLOCK_C,), dtype=tl.float32)
                for j0 in range(0, n, BLOCK_J):
                    j = j0 + tl.arange(0, BLOCK_J)
                    jm = j < n
                    xj = tl.load(cand_x_ptr + j, mask=jm, other=float("-inf"))
                    ej = tl.where(tl.load(keptk_ptr + j, mask=jm, other=0) != 0, tl.exp(xj - m), 0.0)
                    mass += tl.sum(tl.where(xj[None, :] > x[:, None], ej[None, :], 0.0), axis=1)
                kept = kept & (mass < target)
            if pid * BLOCK_C < n:
                _store_best(x, idx, kept, seed, position, part_score_ptr, part_tok_ptr, pid)
            else:
                _store_none(part_score_ptr, part_tok_ptr, pid)
        elif pid < NP:  # ALL / OVER: a block of the vocabulary
            idx = pid * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + idx, mask=idx < V, other=float("-inf"))
            kept = (x > float("-inf")) & ((x - m) >= tl.load(fp_ptr + _F_LOG_MIN_P))
            if mode == _OVER:
                kept = kept & (_key(x) >= tl.load(tau_ptr))
            _store_best(x, idx, kept, seed, position, part_score_ptr, part_tok_ptr, pid)
        else:
            _store_none(part_score_ptr, part_tok_ptr, pid)


@triton.jit
def _store_none(part_score_ptr, part_tok_ptr, pid):
    tl.store(part_score_ptr + pid, float("-inf"))
    tl.store(part_tok_ptr + pid, _IMAX)


@triton.jit
def _store_best(x, idx, kept, seed, position, part_score_ptr, part_tok_ptr, pid):
    # this program's best x + Gumbel over its kept tokens (ties: lowest id)
    score = tl.where(kept, x + gumbel(seed, idx, position, _STREAM_SAMPLE), float("-inf"))
    best = tl.max(score, axis=0)
    tl.store(part_score_ptr + pid, best)
    tl.store(part_tok_ptr + pid, tl.min(tl.where(score == best, idx, _IMAX), axis=0))


# ---------------------------------------------------------------- 6. the token and the slot's state

@triton.jit
def _finish_kernel(part_max_ptr, part_arg_ptr, part_score_ptr, part_tok_ptr, NP, G, token_ptr, out_tokens_ptr,
                   step_idx_ptr, pos_ptr, embed_ptr, h_ptr, H, ip_ptr, counts_ptr, ring_ptr, ban_ptr, banned_ptr,
                   table_ptr, row_ptr, V, NP_POW2: tl.constexpr, G_POW2: tl.constexpr, H_POW2: tl.constexpr,
                   EMBED: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    r = _row(row_ptr)
    ip_ptr += r * _NUM_I
    counts_ptr += r * V
    ring_ptr += r * _RING
    ban_ptr += r * V
    banned_ptr += r * _MAX_BW
    table_ptr += r * (_MAX_BW * _BW_LEN)
    flags = tl.load(ip_ptr + _I_FLAGS)
    p = tl.arange(0, NP_POW2)
    gv = tl.load(part_max_ptr + p, mask=p < NP, other=float("-inf"))
    ga = tl.load(part_arg_ptr + p, mask=p < NP, other=_IMAX)
    tok_greedy = tl.min(tl.where(gv == tl.max(gv, axis=0), ga, _IMAX), axis=0)
    g = tl.arange(0, G_POW2)
    sv = tl.load(part_score_ptr + g, mask=g < G, other=float("-inf"))
    st = tl.load(part_tok_ptr + g, mask=g < G, other=_IMAX)
    tok_sampled = tl.min(tl.where(sv == tl.max(sv, axis=0), st, _IMAX), axis=0)
    tok_sampled = tl.where(tok_sampled == _IMAX, 0, tok_sampled)  # nothing kept (every logit -inf): id 0, as argmax
    tok = tl.where((flags & _GREEDY) != 0, tok_greedy, tok_sampled).to(tl.int64)
    step = tl.load(step_idx_ptr)
    position = tl.load(pos_ptr).to(tl.int64) + 1
    tl.store(token_ptr, tok)
    tl.store(out_tokens_ptr + step, tok)
    tl.store(step_idx_ptr, step + 1)
    tl.store(pos_ptr, tl.load(pos_ptr) + 1)
    if EMBED:
        hh = tl.arange(0, H_POW2)
        row = tl.load(embed_ptr + tok * H + hh, mask=hh < H)
        tl.store(h_ptr + hh, row, mask=hh < H)
    if (flags & _TRACK) != 0:
        tl.store(counts_ptr + tok, tl.load(counts_ptr + tok) + 1)
    if (flags & _BAD_WORDS) != 0:  # the ids the bad words ban at the next position
        tl.store(ring_ptr + position % _RING, tok)
        w = tl.arange(0, _MAX_BW)
        old = tl.load(banned_ptr + w)
        tl.store(ban_ptr + old, tl.zeros((_MAX_BW,), dtype=tl.uint8), mask=old >= 0)
        tl.debug_barrier()
        c = tl.arange(0, _BW_LEN)
        o = _BW_LEN - 1 - c  # offset from the word's end; 0: the banned id
        hp = position + 1 - o  # the history position column c must match
        valid = (o >= 1) & (hp >= tl.load(ip_ptr + _I_FIRST_OUT))
        hist = tl.load(ring_ptr + (hp % _RING), mask=valid, other=-2)
        table = tl.load(table_ptr + w[:, None] * _BW_LEN + c[None, :])
        match = (table == -1) | (o == 0)[None, :] | ((table.to(tl.int64) == hist[None, :]) & valid[None, :])
        last = tl.load(table_ptr + w * _BW_LEN + _BW_LEN - 1)
        hit = (tl.min(match.to(tl.int32), axis=1) == 1) & (last >= 0)
        new = tl.where(hit, last, -1)
        tl.store(banned_ptr + w, new)
        tl.store(ban_ptr + new, tl.full((_MAX_BW,), 1, dtype=tl.uint8), mask=new >= 0)


@triton.jit
def _grammar_mask_kernel(logits_ptr, gmask_ptr, row_ptr, V, W, BLOCK: tl.constexpr):
    """logits[i] = -inf where bit i % 32 of word i // 32 of the row's bitmask is 0."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    r = tl.load(row_ptr).to(tl.int64)
    words = tl.load(gmask_ptr + r * W + offs // 32, mask=ok, other=-1)
    bit = (words >> (offs % 32)) & 1
    logits = tl.load(logits_ptr + offs, mask=ok, other=0.0)
    tl.store(logits_ptr + offs, tl.where(bit != 0, logits, float("-inf")), mask=ok)


LP_CHUNK = 512  # logprobs_rows: the vocabulary in chunks of this many ids, reduced in two stages


def logprobs_rows(logits: torch.Tensor, token: torch.Tensor, step_idx: torch.Tensor, lp_val: torch.Tensor,
                  lp_ids: torch.Tensor, pad: torch.Tensor) -> None:
    """Rows of float32 logits [B, V] and their sampled tokens [B]: each row's logprob, rank (tokens with
    logprob >= its own) and top K = lp_val.shape[-1] - 1 into ``lp_val`` / ``lp_ids`` [B, S, 1 + K] at
    row ``step_idx[b] - 1``. Capturable (static shapes, no host sync). Two stages over chunks of
    LP_CHUNK ids (``pad`` [B, C * LP_CHUNK] float32, -inf past V: its own buffer), so no reduction or
    top-k runs over a whole 128K row in one block: the log-sum-exp from per-chunk maxima and sums, the
    top K of each chunk then of the B x C x K survivors."""
    b, v = logits.shape
    k = lp_val.shape[-1] - 1
    pad[:, :v].copy_(logits)
    x = pad.view(b, -1, LP_CHUNK)  # [B, C, L]
    m = x.amax(dim=-1).amax(dim=-1)  # [B]
    z = torch.exp(x - m[:, None, None]).sum(dim=-1).sum(dim=-1)
    lp = x - (m + torch.log(z))[:, None, None]  # [B, C, L]
    flat = lp.view(b, -1)
    tok_lp = flat.gather(1, token.view(b, 1).long())  # [B, 1]
    rank = (lp >= tok_lp[:, :, None]).sum(dim=-1).sum(dim=-1, keepdim=True)  # [B, 1], padding counted
    rank = rank - (pad.shape[1] - v) * (tok_lp == float("-inf")).long()  # ... only by a -inf token: not it
    kk = min(k, LP_CHUNK)
    v1, i1 = lp.topk(kk, dim=-1)  # [B, C, kk]
    i1 = i1 + (torch.arange(x.shape[1], device=x.device) * LP_CHUNK)[None, :, None]
    v2, j = v1.view(b, -1).topk(k, dim=-1)  # [B, K]
    ids = i1.view(b, -1).gather(1, j)
    at = (step_idx.view(b).long() - 1).clamp(min=0)
    rows = torch.arange(b, device=x.device)
    lp_val.index_put_((rows, at), torch.cat([tok_lp, v2], dim=1))
    lp_ids.index_put_((rows, at), torch.cat([rank, ids], dim=1))


def candidate_cap(vocab: int) -> int:
    """A decoder's FastSampler ``cap`` (candidate buffer): the vocabulary's power of two, 64..16384."""
    return min(16384, max(64, 1 << (vocab - 1).bit_length()))


class FastSampler:
    """The sampling tail of one batch-1 decoder: its scratch buffers and launches (module docstring).

    ``state``: the slot's row of SamplingBuffers; or, with ``row`` (int32 [1] on the device), row 0's views
    (the buffers' bases) and the kernels read row ``row[0]`` (a batched decoder's slot, set between
    replays). ``finish(logits, token, out_tokens, step_idx, pos,
    embed, h)`` is capturable (no host sync, no allocation) and writes like ``gemv.greedy_finish``;
    ``embed``/``h`` None: no next-embedding gather (a decoder that feeds the token itself)."""

    def __init__(self, state: S.SlotSampling, vocab: int, device: torch.device | str, *, block_v: int = 2048,
                 cap: int = 16384, block_c: int = 64, block_j: int = 64, num_warps: int = 4, pdl: bool = False,
                 row: torch.Tensor | None = None):
        dev = torch.device(device)
        self.row = row if row is not None else torch.zeros(1, dtype=torch.int32, device=dev)
        self.state, self.vocab, self.pdl = state, vocab, pdl
        self.block_v, self.cap, self.block_c, self.block_j, self.num_warps = block_v, cap, block_c, block_j, num_warps
        self.slow_block = min(4096, triton.next_power_of_2(vocab))  # the exact search's loads per iteration
        self.np = triton.cdiv(vocab, block_v)
        self.g = max(self.np, triton.cdiv(cap, block_c))
        self.x = torch.zeros(vocab, dtype=torch.float32, device=dev)
        self.part_max = torch.zeros(self.np, dtype=torch.float32, device=dev)
        self.part_arg = torch.zeros(self.np, dtype=torch.int32, device=dev)
        self.part_z = torch.zeros(self.np, dtype=torch.float32, device=dev)
        self.nscratch = triton.next_power_of_2(NUM_BUCKETS + 2)
        self.scratch = torch.zeros(self.nscratch, dtype=torch.int32, device=dev)  # histogram, |S0|, candidates
        self.plan_i = torch.zeros(8, dtype=torch.int32, device=dev)
        self.plan_f = torch.zeros(8, dtype=torch.float32, device=dev)
        self.tau = torch.zeros(1, dtype=torch.int64, device=dev)
        self.cand_x = torch.zeros(cap, dtype=torch.float32, device=dev)
        self.cand_i = torch.zeros(cap, dtype=torch.int32, device=dev)
        self.keptk = torch.zeros(cap, dtype=torch.int8, device=dev)
        self.part_z1 = torch.zeros(self.g, dtype=torch.float32, device=dev)
        self.part_score = torch.zeros(self.g, dtype=torch.float32, device=dev)
        self.part_tok = torch.zeros(self.g, dtype=torch.int32, device=dev)
        self.mask_on = False  # grammar mask in the graph being captured (module docstring)
        self.logprobs_on = False  # logprobs in the graph being captured
        self.lp_val: torch.Tensor | None = None  # [out rows, 1 + MAX_LOGPROBS]: token's logprob, then the top
        self.lp_ids: torch.Tensor | None = None  # [out rows, 1 + MAX_LOGPROBS]: token's rank, then the top ids

    def apply_grammar_mask(self, logits: torch.Tensor) -> None:
        s = self.state
        if s.gmask is None:
            raise ValueError("grammar masks need SamplingBuffers with a gmask buffer")
        block = 1024
        _grammar_mask_kernel[(triton.cdiv(self.vocab, block),)](logits, s.gmask, self.row, self.vocab,
                                                               s.gmask.shape[-1], BLOCK=block, num_warps=4)

    def logprobs(self, logits: torch.Tensor, token: torch.Tensor, step_idx: torch.Tensor, num_rows: int) -> None:
        """The sampled token's logprob and rank and the top MAX_LOGPROBS into row step_idx - 1 (capturable)."""
        if self.lp_val is None or self.lp_val.shape[0] != num_rows:
            k = min(S.MAX_LOGPROBS, self.vocab)
            self.lp_val = torch.zeros(num_rows, 1 + k, dtype=torch.float32, device=logits.device)
            self.lp_ids = torch.zeros(num_rows, 1 + k, dtype=torch.int64, device=logits.device)
            self.lp_pad = torch.full((1, triton.cdiv(self.vocab, LP_CHUNK) * LP_CHUNK), float("-inf"),
                                     dtype=torch.float32, device=logits.device)
        logprobs_rows(logits.view(1, -1), token, step_idx, self.lp_val[None], self.lp_ids[None], self.lp_pad)

    @property
    def mode(self) -> int:
        """The last sampled step's mode (MODE_ALL / MODE_CAND / MODE_OVER): host read, tests and benchmarks."""
        return int(self.plan_i[0])

    def finish(self, logits: torch.Tensor, token: torch.Tensor, out_tokens: torch.Tensor, step_idx: torch.Tensor,
               pos: torch.Tensor, embed: torch.Tensor | None = None, h: torch.Tensor | None = None) -> None:
        s, v, nw = self.state, self.vocab, self.num_warps
        np_pow2, g_pow2 = triton.next_power_of_2(self.np), triton.next_power_of_2(self.g)
        if self.mask_on:
            self.apply_grammar_mask(logits)
        common = dict(BLOCK=self.block_v, num_warps=nw)
        _process_kernel[(self.np,)](logits, self.x, self.part_max, self.part_arg, self.scratch, s.fparams, s.iparams,
                                    s.bias, s.prompt_mask, s.counts, s.stop_mask, s.ban, pos, self.row, v,
                                    NSCRATCH=self.nscratch, **common)
        _hist_kernel[(self.np,)](self.x, self.part_max, self.part_z, self.scratch, s.fparams, s.iparams, self.row, v,
                                 self.np,
                                 NP_POW2=np_pow2, NB=NUM_BUCKETS, INV_W=INV_BUCKET_WIDTH, **common)
        _collect_kernel[(self.np,)](self.x, self.part_max, self.part_z, self.scratch, self.cand_x, self.cand_i,
                                    self.plan_i, self.plan_f, s.fparams, s.iparams, self.row, v, self.np,
                                    NP_POW2=np_pow2,
                                    NB=NUM_BUCKETS, INV_W=INV_BUCKET_WIDTH, CAP=self.cap, **common)
        _rank_kernel[(self.g,)](self.x, self.cand_x, self.keptk, self.part_z1, self.plan_i, self.plan_f, self.tau,
                                self.scratch, s.fparams, s.iparams, self.row, v, BLOCK_C=self.block_c,
                                BLOCK_J=self.block_j,
                                SLOW_BLOCK=self.slow_block, NB=NUM_BUCKETS, INV_W=INV_BUCKET_WIDTH,
                                num_warps=2 * nw)
        _select_kernel[(self.g,)](self.x, self.cand_x, self.cand_i, self.keptk, self.part_z1, self.part_score,
                                  self.part_tok, self.plan_i, self.plan_f, self.tau, s.fparams, s.iparams, pos,
                                  self.row, v,
                                  self.np, self.g, BLOCK_C=self.block_c, BLOCK_J=self.block_j, G_POW2=g_pow2,
                                  **common)
        hidden = embed.shape[1] if embed is not None else 1
        _finish_kernel[(1,)](self.part_max, self.part_arg, self.part_score, self.part_tok, self.np, self.g, token,
                             out_tokens, step_idx, pos, embed if embed is not None else logits,
                             h if h is not None else logits, hidden, s.iparams, s.counts, s.ring, s.ban, s.banned,
                             s.bad_table, self.row, v, NP_POW2=np_pow2, G_POW2=g_pow2,
                             H_POW2=triton.next_power_of_2(hidden), EMBED=embed is not None, PDL=self.pdl,
                             num_warps=nw, **launch_opts(self.pdl))
        if self.logprobs_on:
            self.logprobs(logits, token, step_idx, out_tokens.shape[0])
