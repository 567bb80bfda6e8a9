"""The DeepSeek-family fast path through the Engine API, its Triton kernels interpreted on CPU.

A bfloat16 DeepSeek-V2-Lite-like tiny model (no q LoRA, one routing group; near-bigram, with an MTP
layer whose drafts follow it; ``SMALL``'s shapes): greedy tokens through ``Engine(fast_path="on")`` equal
``Engine(fast_path="off")``'s without drafts and with k = 1..3 MTP drafts per step (one graph of
drafts + verify), also where max_tokens and max_seq_len cut a step; drafts are accepted and counted;
engines it cannot serve say why. The full DeepSeek-V3 layout (q LoRA, group-limited routing, MTP)
decodes on the fast path too, with the reference engine's tokens.
"""

from __future__ import annotations

import json
import shutil

import pytest

from services.decode.engine import Engine
from shared.events import SamplingParams
from tests.unit.engine.hf_models import save_checkpoint

PROMPT = [0, 17, 42, 99, 3, 250, 7]
V3_PROMPT = [0, 13, 131, 31]  # the reference's top-2 logits of its 8 tokens 0.06+ apart: no near-tie
# hf_models' DeepSeek shapes with 2 heads over a hidden size of 32 and MLPs of 32 (dense) / 16 (experts):
# the interpreter's cost grows with the kernels' programs, and these shapes take the same kernel paths as
# the 4-head, 64-wide default (several heads on one latent, routed + shared experts, masked head tiles)
SMALL = dict(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
             moe_intermediate_size=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fast-engine-mla")
    save_checkpoint("deepseek_v3_lite", path, **SMALL)
    return path


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fast-engine-v3")
    save_checkpoint("deepseek_v3", path, **SMALL)  # q LoRA (q_lora_rank 48), 2 routing groups of which 1 is kept
    return path


def load(path, mode: str, k: int, max_seq_len: int = 40, adaptive: bool = False) -> Engine:
    """Drafting every step unless ``adaptive``: these tests are about the draft steps themselves."""
    return Engine.load(path, num_slots=2, max_seq_len=max_seq_len, dtype="bfloat16", fast_path=mode,
                       num_speculative_tokens=k, adaptive_speculation=adaptive)


def run(engine: Engine, prompt: list[int], sampling: SamplingParams, slot: int = 0):
    first = int(engine.prefill(slot, prompt).argmax())
    engine.start(slot, first, sampling)
    tokens, reason, paths, per_step = [first], None, set(), []
    while engine.active_slots():
        out = engine.step()[slot]
        tokens, reason = tokens + out.token_ids, out.finish_reason
        paths.add(engine.last_step_path)
        per_step.append(len(out.token_ids))
    stats = engine.spec_stats(slot)
    engine.release(slot)
    return tokens, reason, paths, per_step, stats


@pytest.mark.parametrize("k", [0, 3])
def test_mla_fast_path_greedy_tokens_equal_the_reference_engine(checkpoint, k):
    greedy = SamplingParams(max_tokens=9, ignore_eos=True)
    fast = load(checkpoint, "on", k)
    assert fast.fast_path_reason is None
    got, reason, paths, per_step, stats = run(fast, PROMPT, greedy)
    want, want_reason, ref_paths, _, _ = run(load(checkpoint, "off", k), PROMPT, greedy)
    assert paths == {"fast"} and ref_paths == {"reference"}
    assert got == want and reason == want_reason == "length" and len(got) == 10
    assert max(per_step) <= k + 1
    if k:
        assert stats.num_draft_tokens == k * stats.num_steps
        assert stats.num_accepted_tokens == len(got) - 1 - stats.num_steps > 0  # drafts were kept
    else:
        assert stats.num_draft_tokens == 0 and len(per_step) == 9


@pytest.mark.parametrize("k, verify_chain", [(0, False), (2, False), (2, True)])
def test_deepseek_v3_with_q_lora_and_group_limited_routing_decodes_on_the_fast_path(v3_checkpoint, k, verify_chain,
                                                                                  monkeypatch):
    # verify_chain: the verify's block as one chain of Triton kernels (MlaStack.VERIFY_CHAIN)
    from services.decode.engine.cuda import mla

    monkeypatch.setattr(mla.MlaStack, "VERIFY_CHAIN", verify_chain)
    greedy = SamplingParams(max_tokens=7, ignore_eos=True)
    fast = load(v3_checkpoint, "on", k)
    assert fast.fast_path_reason is None
    first = int(fast.prefill(0, V3_PROMPT).argmax())
    fast.start(0, first, greedy)
    assert fast.slot_fast_path_reason(0) is None
    fast.release(0)
    got, reason, paths, per_step, stats = run(fast, V3_PROMPT, greedy)
    want, want_reason, ref_paths, _, _ = run(load(v3_checkpoint, "off", k), V3_PROMPT, greedy)
    assert paths == {"fast"} and ref_paths == {"reference"}
    assert got == want and reason == want_reason == "length" and len(got) == 8
    assert max(per_step) <= k + 1
    assert stats.num_draft_tokens == k * stats.num_steps
    assert stats.num_accepted_tokens == len(got) - 1 - stats.num_steps >= (1 if k else 0)  # verified drafts kept


def test_mla_fast_path_cuts_a_speculative_step_at_max_tokens_and_max_seq_len(checkpoint):
    for max_tokens, max_seq_len in ((5, 40), (30, len(PROMPT) + 6)):
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        got = run(load(checkpoint, "on", 3, max_seq_len), PROMPT, sampling)
        want = run(load(checkpoint, "off", 3, max_seq_len), PROMPT, sampling)
        assert got[0] == want[0] and got[1] == want[1] == "length"
        assert len(got[0]) - 1 == min(max_tokens, max_seq_len - len(PROMPT) - 1)


def test_mla_fast_path_refusals_say_why(checkpoint, v3_checkpoint, tmp_path):
    path = shutil.copytree(v3_checkpoint, tmp_path / "unnormalised")  # top-k weights not normalised
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": False}))
    engine = Engine.load(path, num_slots=1, max_seq_len=32, dtype="bfloat16", fast_path="auto")
    assert engine.fast_path is None and "norm_topk_prob=false" in engine.fast_path_reason
    with pytest.raises(ValueError, match="norm_topk_prob=false"):
        Engine.load(path, num_slots=1, max_seq_len=32, dtype="bfloat16", fast_path="on")
    fast = load(checkpoint, "on", 1)
    fast.prefill(0, PROMPT)
    fast.start(0, 5, SamplingParams(max_tokens=3, temperature=0.8, seed=1, logprobs=1))
    assert "logprobs" in fast.slot_fast_path_reason(0)


def test_mla_fast_path_with_a_reduced_draft_vocabulary_keeps_the_output(checkpoint):
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    fast = Engine.load(checkpoint, num_slots=1, max_seq_len=40, dtype="bfloat16", fast_path="on",
                       num_speculative_tokens=2, mtp_draft_vocab=128, adaptive_speculation=False)
    assert fast.fast_path.decoders[0][0].draft_head.shape[0] == 128
    got = run(fast, PROMPT, greedy)
    want = run(load(checkpoint, "off", 2), PROMPT, greedy)
    assert got[0] == want[0] and got[2] == {"fast"}
    one = run(fast, PROMPT, SamplingParams(max_tokens=5, ignore_eos=True, num_speculative_tokens=1))
    assert one[0] == want[0] and max(one[3]) <= 2 and one[4].num_draft_tokens == one[4].num_steps
    for bad in (0, 257):
        with pytest.raises(ValueError, match="mtp_draft_vocab must be 1..256"):
            Engine.load(checkpoint, num_slots=1, max_seq_len=40, dtype="bfloat16", num_speculative_tokens=2,
                        mtp_draft_vocab=bad)


def test_adaptive_drafting_on_the_fast_path_switches_draft_and_plain_steps_without_changing_tokens(tmp_path):
    """Random MTP weights (a model that is not near-bigram): drafts miss, so the request soon decodes
    plain steps on the fast path (its k-draft graph and its plain graph share the slot's decoder state),
    then a probe drafts again (steps 13 and 14 of 15), all with the reference's tokens."""
    save_checkpoint("deepseek_v3_lite", tmp_path, damp=False, **SMALL)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    fast = load(tmp_path, "on", 3, adaptive=True)
    got, reason, paths, per_step, stats = run(fast, PROMPT, greedy)
    want = run(load(tmp_path, "off", 3), PROMPT, greedy)[0]
    assert got == want and paths == {"fast"}
    assert 0 < stats.num_draft_tokens < 3 * stats.num_steps // 2
    assert fast.spec_counters["draft_tokens"] == stats.num_draft_tokens
    assert 0 < fast.spec_counters["steps"] < stats.num_steps  # steps with drafts and plain steps



@pytest.mark.parametrize("arch, mtp_rows", [("deepseek_v3_lite", True), ("deepseek_v3", True),
                                            ("deepseek_v3_lite", False)])
def test_plain_steps_between_drafts_write_the_mtp_rows_a_drafting_step_writes(tmp_path, monkeypatch, arch, mtp_rows):
    """Adaptive drafting on random MTP weights turns drafting off after the first steps (plain steps until a probe).
    Those plain steps still write the MTP layer's cache row of the pair they leave (MlaDecoder.mtp_row: the draft
    prologue, eh_proj and the MTP block's latent alone; without and with q LoRA), so after the run the rows of every
    decoded position are those of the fast path drafting every step (bf16 rounding apart): a probe's drafts
    attend over no holes. With FastPath.MTP_ROWS off, the plain steps' rows stay empty. The rows drafting every step
    writes are the reference step's (the fast path's drafts write the same rows, a test above; interpreted kernels
    drafting every step cost the suite twice this test)."""
    import torch

    from services.decode.engine import fastpath

    monkeypatch.setattr(fastpath.FastPath, "MTP_ROWS", mtp_rows)
    save_checkpoint(arch, tmp_path, damp=False, **SMALL)
    n, rows, tokens = len(PROMPT), {}, {}
    for mode in ("adaptive", "every step"):  # the rows drafting every step writes: the reference step's
        engine = load(tmp_path, "on" if mode == "adaptive" else "off", 3, adaptive=mode == "adaptive")
        out = [int(engine.prefill(0, PROMPT).argmax())]
        engine.start(0, out[0], SamplingParams(max_tokens=16, ignore_eos=True))
        while engine.active_slots():
            out += engine.step()[0].token_ids
        tokens[mode], rows[mode] = out, engine.cache.kv[-1][0][n - 1: n + len(out) - 2].float().clone()
        if mode == "adaptive":
            stats = engine.spec_stats(0)
            assert 0 < stats.num_draft_tokens < 3 * stats.num_steps // 2  # plain steps between drafting ones
    assert tokens["adaptive"] == tokens["every step"]
    fast, ref = rows["adaptive"], rows["every step"]
    written = fast.abs().amax(dim=-1) > 0
    if not mtp_rows:
        assert not written.all()  # the holes this closes
        return
    assert written.all()
    # each row the pair's own (a wrong pair, position or hidden is off by the rows' whole scale); the reference
    # step's torch rows and the kernels' round apart by a few bf16 ulps (a row the verify's several-row MTP block
    # wrote in one run and a one-row draft in the other by a few more)
    rel = (fast - ref).abs().amax(dim=-1) / ref.abs().max()
    assert rel.max() <= 0.06 and (rel <= 0.01).sum() >= len(fast) - 2, rel

DSA_PROMPT = [0, 13, 131, 31, 7, 250, 42, 99, 3, 17, 64, 5, 77, 120]  # longer than index_topk (8): tokens dropped


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_decodes_on_the_fast_path_with_the_reference_tokens(tmp_path, arch):
    """DSA (index_topk 8 of a 14-token prompt: each step attends to 8 tokens its indexer picks) on the fast
    path: plain steps (indexer query, key and head weights, scores, radix top-k, sparse MLA attention; GLM's
    second layer reuses the first one's choice) give the reference engine's greedy tokens, and a seeded
    sampled request its sampled tokens; MTP drafts (the draft layer's own indexer) + a verify whose every
    token attends to its own list keep the greedy output, with drafts accepted."""
    save_checkpoint(arch, tmp_path, **SMALL)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    fast, reference = load(tmp_path, "on", 0), load(tmp_path, "off", 0)
    assert fast.fast_path_reason is None
    got, reason, paths, per_step, _ = run(fast, DSA_PROMPT, greedy)
    want, want_reason, ref_paths, _, _ = run(reference, DSA_PROMPT, greedy)
    assert paths == {"fast"} and ref_paths == {"reference"}
    assert got == want and reason == want_reason == "length" and len(got) == 9 and max(per_step) == 1
    sampled = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    got, _, paths, _, _ = run(fast, DSA_PROMPT, sampled)
    assert paths == {"fast"} and got == run(reference, DSA_PROMPT, sampled)[0]
    drafting = load(tmp_path, "on", 3)
    assert drafting.fast_path_reason is None
    got, reason, paths, per_step, stats = run(drafting, DSA_PROMPT, greedy)
    assert paths == {"fast"} and got == want and reason == "length" and max(per_step) <= 4
    assert stats.num_draft_tokens == 3 * stats.num_steps
    assert stats.num_accepted_tokens == len(got) - 1 - stats.num_steps > 0  # verified drafts kept


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_verify_picks_and_attends_each_tokens_own_rows(tmp_path, arch, monkeypatch):
    """A 4-token verify forward on the fast path (MlaDecoder.forward(4), interpreted) against the reference
    model over the same 4 tokens: every indexer layer's top-k list of every token (rows up to its own
    position) equals the reference's pick, and the logits agree, so each token attends to its own list."""
    import torch

    from services.decode.engine import deepseek
    from services.decode.engine.cuda import dsa
    from services.decode.engine.cuda.adapter import mla_decoder_from_engine

    save_checkpoint(arch, tmp_path, damp=False, **SMALL)  # attention matters: no near-bigram damping
    fast_lists, ref_lists = [], []
    select = dsa.SparseSelect.__call__

    def record_fast(self, q, w, k, pos):
        out = select(self, q, w, k, pos)
        fast_lists.append(sorted(i for i in self.idx.tolist() if i <= int(pos)))
        return out

    picked = deepseek.DeepseekModel._selected

    def record_ref(self, layer, blk, x, *args):
        out = picked(self, layer, blk, x, *args)
        positions = args[-1]
        if positions.shape[-1] == 4:
            ref_lists.extend(torch.nonzero(out[0, 0, j]).reshape(-1).tolist() for j in range(4))
        return out

    monkeypatch.setattr(dsa.SparseSelect, "__call__", record_fast)
    monkeypatch.setattr(deepseek.DeepseekModel, "_selected", record_ref)
    tokens = [5, 77, 140, 9]
    pos = len(DSA_PROMPT)
    fast, ref = (Engine.load(tmp_path, num_slots=1, max_seq_len=40, dtype="bfloat16", fast_path="off",
                             num_speculative_tokens=3) for _ in range(2))
    for e in (fast, ref):
        e.prefill(0, DSA_PROMPT)
    dec = mla_decoder_from_engine(fast.model, 0, max_draft=3)
    dec.set_state(tokens[0], pos)
    dec.tokens.copy_(torch.tensor(tokens))
    fast_lists.clear()
    dec.forward(4)
    got = dec.logits[4].clone()
    with torch.inference_mode():
        hidden = ref.model(torch.tensor([tokens]), torch.arange(pos, pos + 4)[None], torch.tensor([0]), 40)
        want = ref.model.logits(hidden[0]).float()
    assert len(ref_lists) == len(fast_lists) > 0 and fast_lists == ref_lists
    assert any(max(lst) > pos for lst in fast_lists)  # later tokens pick rows the verify itself wrote
    assert len({tuple(lst) for lst in fast_lists[:4]}) > 1  # the tokens' lists differ
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()


@pytest.mark.parametrize("early", [True, False])
def test_the_block_on_programmatic_dependent_launch_keeps_the_tokens(checkpoint, v3_checkpoint, pdl_interpreted,
                                                                     monkeypatch, early):
    # MlaStack.PDL (on by default on sm_90): the block's kernels, with (PDL_EARLY) their first weight tiles
    # before the wait and the first iteration peeled, give the reference step's tokens, without and with drafts
    # (the verify's block a chain too: MlaStack.VERIFY_CHAIN, the default)
    from services.decode.engine.cuda import mla

    monkeypatch.setattr(mla.MlaStack, "PDL", True)
    monkeypatch.setattr(mla.MlaStack, "PDL_EARLY", early)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)  # 5 steps, 2-3 verifies with k = 2: each kernel's chain
    for path, prompt in ((checkpoint, PROMPT), (v3_checkpoint, V3_PROMPT)):
        ref = run(load(path, "off", 0), prompt, greedy)[0]
        for k in (0, 2):
            fast = load(path, "on", k)
            tokens, _, paths = run(fast, prompt, greedy)[:3]
            assert "fast" in paths and tokens == ref
            dec, _ = fast.fast_path.decoders[0]
            assert dec.stacks[1].pdl and dec.stacks[1].moe.pdl  # the one-token stack ran with PDL
            # the verify's stacks (k drafts) are the same chain by default (VERIFY_CHAIN), on PDL as well
            assert dec.stacks[1].early == early and all(st.pdl for st in dec.stacks.values())


def test_the_fast_drafts_write_the_mtp_rows_the_reference_step_and_vllm_write(checkpoint):
    """The MTP layer pairs the hidden at position p with the token at p + 1 in its cache row p (vLLM's MTP
    layer, whose KV the prefill hands over, and the reference step): the fast path's first draft step
    writes row len(prompt) - 1 from the prefill's hidden and the first token (its start drafts nothing),
    and after each verify the rows of the verified tokens from the main model's hiddens, as the reference
    engine does, so both draft the same tokens and accept the same drafts."""
    import torch

    n = len(PROMPT)
    rows, counts = {}, {}
    for mode in ("on", "off"):
        engine = load(checkpoint, mode, 2)
        first = int(engine.prefill(0, PROMPT).argmax())
        engine.start(0, first, SamplingParams(max_tokens=12, ignore_eos=True))
        if mode == "on":
            assert engine.cache.kv[-1][0][n - 1].abs().max() == 0  # no reference drafts at the start
        out = [first]
        for _ in range(3):
            out += engine.step()[0].token_ids
            assert engine.last_step_path == ("fast" if mode == "on" else "reference")
        stats = engine.spec_stats(0)
        counts[mode] = (out, stats.num_steps, stats.num_accepted_tokens)
        rows[mode] = engine.cache.kv[-1][0][: n + len(out) - 2].float().clone()  # rows of verified pairs
    assert counts["on"] == counts["off"] and counts["on"][2] > 0, counts
    fast, ref = rows["on"], rows["off"]
    assert fast[n - 1].abs().max() > 0
    # each row the pair's own (a wrong pair, position or hidden is off by the rows' whole scale); a row whose last
    # writer was the verify's several-row MTP block in one run and the next step's one-row draft in the other
    # rounds apart by a few bf16 ulps on this random model, the plain steps' rows equal the drafts' bit for bit
    assert (fast - ref).abs().max() <= 0.06 * ref.abs().max(), (fast - ref).abs().amax(dim=-1)
    assert (fast == ref).all(dim=-1).sum() >= len(fast) - 2
