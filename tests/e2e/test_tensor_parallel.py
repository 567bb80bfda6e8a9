"""A tensor-parallel decode node behind the real lane: ``expresslane decode --tensor-parallel-size 2``
(two processes, gloo on CPU) fed by vLLM with TP=1, whose connector writes each rank its half of
the KV heads into that rank's own receive buffer. Its tokens equal vLLM's greedy tokens; a rank
that dies takes the node down, and the request it was decoding finishes on another node."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from infra.up import stop_all
from tests.e2e.conftest import E2E_VLLM_SERVERS, LLAMA_NODES, sse_events, wait_until
from tests.fixtures.vllm import vllm_greedy

pytestmark = pytest.mark.e2e
VLLM_SERVERS = E2E_VLLM_SERVERS
NODE = "llama-tp"
MIGRATED_TOKENS = 300


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _express(dep, prompt_ids: list[int] | None, prompt: str, max_tokens: int):
    """A streamed greedy express completion: (lane, token ids, prompt ids, node events)."""
    body = {"model": dep.llama_model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with httpx.stream("POST", f"{dep.router_url}/v1/chat/completions", json=body, timeout=180.0,
                      headers={"x-expresslane": "on"}) as r:
        assert r.status_code == 200, r.read()
        lane = r.headers["x-expresslane-lane"]
        events = sse_events(r.iter_lines())
    ids, prompt_ids = [], None
    for e in events:
        prompt_ids = e.get("prompt_token_ids") or prompt_ids
        for c in e.get("choices", []):
            ids += c.get("token_ids") or []
    return lane, ids, prompt_ids


@pytest.fixture
def tp_node(deployment):
    """The llama nodes stopped and a two-rank node in their place; the llama nodes back after."""
    dep = deployment
    stop_all([dep.procs.pop(n) for n in LLAMA_NODES], grace_s=10.0)
    proc = dep.decode_proc(NODE, dep.llama.model_dir, "float32")
    proc.argv += ["--tensor-parallel-size", "2"]
    try:
        dep.start(proc)
        wait_until(lambda: dep.express_capacity().get(dep.llama_model), 30.0, "the two-rank node in the router")
        yield proc
    finally:
        if NODE in dep.procs:
            stop_all([dep.procs.pop(NODE)], grace_s=15.0)
        for name in LLAMA_NODES:
            dep.start(dep.decode_proc(name, dep.llama.model_dir, "float32"))
        wait_until(lambda: dep.express_capacity().get(dep.llama_model), 30.0, "the llama nodes back")


def test_two_rank_node_decodes_vllms_tokens_and_dies_cleanly_with_a_rank(deployment, tp_node):
    dep = deployment
    rank0 = tp_node.popen.pid
    ranks = _children(rank0)
    assert len(ranks) == 1, f"rank 0 ({rank0}) runs one more rank, found {ranks}"
    for prompt in ("Tell me about express lanes on a highway.", "Write a haiku about the sea"):
        lane, ids, prompt_ids = _express(dep, None, prompt, 16)
        assert lane == "express" and prompt_ids
        assert ids == vllm_greedy(dep.llama.server, prompt_ids, 16, ignore_eos=True)

    # A rank dies mid-request: the node fails what it holds as retryable, says it is draining and
    # exits 1; the router moves the request on (the standard lane: no express node is left), and
    # the client still gets vLLM's tokens, none lost or repeated.
    result = {}
    prompt = "Tell me a long story about a lighthouse."
    t = threading.Thread(target=lambda: result.update(out=_express(dep, None, prompt, MIGRATED_TOKENS)))
    t.start()
    wait_until(lambda: dep.health(NODE).get("active"), 60.0, "the two-rank node decoding")
    os.kill(ranks[0], signal.SIGKILL)
    assert tp_node.popen.wait(60) == 1  # rank 0 noticed and exited
    t.join(180)
    lane, ids, prompt_ids = result["out"]
    assert ids == vllm_greedy(dep.llama.server, prompt_ids, MIGRATED_TOKENS, ignore_eos=True)
    dep.procs.pop(NODE)
    assert not Path(f"/proc/{ranks[0]}").exists() and not _children(rank0)
