"""Losing one member of a three-node NATS cluster under load (tiny model, CPU).

    python bench/chaos_nats.py [--requests 4] [--tokens 200]

``await measure_nats_node_kill()`` starts its own cluster (infra.nats_cluster), a coordinator
(``--js-replicas 3``) and a decode node, both given every member's URL; plays router and prefill
itself from a member no service uses; starts ``num_requests`` streaming requests, SIGKILLs the
member the decode node is connected to once every request has its first token, then counts:

- ``nats_node_kill_requests_lost``: requests started before the kill that did not end with every
  token (a gap in the indexes, a failure, or silence);
- ``nats_node_kill_reconnect_ms``: kill -> every service says connected again;
- ``nats_node_kill_first_grant_ms``: kill -> the first claim granted after it (claims start right
  after the kill, while the requests still stream; the node has one slot more than the requests);
- ``nats_node_kill_leaked``: leases, waiting claims or busy slots left at the end;
- ``nats_node_kill_coordinator_on_killed_member``: whether the coordinator lost its member too (the
  killed one is shared when the clients' random placement put both there);
- ``nats_node_kill_state_leader_killed``: whether the killed member led the coordinator's state
  bucket (its JetStream stream). Then no state write, hence no grant, is possible until JetStream
  elects another leader (seconds: its raft election timeout); otherwise the first grant comes in
  milliseconds.
Also runnable alone: prints the dict and writes ``bench/results/chaos_nats.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from infra.nats import DEV_CONFIG
from infra.nats_cluster import NatsCluster
from infra.processes import free_port, stop_process_groups
from infra.tinymodel import make_model
from shared import subjects
from shared.bus import Bus, BusError
from shared.events import (
    ClaimGranted, ClaimReply, ClaimRequest, DecodeStart, KvReady, RequestFinished, SamplingParams,
    TokenMessage, TokensGenerated,
)

REPO = Path(__file__).resolve().parents[1]
SERVICES = ("coordinator", "decode-bench")  # bus client names


def _health(port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return json.load(resp)
    except (OSError, ValueError):
        return {}


async def _wait(port: int, until, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = await asyncio.to_thread(_health, port)
        if body and until(body):
            return body
        await asyncio.sleep(0.02)
    raise TimeoutError(f"service on :{port} not ready in {timeout_s:.0f} s")


def _start(args: list[str], log_path: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_CPU_OMP_THREADS_BIND="0-1")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "infra.cli", *args, "--http-port", str(port)],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, port


async def _stream(bus: Bus, grant: ClaimGranted, num_tokens: int, first_token: asyncio.Event,
                  timeout_s: float) -> bool:
    """One request as router + prefill would run it; True when every token arrived in order."""
    queue: asyncio.Queue = asyncio.Queue()

    async def on_token(ev, _msg):
        queue.put_nowait(ev)

    sub = await bus.subscribe(subjects.req_tokens(grant.request_id), on_token, TokenMessage)
    await bus.publish(subjects.kv_ready(grant.node_id), KvReady(
        request_id=grant.request_id, lease_id=grant.lease_id, generation=grant.generation,
        node_id=grant.node_id, slot=grant.target.slot.slot, num_tokens=8,
        layout_version=grant.target.layout.layout_version, nbytes=0), replay=True)
    await bus.publish(subjects.decode_start(grant.node_id), DecodeStart(
        request_id=grant.request_id, lease_id=grant.lease_id, generation=grant.generation,
        slot=grant.target.slot.slot, first_token_id=1, num_prompt_tokens=8,
        sampling=SamplingParams(max_tokens=num_tokens, ignore_eos=True)), replay=True)
    num_received = 0
    try:
        while True:
            ev = await asyncio.wait_for(queue.get(), timeout_s)
            if not isinstance(ev, TokensGenerated):
                return isinstance(ev, RequestFinished) and num_received == num_tokens
            if ev.index > num_received + 1:
                return False  # tokens never arrived
            num_received = max(num_received, ev.index - 1 + len(ev.token_ids))
            first_token.set()
    except asyncio.TimeoutError:
        return False
    finally:
        await sub.unsubscribe()


async def measure_nats_node_kill(num_requests: int = 4, num_tokens: int = 200,
                                 timeout_s: float = 60.0) -> dict:
    """Kill the NATS member the decode node uses while requests stream (module docstring)."""
    work = Path(tempfile.mkdtemp(prefix="chaos-nats-"))
    model = make_model("llama", work / "tiny-llama")
    cluster = NatsCluster(work / "nats", 3, config_file=DEV_CONFIG, log_dir=work)
    procs: list[subprocess.Popen] = []
    bus: Bus | None = None
    granting: asyncio.Task | None = None
    try:
        await asyncio.to_thread(cluster.start, 30.0)
        coord, coord_port = _start(["coordinator", "--nats-url", cluster.url, "--js-replicas", "3",
                                    "--tick-ms", "20"], work / "coordinator.log")
        procs.append(coord)
        await _wait(coord_port, lambda h: True, 60)  # answers 200 once ready
        decode, decode_port = _start(["decode", "--nats-url", cluster.url, "--model", str(model),
                                      "--node-id", "bench", "--slots", str(num_requests + 1),
                                      "--max-seq-len", str(num_tokens + 64)], work / "decode.log")
        procs.append(decode)
        await _wait(decode_port, lambda h: h.get("connected"), 180)
        await _wait(coord_port, lambda h: "bench" in h.get("nodes", []), 30)
        used = {name: cluster.client_nodes(name) for name in SERVICES}
        # the member the decode node uses, the coordinator's too where they share one
        shared = sorted(set(used["decode-bench"]) & set(used["coordinator"]))
        doomed = shared[0] if shared else used["decode-bench"][0]
        spare = min(set(range(3)) - {m for ms in used.values() for m in ms})
        bus = await Bus.connect(cluster.urls[spare], name="bench")

        async def claim(rid: str, wait_ms: int = 5000, timeout_s: float = 10.0) -> ClaimReply:
            return await bus.request(subjects.CLAIM, ClaimRequest(
                request_id=rid, model=model.name, num_prompt_tokens=8, max_tokens=num_tokens,
                wait_ms=wait_ms), ClaimReply, timeout_s)

        grants = [g for g in [await claim(f"kill-{i}") for i in range(num_requests)]
                  if isinstance(g, ClaimGranted)]  # one not granted counts as lost
        firsts = [asyncio.Event() for _ in grants]
        streams = [asyncio.create_task(_stream(bus, g, num_tokens, f, timeout_s))
                   for g, f in zip(grants, firsts)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), timeout_s)
        state = await bus.nc.jetstream().stream_info(f"KV_{subjects.COORD_KV_BUCKET}")
        state_leader_killed = state.cluster.leader == f"{cluster.name}-{doomed}"
        t_kill = time.monotonic()
        await asyncio.to_thread(cluster.kill, doomed)

        async def first_grant() -> float | None:
            """Claim every 10 ms from the kill on; ms from the kill to the first grant. A claim
            not answered in 0.5 s is sent again under the same request id, as the router retries
            (a new id would leave the late grant of the first holding the spare slot)."""
            num_answered = 0
            for _ in range(int(timeout_s * 100)):
                try:
                    reply = await claim(f"after-{num_answered}", wait_ms=0, timeout_s=0.5)
                except BusError:
                    reply = None
                if isinstance(reply, ClaimGranted):
                    granted_ms = (time.monotonic() - t_kill) * 1000
                    await _stream(bus, reply, 2, asyncio.Event(), timeout_s)
                    return granted_ms
                num_answered += reply is not None  # refused: the next claim is a new one
                await asyncio.sleep(0.01)
            return None

        granting = asyncio.create_task(first_grant())
        await asyncio.gather(_wait(decode_port, lambda h: h.get("connected"), timeout_s),
                             _wait(coord_port, lambda h: h.get("connected"), timeout_s))
        reconnect_ms = (time.monotonic() - t_kill) * 1000
        results = await asyncio.gather(*streams)
        first_grant_ms = await granting
        try:
            await _wait(coord_port, lambda h: h["leases"] == 0 and h["queued"] == 0, timeout_s)
            await _wait(decode_port, lambda h: h["active"] == [] and
                        len(h["free_slots"]) == h["total_slots"], timeout_s)
            leaked = False
        except TimeoutError:
            leaked = True
        return {
            "nats_node_kill_requests": num_requests,
            "nats_node_kill_requests_lost": num_requests - sum(results),
            "nats_node_kill_reconnect_ms": round(reconnect_ms, 1),
            "nats_node_kill_first_grant_ms": round(first_grant_ms, 1) if first_grant_ms else None,
            "nats_node_kill_leaked": leaked,
            # the first grant waits on the coordinator's reconnect only where it lost its member too
            "nats_node_kill_coordinator_on_killed_member": bool(shared),
            "nats_node_kill_state_leader_killed": state_leader_killed,
        }
    finally:
        if granting is not None and not granting.done():
            granting.cancel()
        if bus is not None:
            await bus.close()
        await asyncio.to_thread(stop_process_groups, procs, 10.0)
        await asyncio.to_thread(cluster.stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    result = asyncio.run(measure_nats_node_kill(args.requests, args.tokens))
    out = REPO / "bench" / "results" / "chaos_nats.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for key, value in result.items():
        print(f"{key:<36} {value}")


if __name__ == "__main__":
    main()
