"""The decode node on a GPU, end to end: nats-server, coordinator, a decode node on CUDA, the router,
and a prefill stand-in that runs the connector's worker-side code, on a host with two GPUs.

    python bench/gpu_node.py --device cuda [--families llama8b,dsv2lite] [--out bench/results/gpu_node.json]
    python bench/gpu_node.py --device cpu --tiny      # the same run on CPU with tiny shapes (a smoke test)

What runs (every piece but vLLM is the product's own code path):
- ``expresslane decode`` with the flags of docker-compose.yml's decode services (read from the file;
  only the per-deployment ones, --model/--node-id/--transport-host/--http-*, are this run's), on the
  second GPU (``CUDA_VISIBLE_DEVICES=1,0``: it is the process's ``cuda``, and the other GPU stays
  visible for CUDA IPC); the coordinator, the router and nats-server as an operator starts them.
- The prefill stand-in (``standin``: tests/fixtures/prefill_standin.py), on the first GPU, in place
  of vLLM: an OpenAI ``/v1/completions`` server that runs the engine's own prefill into the engine's
  cache, copies it into vLLM's GPU KV layout (FlashAttention's paged
  ``[2, blocks, 16, kv_heads, head_dim]`` per layer for GQA; the MLA latent
  ``[blocks, 64, kv_lora_rank + rope]`` with vLLM's interleaved rope for DeepSeek) under a shuffled
  block table, then runs the connector's worker
  (``services.prefill.worker.ExpressWorker``: ``register_kv_caches``, ``wait_for_save``: layout
  adapters into GPU staging, the background sender writing with the transport, ``KvReady``) and
  streams the first token as vLLM does. vLLM's own model code and scheduler are not in this run.
- The engine run alone (the stand-in's engine: prefill, then greedy steps on the fast path) for the
  reference tokens and the engine's own step time.

Measured per model family and context (1K, 8K): the raw transfer engine's write of the same
segments between the same GPU buffers; the handoff (extraction start -> the node's DecodeStarted,
with extract / transfer / event legs); TTFT (the stand-in's first token -> the client, and the
client's whole TTFT); ITL through the router against the engine's step; tokens equal to the engine
alone. Writes JSON as it goes (partial results survive a failure).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.prefill_standin import add_args as standin_args  # noqa: E402
from tests.fixtures.prefill_standin import log, now, standin_main  # noqa: E402

NODE_ID = "gpu-node-0"
PER_DEPLOYMENT_FLAGS = ("--model", "--node-id", "--transport-host", "--http-host", "--http-port")

LLAMA3_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}, "rope_theta": 500000.0,
}
DSV2_LITE = {  # DeepSeek-V2-Lite's shape (no q LoRA, one routing group, no MTP layer) as a DeepSeek-V3-family config
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "routed_scaling_factor": 1.0, "norm_topk_prob": True, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "hidden_act": "silu", "moe_layer_freq": 1, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "attention_bias": False, "rope_interleave": True,
}
TINY = {
    "llama8b": {**LLAMA3_8B, "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64},
    "dsv2lite": {**DSV2_LITE, "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
                 "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
                 "kv_lora_rank": 128, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32},
}
FULL = {"llama8b": LLAMA3_8B, "dsv2lite": DSV2_LITE}


# ---------------------------------------------------------------- checkpoints

def weight_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, v = c["hidden_size"], c["vocab_size"]
    s = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}

    def mlp(p, i):
        return {f"{p}.gate_proj.weight": (i, h), f"{p}.up_proj.weight": (i, h), f"{p}.down_proj.weight": (h, i)}

    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        s |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)}
        a = f"{p}.self_attn"
        if c["model_type"] == "llama":
            d = c["head_dim"]
            nq, nkv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
            s |= {f"{a}.q_proj.weight": (nq, h), f"{a}.k_proj.weight": (nkv, h), f"{a}.v_proj.weight": (nkv, h),
                  f"{a}.o_proj.weight": (h, nq), **mlp(f"{p}.mlp", c["intermediate_size"])}
            continue
        nh, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        s |= {f"{a}.q_proj.weight": (nh * qk, h),
              f"{a}.kv_a_proj_with_mqa.weight": (c["kv_lora_rank"] + c["qk_rope_head_dim"], h),
              f"{a}.kv_a_layernorm.weight": (c["kv_lora_rank"],),
              f"{a}.kv_b_proj.weight": (nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
              f"{a}.o_proj.weight": (h, nh * c["v_head_dim"])}
        if layer < c["first_k_dense_replace"]:
            s |= mlp(f"{p}.mlp", c["intermediate_size"])
            continue
        e, im = c["n_routed_experts"], c["moe_intermediate_size"]
        s |= {f"{p}.mlp.gate.weight": (e, h), f"{p}.mlp.gate.e_score_correction_bias": (e,)}
        for j in range(e):
            s |= mlp(f"{p}.mlp.experts.{j}", im)
        s |= mlp(f"{p}.mlp.shared_experts", im * c["n_shared_experts"])
    return s


def write_checkpoint(cfg: dict, out: Path, device: str, seed: int = 0) -> Path:
    """An HF checkpoint of random bf16 weights (std 1/sqrt(fan_in), embeddings 1, head 4/sqrt(h),
    norms 1 + N(0, 0.1)) with the tiny models' tokenizer, written tensor by tensor (no second copy)."""
    import torch

    from infra.tinymodel_tokenizer import style_for, tokenizer_config_files, train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    style = style_for("llama")
    tok = train_tokenizer(style)
    tok.save(str(out / "tokenizer.json"))
    for fname, obj in tokenizer_config_files(style).items():
        (out / fname).write_text(json.dumps(obj))
    eos = style.id_of(style.eos)
    cfg = {**cfg, "eos_token_id": eos, "bos_token_id": style.id_of(style.bos)}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    shapes = weight_shapes(cfg)
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    gen = torch.Generator(device=device).manual_seed(seed)
    h = cfg["hidden_size"]
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in shapes.items():
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
            if name.endswith("embed_tokens.weight"):
                pass
            elif name == "lm_head.weight":
                t *= 4.0 / math.sqrt(h)
            elif len(shape) == 1 and "norm" in name:
                t = t * 0.1 + 1.0
            elif len(shape) == 1:
                t *= 0.1
            else:
                t *= 1.0 / math.sqrt(shape[1])
            t.to(torch.bfloat16).view(torch.int16).cpu().numpy().tofile(f)
            del t
    return out


# ---------------------------------------------------------------- the prefill stand-in
# tests/fixtures/prefill_standin.py: the engine's prefill into vLLM's KV layouts and the connector's worker

# ---------------------------------------------------------------- the orchestrator

def compose_decode_flags(path: Path) -> list[str]:
    """The flags docker-compose.yml gives its single-GPU decode services (``decode-*`` in the default
    profile; ``decode-tp`` and other profiled variants are not what this run measures), less the
    per-deployment ones. Those services must agree."""
    import yaml

    services = yaml.safe_load(path.read_text())["services"]
    flag_sets = []
    for name in sorted(n for n in services if n.startswith("decode-") and not services[n].get("profiles")):
        cmd = services[name]["command"]
        assert cmd[0] == "decode", f"{name}: command {cmd}"
        flag_sets.append([f for f in cmd[1:] if f.split("=", 1)[0] not in PER_DEPLOYMENT_FLAGS])
    if not flag_sets or any(f != flag_sets[0] for f in flag_sets):
        raise SystemExit(f"docker-compose decode services disagree on their flags: {flag_sets}")
    return flag_sets[0]


class Procs:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        logf = open(self.work / f"{name}.log", "ab")
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, **(env or {})}, cwd=ROOT)
        self.procs[name] = p
        log("started", name, " ".join(cmd[-12:]))
        return p

    def tail(self, name: str, n: int = 40) -> str:
        try:
            return "\n".join((self.work / f"{name}.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, *names: str) -> None:
        for name in names or list(self.procs):
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def wait_http(url: str, procs: Procs, name: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        p = procs.procs.get(name)
        if p is not None and p.poll() is not None:
            raise RuntimeError(f"{name} exited ({p.returncode}):\n{procs.tail(name)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} not healthy after {timeout_s:.0f} s:\n{procs.tail(name)}")


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Results:
    def __init__(self, path: Path, base: dict) -> None:
        self.path = path
        self.data = base

    def put(self, **kv) -> None:
        self.data.update(kv)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str))


async def client_request(http, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    t0, t0_wall = time.perf_counter(), now()
    arrivals, tokens, lane = [], [], None
    async with http.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            raise RuntimeError(f"router answered {r.status_code}: {(await r.aread())[:500]!r}")
        lane = r.headers.get("x-expresslane-lane") or r.headers.get("x-expresslane")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            ids = [t for c in chunk.get("choices") or [] for t in (c.get("token_ids") or [])]
            if ids:
                arrivals.append((time.perf_counter(), now(), len(ids)))
                tokens += ids
    return {"t0": t0, "t0_wall": t0_wall, "arrivals": arrivals, "tokens": tokens, "lane": lane}


def itl_ms(arrivals: list[tuple[float, float, int]]) -> list[float]:
    """Per-token gaps between the decode node's chunks (from the second decode chunk on)."""
    out = []
    for (a, _, _), (b, _, k) in zip(arrivals[1:], arrivals[2:]):
        out += [(b - a) * 1e3 / k] * k
    return out


def metric_values(text: str, name: str) -> dict[str, float]:
    vals = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, _, v = line.rpartition(" ")
            vals[key] = float(v)
    return vals


async def run_family(fam: str, args, procs: Procs, nats_url: str, res: Results, flags: list[str]) -> None:
    import httpx

    from shared import subjects
    from shared.bus import Bus
    from shared.events import DecodeStarted, KvMessage, KvReady, NodeAvailable, ReportMessage

    cfg = (TINY if args.tiny else FULL)[fam]
    if fam == "dsv2lite" and args.dsv2_layers:
        cfg = {**cfg, "num_hidden_layers": args.dsv2_layers}
    p = f"{fam}_"
    t0 = time.monotonic()
    model_dir = write_checkpoint(cfg, Path(args.models_dir) / f"{fam}-shape", args.gen_device)
    res.put(**{p + "checkpoint_s": round(time.monotonic() - t0, 1)})
    log(fam, "checkpoint written in", res.data[p + "checkpoint_s"], "s")
    max_seq_len = int(next((f.split("=", 1)[1] for f in flags if f.startswith("--max-seq-len=")), 2048))
    py = sys.executable
    gpu_env = {"UCX_NET_DEVICES": "lo"} if args.device == "cpu" else {}
    sport, dport, rport = (free_port() for _ in range(3))
    node_flags = list(flags)
    if args.device == "cpu":  # the smoke run: CPU and its reference step
        node_flags = [f.replace("--device=cuda", "--device=cpu").replace("--fast-path=on", "--fast-path=auto")
                      for f in node_flags]
    procs.start(f"{fam}-decode", [py, "-m", "infra.cli", "decode", *node_flags, f"--model={model_dir}",
                                  f"--node-id={NODE_ID}", "--transport-host=127.0.0.1", "--http-host=127.0.0.1",
                                  f"--http-port={dport}", "--nats-url", nats_url, "--log-format", "json"],
                env={**gpu_env, **({"CUDA_VISIBLE_DEVICES": args.decode_gpus} if args.device == "cuda" else {})})
    procs.start(f"{fam}-standin", [py, str(Path(__file__).resolve()), "standin", "--model", str(model_dir),
                                   "--port", str(sport), "--nats-url", nats_url, "--device", args.device,
                                   "--max-seq-len", str(max_seq_len), "--transport", args.transport,
                                   "--fast-path", "on" if args.device == "cuda" else "auto"],
                env={**gpu_env, **({"CUDA_VISIBLE_DEVICES": args.prefill_gpus} if args.device == "cuda" else {})})
    bus = await Bus.connect(nats_url, name="bench-gpu-node")
    seen: dict[tuple[str, str], float] = {}
    events: dict[tuple[str, str], object] = {}
    node_seen = asyncio.Event()

    async def on_kv(ev, _):
        seen[("kv", ev.request_id)] = now()
        events[("kv", ev.request_id)] = ev

    async def on_report(ev, _):
        if isinstance(ev, DecodeStarted):
            seen[("started", ev.request_id)] = now()

    async def on_avail(ev, _):
        if isinstance(ev, NodeAvailable) and ev.node_id == NODE_ID:
            node_seen.set()

    await bus.subscribe(subjects.kv_ready(NODE_ID), on_kv, KvMessage)
    await bus.subscribe(subjects.COORD_REPORT, on_report, ReportMessage)
    await bus.subscribe(subjects.node_avail(NODE_ID), on_avail, NodeAvailable)
    try:
        t0 = time.monotonic()
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{sport}/health", procs, f"{fam}-standin", args.start_timeout_s)
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{dport}/health", procs, f"{fam}-decode", args.start_timeout_s)
        res.put(**{p + "start_s": round(time.monotonic() - t0, 1)})
        await asyncio.wait_for(node_seen.wait(), 30)
        procs.start(f"{fam}-router", [py, "-m", "infra.cli", "router", "--nats-url", nats_url, "--port", str(rport),
                                      "--host", "127.0.0.1", "--prefill-url", f"http://127.0.0.1:{sport}",
                                      "--log-format", "json"])
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{rport}/health", procs, f"{fam}-router", 120)
        router, standin = f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{sport}"
        vocab = cfg["vocab_size"]
        async with httpx.AsyncClient() as http:
            for ctx in args.contexts:
                c = f"{p}ctx{ctx // 1024}k_" if ctx >= 1024 else f"{p}ctx{ctx}_"
                rng = random.Random(ctx)
                prompts = [[rng.randrange(3, vocab) for _ in range(ctx)] for _ in range(args.repeats + 1)]
                alone = [(await http.post(f"{standin}/bench/alone", json={"prompt": pr, "max_tokens": args.tokens},
                                          timeout=300)).json() for pr in prompts]
                runs = []
                for i, pr in enumerate(prompts):
                    r = await asyncio.wait_for(client_request(http, router, model_dir.name, pr, args.tokens), 180)
                    last = (await http.get(f"{standin}/bench/last")).json()
                    rid = last.get("request_id", "")
                    deadline = time.monotonic() + 10
                    while ("started", rid) not in seen and time.monotonic() < deadline:
                        await asyncio.sleep(0.01)
                    kv = events.get(("kv", rid))
                    run = {"request_id": rid, "lane": r["lane"], "tokens_equal": r["tokens"] == alone[i]["tokens"],
                           "num_tokens": len(r["tokens"]), "alone_paths": alone[i]["paths"]}
                    if not run["tokens_equal"]:
                        first_diff = next((j for j, (a, b) in enumerate(zip(r["tokens"], alone[i]["tokens"])) if a != b),
                                          min(len(r["tokens"]), len(alone[i]["tokens"])))
                        run["first_difference_at"] = first_diff
                    if r["arrivals"]:
                        run["ttft_client_ms"] = (r["arrivals"][0][0] - r["t0"]) * 1e3
                        run["ttft_ms"] = (r["arrivals"][0][1] - last["t_first_token"]) * 1e3
                        run["standin_first_token_ms"] = (last["t_first_token"] - r["t0_wall"]) * 1e3
                        run["itl_ms"] = itl_ms(r["arrivals"])
                    if isinstance(kv, KvReady) and "t_extract_start" in last:
                        te = last["t_extract_start"]
                        run.update(extract_ms=kv.extract_ms, transfer_ms=kv.transfer_ms, nbytes=kv.nbytes,
                                   kv_ready_ms=(seen[("kv", rid)] - te) * 1e3,
                                   transfer_gbps=kv.nbytes / kv.transfer_ms / 1e6 if kv.transfer_ms else None)
                        if ("started", rid) in seen:
                            run["handoff_ms"] = (seen[("started", rid)] - te) * 1e3
                            run["kv_ready_to_started_ms"] = (seen[("started", rid)] - seen[("kv", rid)]) * 1e3
                    elif kv is not None:
                        run["kv_failed"] = getattr(kv, "reason", str(kv))
                    raw = (await http.post(f"{standin}/bench/raw", json={"num_tokens": ctx, "repeats": 5},
                                           timeout=120)).json()
                    run["raw"] = raw
                    runs.append(run)
                    log(fam, ctx, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in run.items()
                                   if k not in ("itl_ms", "raw")}, "raw_ms", round(raw["raw_ms"], 3),
                        {k.removeprefix("write_ms_"): round(raw[k], 3) for k in raw
                         if k.startswith(("write_ms", "handoff_write_")) and isinstance(raw[k], float)})
                measured = runs[1:]  # the first one warms this context's graphs and transfers up
                steps = [x for a in alone[1:] for x in a["step_ms"][1:]]
                itls = [x for r in measured for x in r.get("itl_ms", [])]

                def med(key):
                    vals = [r[key] for r in measured if r.get(key) is not None]
                    return statistics.median(vals) if vals else None

                raw_ms = statistics.median(r["raw"]["raw_ms"] for r in measured)
                nbytes = measured[0]["raw"]["nbytes"]
                res.put(**{c + "runs": runs, c + "nbytes": nbytes,
                           c + "transfer_ms_raw": raw_ms, c + "transfer_gbps_raw": nbytes / raw_ms / 1e6,
                           c + "transfer_ms_handoff": med("transfer_ms"),
                           **{c + k: statistics.median(r["raw"][k] for r in measured)
                              for k in ("write_ms_kept", "write_ms_new", "write_ms_fresh_thread",
                                        "write_ms_cold", "write_ms_cold_prewarmed", "handoff_write_post_ms",
                                        "handoff_write_wait_ms")
                              if all(k in r["raw"] for r in measured)},
                           c + "transfer_gbps_handoff": med("transfer_gbps"),
                           c + "extract_ms": med("extract_ms"), c + "kv_ready_ms": med("kv_ready_ms"),
                           c + "kv_ready_to_started_ms": med("kv_ready_to_started_ms"),
                           c + "handoff_ms": med("handoff_ms"), c + "ttft_ms": med("ttft_ms"),
                           c + "ttft_client_ms": med("ttft_client_ms"),
                           c + "standin_first_token_ms": med("standin_first_token_ms"),
                           c + "engine_step_ms": statistics.median(steps) if steps else None,
                           c + "router_itl_p50_ms": pct(itls, 0.5), c + "router_itl_p90_ms": pct(itls, 0.9),
                           c + "tokens_equal": all(r["tokens_equal"] for r in runs),
                           c + "alone_paths": sorted({x for a in alone for x in a["paths"]}),
                           c + "lanes": sorted({str(r["lane"]) for r in runs})})
            metrics = (await http.get(f"http://127.0.0.1:{dport}/metrics")).text
        res.put(**{p + "node_requests_by_path": metric_values(metrics, "xl_decode_requests_total"),
                   p + "node_steps_by_path": metric_values(metrics, "xl_decode_steps_total")})
        steps_sum = metric_values(metrics, "xl_decode_step_seconds_sum")
        steps_count = metric_values(metrics, "xl_decode_step_seconds_count")
        if steps_sum and steps_count and sum(steps_count.values()):
            res.put(**{p + "node_step_mean_ms": 1e3 * sum(steps_sum.values()) / sum(steps_count.values())})
        # The headline keys: the 1K context for latencies, the longest for bandwidth.
        lo = f"{p}ctx{args.contexts[0] // 1024}k_" if args.contexts[0] >= 1024 else f"{p}ctx{args.contexts[0]}_"
        hi = f"{p}ctx{args.contexts[-1] // 1024}k_" if args.contexts[-1] >= 1024 else f"{p}ctx{args.contexts[-1]}_"
        d = res.data
        res.put(**{p + "transfer_gbps_raw": d[hi + "transfer_gbps_raw"],
                   p + "transfer_gbps_handoff": d[hi + "transfer_gbps_handoff"],
                   p + "handoff_ms_ctx1k": d[lo + "handoff_ms"], p + "handoff_ms_ctx8k": d[hi + "handoff_ms"],
                   p + "ttft_ms": d[lo + "ttft_ms"], p + "ttft_client_ms": d[lo + "ttft_client_ms"],
                   p + "engine_step_ms": d[lo + "engine_step_ms"],
                   p + "router_itl_p50_ms": d[lo + "router_itl_p50_ms"],
                   p + "tokens_equal": all(d[f"{x}tokens_equal"] for x in (lo, hi))})
        g = d[p + "transfer_gbps_handoff"], d[p + "transfer_gbps_raw"]
        res.put(**{p + "must_show": {
            "handoff_over_raw": g[0] / g[1] if g[0] and g[1] else None,
            "transfer_handoff_ge_0.8_raw": bool(g[0] and g[1] and g[0] >= 0.8 * g[1]),
            "itl_le_step_plus_0.5": bool(d[p + "router_itl_p50_ms"] is not None and d[p + "engine_step_ms"] is not None
                                         and d[p + "router_itl_p50_ms"] <= d[p + "engine_step_ms"] + 0.5),
            "tokens_equal": d[p + "tokens_equal"]}})
    finally:
        await bus.close()
        procs.stop(f"{fam}-router", f"{fam}-standin", f"{fam}-decode")
        if not args.keep_models:
            shutil.rmtree(model_dir, ignore_errors=True)


def free_port() -> int:
    from infra.processes import free_port as fp

    return fp()


async def orchestrate(args) -> int:
    from infra.nats import NatsServer

    work = Path(tempfile.mkdtemp(prefix="gpu-node-"))
    args.models_dir = args.models_dir or str(work / "models")
    args.logs_dir = args.logs_dir or str(work / "logs")
    Path(args.logs_dir).mkdir(parents=True, exist_ok=True)
    log("process logs in", args.logs_dir)
    flags = compose_decode_flags(ROOT / "docker-compose.yml")
    base = {"bench": "gpu_node", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "device": args.device, "tiny": args.tiny, "transport": args.transport,
            "decode_flags": flags, "decode_flags_from": "docker-compose.yml services decode-0/decode-1",
            "contexts": args.contexts, "tokens": args.tokens, "repeats": args.repeats,
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}}
    if args.device == "cuda":
        import torch

        base["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        base["torch"] = torch.__version__
        base["placement"] = {"prefill_standin": f"CUDA_VISIBLE_DEVICES={args.prefill_gpus}",
                             "decode_node": f"CUDA_VISIBLE_DEVICES={args.decode_gpus}"}
    res = Results(Path(args.out), base)
    res.write()
    procs = Procs(Path(args.logs_dir))
    nats = NatsServer(work / "nats").start()
    try:
        cport = free_port()
        procs.start("coordinator", [sys.executable, "-m", "infra.cli", "coordinator", "--nats-url", nats.url,
                                    "--http-port", str(cport), "--log-format", "json"])
        wait_http(f"http://127.0.0.1:{cport}/health", procs, "coordinator", 60)
        for fam in args.families:
            try:
                await run_family(fam, args, procs, nats.url, res, flags)
            except (Exception, KeyboardInterrupt) as exc:
                log(fam, "FAILED", repr(exc))
                if isinstance(exc, KeyboardInterrupt):
                    res.put(**{f"{fam}_error": repr(exc)})
                    raise
                res.put(**{f"{fam}_error": repr(exc)[:4000]})
    finally:
        procs.stop()
        nats.stop()
    d = res.data
    print(f"\n{'key':<34} " + " ".join(f"{f:>12}" for f in args.families))
    for key in ("transfer_gbps_raw", "transfer_gbps_handoff", "handoff_ms_ctx1k", "handoff_ms_ctx8k", "ttft_ms",
                "ttft_client_ms", "engine_step_ms", "router_itl_p50_ms", "node_step_mean_ms", "tokens_equal"):
        vals = [d.get(f"{f}_{key}") for f in args.families]
        print(f"{key:<34} " + " ".join(f"{v:>12.3f}" if isinstance(v, float) else f"{str(v):>12}" for v in vals))
    for f in args.families:
        print(f, "must_show", d.get(f"{f}_must_show"), d.get(f"{f}_error", ""))
    return 0 if all(f"{f}_error" not in d for f in args.families) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    standin_args(sub.add_parser("standin", help="(internal) the prefill stand-in server"))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--families", default="llama8b,dsv2lite")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU smoke run)")
    p.add_argument("--dsv2-layers", type=int, default=0, help="cut the DeepSeek shape to N layers (0: all 27)")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--tokens", type=int, default=64, help="completion tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="measured requests per context (after one warm-up)")
    p.add_argument("--transport", default="nixl", choices=["nixl", "mooncake"],
                   help="the stand-in's sender; the node's comes from the compose flags")
    p.add_argument("--prefill-gpus", default="0,1")
    p.add_argument("--decode-gpus", default="1,0")
    p.add_argument("--gen-device", default="", help="where random weights are drawn (default: --device)")
    p.add_argument("--models-dir", default="")
    p.add_argument("--logs-dir", default="")
    p.add_argument("--keep-models", action="store_true")
    p.add_argument("--start-timeout-s", type=float, default=420)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_node.json"))
    args = p.parse_args(argv)
    if args.cmd == "standin":
        return standin_main(args)
    args.families = [f for f in args.families.split(",") if f]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.gen_device = args.gen_device or args.device

    def interrupted(signum, frame):  # a `timeout` around the run: stop what it started, keep the JSON
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    return asyncio.run(orchestrate(args))


if __name__ == "__main__":
    sys.exit(main())
