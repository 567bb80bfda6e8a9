"""Several DeepSeek-family slots in one fast-path step (cuda/mla_decoder.py's MlaBatchDecoder), its Triton
kernels interpreted on CPU, through the Engine API.

Slots at different context lengths decode together in one batched step (each row's latent written into its
own slot at its own position, its attention over its own slot, its own experts) and emit, per slot, the
tokens that slot gets decoding alone on the batch-1 fast path: greedy and seeded sampled requests mixed,
with q LoRA and group-limited routing; slots with MTP drafts verify their own drafts in the batched step,
greedy or by speculative sampling; a slot batched with one whose processors read its output decodes plain
steps (writing its draft layer's rows) and drafts again alone; a slot joining or leaving changes no one's
tokens; the scratch slot takes the padded rows and no other slot's cache changes. A sparse-attention model
keeps one slot per step.
"""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine
from shared.events import SamplingParams
from tests.unit.engine.hf_models import save_checkpoint
from tests.unit.engine_cuda.test_engine_fast_path_mla import SMALL
from tests.unit.engine_cuda.test_fast_path_batch import decode_alone, decode_on_schedule, decode_together

PROMPTS = {0: [0, 13, 131, 31], 1: [5, 77, 200, 9, 61, 18, 140], 2: [3, 44]}
DRAFTING_PROMPTS = {**PROMPTS, 3: [11, 12, 13], 4: [250, 1, 90, 7, 33]}  # up to five slots drafting together
REQUESTS = {
    0: SamplingParams(max_tokens=4, ignore_eos=True),
    1: SamplingParams(max_tokens=4, temperature=0.9, top_k=20, top_p=0.9, seed=11, ignore_eos=True),
    2: SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.5, ignore_eos=True),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fast-batch-v3")
    save_checkpoint("deepseek_v3", path, **SMALL)  # q LoRA, 2 routing groups of which 1 is kept, an MTP layer
    return path


def load(path, k: int = 0) -> Engine:
    return Engine.load(path, num_slots=3, max_seq_len=24, dtype="bfloat16", fast_path="on",
                       num_speculative_tokens=k)


@pytest.fixture(scope="module")
def alone(checkpoint):
    """Each request's tokens decoding alone (the batch-1 fast path)."""
    return decode_alone(load(checkpoint), PROMPTS, REQUESTS)


@pytest.mark.parametrize("chain,norm_in_reduce", [(False, False), (True, False), (True, True)])
def test_slots_decode_together_in_one_fast_step_with_their_tokens_alone(checkpoint, alone, chain, norm_in_reduce,
                                                                       monkeypatch):
    # chain: the batched block as one chain of Triton kernels (MlaStack.BATCH_CHAIN: absorb and merge + w_uv
    # kernels over every row) instead of cuBLAS bmms; norm_in_reduce: each MLP's reduce norms h for the next block
    # (MlaStack.NORM_IN_REDUCE), whose own norm launch is skipped
    from services.decode.engine.cuda import mla, smallops

    monkeypatch.setattr(mla.MlaStack, "BATCH_CHAIN", chain)
    monkeypatch.setattr(mla.MlaStack, "NORM_IN_REDUCE", norm_in_reduce)
    norms, rmsnorm_rows = [], smallops.rmsnorm_rows
    monkeypatch.setattr(smallops, "rmsnorm_rows", lambda *a, **kw: norms.append(a[1]) or rmsnorm_rows(*a, **kw))
    engine = load(checkpoint)
    assert engine.fast_path.batch_ok and not engine.fast_path.batches  # interpreted: built at first use
    assert engine.fast_path.max_batch == 8  # more active slots take the reference step together
    before = [kv.clone() for kv in engine.cache.kv]
    got = decode_together(engine, PROMPTS, REQUESTS)  # every step ("fast", 3)
    assert got == alone and all(len(t) == 5 for t in got.values())
    assert set(engine.fast_path.batches) == {4}
    assert engine.fast_path.batches[4][0].stack.absorb is chain
    layers = engine.fast_path.batches[4][0].model.layers
    launched = [[w is lw.attn_norm for w in norms].count(True) for lw in layers]  # attention norm launches a layer
    # every layer's own, once a batched step; or (norm_in_reduce) the first layer's only, the others' by the reduce
    assert launched[0] > 0 and launched[1:] == ([0] if norm_in_reduce else [launched[0]]) * (len(layers) - 1)
    for layer, kv in enumerate(engine.cache.kv[: len(engine.model.layers)]):
        for slot in REQUESTS:  # each slot's rows: the prompt's (prefill) and one per decoded token, nothing past
            n = len(PROMPTS[slot]) + 4
            assert kv[slot, n - 1].abs().max() > 0 and torch.equal(kv[slot, n:], before[layer][slot, n:])


def test_slots_join_and_leave_without_changing_anyone_s_tokens(checkpoint, alone):
    engine = load(checkpoint)
    got, served = decode_on_schedule(engine, PROMPTS, REQUESTS, {0: [0], 1: [1], 2: [2]})
    assert got == alone
    assert served[:3] == [("fast", 1), ("fast", 2), ("fast", 3)] and {p for p, _ in served} == {"fast"}


def _decode(engine: Engine, params: dict[int, SamplingParams]) -> tuple[dict, list]:
    """Every slot of ``params`` started on its prompt, then stepped until all finish: (tokens, each step's
    (path, active slots))."""
    got = {slot: [int(engine.prefill(slot, DRAFTING_PROMPTS[slot]).argmax())] for slot in params}
    for slot, p in params.items():
        engine.start(slot, got[slot][0], p)
    served = []
    while engine.active_slots():
        for slot, out in engine.step().items():
            got[slot] += out.token_ids
        served.append((engine.last_step_path, engine.last_step_slots))
    return got, served


def _reference_and_fast(checkpoint, params: dict[int, SamplingParams], num_slots: int, k: int = 2):
    """The requests decoded together by the reference engine and by the fast path, both drafting k every step:
    (reference tokens, fast tokens, the fast engine's steps, the reference engine, the fast engine)."""
    engines = [Engine.load(checkpoint, num_slots=num_slots, max_seq_len=24, dtype="bfloat16", fast_path=mode,
                           num_speculative_tokens=k, adaptive_speculation=False) for mode in ("off", "on")]
    (want, _), (got, served) = (_decode(e, params) for e in engines)
    return want, got, served, *engines


def _mtp_rows(engine: Engine, slot: int, upto: int) -> torch.Tensor:
    return engine.cache.kv[-1][slot][:upto].float()


@pytest.mark.parametrize("k, slots, batch_k, plain", [(2, (0, 1), 2, None), (2, (0, 1, 2, 3, 4), 1, None),
                                                      (2, (0, 1), 2, 1)])
def test_drafting_slots_verify_their_own_drafts_in_one_batched_step(checkpoint, k, slots, batch_k, plain):
    """Greedy slots with MTP drafts decode together on the fast path, each verifying its own drafts and drawing its
    next ones in the batched step (2 slots: all k; 5 slots, a batch of 8 rows: one draft each, so that the rows fit
    16; ``plain``: a slot that asks for no drafts, one token a step beside a drafting one): every slot's tokens are
    the reference engine's (which drafts for the same slots together), and the MTP layer's cache rows each slot's
    batched steps write (the verified tokens' pairs) are the reference step's."""
    from services.decode.engine import fastpath

    n = 8 if len(slots) == 2 else 5  # (each interpreted step of 8 rows costs ~4 of 2)
    params = {slot: SamplingParams(max_tokens=n, ignore_eos=True, num_speculative_tokens=0 if slot == plain else None)
              for slot in slots}
    want, got, served, ref, engine = _reference_and_fast(checkpoint, params, len(slots), k)
    assert got == want and all(len(t) == n + 1 for t in got.values())
    assert served[0] == ("fast", len(slots)) and {p for p, _ in served} == {"fast"}
    graphs = engine.fast_path.spec_batches  # (padded size, drafts): a batch keeps fewer slots as they finish
    assert (fastpath.padded_batch(len(slots)), batch_k) in graphs
    assert all(d == fastpath.batch_spec_k(size, k) for size, d in graphs)
    accepted = 0
    for slot in slots:
        stats = engine.spec_stats(slot)
        batched = sum(1 for _, n in served[: stats.num_steps] if n > 1)  # its steps while the others decoded
        lo, upto = 0, len(DRAFTING_PROMPTS[slot]) + len(got[slot]) - 2  # rows of verified pairs in both engines
        if slot == plain:  # nothing verified, one token a step, its MTP rows written all the same while batched
            assert stats.num_draft_tokens == stats.num_accepted_tokens == 0 and stats.num_steps == n
            # (its first token's pair, row L - 1, the fast path's first draft writes and the reference's start does
            # not; alone, its plain steps write none: a hole, as the reference's)
            lo, upto = len(DRAFTING_PROMPTS[slot]), len(DRAFTING_PROMPTS[slot]) + batched
        else:
            assert batched > 0 and stats.num_draft_tokens >= batch_k * batched
        accepted += stats.num_accepted_tokens
        fast_rows, ref_rows = _mtp_rows(engine, slot, upto)[lo:], _mtp_rows(ref, slot, upto)[lo:]
        decoded = fast_rows[len(DRAFTING_PROMPTS[slot]) - lo:]
        assert decoded.abs().amax(dim=-1).min() > 0  # every decoded position's row written
        assert torch.allclose(fast_rows, ref_rows, atol=3e-2, rtol=3e-2), (fast_rows - ref_rows).abs().max()
    assert accepted > 0  # drafts were accepted: a slot had more than one token in a step


def test_a_drafting_slot_batched_with_a_penalised_one_decodes_plain_steps_and_drafts_again_alone(checkpoint):
    """Slot 0 (two greedy drafts a step) batched with a sampled slot 1 with a repetition penalty for two plain steps (a
    batch with a slot whose processors read its output does not draft), then alone: its tokens are the reference
    engine's, and its first draft alone starts from its last batched step's hidden, so the MTP cache row that draft
    writes (the pair of hidden 5 and token 6) is the reference step's, not one from a zero hidden."""
    sampled = SamplingParams(max_tokens=2, temperature=0.9, repetition_penalty=1.3, seed=5, ignore_eos=True)
    params = {0: SamplingParams(max_tokens=8, ignore_eos=True), 1: sampled}
    want, got, served, ref, engine = _reference_and_fast(checkpoint, params, 3)
    assert got[0] == want[0]
    assert served[:2] == [("fast", 2), ("fast", 2)] and {p for p, _ in served} == {"fast"}
    assert not engine.fast_path.spec_batches
    stats = engine.spec_stats(0)
    # the two batched steps drafted nothing; alone again, k drafts + verify every step
    assert stats.num_draft_tokens == 2 * (stats.num_steps - 2) > 0 and stats.num_accepted_tokens > 0
    alone_at = len(PROMPTS[0]) + 2  # slot 0's next token after the two batched steps
    fast_row, ref_row = (e.cache.kv[-1][0][alone_at - 1].float() for e in (engine, ref))
    assert fast_row.abs().max() > 0
    assert torch.allclose(fast_row, ref_row, atol=3e-2, rtol=3e-2), (fast_row - ref_row).abs().max()


def test_sampled_slots_draft_together_by_speculative_sampling_with_the_reference_tokens(checkpoint):
    """A greedy slot, two seeded sampled ones and one at temperature 0 with logits processors (one-hot distributions)
    asking for no drafts decode together on the fast path by speculative sampling in one batched step (each slot's
    drafts drawn from its own processed distribution with its own seed, accepted or redrawn against the verify's),
    finishing at different lengths (the batch of 4 shrinks to 2, then one slot alone): their tokens are the reference
    engine's (which drafts for the same slots together with the same distributions and random numbers) and each
    sampled slot's are its tokens alone on the fast path; drafts are accepted, the slot without drafts verifies none."""
    params = {0: SamplingParams(max_tokens=10, ignore_eos=True),
              1: SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=20, min_p=0.05, seed=7,
                                ignore_eos=True),
              2: SamplingParams(max_tokens=6, temperature=0.0, logit_bias={5: 0.5, 42: -1.0}, min_tokens=3,
                                ignore_eos=True, num_speculative_tokens=0),
              3: SamplingParams(max_tokens=7, temperature=0.8, top_k=30, seed=11, ignore_eos=True)}
    want, got, served, _, engine = _reference_and_fast(checkpoint, params, 4)
    assert served[0] == ("fast", 4) and ("fast", 2) in served and {p for p, _ in served} == {"fast"}
    # a sampled slot draws with the reference step's distributions, positions and random numbers over the same MTP
    # rows, so its tokens follow the reference's until bf16 rounding (Triton kernels against torch) flips a draw:
    # here slot 1's last, a redraw after a rejected draft, which it draws alone on the fast path too
    assert {s: t for s, t in got.items() if s != 1} == {s: t for s, t in want.items() if s != 1}
    assert got[1][:8] == want[1][:8] and [len(got[s]) for s in params] == [11, 9, 7, 8]
    assert {key: sorted(map(str, runners)) for key, (_, runners) in engine.fast_path.spec_batches.items()} == {
        (4, 2): ["sampled"], (2, 2): ["sampled"]}
    stats = {slot: engine.spec_stats(slot) for slot in params}
    assert stats[2].num_draft_tokens == stats[2].num_accepted_tokens == 0 and stats[2].num_steps == 6
    assert all(stats[s].num_accepted_tokens > 0 for s in (0, 1, 3))
    for slot in params:
        engine.release(slot)
    for slot in (1, 3):  # alone, the same draws
        assert _decode(engine, {slot: params[slot]})[0] == {slot: got[slot]}
        engine.release(slot)


def test_a_reduced_draft_vocabulary_in_the_batched_drafting_step(checkpoint):
    """``mtp_draft_vocab=128`` of 256: the batched drafting step's draft head reads 128 rows into the front of
    whole-vocabulary rows (the rest -inf). A greedy slot keeps its tokens (the reference engine's); a sampled slot
    allowed only ids >= 128 draws empty draft distributions, so none of its drafts is verified (one token a step,
    none accepted), and its tokens are its tokens alone on the fast path."""
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=5, allowed_token_ids=list(range(128, 256)),
                             ignore_eos=True)
    params = {0: SamplingParams(max_tokens=6, ignore_eos=True), 1: sampled}
    engine = Engine.load(checkpoint, num_slots=2, max_seq_len=24, dtype="bfloat16", fast_path="on",
                         num_speculative_tokens=2, mtp_draft_vocab=128, adaptive_speculation=False)
    got, served = _decode(engine, params)
    assert served[0] == ("fast", 2) and (2, 2) in engine.fast_path.spec_batches
    reference = Engine.load(checkpoint, num_slots=2, max_seq_len=24, dtype="bfloat16", fast_path="off",
                            num_speculative_tokens=2, adaptive_speculation=False)
    assert got[0] == _decode(reference, {0: params[0]})[0][0]
    assert all(t >= 128 for t in got[1][1:]) and engine.spec_stats(1).num_accepted_tokens == 0
    assert engine.spec_stats(1).num_steps == 6
    for slot in params:
        engine.release(slot)
    assert _decode(engine, {1: sampled})[0] == {1: got[1]}


@pytest.mark.parametrize("plain, mtp_rows", [("penalised", True), ("backed_off", True), ("backed_off", False)])
def test_plain_batched_steps_of_drafting_requests_write_the_mtp_rows_drafting_writes(checkpoint, plain, mtp_rows,
                                                                                   monkeypatch):
    """Two greedy requests that may draft decode plain batched steps, beside a penalised request (a batch that does
    not draft: the sampled graph) or backed off by adaptive drafting (a draft priced at a whole step while batched:
    the greedy graph after their first step). Each plain step writes every row's MTP layer row (the pair of the
    step's hidden and the token it picked) as drafting writes it: rows L .. L + 7 of slots 0 and 1 equal (bf16) those
    of the same two requests drafting every step together, their tokens unchanged, nothing written past them; with
    ``FastPath.MTP_ROWS`` off the plain steps leave holes."""
    from services.decode.engine import fastpath, spec_policy

    monkeypatch.setattr(fastpath.FastPath, "MTP_ROWS", mtp_rows)
    monkeypatch.setattr(spec_policy, "BATCH_COST_PER_DRAFT", 1.0)  # batched, no draft count pays
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    penalised = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)
    params = {0: greedy, 1: greedy, 2: penalised} if plain == "penalised" else {0: greedy, 1: greedy}
    engine = Engine.load(checkpoint, num_slots=3, max_seq_len=24, dtype="bfloat16", fast_path="on",
                         num_speculative_tokens=2, adaptive_speculation=plain == "backed_off")
    got, served = _decode(engine, params)
    drafting_steps = 0 if plain == "penalised" else 1  # the first step drafts (k = 2), then drafting backs off
    assert served[0] == ("fast", len(params)) and served.count(("fast", len(params))) >= 5
    assert {p for p, _ in served} == {"fast"}
    assert engine.spec_stats(0).num_draft_tokens == engine.spec_stats(1).num_draft_tokens == 2 * drafting_steps
    keys = engine.fast_path.batches[fastpath.padded_batch(len(params))][1]
    assert (fastpath.SAMPLED_ROW if plain == "penalised" else fastpath.PLAIN_ROW) in keys or not mtp_rows
    rows = {}
    for slot in (0, 1):
        n = len(DRAFTING_PROMPTS[slot])
        rows[slot] = _mtp_rows(engine, slot, n + 8)[n:]
        assert engine.cache.kv[-1][slot][n + 8:].abs().max() == 0  # nothing past the decoded positions
    if not mtp_rows:  # the first step's verify wrote rows L .. L + 2; the plain steps after it none
        assert all(r[3:].abs().max() == 0 for r in rows.values())
        return
    # the rows of the two drafting every step together: the reference step's (the batched fast drafts write the
    # same rows, test_drafting_slots_verify_their_own_drafts_in_one_batched_step; interpreted, that run doubled this)
    drafting = Engine.load(checkpoint, num_slots=3, max_seq_len=24, dtype="bfloat16", fast_path="off",
                           num_speculative_tokens=2, adaptive_speculation=False)
    want, served = _decode(drafting, {0: greedy, 1: greedy})
    assert {s: want[s] for s in (0, 1)} == {s: got[s] for s in (0, 1)}
    assert ("reference", 2) in served and drafting.spec_stats(0).num_draft_tokens > 0
    for slot in (0, 1):
        ref = _mtp_rows(drafting, slot, len(DRAFTING_PROMPTS[slot]) + 8)[len(DRAFTING_PROMPTS[slot]):]
        assert rows[slot].abs().amax(dim=-1).min() > 0 and ref.abs().amax(dim=-1).min() > 0
        assert torch.allclose(rows[slot], ref, atol=3e-2, rtol=3e-2), (rows[slot] - ref).abs().max()


def test_a_sparse_attention_model_keeps_one_slot_per_step(tmp_path):
    save_checkpoint("deepseek_v32", tmp_path, **SMALL)
    engine = Engine.load(tmp_path, num_slots=2, max_seq_len=24, dtype="bfloat16", fast_path="on")
    assert not engine.fast_path.batch_ok and engine.fast_path.max_batch == 1
    with pytest.raises(ValueError, match="one slot per step"):
        engine.fast_path.prepare_batch(2)


@pytest.mark.parametrize("num_slots, sizes", [(1, []), (2, [2]), (3, [2, 4]), (8, [2, 4, 8]), (16, [2, 4, 8])])
def test_batch_graphs_an_engine_builds(num_slots, sizes):
    from services.decode.engine import fastpath

    assert fastpath.batch_sizes(num_slots) == sizes
