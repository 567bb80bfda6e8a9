"""The express lane serving sparse attention (deepseek_v32, glm_moe_dsa) with everything real but the prefill.

Not an end-to-end test: no vLLM prefills here (vLLM's CPU build refuses sparse attention). In its
place runs the prefill stand-in (tests/fixtures/prefill_standin.py), an OpenAI server that runs the
decode engine's own prefill, lays the prompt's KV out as vLLM's CUDA sparse-attention model holds it
(the sparse-MLA latent in FLASHMLA_SPARSE's ``fp8_ds_mla`` or its model-dtype ``auto`` format, and
every layer's DEEPSEEK_V32_INDEXER cache of FP8 keys with per-token scales, MTP layer included,
under shuffled block tables), then runs the connector's worker-side code (``ExpressWorker``:
``register_kv_caches``, ``wait_for_save`` through the DSA layout adapters into a staging slot, the
background sender writing over Mooncake, ``KvReady`` on the bus) and answers the router's streamed
prefill (``max_tokens=1``, ``return_token_ids``, ``kv_transfer_params``) as vLLM does. Everything
else is the product as an operator starts it: a nats-server (JetStream) of the module's own,
``expresslane coordinator``, one ``expresslane decode`` node per family (CPU, bfloat16, its MTP drafts on) and
``expresslane router``.

Per family, one chat completion through the router with ``x-expresslane: on``:
- the router says the express lane served it (``x-expresslane-lane: express``);
- its greedy token ids equal the engine alone (the stand-in's engine, same dtype, MTP drafts and
  torch threads as the node) on the same prompt ids, decoding from the KV as vLLM's cache holds it:
  where vLLM keeps FP8 (every index key; the ``fp8_ds_mla`` latent) the engine's slot holds the
  dequantized values its readers see (the twins' FP8 round trip, independent of the adapters), put
  in the slot as the node's receiver puts it (bytes, then ``inject``). The engine decoding from its
  own unquantized KV is not the reference: FP8 index keys change which tokens its indexer keeps
  (on these checkpoints its tokens part from the lane's within the 12 compared, for both families);
- the node's /metrics count the request under the path that decoded it (``reference``: the CPU
  engine's step) and one ``finished.length``;
- afterwards the stand-in's staging slots are free and it handed one request over (``kv_ready``),
  the node's slot is free and the coordinator holds no lease.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import save_file

from infra.nats import DEV_CONFIG, NatsServer
from infra.processes import free_port
from infra.tinymodel import make_model, make_weights
from infra.up import Proc, stop_all
from services.prefill.config import ExpressConfig
from services.prefill.launch import mooncake_env
from services.prefill.staging import read_stats

CLI = [sys.executable, "-m", "infra.cli"]
MAX_SEQ_LEN = 256
MAX_TOKENS = 12
# arch -> vLLM's latent cache format (fp8_ds_mla: DeepSeek-V3.2's FP8 serving on FLASHMLA_SPARSE)
FAMILIES = {"deepseek_v32": "fp8_ds_mla", "glm_moe_dsa": "auto"}
ADAPTERS = {"fp8_ds_mla": ["DsMlaFp8", "DsaIndexerKeys"], "auto": ["DsaIndexerKeys", "MlaLatent"]}
STORY = ("Tell me a long story about a dragon who lived in the mountains above a small town, guarded a "
         "treasure for a thousand years and one winter met a girl who wanted to learn how to fly, and "
         "tell me what they found when they crossed the sea together.")


def wait_until(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def dsa_checkpoint(arch: str, out: Path) -> Path:
    """make-model's tiny checkpoint with the indexer vLLM can page (index_head_dim 128, as both
    families ship; index_topk 16 stays well below the prompt, so the indexer drops tokens) and,
    for GLM, the config key vLLM ropes its indexer by."""
    path = make_model(arch, out)
    config = json.loads((path / "config.json").read_text())
    config.update(index_head_dim=128)
    if arch == "glm_moe_dsa":
        config["indexer_rope_interleave"] = True
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(make_weights(config, 0, "float32"), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def lane(tmp_path_factory):
    """A nats-server of its own (as tests.fixtures.nats makes them: no coordinator state of this
    module outlives it), the coordinator, a decode node and a prefill stand-in per family, the
    router in front of them."""
    log_dir = Path(tempfile.mkdtemp(prefix="expresslane-dsa-lane-logs-"))
    print(f"logs in {log_dir}")
    env = {"UCX_NET_DEVICES": "lo", **mooncake_env(ExpressConfig(transfer_timeout_s=30.0))}
    procs: list[Proc] = []
    out = {"families": {}}
    nats = NatsServer(tmp_path_factory.mktemp("nats-dsa-lane"), config_file=DEV_CONFIG, stop_with_parent=True)
    nats_url = nats.start(timeout_s=15.0).url

    def start(proc: Proc) -> Proc:
        proc.env = {**env, **proc.env}
        proc.start(log_dir)
        procs.append(proc)
        return proc

    try:
        port = free_port()
        out["coordinator"] = f"http://127.0.0.1:{port}"
        start(Proc("coordinator", CLI + ["coordinator", "--nats-url", nats_url, "--http-port", str(port),
                                         "--tick-ms", "20"], f"{out['coordinator']}/health"))
        for arch, kv_cache_dtype in FAMILIES.items():
            model = dsa_checkpoint(arch, tmp_path_factory.mktemp(f"{arch}-dsa"))
            node_port, standin_port = free_port(), free_port()
            fam = {"model": model, "kv_cache_dtype": kv_cache_dtype, "node": f"http://127.0.0.1:{node_port}",
                   "standin": f"http://127.0.0.1:{standin_port}", "node_id": f"{arch}-0",
                   "stats": str(tmp_path_factory.mktemp(f"{arch}-staging") / "slots")}
            start(Proc(f"{arch}-decode", CLI + [
                "decode", "--nats-url", nats_url, "--model", str(model), "--node-id", fam["node_id"],
                "--slots", "1", "--device", "cpu", "--dtype", "bfloat16", "--max-seq-len", str(MAX_SEQ_LEN),
                "--transport", "mooncake", "--transport-host", "127.0.0.1", "--heartbeat-ms", "300",
                "--http-host", "127.0.0.1", "--http-port", str(node_port)], f"{fam['node']}/health"))
            start(Proc(f"{arch}-standin", [sys.executable, "-m", "tests.fixtures.prefill_standin",
                                           "--model", str(model), "--port", str(standin_port),
                                           "--nats-url", nats_url, "--device", "cpu", "--dtype", "bfloat16",
                                           "--max-seq-len", str(MAX_SEQ_LEN), "--transport", "mooncake",
                                           "--fast-path", "auto", "--num-speculative-tokens", "-1",
                                           "--kv-cache-dtype", kv_cache_dtype, "--stats-path", fam["stats"]],
                       f"{fam['standin']}/health"))
            out["families"][arch] = fam
        for proc in procs:  # started together, waited for together
            proc.wait_healthy(240.0)
        port = free_port()
        out["router"] = f"http://127.0.0.1:{port}"
        router = start(Proc("router", CLI + [
            "router", "--nats-url", nats_url, "--port", str(port), "--host", "127.0.0.1",
            "--prefill-url", ",".join(f["standin"] for f in out["families"].values()),
            "--warm-leases", "0", "--capability-gate", "reject"], f"{out['router']}/health"))
        router.wait_healthy(120.0)

        def every_node_seen():
            capacity = httpx.get(f"{out['router']}/health", timeout=5.0).json()["express_capacity"]
            return all(capacity.get(f["model"].name) or capacity.get(str(f["model"]))
                       for f in out["families"].values())
        wait_until(every_node_seen, 60.0, "both decode nodes seen by the router")
        yield out
    finally:
        stop_all(procs, grace_s=15.0)
        nats.stop()
        left = [p.name for p in procs if p.group_alive()]
        assert not left, f"processes left running: {left}"


def metric(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{want}}}" if labels else name):
            return float(value)
    return 0.0


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_sparse_attention_request_is_decoded_on_the_express_lane(lane, arch):
    fam = lane["families"][arch]
    model = fam["model"].name
    body = {"model": model, "messages": [{"role": "user", "content": STORY}], "temperature": 0,
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True}
    resp = httpx.post(f"{lane['router']}/v1/chat/completions", json=body, headers={"x-expresslane": "on"},
                      timeout=120.0)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-expresslane-lane"] == "express", dict(resp.headers)
    got = resp.json()
    prompt, tokens = got["prompt_token_ids"], got["choices"][0]["token_ids"]
    assert len(prompt) > 64  # more than one kernel block, and well above index_topk (16)
    assert got["choices"][0]["finish_reason"] == "length" and len(tokens) == MAX_TOKENS

    # the stand-in prefilled the prompt the router rendered and staged it through the DSA adapters
    last = httpx.get(f"{fam['standin']}/standin/last", timeout=5.0).json()
    assert last["num_tokens"] == len(prompt) and last["adapters"] == ADAPTERS[fam["kv_cache_dtype"]], last
    alone = httpx.post(f"{fam['standin']}/standin/alone", timeout=120.0,
                       json={"prompt": prompt, "max_tokens": MAX_TOKENS, "as_handed_over": True}).json()
    assert tokens == alone["tokens"]

    # which path decoded it, and everything freed afterwards
    def node_done():
        text = httpx.get(f"{fam['node']}/metrics", timeout=5.0).text
        return text if metric(text, "xl_decode_events_total", event="finished.length") >= 1 else None
    metrics = wait_until(node_done, 30.0, "the node to finish the request")
    assert metric(metrics, "xl_decode_requests_total", path="reference") == 1
    assert metric(metrics, "xl_decode_requests_total", path="fast") == 0

    def freed():
        node = httpx.get(f"{fam['node']}/health", timeout=5.0).json()
        coord = httpx.get(f"{lane['coordinator']}/health", timeout=5.0).json()
        stats = read_stats(fam["stats"])
        return (not node["active"] and len(node["free_slots"]) == node["total_slots"] and coord["leases"] == 0
                and stats["free"] == stats["total"] and stats["kv_ready"] == 1 and stats["kv_failed"] == 0)
    wait_until(freed, 30.0, "the staging slot, the decode slot and the lease to be freed")
