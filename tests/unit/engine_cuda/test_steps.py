"""Whole decode steps of the fast path (kernels interpreted on CPU) against the torch reference steps.

Llama family: GqaDecoder on Triton and on cuBLAS-style backends vs reference_step, token by token.
DeepSeek family: MlaDecoder plain steps vs reference_forward, a verify forward of 3 tokens vs the
reference (also with q LoRA and group-limited routing), and MTP speculative output equal to plain greedy
output with consistent counters.
"""

from __future__ import annotations

import pytest
import torch

from services.decode.engine.cuda import FastOptions, GqaDecoder, GqaLayer, GqaModel, GraphedFn, reference, reference_step
from services.decode.engine.cuda.mla import MlaDims, MtpWeights, prepare_layer, split_shared
from services.decode.engine.cuda.mla_decoder import MlaBatchDecoder, MlaDecoder, MlaModel, reference_forward

BF = torch.bfloat16


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _w(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale * shape[-1] ** -0.5).to(BF)


def _nw(g, n):
    return (1 + 0.1 * torch.randn(n, generator=g)).to(BF)


def _tables(n, dim):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    f = torch.arange(n)[:, None] * inv[None]
    return f.cos(), f.sin()


def tiny_llama():
    g, h, hq, hkv, d, inter, vocab = _gen(0), 64, 4, 2, 16, 96, 100
    layers = [GqaLayer(_nw(g, h), _w(g, (hq + 2 * hkv) * d, h), _w(g, h, hq * d), _nw(g, h), _w(g, 2 * inter, h),
                       _w(g, h, inter)) for _ in range(2)]
    return GqaModel(layers, torch.randn(vocab, h, generator=g).to(BF), _nw(g, h), _w(g, vocab, h), hq, hkv, d, 1e-5)


SMALL_TILES = {"qkv": (8, 32, 4, 2), "o": (8, 32, 4, 1), "gate_up": (16, 32, 4, 3), "down": (8, 32, 4, 1),
               "lm_head": (16, 32, 4, 1)}


@pytest.mark.parametrize("backend", ["triton", "cublas"])
def test_gqa_decoder_follows_reference_tokens_and_advances_state(backend):
    m, n, ctx, steps = tiny_llama(), 40, 20, 4
    g = _gen(1)
    kc = [torch.randn(n, 2, 16, generator=g).to(BF) for _ in m.layers]
    vc = [torch.randn(n, 2, 16, generator=g).to(BF) for _ in m.layers]
    kr, vr = [k.clone() for k in kc], [v.clone() for v in vc]
    cos, sin = _tables(n, 16)
    opts = FastOptions(backends={p: backend for p in SMALL_TILES}, tiles=SMALL_TILES, num_splits=4, block_s=16)
    dec = GqaDecoder(m, kc, vc, cos, sin, opts, max_steps=8)
    step = GraphedFn(dec.step, use_graph=False)
    dec.set_state(3, ctx)
    tok, expected = 3, []
    for i in range(steps):
        ref = reference_step(m, kr, vr, cos, sin, tok, ctx + i, norm_late=backend == "triton")  # opts.norm_late
        step()
        tok = int(ref.argmax())
        expected.append(tok)
        tol = 1e-6 if backend == "triton" else 1e-2  # cuBLAS-style lm_head rounds logits to bf16
        assert ((dec.logits - ref).abs().max() / ref.abs().max()).item() < tol
        assert torch.equal(kc[1][ctx + i], kr[1][ctx + i]) and torch.equal(vc[0][ctx + i], vr[0][ctx + i])
    assert dec.out_tokens[:steps].tolist() == expected
    assert int(dec.pos) == ctx + steps and int(dec.step_idx) == steps
    assert torch.equal(dec.residual, m.embed[expected[-1]])  # the next step's input is already gathered


def test_graphed_fn_runs_steps_per_replay_calls_eagerly_without_graphs():
    calls = []
    step = GraphedFn(lambda: calls.append(1) or len(calls), use_graph=False, steps_per_replay=3)
    step.capture()  # nothing to capture off CUDA
    assert step() == 3 and step() == 6  # the last call's output
    assert len(calls) == 6 and step.graphs == {}


def test_gqa_decoder_rejects_non_bf16_models():
    m = tiny_llama()
    m.embed = m.embed.float()
    with pytest.raises(ValueError, match="bfloat16"):
        GqaDecoder(m, [], [], *_tables(8, 16))


# ---- DeepSeek-V3 family ----

H, NH, R, NOPE, ROPE, V, E, K, INTER, SHARED, VOCAB, DENSE = 32, 2, 32, 16, 16, 16, 4, 2, 16, 1, 40, 32


def _mla_layer(g, dense: bool, q_lora: int = 0):
    p = dict(attn_norm=_nw(g, H), wq=_w(g, NH * (NOPE + ROPE), H), wkv_a=_w(g, R + ROPE, H), kv_a_norm=_nw(g, R),
             w_uk=_w(g, NH, NOPE, R), w_uv=_w(g, NH, V, R), wo=_w(g, H, NH * V, scale=0.3), mlp_norm=_nw(g, H))
    if q_lora:  # the engine's q LoRA names instead of wq
        del p["wq"]
        p.update(wq_a=_w(g, q_lora, H), q_a_norm=_nw(g, q_lora), wq_b=_w(g, NH * (NOPE + ROPE), q_lora))
    if dense:
        p.update(w_gate_up=_w(g, 2 * DENSE, H), w_down=_w(g, H, DENSE, scale=0.3))
    else:
        p.update(router=_w(g, E, H), router_bias=0.1 * torch.randn(E, generator=g), experts_gate_up=_w(g, E, 2 * INTER, H),
                 experts_down=_w(g, E, H, INTER, scale=0.3), shared_gate_up=_w(g, 2 * SHARED * INTER, H),
                 shared_down=_w(g, H, SHARED * INTER, scale=0.3))
    return prepare_layer(p, INTER)


@pytest.fixture(scope="module")
def tiny_mla():
    g = _gen(5)
    dims = MlaDims(H, NH, R, NOPE, ROPE, V, E, K, INTER, SHARED, 1.5, 1e-6, (NOPE + ROPE) ** -0.5)
    layers = [_mla_layer(g, True), _mla_layer(g, False)]
    embed = torch.randn(VOCAB, H, generator=g).to(BF)
    mtp = MtpWeights(_nw(g, H), _nw(g, H), _w(g, H, 2 * H), _nw(g, H), _w(g, VOCAB, H), embed, _mla_layer(g, False))
    return MlaModel(dims, layers, embed, _nw(g, H), _w(g, VOCAB, H), mtp, DENSE)


def _mla_caches(n, seed=6):
    g = _gen(seed)
    return [torch.randn(n, R + ROPE, generator=g).to(BF) for _ in range(3)]


def test_split_shared_is_the_same_mlp():
    g = _gen(7)
    gate_up, down, x = _w(g, 2 * 2 * INTER, H), _w(g, H, 2 * INTER), torch.randn(H, generator=g)
    sg, sd = split_shared(gate_up, down, INTER)
    full = down.float() @ (torch.nn.functional.silu(gate_up.float()[:2 * INTER] @ x) * (gate_up.float()[2 * INTER:] @ x))
    parts = sum(sd[s].float() @ (torch.nn.functional.silu(sg[s].float()[:INTER] @ x) * (sg[s].float()[INTER:] @ x))
                for s in range(2))
    assert torch.allclose(full, parts, atol=1e-5)


@pytest.mark.parametrize("form", ["bmm", "chain", "pdl"])
def test_mla_plain_steps_and_verify_follow_reference(tiny_mla, form, request, monkeypatch):
    # the verify's T-row block with cuBLAS bmms (the default) or as one chain of Triton kernels
    # (MlaStack.VERIFY_CHAIN), on PDL ("pdl")
    from services.decode.engine.cuda import mla

    if form == "pdl":
        request.getfixturevalue("pdl_interpreted")
        monkeypatch.setattr(mla.MlaStack, "PDL", True)
    monkeypatch.setattr(mla.MlaStack, "VERIFY_CHAIN", form != "bmm")
    n, ctx = 40, 12
    caches = _mla_caches(n)
    ref_caches = [c.clone() for c in caches]
    cos, sin = _tables(n, ROPE)
    dec = MlaDecoder(tiny_mla, caches, cos, sin, max_draft=2, max_steps=8, num_splits=4)
    assert (dec.stacks[3].absorb, dec.stacks[3].fused_uv, dec.stacks[3].pdl) == (form != "bmm",) * 2 + (form == "pdl",)
    dec.set_state(3, ctx)
    tok = 3
    for i in range(2):
        dec.plain_step()
        ref, hid = reference_forward(tiny_mla, ref_caches, cos, sin, [tok], ctx + i)
        assert ((dec.logits[1] - ref).abs().max() / ref.abs().max()).item() < 1e-6
        assert torch.equal(caches[1][ctx + i], ref_caches[1][ctx + i])
        tok = int(ref[0].argmax())
        assert int(dec.tokens[0]) == tok and torch.equal(dec.mtp_hidden, hid)
    dec.tokens[:3] = torch.tensor([5, 7, 9])
    dec.pos.fill_(ctx + 5)
    dec.forward(3)
    ref, hid = reference_forward(tiny_mla, ref_caches, cos, sin, [5, 7, 9], ctx + 5)
    assert ((dec.logits[3] - ref).abs().max() / ref.abs().max()).item() < 1e-6
    assert torch.equal(caches[0][ctx + 5:ctx + 8], ref_caches[0][ctx + 5:ctx + 8])


@pytest.mark.parametrize("q_lora, batch, form", [(0, 4, "chain"), (24, 4, "chain"), (0, 8, "chain"),
                                                  (24, 4, "pdl"), (0, 4, "bmm")])
def test_mla_batch_rows_follow_the_reference_each_in_its_own_slot(tiny_mla, q_lora, batch, form, request,
                                                                  monkeypatch):
    """MlaBatchDecoder: rows at different positions in different slots (padded rows on the scratch slot)
    against reference_forward per slot: logits, the latent row each step writes into its own slot and nowhere
    else. The block as one chain of Triton kernels (the absorb kernel, merge + w_uv; "pdl": launched as
    programmatic dependents, MlaStack.PDL, the GPU's default) and as norms + cuBLAS bmms (BATCH_CHAIN off)."""
    from services.decode.engine.cuda import mla

    if form == "pdl":
        request.getfixturevalue("pdl_interpreted")
        monkeypatch.setattr(mla.MlaStack, "PDL", True)
    monkeypatch.setattr(mla.MlaStack, "BATCH_CHAIN", form != "bmm")
    n = 40
    rows = [(2, 3, 20), (0, 7, 5), (1, 11, 33)]  # (slot, token, context length); the rest is padding
    if batch == 8:
        rows += [(4, 19, 12), (3, 23, 1), (5, 29, 27)]
    num_slots = len(rows)
    model = tiny_mla
    if q_lora:
        model = _q_lora_mla(q_lora)
    g = _gen(9)
    caches = [torch.randn(num_slots + 1, n, R + ROPE, generator=g).to(BF) for _ in model.layers]
    ref_caches = [c.clone() for c in caches]
    cos, sin = _tables(n, ROPE)
    dec = MlaBatchDecoder(model, caches, cos, sin, batch=batch, max_steps=8, num_splits=4)
    st = dec.stack
    assert (st.absorb, st.fused_uv, st.pdl, st.early) == ((form != "bmm",) * 2 + (form == "pdl",) * 2)
    dec.set_rows([t for _, t, _ in rows], [c for _, _, c in rows], [s for s, _, _ in rows])
    toks = [t for _, t, _ in rows]
    for i in range(2):  # step 2 feeds step 1's tokens
        dec.step()
        for r, (slot, _, ctx) in enumerate(rows):
            ref, _ = reference_forward(model, [c[slot] for c in ref_caches], cos, sin, [toks[r]], ctx + i)
            assert ((dec.logits[r] - ref[0]).abs().max() / ref.abs().max()).item() < 1e-6
            toks[r] = int(ref[0].argmax())
    for c, rc in zip(caches, ref_caches):  # every slot's cache as the reference wrote it; the scratch slot aside
        assert torch.equal(c[:num_slots], rc[:num_slots])
    m = len(rows)
    assert dec.out_tokens[:m, 1].tolist() == toks and dec.pos[:m].tolist() == [c + 2 for _, _, c in rows]
    assert dec.slots.tolist() == [s for s, _, _ in rows] + [num_slots] * (batch - m)


def _q_lora_mla(q_lora: int) -> MlaModel:
    """A tiny model with q LoRA and group-limited routing (2 groups of 2 experts, the best one kept), no MTP."""
    g = _gen(8)
    dims = MlaDims(H, NH, R, NOPE, ROPE, V, E, K, INTER, SHARED, 1.5, 1e-6, (NOPE + ROPE) ** -0.5,
                   q_lora_rank=q_lora, n_group=2, topk_group=1)
    layers = [_mla_layer(g, True, q_lora), _mla_layer(g, False, q_lora)]
    return MlaModel(dims, layers, torch.randn(VOCAB, H, generator=g).to(BF), _nw(g, H), _w(g, VOCAB, H), None, DENSE)


def _plain_and_verify_follow_reference(model, k_scales: list[float] | None = None) -> None:
    # a plain step at ctx, then a 3-token verify at ctx + 1: logits, tokens and the latent rows each writes
    # (k_scales: the latent in FP8, each layer's k_scale)
    n, ctx = 40, 12
    caches = _mla_caches(n)[:2]
    if k_scales:
        caches = [reference.fp8_latent_bytes(c, s) for c, s in zip(caches, k_scales)]
    ref_caches = [c.clone() for c in caches]
    cos, sin = _tables(n, ROPE)
    dec = MlaDecoder(model, caches, cos, sin, max_draft=2, max_steps=8, num_splits=4, kv_scales=k_scales)
    dec.set_state(3, ctx)
    dec.plain_step()
    ref, _ = reference_forward(model, ref_caches, cos, sin, [3], ctx, k_scales)
    assert ((dec.logits[1] - ref).abs().max() / ref.abs().max()).item() < 1e-6
    assert torch.equal(caches[1][ctx], ref_caches[1][ctx]) and int(dec.tokens[0]) == int(ref[0].argmax())
    dec.tokens[:3] = torch.tensor([5, 7, 9])
    dec.forward(3)  # pos advanced to ctx + 1
    ref, _ = reference_forward(model, ref_caches, cos, sin, [5, 7, 9], ctx + 1, k_scales)
    assert ((dec.logits[3] - ref).abs().max() / ref.abs().max()).item() < 1e-6
    assert dec.logits[3].argmax(-1).tolist() == ref.argmax(-1).tolist()
    assert torch.equal(caches[0][ctx + 1:ctx + 4], ref_caches[0][ctx + 1:ctx + 4])


def test_mla_q_lora_and_group_limited_routing_follow_reference():
    _plain_and_verify_follow_reference(_q_lora_mla(24))


def test_mla_fp8_latent_steps_follow_reference():
    # the latent in FP8 (E4M3 bytes, a k_scale a layer): the plain step and a 3-token verify against the torch
    # twins over the same bytes; the rows each writes byte for byte
    _plain_and_verify_follow_reference(_q_lora_mla(24), k_scales=[0.01, 0.03])


def test_mla_block_fp8_steps_follow_reference():
    # block-scaled FP8 projections and experts (16 x 16 blocks, activations rounded per block): the plain step and
    # a 3-token verify (the tensor-core form: each block's dot scaled on its own) against the torch twins over the
    # same bytes (reference.linear reads BlockFp8)
    from services.decode.engine.cuda.fp8block import BlockFp8, quantize

    model = _q_lora_mla(32)
    for lw in model.layers:
        for name in ("wqkv_a", "wq_b", "wo", "gate_up", "down", "shared_gate_up", "shared_down"):
            w = getattr(lw, name)
            # columns scaled by their 16-block's index: the blocks' scales differ along K as well as N
            setattr(lw, name, quantize(w.float() * (1 + torch.arange(w.shape[-1]) // 16)[None, :] / 2, (16, 16)))
    assert isinstance(model.layers[1].gate_up, BlockFp8) and model.layers[1].wqkv_a.act
    _plain_and_verify_follow_reference(model)


SPEC_N, SPEC_CTX, SPEC_WANT = 40, 12, 5  # the speculative tests: slot size, context, tokens compared


@pytest.fixture(scope="module")
def plain_greedy(tiny_mla):
    """(SPEC_WANT plain greedy tokens after token 3 at SPEC_CTX, the last step's final-normed hidden): the
    output every speculative variant must reproduce, decoded once for all of them."""
    cos, sin = _tables(SPEC_N, ROPE)
    dec = MlaDecoder(tiny_mla, _mla_caches(SPEC_N), cos, sin, max_draft=1, max_steps=16, num_splits=4)
    dec.set_state(3, SPEC_CTX)
    for _ in range(SPEC_WANT):
        dec.plain_step()
    return dec.out_tokens[:SPEC_WANT].tolist(), dec.hid[1][0].clone()


@pytest.mark.parametrize("verify_chain", [False, True])
def test_mtp_spec_output_equals_plain_greedy_output(tiny_mla, plain_greedy, verify_chain, monkeypatch):
    # verify_chain: the verify's block as one chain of Triton kernels (MlaStack.VERIFY_CHAIN)
    from services.decode.engine.cuda import mla

    monkeypatch.setattr(mla.MlaStack, "VERIFY_CHAIN", verify_chain)
    n, ctx, want = SPEC_N, SPEC_CTX, SPEC_WANT
    cos, sin = _tables(n, ROPE)
    dec = MlaDecoder(tiny_mla, _mla_caches(n), cos, sin, max_draft=1, max_steps=16, num_splits=4)
    plain = plain_greedy[0]
    dec.set_state(3, ctx)
    replays = 0
    while int(dec.out_idx) < want:
        dec.spec_step(1)
        replays += 1
    assert dec.out_tokens[:want].tolist() == plain
    emitted, accepted = int(dec.out_idx), int(dec.accepted)
    assert emitted == replays + accepted and 0 <= accepted <= replays
    assert int(dec.pos) == ctx + emitted


@pytest.mark.parametrize("draft_vocab", [VOCAB // 2, 1])
def test_reduced_draft_vocab_drafts_from_the_first_ids_and_keeps_the_output(tiny_mla, plain_greedy, draft_vocab):
    n, ctx, want = SPEC_N, SPEC_CTX, SPEC_WANT
    cos, sin = _tables(n, ROPE)
    plain, last_hidden = plain_greedy
    dec = MlaDecoder(tiny_mla, _mla_caches(n), cos, sin, max_draft=1, max_steps=16, num_splits=4,
                     draft_vocab=draft_vocab)
    assert dec.draft_head.shape[0] == draft_vocab and dec.draft_head.data_ptr() == tiny_mla.mtp.head.data_ptr()
    dec.set_state(3, ctx, last_hidden)
    dec.mtp_draft(0)  # the draft: argmax over the first draft_vocab rows of the MTP head
    head_logits = dec.mtp_hidden.float() @ tiny_mla.mtp.head.float().T  # dec.mtp_hidden: the draft's normed hidden
    assert int(dec.tokens[1]) == int(head_logits[0, :draft_vocab].argmax())
    assert torch.allclose(dec.mtp_logits[0], head_logits[0, :draft_vocab], rtol=1e-5, atol=1e-5)
    dec.set_state(3, ctx)
    while int(dec.out_idx) < want:
        dec.spec_step(1)
    assert dec.out_tokens[:want].tolist() == plain


def test_draft_vocab_out_of_range_is_refused(tiny_mla):
    cos, sin = _tables(8, ROPE)
    for bad in (0, VOCAB + 1):
        with pytest.raises(ValueError, match="draft_vocab"):
            MlaDecoder(tiny_mla, _mla_caches(8), cos, sin, max_draft=1, max_steps=4, draft_vocab=bad)
