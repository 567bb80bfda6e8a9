"""Prefill hand-off cost: extraction time per 1K tokens, and transfer time against raw Mooncake.

    python bench/prefill_handoff.py [--arch llama] [--dtype float32] [--lengths 256,512,1024,1900]
                                    [--repeats 3] [--out bench/results/prefill_handoff.json]

Starts a nats-server, a tiny model's vLLM (CPU) with ExpressConnector as ``expresslane prefill``
would, and a receiver process (the decode side). For each prompt length it sends claimed and
unmarked requests alternately and records:

- ``extract_ms``: time spent in ``wait_for_save`` copying the request's blocks into staging, as
  the connector reports it in KV-ready (this is what the prefill iteration pays);
- ``prefill_ms`` of claimed vs unmarked requests (HTTP round trip; noisy on small machines);
- ``transfer_ms``: the sender's one-sided write (KV-ready), against ``raw_ms``: the bare engine's
  ``batch_transfer_sync_write`` of the same segments and bytes from a registered buffer of this
  process into the same receiver, in the same run.

Prints a table and writes JSON (machine, model, per-length medians).

``--gpu-extract`` (CUDA, no vLLM needed) times the GPU layout adapters instead, on production
shapes (Llama-3-8B in FlashAttention and FlashInfer layouts, DeepSeek-V3 MLA with its MTP layer),
into pinned host staging and into GPU staging: ``bench/results/prefill_extract_gpu.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("vLLM did not become healthy")


async def run(args) -> dict:
    from infra.nats import NatsServer
    from infra.tinymodel import make_model
    from services.prefill.config import ExpressConfig
    from shared.handoff import Handoff, request_params
    from services.prefill.launch import cpu_worker_inline, is_cpu_vllm, kv_transfer_config, vllm_command, vllm_env
    from services.prefill.sender import write_ops
    from shared import subjects
    from shared.bus import Bus
    from shared.events import KvMessage, KvReady, SlotTarget, TransferTarget
    from shared.kvlayout import kv_shape_from_hf_config, layout_spec
    from shared.transport import create_transport
    from infra.processes import stop_process_groups
    from infra.receiver import ReceiverProcess

    import httpx

    work = Path(tempfile.mkdtemp(prefix="bench-prefill-"))
    model_dir = make_model(args.arch, work / "model", dtype="float32")
    hf_config = json.loads((model_dir / "config.json").read_text())
    vocab = int(hf_config["vocab_size"])
    has_mtp = bool(hf_config.get("num_nextn_predict_layers"))
    nats = NatsServer(work / "nats").start()
    stats_path = str(work / "slots")
    config = ExpressConfig(nats_url=nats.url, staging_slots=2, stats_path=stats_path)
    ktc = kv_transfer_config(config, engine_id="bench")
    port = 18000 + os.getpid() % 1000
    extra = ["--max-model-len", "2048", "--enforce-eager"]
    if has_mtp:
        extra += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1})]
    env = vllm_env({**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}, config,
                   cpu_inline=is_cpu_vllm() and cpu_worker_inline(extra))
    log = open(work / "vllm.log", "wb")
    proc = subprocess.Popen(vllm_command(str(model_dir), ktc, port=port, dtype=args.dtype, cpu=None,
                                         extra_args=extra),
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    layout = layout_spec(kv_shape_from_hf_config(hf_config, include_mtp=has_mtp), args.dtype, 2048)
    rx = ReceiverProcess("mooncake", layout.slot_nbytes)
    raw = create_transport("mooncake")
    src = np.random.default_rng(0).integers(0, 255, layout.slot_nbytes, dtype=np.uint8)
    raw.register(src.ctypes.data, src.nbytes)
    bus = await Bus.connect(nats.url, name="bench-prefill")
    ready: asyncio.Queue = asyncio.Queue()

    async def on_event(event, msg):
        await ready.put(event)

    await bus.subscribe(subjects.kv_ready("bench"), on_event, KvMessage)
    rows = []
    try:
        wait_healthy(url, proc)
        # --skip-transfer: a transport this prefill does not enable, so the sender fails at once
        # (KV-failed) and only extraction and the event remain: isolates the transfer's share.
        target = TransferTarget(node_id="bench", transport="nixl" if args.skip_transfer else "mooncake",
                                endpoint=rx.endpoint,
                                slot=SlotTarget(slot=0, base_addr=rx.addr, nbytes=rx.nbytes), layout=layout)
        async with httpx.AsyncClient(timeout=600) as client:
            async def complete(prompt, params=None):
                body = {"model": str(model_dir), "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
                if params:
                    body["kv_transfer_params"] = params
                t0 = time.perf_counter()
                r = await client.post(f"{url}/v1/completions", json=body)
                r.raise_for_status()
                return (time.perf_counter() - t0) * 1e3

            await complete([1, 2, 3])  # warm-up
            for n in args.lengths:
                m = {"extract_ms": [], "transfer_ms": [], "raw_ms": [], "claimed_ms": [], "plain_ms": []}
                nbytes = 0
                for rep in range(args.repeats + 1):  # first round warms up this length
                    # Distinct prompts of the same length: no prefix-cache hit favours either one.
                    prompt, other = ([int(x) for x in np.random.default_rng(n * 100 + 2 * rep + i)
                                      .integers(5, vocab, n)] for i in range(2))
                    h = Handoff(request_id=f"b-{uuid.uuid4().hex[:8]}", lease_id="l", generation=1,
                                target=target)
                    plain_ms = await complete(other)
                    claimed_ms = await complete(prompt, request_params(h))
                    event = await asyncio.wait_for(ready.get(), 60)
                    if args.skip_transfer:
                        event = KvReady(request_id="", lease_id="", generation=0, node_id="", slot=0,
                                        num_tokens=n, layout_version=1, nbytes=0, extract_ms=float("nan"))
                    elif not isinstance(event, KvReady):
                        raise RuntimeError(f"hand-off failed: {event}")
                    # Raw: the bare engine's synchronous batch write of the same segments.
                    ops = write_ops(layout, src.ctypes.data, layout, rx.addr, n)
                    t0 = time.perf_counter()
                    rc = raw.transfer_engine.batch_transfer_sync_write(
                        rx.endpoint, [o[0] for o in ops], [o[1] for o in ops], [o[2] for o in ops])
                    raw_ms = (time.perf_counter() - t0) * 1e3
                    if rc != 0:
                        raise RuntimeError(f"raw mooncake write failed ({rc})")
                    nbytes = event.nbytes
                    if rep:
                        m["extract_ms"].append(event.extract_ms)
                        m["transfer_ms"].append(event.transfer_ms)
                        m["raw_ms"].append(raw_ms)
                        m["claimed_ms"].append(claimed_ms)
                        m["plain_ms"].append(plain_ms)
                med = {k: statistics.median(v) for k, v in m.items()}
                rows.append({"num_tokens": n, "nbytes": nbytes, **med,
                             "extract_ms_per_1k_tokens": med["extract_ms"] * 1000 / n,
                             "prefill_added_ms": med["claimed_ms"] - med["plain_ms"],
                             "transfer_over_raw": med["transfer_ms"] / med["raw_ms"] if med["raw_ms"] else None})
    finally:
        await bus.close()
        rx.close()
        raw.close()
        stop_process_groups([proc], grace_s=30.0)
        nats.stop()
    return {"bench": "prefill_handoff", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
            "model": {"arch": args.arch, "dtype": args.dtype, "bytes_per_token": layout.slot_nbytes // 2048},
            "transport": "none (--skip-transfer)" if args.skip_transfer else "mooncake tcp loopback",
            "repeats": args.repeats, "rows": rows}


# name, adapter, layers, kv heads, head dim (GQA) or latent width (MLA), block size, dtype
GPU_SHAPES = [
    ("llama3-8b flash_attn", "flash_attn", 32, 8, 128, 16, "bfloat16"),
    ("llama3-8b flashinfer", "flashinfer", 32, 8, 128, 16, "bfloat16"),
    ("deepseek-v3 mla+mtp", "mla", 62, 1, 576, 64, "bfloat16"),
]


def gpu_extract(lengths: list[int], repeats: int) -> dict:
    """Extraction on a GPU (no vLLM needed): production-shaped caches in vLLM's GPU layouts,
    checked for equality, timed into pinned host staging and into GPU staging."""
    import torch

    from services.prefill.layouts import FlashAttn, FlashInfer, MlaLatent

    dev = torch.device("cuda")
    rows = []
    for name, kind, layers, heads, dim, block, dtype_name in GPU_SHAPES:
        dtype = getattr(torch, dtype_name)
        max_n = max(lengths)
        num_blocks = max_n // block + 8
        if kind == "flash_attn":
            adapter, cache = FlashAttn(), torch.randn(2, num_blocks, block, heads, dim, device=dev, dtype=dtype)
        elif kind == "flashinfer":
            adapter, cache = FlashInfer(), torch.randn(num_blocks, 2, block, heads, dim, device=dev, dtype=dtype)
        else:
            adapter, cache = MlaLatent(rope_dim=64), torch.randn(num_blocks, block, dim, device=dev, dtype=dtype)
        ids = torch.randperm(num_blocks, device=dev)
        per_layer = 1 if kind == "mla" else 2
        shape = (dim,) if kind == "mla" else (heads, dim)
        for n in lengths:
            nb = -(-n // block)
            block_ids = ids[:nb]
            for where in ("pinned_host", "gpu"):
                out = [torch.empty(n, *shape, dtype=dtype, device="cpu" if where == "pinned_host" else dev,
                                   pin_memory=where == "pinned_host") for _ in range(per_layer * layers)]
                times = []
                for rep in range(repeats + 1):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for layer in range(layers):  # one cache per layer in vLLM; the same tensor here
                        adapter(cache, block_ids, n, out[layer * per_layer:(layer + 1) * per_layer])
                    torch.cuda.synchronize()
                    if rep:
                        times.append((time.perf_counter() - t0) * 1e3)
                # Check: token t of the staged K equals the cache's token t (first layer).
                t = n - 1
                b, o = block_ids[t // block].item(), t % block
                src = cache[0, b, o] if kind == "flash_attn" else cache[b, 0, o] if kind == "flashinfer" else None
                if src is not None:
                    assert torch.equal(out[0][t].to(dev), src), name
                nbytes = sum(x.numel() * x.element_size() for x in out)
                ms = statistics.median(times)
                rows.append({"shape": name, "staging": where, "num_tokens": n, "nbytes": nbytes,
                             "extract_ms": ms, "extract_ms_per_1k_tokens": ms * 1000 / n,
                             "gb_per_s": nbytes / ms / 1e6})
    return {"bench": "prefill_extract_gpu", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="llama")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", default="256,512,1024,1900")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="")
    p.add_argument("--skip-transfer", action="store_true",
                   help="claimed requests are staged but not sent (isolates the transfer's cost)")
    p.add_argument("--gpu-extract", action="store_true",
                   help="only time the GPU layout adapters on production shapes (needs CUDA, not vLLM)")
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if args.gpu_extract:
        result = gpu_extract(args.lengths, args.repeats)
        print(f"{'shape':<22} {'staging':<12} {'tokens':>7} {'MB':>8} {'ms':>8} {'ms/1K tok':>9} {'GB/s':>6}")
        for r in result["rows"]:
            print(f"{r['shape']:<22} {r['staging']:<12} {r['num_tokens']:>7} {r['nbytes'] / 1e6:>8.1f} "
                  f"{r['extract_ms']:>8.3f} {r['extract_ms_per_1k_tokens']:>9.3f} {r['gb_per_s']:>6.1f}")
        out = Path(args.out or ROOT / "bench" / "results" / "prefill_extract_gpu.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
        return 0
    result = asyncio.run(run(args))
    print(f"{'tokens':>7} {'bytes':>10} {'extract ms':>10} {'ms/1K tok':>9} {'+prefill ms':>11} "
          f"{'xfer ms':>8} {'raw ms':>7} {'xfer/raw':>8}")
    for r in result["rows"]:
        print(f"{r['num_tokens']:>7} {r['nbytes']:>10} {r['extract_ms']:>10.3f} "
              f"{r['extract_ms_per_1k_tokens']:>9.3f} {r['prefill_added_ms']:>11.2f} "
              f"{r['transfer_ms']:>8.3f} {r['raw_ms']:>7.3f} {r['transfer_over_raw'] or 0:>8.2f}")
    default = "prefill_handoff_skip_transfer.json" if args.skip_transfer else "prefill_handoff.json"
    out = Path(args.out or ROOT / "bench" / "results" / default)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
