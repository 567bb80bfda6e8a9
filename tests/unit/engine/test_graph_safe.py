"""The decode-step functions trace as one graph (no host sync, no data-dependent Python), which is
what CUDA-graph capture needs; checked on CPU with dynamo's fullgraph mode and the eager backend."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_decode_forward_and_mtp_trace_as_one_graph(hf_checkpoint, arch):
    path, _ = hf_checkpoint(arch)
    engine = Engine.load(path, num_slots=2, max_seq_len=64, dtype=torch.float32,
                         num_speculative_tokens=2 if arch == "deepseek_v3" else 0)
    model = engine.model
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    positions = torch.tensor([[3, 4, 5], [9, 10, 11]])
    slot_ids = torch.tensor([0, 1])
    torch._dynamo.reset()
    with torch.inference_mode():
        eager_hidden = model(tokens, positions, slot_ids, 64)
        traced = torch.compile(lambda t, p, s: model(t, p, s, 64), fullgraph=True, backend="eager")
        assert torch.allclose(traced(tokens, positions, slot_ids), eager_hidden, atol=1e-6)
        if engine.model.has_mtp:
            mtp = torch.compile(lambda t, p, h, s: model.mtp_forward(t, p, h, s, 64), fullgraph=True, backend="eager")
            hidden, logits = mtp(tokens, positions, eager_hidden, slot_ids)
            assert logits.shape == (2, 3, engine.cfg.vocab_size)
    torch._dynamo.reset()


def test_sampling_and_acceptance_trace_as_one_graph():
    from services.decode.engine.cuda.sampling_state import RequestSampling, SamplingBuffers
    from services.decode.engine.sampling import ReferenceSampler, sample
    from services.decode.engine.spec import verify

    torch._dynamo.reset()
    b, k, v = 3, 2, 50
    bufs = SamplingBuffers(4, v, "cpu")
    reqs = [RequestSampling(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2, prompt_ids=[1, 2]),
            RequestSampling(temperature=0.7, top_k=5, min_p=0.05, logit_bias={3: 2.0}, seed=1),
            RequestSampling(temperature=1.0, top_p=0.9, presence_penalty=0.5, stop_ids=[4], min_pos=30, seed=2)]
    flags = 0
    for r, req in enumerate(reqs, start=1):
        bufs.arm(r, req, [r, 7, 7], 20)
        flags |= req.flags
    sampler = ReferenceSampler(bufs)
    logits = torch.randn(b * (k + 1), v)
    rows = torch.tensor([1, 2, 3]).repeat_interleave(k + 1)
    positions = torch.arange(20, 20 + k + 1).repeat(b)
    eager = sampler.tokens(logits, rows, positions, flags)
    traced = torch.compile(lambda l, r, p: sampler.tokens(l, r, p, flags), fullgraph=True, backend="eager")
    assert torch.equal(traced(logits, rows, positions), eager)
    probs = torch.compile(lambda l, r, p: sampler.probs(l, r, p, flags), fullgraph=True, backend="eager")(
        logits, rows, positions).view(b, k + 1, v)
    assert torch.allclose(probs, sampler.probs(logits, rows, positions, flags).view(b, k + 1, v))
    drafts = torch.randint(0, v, (b, k))
    args = (probs, probs[:, :k], drafts, torch.tensor([2, 1, 0]), torch.rand(b, k), torch.rand(b, v) + 0.1,
            torch.tensor([True, False, False]))
    n, nxt = torch.compile(verify, fullgraph=True, backend="eager")(*args)
    assert torch.equal(n, verify(*args)[0]) and torch.equal(nxt, verify(*args)[1])
    assert torch.compile(sample, fullgraph=True, backend="eager")(probs, torch.rand(b, k + 1, v) + 0.1, args[-1]).shape == (b, k + 1)
    torch._dynamo.reset()
