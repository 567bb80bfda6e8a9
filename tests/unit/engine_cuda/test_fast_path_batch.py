"""Several slots in one fast-path step (cuda/batch.py, Triton interpreted on CPU, conftest.py).

Decoder: ``GqaBatchDecoder`` rows at different context lengths in different slots (Llama, Qwen2's
biases, Qwen3's q/k norm; a padded row) against ``cuda.llama.reference_step`` per row: logits, the
K/V rows each step writes into its own slot (and nowhere else), greedy tokens.
Engine: greedy and seeded sampled requests decoding together through ``Engine(fast_path="on")`` take
the batched step and emit, per slot, the tokens that slot gets decoding alone; slots join and leave
mid-run without changing anyone's tokens; Qwen2 and Qwen3 checkpoints likewise; a batch with a request
the fast path cannot serve takes the reference step. Kernel: ``rows_gemv``'s accumulation modes against
the one-token GEMV per row.
"""

from __future__ import annotations

import functools

import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine.cuda import FastOptions, reference_step
from services.decode.engine.cuda.batch import GqaBatchDecoder, padded_batch
from shared.events import SamplingParams
from tests.unit.engine.hf_models import save_checkpoint
from tests.unit.engine_cuda.test_fast_path_families import _close, _gen, _rand, _tables, tiny_model

# 32 x 32 tiles: every GEMV of the tiny model spans several blocks along N and K (the lm_head's last block
# masked: 100 rows); the QKV tile's pairs of 16 rows divide head_dim / 2 at d 32 only: rope in its epilogue there
BATCH_TILES = {"qkv": (32, 32, 4, 1), "o": (32, 32, 4, 1), "gate_up": (32, 32, 4, 1), "down": (32, 32, 4, 1),
               "lm_head": (32, 32, 4, 1)}


@pytest.mark.parametrize("bias, o_bias, qk_norm, d", [(False, False, False, 16), (True, True, False, 16),
                                                       (False, False, True, 16), (False, False, False, 32),
                                                       (True, False, False, 32)],
                         ids=["llama", "qkv + o bias", "qwen3 q/k norm", "llama, rope in the qkv epilogue",
                              "qkv bias, rope in the qkv epilogue"])
def test_batch_decoder_rows_follow_the_reference_step_each_in_its_own_slot(bias, o_bias, qk_norm, d):
    m, n, steps, num_slots = tiny_model(bias, o_bias, qk_norm, d=d), 40, 2, 3  # step 2 feeds step 1's tokens
    g = _gen(1)
    kc = [_rand(g, num_slots + 1, n, 2, d) for _ in m.layers]
    vc = [_rand(g, num_slots + 1, n, 2, d) for _ in m.layers]
    kr, vr = [k.clone() for k in kc], [v.clone() for v in vc]
    cos, sin = _tables(n, d)
    # 2 splits of 16-row blocks: row 1 (5 keys) leaves its second split empty, row 2 (33+) puts two blocks in its
    # first; d 32: also the one-launch attention (each row's kv heads merged by their last split)
    opts = FastOptions(batch_tiles=BATCH_TILES, num_splits=2, block_s=16, attn_one_launch=d == 32,
                       batch_fused_rope=True, norm_late=False)  # (the fused rope takes rows normed before it)
    dec = GqaBatchDecoder(m, kc, vc, cos, sin, batch=4, options=opts, max_steps=8)
    assert dec.fused_rope == (d == 32) and dec.attn.one_launch == (d == 32)
    rows = [(2, 3, 20), (0, 7, 5), (1, 11, 33)]  # (slot, token, context length); row 3 is padding
    dec.set_rows([t for _, t, _ in rows], [c for _, _, c in rows], [s for s, _, _ in rows])
    toks = [t for _, t, _ in rows]
    expected = [[] for _ in rows]
    for i in range(steps):
        dec.step()
        for r, (slot, _, ctx) in enumerate(rows):
            ref = reference_step(m, [k[slot] for k in kr], [v[slot] for v in vr], cos, sin, toks[r], ctx + i)
            _close(dec.logits[r], ref, 1e-5)
            toks[r] = int(ref.argmax())
            expected[r].append(toks[r])
    for layer in range(2):  # every slot's cache as the reference wrote it; the scratch slot aside
        assert torch.equal(kc[layer][:num_slots], kr[layer][:num_slots])
        assert torch.equal(vc[layer][:num_slots], vr[layer][:num_slots])
    assert dec.out_tokens[:3, :steps].tolist() == expected
    assert dec.pos[:3].tolist() == [c + steps for _, _, c in rows]
    assert torch.equal(dec.residual[:3], m.embed[[e[-1] for e in expected]])
    assert not dec.attn.count.any()  # the merge counters are back to zero for the next call
    dec.set_rows([5, 6], [9, 10], [1, 0])  # a re-start: applied by the next step's first kernel, once
    for i in range(2):
        dec.step()
        assert dec.pos.tolist() == [10 + i, 11 + i, 1 + i, 1 + i] and dec.step_idx.tolist() == [1 + i] * 4
        assert dec.slots.tolist() == [1, 0, num_slots, num_slots]
    kr1 = reference_step(m, [k[1] for k in kr], [v[1] for v in vr], cos, sin, 5, 9)  # row 0 restarted: token 5 at 9
    assert dec.out_tokens[0, 0] == int(kr1.argmax())


def test_padded_batch_sizes():
    assert [padded_batch(n) for n in range(1, 9)] == [2, 2, 4, 4, 8, 8, 8, 8]
    with pytest.raises(ValueError):
        padded_batch(9)


# ---------------------------------------------------------------- through the Engine API

OPTIONS = FastOptions(tiles={"qkv": (8, 64, 4, 1), "o": (64, 64, 4, 1), "gate_up": (128, 64, 4, 1),
                             "down": (64, 128, 4, 1), "lm_head": (256, 64, 4, 1)},
                      batch_tiles={"qkv": (32, 64, 4, 1), "o": (64, 64, 4, 1), "gate_up": (128, 64, 4, 1),
                                   "down": (64, 128, 4, 1), "lm_head": (256, 64, 4, 1)}, num_splits=2, block_s=32)
PROMPTS = {0: [0, 17, 42, 99, 3, 250, 7], 1: [0, 88, 2, 150], 2: [0, 5, 9, 33, 61, 200, 11, 14, 90, 3, 8, 60, 2],
           3: [0, 31, 4]}
# max_tokens 7, 3, 5, 2: at one token a step 4, 4, 3, 2, 2, 1, 1 slots decode together, at three a step 4, 2, 1
# (both batch sizes, 4 and 2, taken); slot 2 has tokens left after 2 steps alone (the run-ahead tests)
REQUESTS = {
    0: SamplingParams(max_tokens=7, ignore_eos=True),
    1: SamplingParams(max_tokens=3, temperature=0.9, top_k=50, top_p=0.9, seed=11, ignore_eos=True),
    2: SamplingParams(max_tokens=5, temperature=1.2, presence_penalty=1.0, repetition_penalty=1.3,
                      bad_words_token_ids=[[200], [42, 43]], seed=5, ignore_eos=True),
    3: SamplingParams(max_tokens=2, temperature=0.0, repetition_penalty=1.8, ignore_eos=True),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fast-batch-llama")
    save_checkpoint("llama", path, damp=True)
    return path


def load(path, tokens_per_step: int = 1, mode: str = "on", run_ahead: bool = True) -> Engine:
    return Engine.load(path, num_slots=4, max_seq_len=48, dtype="bfloat16", fast_path=mode,
                       fast_path_options=OPTIONS, fast_path_tokens_per_step=tokens_per_step,
                       fast_path_run_ahead=run_ahead)


@pytest.fixture(scope="module")
def alone(checkpoint):
    """Each request's tokens decoding alone (the batch-1 fast path, every step read before the next)."""
    engine, out = load(checkpoint, run_ahead=False), {}
    for slot in REQUESTS:
        out[slot] = [start(engine, slot)]
        while engine.active_slots():
            out[slot] += engine.step()[slot].token_ids
            assert (engine.last_step_path, engine.last_step_slots) == ("fast", 1)
        engine.release(slot)
    return out


def start(engine: Engine, slot: int) -> int:
    first = int(engine.prefill(slot, PROMPTS[slot]).argmax())
    engine.start(slot, first, REQUESTS[slot])
    return first


@pytest.mark.parametrize("tokens_per_step", [1, 3])
def test_slots_decode_together_in_one_fast_step_with_their_tokens_alone(checkpoint, alone, tokens_per_step):
    engine = load(checkpoint, tokens_per_step)
    got = {slot: [start(engine, slot)] for slot in REQUESTS}
    assert all(engine.slot_fast_path_reason(slot) is None for slot in REQUESTS)
    served = []
    while engine.active_slots():
        for slot, out in engine.step().items():
            assert len(out.token_ids) <= tokens_per_step
            got[slot] += out.token_ids
        assert engine.last_step_path == "fast"
        served.append(engine.last_step_slots)
    assert got == alone
    assert served[0] == 4 and sorted(served, reverse=True) == served
    assert set(engine.fast_path.batches) == {2, 4}


@pytest.mark.parametrize("tokens_per_step", [1, 2])
def test_slots_join_and_leave_mid_run_without_changing_anyone_s_tokens(checkpoint, alone, tokens_per_step):
    """One token a step: every step of a request with room left runs the next one ahead (run-ahead);
    a slot joining or leaving discards it, a continuing step uses it, and no token changes."""
    engine = load(checkpoint, tokens_per_step=tokens_per_step)
    got, served = decode_on_schedule(engine, PROMPTS, REQUESTS, {0: [0], 1: [1], 2: [2, 3]})
    assert got == alone
    assert served[:3] == [("fast", 1), ("fast", 2), ("fast", 4)]
    assert {n for _, n in served} >= {1, 2, 4} and {p for p, _ in served} == {"fast"}
    fast = engine.fast_path
    if tokens_per_step == 1:  # each join discarded the step run ahead
        assert fast.ahead_dropped >= 1
    else:
        assert fast.ahead_kept == fast.ahead_dropped == 0
    assert fast._flight is None  # every slot released: nothing left in flight


def test_a_batch_runs_its_next_step_ahead_while_its_slots_continue(checkpoint, alone):
    engine = load(checkpoint)
    got = {slot: [start(engine, slot)] for slot in (0, 1)}  # greedy and seeded top-k/top-p: no state
    while engine.active_slots():
        for slot, out in engine.step().items():
            got[slot] += out.token_ids
            if out.finish_reason is not None:
                engine.release(slot)
    assert got == {slot: alone[slot] for slot in (0, 1)}
    # slot 1 (3 tokens) runs with slot 0 for 3 steps, the last 2 continuing the one before; then slot 0 alone
    # (4 steps, the last 3 continuing)
    assert engine.fast_path.ahead_kept >= 5 and engine.fast_path.ahead_dropped <= 1


@pytest.mark.parametrize("joining", [0, 1], ids=["a fast request joins", "a reference-step request joins"])
def test_a_discarded_step_run_ahead_takes_its_token_out_of_the_penalty_counts(checkpoint, alone, joining):
    """Slot 2 (penalties, bad words) runs ahead alone; a request joining discards that step: its
    tokens stay those of slot 2 alone, and its penalty counts hold exactly its output at the end."""
    engine = load(checkpoint)
    got = {2: [start(engine, 2)]}
    for _ in range(2):
        got[2] += engine.step()[2].token_ids
    assert engine.fast_path._flight is not None
    if joining == 0:
        got[0] = [start(engine, 0)]
    else:  # more bad words than the fast path holds: the batch takes the reference step
        got[1] = [int(engine.prefill(1, PROMPTS[1]).argmax())]
        engine.start(1, got[1][0], SamplingParams(max_tokens=3, ignore_eos=True, bad_words_token_ids=[[3] * 17]))
    paths = []
    while engine.active_slots():
        for slot, out in engine.step().items():
            got[slot] += out.token_ids
        paths.append(engine.last_step_path)
    assert got[2] == alone[2] and (joining == 1 or got[0] == alone[0])
    assert ("reference" in paths) == (joining == 1) and engine.fast_path.ahead_dropped >= 1
    counts = engine.sampling.counts[2]
    assert torch.equal(counts, torch.bincount(torch.tensor(got[2]), minlength=counts.numel()).to(counts.dtype))


def test_a_released_slot_has_no_step_in_flight_and_its_next_request_starts_clean(checkpoint, alone):
    engine = load(checkpoint)
    got = [start(engine, 0)]
    got += engine.step()[0].token_ids
    assert engine.fast_path._flight is not None  # the second step is on its way
    engine.cancel(0)  # the client went away mid-request
    engine.release(0)
    assert engine.fast_path._flight is None and engine.fast_path.ahead_dropped == 1
    got = [start(engine, 0)]  # the same slot, the same request again: the same tokens as alone
    while engine.active_slots():
        got += engine.step()[0].token_ids
    assert got == alone[0] and engine.fast_path.ahead_kept == len(alone[0]) - 2


def test_a_batch_with_a_request_the_fast_path_cannot_serve_takes_the_reference_step(checkpoint, alone):
    engine = load(checkpoint)
    got = {0: [start(engine, 0)], 1: [int(engine.prefill(1, PROMPTS[1]).argmax())]}
    engine.start(1, got[1][0], SamplingParams(max_tokens=2, ignore_eos=True, bad_words_token_ids=[[3] * 17]))
    paths = []
    while engine.active_slots():
        for slot, out in engine.step().items():
            got[slot] += out.token_ids
        paths.append(engine.last_step_path)
    assert paths[:2] == ["reference"] * 2 and set(paths[2:]) == {"fast"}
    assert got[0] == alone[0]


@functools.cache
def _one_token_rows(rows: int) -> tuple:
    """The rows_gemv test's inputs for ``rows`` rows and, per row, the one-token GEMV's outputs it must
    equal (plain with a norm, SiLU with a norm, plain on the first 40 rows with a residual): computed once
    per row count, as they do not depend on the mode under test."""
    from services.decode.engine.cuda import gemv

    g = _gen(4)
    x, w, nw, res = _rand(g, rows, 96), _rand(g, 2 * 40, 96, std=0.1), (1 + 0.1 * _rand(g, 96)), _rand(g, rows, 40)
    plain, silu, residual = [], [], []
    for r in range(rows):
        one = torch.empty(80, dtype=torch.bfloat16)
        gemv.gemv(x[r], w, one, norm_w=nw, eps=1e-5, block_n=8, block_k=32)
        plain.append(one)
        one = torch.empty(40, dtype=torch.bfloat16)
        gemv.gemv_silu(x[r], w, one, norm_w=nw, eps=1e-5, block_n=8, block_k=32)
        silu.append(one)
        one = torch.empty(40, dtype=torch.bfloat16)
        gemv.gemv(x[r], w[:40], one, residual=res[r], block_n=8, block_k=32)
        residual.append(one)
    return (x, w, nw, res), (plain, silu, residual)


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_rows_gemv_modes_equal_the_one_token_gemv_per_row(mode, rows):
    from services.decode.engine.cuda.batch import rows_gemv

    (x, w, nw, res), (plain, silu_rows, residual) = _one_token_rows(rows)
    kw = dict(block_n=16, block_k=32, stages=1, mode=mode)
    for silu in (False, True):
        out = torch.full((rows, 40 if silu else 80), float("nan"), dtype=torch.bfloat16)
        if silu:
            rows_gemv(x, w, out, norm_w=nw, eps=1e-5, silu=True, **kw)
        else:
            rows_gemv(x, w, out, norm_w=nw, eps=1e-5, **kw)
        for r in range(rows):
            _close(out[r], (silu_rows if silu else plain)[r], 1e-2)
    out = res.clone()
    rows_gemv(x, w[:40], out, residual=out, **kw)
    for r in range(rows):
        _close(out[r], residual[r], 1e-2)


def _params_of(params: SamplingParams | dict, slot: int) -> SamplingParams:
    return params[slot] if isinstance(params, dict) else params


def decode_alone(engine: Engine, prompts: dict, params: SamplingParams | dict, release: bool = True) -> dict:
    """Each slot's tokens (first from its prompt) decoding alone: every step the batch-1 fast path.
    ``params``: every slot's, or a dict of each slot's."""
    out = {}
    for slot, prompt in prompts.items():
        out[slot] = [int(engine.prefill(slot, prompt).argmax())]
        engine.start(slot, out[slot][0], _params_of(params, slot))
        while engine.active_slots():
            out[slot] += engine.step()[slot].token_ids
            assert (engine.last_step_path, engine.last_step_slots) == ("fast", 1)
        if release:
            engine.release(slot)
    return out


def decode_on_schedule(engine: Engine, prompts: dict, params: SamplingParams | dict,
                       schedule: dict[int, list[int]]) -> tuple[dict, list]:
    """Slots joining as ``schedule`` says (step index -> the slots started before that step) and each
    leaving when it finishes while the others keep decoding in the same graphs: (each slot's tokens, each
    step's (path, active slots)). ``params`` as decode_alone's."""
    out, served, step = {}, [], 0
    while engine.active_slots() or step <= max(schedule):
        for slot in schedule.get(step, []):
            out[slot] = [int(engine.prefill(slot, prompts[slot]).argmax())]
            engine.start(slot, out[slot][0], _params_of(params, slot))
        for slot, result in engine.step().items():
            out[slot] += result.token_ids
            if result.finish_reason is not None:
                engine.release(slot)
        served.append((engine.last_step_path, engine.last_step_slots))
        step += 1
    return out, served


def decode_together(engine: Engine, prompts: dict, params: SamplingParams | dict) -> dict:
    """Every slot's tokens with all of them started first: every step one batched fast step of all slots
    (the same ``max_tokens`` for each, so none leaves early). ``params`` as decode_alone's."""
    out = {}
    for slot, prompt in prompts.items():
        out[slot] = [int(engine.prefill(slot, prompt).argmax())]
        engine.start(slot, out[slot][0], _params_of(params, slot))
    while engine.active_slots():
        for slot, step in engine.step().items():
            out[slot] += step.token_ids
        assert (engine.last_step_path, engine.last_step_slots) == ("fast", len(prompts))
    return out


@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
def test_qwen_slots_decode_together_with_their_tokens_alone(tmp_path, variant):
    save_checkpoint(variant, tmp_path, damp=True)
    engine = Engine.load(tmp_path, num_slots=2, max_seq_len=32, dtype="bfloat16", fast_path="on",
                         fast_path_options=OPTIONS)
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)  # 3 batched steps: each feeds the next its tokens
    prompts = {slot: PROMPTS[slot] for slot in (0, 1)}
    alone = decode_alone(engine, prompts, greedy)
    assert decode_together(engine, prompts, greedy) == alone
