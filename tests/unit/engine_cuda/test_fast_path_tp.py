"""The Llama-family fast path sharded over two ranks (gloo, Triton's interpreter on CPU): each rank's
batch-1 step runs its heads, MLP slice and vocabulary rows, the o / down partial sums meet in one
all-reduce of the residual and the lm_head's argmax partials (or, sampling, the logits) are gathered.
Greedy and seeded sampled tokens equal the one-rank fast path's, every step on the fast path; a
Qwen3 (q/k norm) checkpoint too. The DeepSeek family stays on the reference step under tensor
parallelism, and says so."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine.cuda import FastOptions
from services.decode.engine.tp import TensorParallel
from shared.events import SamplingParams
from tests.unit.engine.hf_models import save_checkpoint

WORLD = 2
# few, wide programs (the interpreter's cost is per program); gate/up's and lm_head's block_n divide a rank's
# 64 intermediate rows and 128 vocabulary rows
OPTIONS = FastOptions(tiles={"qkv": (8, 64, 4, 1), "o": (64, 64, 4, 1), "gate_up": (64, 64, 4, 1),
                             "down": (64, 128, 4, 1), "lm_head": (64, 64, 4, 1)}, num_splits=2, block_s=32)
PROMPT = [0, 17, 42, 99, 3, 250, 7]
REQUESTS = [SamplingParams(max_tokens=8, ignore_eos=True),
            SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=50, seed=11)]


def _load(path, tp=None) -> Engine:
    return Engine.load(path, num_slots=1, max_seq_len=48, dtype="bfloat16", fast_path="on",
                       fast_path_options=OPTIONS, **({"tp": tp} if tp is not None else {}))


def _decode(engine: Engine) -> dict:
    out = {"tokens": [], "paths": set(), "reason": engine.fast_path_reason}
    for sampling in REQUESTS:
        first = int(engine.prefill(0, PROMPT).argmax())
        engine.start(0, first, sampling)
        tokens = [first]
        while engine.active_slots():
            tokens += engine.step()[0].token_ids
            out["paths"].add(engine.last_step_path)
        engine.release(0)
        out["tokens"].append(tokens)
    return out


def _rank_main(rank: int, port: int, paths: list[str], out_dir: str) -> None:
    import torch.distributed as dist

    import tests.unit.engine_cuda.conftest  # noqa: F401 - this process interprets the kernels too

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    try:
        tp = TensorParallel(rank, WORLD, dist.new_group(list(range(WORLD))))
        torch.save([_decode(_load(p, tp)) for p in paths], Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """[(one-rank result, [rank 0, rank 1 results])] for a near-bigram Llama and a Qwen3."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("fast-tp")
    paths = [tmp / "llama", tmp / "qwen3"]
    save_checkpoint("llama", paths[0], damp=True)
    save_checkpoint("qwen3", paths[1], damp=True)
    single = [_decode(_load(p)) for p in paths]
    mp_env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # the ranks define their kernels interpreted from the start
    try:
        mp.start_processes(_rank_main, args=(_free_port(), [str(p) for p in paths], str(tmp)), nprocs=WORLD,
                           join=True, start_method="spawn")
    finally:
        if mp_env is None:
            del os.environ["TRITON_INTERPRET"]
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return [(single[i], [r[i] for r in ranks]) for i in range(len(paths))]


@pytest.mark.parametrize("model", [0, 1], ids=["llama", "qwen3"])
def test_sharded_fast_path_decodes_the_one_rank_tokens(runs, model):
    single, ranks = runs[model]
    assert single["paths"] == {"fast"} and single["reason"] is None
    for r, got in enumerate(ranks):
        assert got["reason"] is None and got["paths"] == {"fast"}, f"rank {r}"
        assert got["tokens"][0] == single["tokens"][0], f"greedy, rank {r}"
        assert got["tokens"][1] == single["tokens"][1], f"seeded sampling, rank {r}"
        assert [len(t) for t in got["tokens"]] == [9, 9]


def test_deepseek_family_stays_on_the_reference_step_under_tensor_parallelism(tmp_path):
    save_checkpoint("deepseek_v3", tmp_path)
    engine = Engine.load(tmp_path, num_slots=1, max_seq_len=48, dtype="bfloat16", tp=TensorParallel(1, 2))
    assert engine.fast_path is None and "DeepSeek-family fast path is single-GPU" in engine.fast_path_reason
