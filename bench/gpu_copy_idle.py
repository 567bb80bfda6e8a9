"""What a GPU-to-GPU copy costs after an idle spell, and what keeps it at its hot speed (2 GPUs).

Issue 20's handoff write over NVLink (NIXL, CUDA IPC) ran ~0.2-0.3 ms slower than the same write back
to back, whatever its size: every handoff follows an idle spell of the GPUs. This measures the same
effect with torch's peer copy (the copy engine path CUDA IPC takes) for the handoff's sizes:

- ``hot``: back to back (the raw bench's loop);
- ``idle``: after 50 ms with nothing on either GPU;
- ``idle_recv_busy`` / ``idle_send_busy``: the same, while a one-block spin kernel keeps the receiving /
  sending GPU from idling (as a decode node that is decoding, or a prefill that is computing, does);
- ``idle_prewarm_64b_1ms`` / ``idle_prewarm_1mb_1ms`` / ``idle_prewarm_1mb_200us``: a small copy to the
  same receiver that long before the write.

Writes ``bench/results/gpu_copy_idle.json`` (median ms per case and size) and a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def spin(device: torch.device, ms: float) -> None:
    """A one-block kernel that keeps ``device`` busy for about ``ms`` (clock-rate cycles)."""
    with torch.cuda.device(device):
        rate = torch.cuda.get_device_properties(device).clock_rate if hasattr(
            torch.cuda.get_device_properties(device), "clock_rate") else 1_980_000  # kHz
        torch.cuda._sleep(int(ms * rate))


def timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    """ms from issuing the peer copy to its end (on the source device's current stream)."""
    stream = torch.cuda.current_stream(src.device)
    t0 = time.perf_counter()
    with torch.cuda.device(src.device):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()
    return (time.perf_counter() - t0) * 1e3


def case(name: str, dst, src, small_dst, small_src, big_small_dst, big_small_src, reps: int) -> list[float]:
    s0, s1 = src.device, dst.device
    side = {d.index: torch.cuda.Stream(d) for d in (s0, s1)}
    out = []
    for _ in range(reps):
        torch.cuda.current_stream(s0).synchronize()
        torch.cuda.current_stream(s1).synchronize()
        if name == "hot":
            timed_copy(dst, src)
        else:
            if name in ("idle_recv_busy", "idle_send_busy"):  # on a side stream: the copy does not wait for it
                dev = s1 if name == "idle_recv_busy" else s0
                with torch.cuda.device(dev), torch.cuda.stream(side[dev.index]):
                    spin(dev, 60)
            time.sleep(0.05)
            if name == "idle_prewarm_64b_1ms":
                small_dst.copy_(small_src, non_blocking=True)
                time.sleep(0.001)
            elif name == "idle_prewarm_1mb_1ms":
                big_small_dst.copy_(big_small_src, non_blocking=True)
                time.sleep(0.001)
            elif name == "idle_prewarm_1mb_200us":
                big_small_dst.copy_(big_small_src, non_blocking=True)
                time.sleep(0.0002)
        t = timed_copy(dst, src)
        out.append(t)
        if name in ("idle_recv_busy", "idle_send_busy"):  # let the spin end before the next round
            for st in side.values():
                st.synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="8,75,255", help="copy sizes in MB (handoff sizes: dsv2lite 8K 8/27 layers)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=str(ROOT / "bench/results/gpu_copy_idle.json"))
    a = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    res: dict = {"device": torch.cuda.get_device_name(0), "peer_access": torch.cuda.can_device_access_peer(0, 1),
                 "ms": {}}
    small_src, small_dst = torch.ones(64, dtype=torch.uint8, device=d0), torch.empty(64, dtype=torch.uint8, device=d1)
    bs_src, bs_dst = torch.ones(1 << 20, dtype=torch.uint8, device=d0), torch.empty(1 << 20, dtype=torch.uint8, device=d1)
    cases = ["hot", "idle", "idle_recv_busy", "idle_send_busy", "idle_prewarm_64b_1ms", "idle_prewarm_1mb_1ms",
             "idle_prewarm_1mb_200us"]
    for mb in [int(x) for x in a.sizes_mb.split(",")]:
        src = torch.ones(mb << 20, dtype=torch.uint8, device=d0)
        dst = torch.empty(mb << 20, dtype=torch.uint8, device=d1)
        for _ in range(3):
            timed_copy(dst, src)
        for name in cases:
            times = case(name, dst, src, small_dst, small_src, bs_dst, bs_src, a.reps)
            res["ms"][f"{name}_{mb}mb"] = round(statistics.median(times), 4)
        del src, dst
    print("| case | " + " | ".join(f"{mb} MB" for mb in a.sizes_mb.split(",")) + " |")
    print("|---|" + "---|" * len(a.sizes_mb.split(",")))
    for name in cases:
        print(f"| {name} | " + " | ".join(f"{res['ms'][f'{name}_{mb}mb']:.3f}" for mb in a.sizes_mb.split(",")) + " |")
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
