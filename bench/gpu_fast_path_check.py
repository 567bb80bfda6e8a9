"""On a GPU: the fast path's greedy tokens equal the reference step's for every family, tiny models.

    python3 bench/gpu_fast_path_check.py [--archs llama,qwen2,qwen3,deepseek_v3_lite,deepseek_v3,deepseek_v32,glm_moe_dsa]

For each tiny HF-built checkpoint (tests/unit/engine/hf_models.py: random near-bigram bfloat16
weights; ``deepseek_v3`` has q LoRA and group-limited routing, ``deepseek_v3_lite`` neither; both
have an MTP layer), greedy tokens through ``Engine(fast_path="on")`` against ``Engine(fast_path="off")``,
with and (MLA) without MTP drafts, and a seeded sampled request (temperature, top-p/k, min-p,
repetition penalty) the same way, and which path each step took. The CPU tests run the same
kernels under Triton's interpreter; this is the compiled kernels' check on real hardware. Writes
``bench/results/gpu_fast_path_check.json``: ``<arch>_k<k>_tokens_identical``, ``..._paths``,
``..._fast_path_reason``, and ``all_identical`` (so far: the file is written after each check). Where
greedy tokens part, the reference's top-2 logit gap at that step is recorded: an exact tie (0.0 in
its bf16 logits) makes either token right, and ``..._differs_only_at_a_reference_tie`` says so
(``all_identical`` then still holds). ``--batch``: three requests of each dense-attention family decoding
together in one batched step (five slots: the 8-row graph) against each alone (``<arch>_batch5_tokens_identical``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.decode.engine import Engine  # noqa: E402
from shared.events import SamplingParams  # noqa: E402
from tests.unit.engine.hf_models import save_checkpoint  # noqa: E402
from tests.unit.engine_cuda.test_engine_fast_path_mla import DSA_PROMPT, V3_PROMPT  # noqa: E402

# prompts whose greedy continuations have clear top-2 margins on these near-bigram models (a bf16
# near tie may go either way between the fast path's fp32 logits and the reference's)
PROMPTS = {"deepseek_v3": V3_PROMPT, "deepseek_v32": DSA_PROMPT, "glm_moe_dsa": DSA_PROMPT}
PROMPT = [0, 17, 42, 99, 3, 250, 7]
ARCHS = ("deepseek_v3", "deepseek_v3_lite", "deepseek_v32", "glm_moe_dsa", "qwen3", "qwen2", "llama")
MTP_ARCHS = ("deepseek_v3", "deepseek_v3_lite", "deepseek_v32", "glm_moe_dsa")  # with an MTP layer: drafts too


SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, repetition_penalty=1.1, seed=7)


def run(path: Path, mode: str, k: int, num_tokens: int, prompt: list[int],
        sampled: bool = False, run_ahead: bool = True, margins: list | None = None, kv_cache_dtype: str = "auto"
        ) -> tuple[list[int], list[str], str | None]:
    """Tokens, paths and fast-path reason of one request; ``margins`` (reference step, greedy k=0) gets
    each step's top-2 logit gap."""
    engine = Engine.load(path, num_slots=1, max_seq_len=128, dtype="bfloat16", fast_path=mode,
                         num_speculative_tokens=k, device="cuda", fast_path_run_ahead=run_ahead,
                         kv_cache_dtype=kv_cache_dtype)
    first = int(engine.prefill(0, prompt).argmax())
    extra = dict(SAMPLED, prompt_token_ids=list(prompt)) if sampled else {}
    engine.start(0, first, SamplingParams(max_tokens=num_tokens, ignore_eos=True, **extra))
    tokens, paths = [first], []
    while engine.active_slots():
        tokens += engine.step()[0].token_ids
        paths.append(engine.last_step_path)
        if margins is not None and engine.last_step_path == "reference":
            top = engine.last_logits[0, 0].float().topk(2).values
            margins.append(round(float(top[0] - top[1]), 5))
    engine.release(0)
    return tokens, sorted(set(paths)), engine.fast_path_reason


def run_batch(path: Path, num_tokens: int, prompts: list[list[int]]) -> dict:
    """Requests (in turn greedy, seeded sampled, greedy with a repetition penalty) decoding together in one
    batched fast step against each decoding alone on the batch-1 fast path: tokens, and the (path, slots)
    of every step."""
    engine = Engine.load(path, num_slots=len(prompts), max_seq_len=128, dtype="bfloat16", fast_path="on",
                         device="cuda")
    params = [SamplingParams(max_tokens=num_tokens, ignore_eos=True),
              SamplingParams(max_tokens=num_tokens, ignore_eos=True, **SAMPLED),
              SamplingParams(max_tokens=num_tokens, ignore_eos=True, repetition_penalty=1.3)]

    def begin(slot):
        first = int(engine.prefill(slot, prompts[slot]).argmax())
        engine.start(slot, first, params[slot % len(params)])
        return [first]

    alone, together, served = {}, {}, []
    for slot in range(len(prompts)):
        alone[slot] = begin(slot)
        while engine.active_slots():
            alone[slot] += engine.step()[slot].token_ids
        engine.release(slot)
    together = {slot: begin(slot) for slot in range(len(prompts))}
    while engine.active_slots():
        for slot, out in engine.step().items():
            together[slot] += out.token_ids
        served.append((engine.last_step_path, engine.last_step_slots))
    return {"tokens_identical": together == alone, "steps": sorted(set(served)),
            "first_difference": {slot: next((i for i, (a, b) in enumerate(zip(together[slot], alone[slot]))
                                             if a != b), None) for slot in alone}}


def run_batch_spec(path: Path, num_tokens: int, prompts: list[list[int]], k: int, sampled: bool = False) -> dict:
    """Requests with k MTP drafts each (fixed drafting) decoding together, each slot verifying its own drafts in the
    batched fast step, against the reference engine's tokens for the same requests together; which batched drafting
    graphs ran (size, k, graph keys: "sampled" the speculative sampling one), and each slot's verified and accepted
    drafts. Greedy, or with ``sampled`` every other slot seeded at temperature 0.7 (a bf16 rounding difference
    between the kernels and torch can flip a draw: ``first_difference`` says where)."""
    res = {}
    for mode in ("on", "off"):
        engine = Engine.load(path, num_slots=len(prompts), max_seq_len=128, dtype="bfloat16", fast_path=mode,
                             device="cuda", num_speculative_tokens=k, adaptive_speculation=False)
        tokens = {slot: [int(engine.prefill(slot, p).argmax())] for slot, p in enumerate(prompts)}
        for slot, first in tokens.items():
            engine.start(slot, first[0], SamplingParams(max_tokens=num_tokens, ignore_eos=True, seed=100 + slot,
                                                        **(dict(temperature=0.7, top_p=0.95) if sampled and slot % 2
                                                           else {})))
        served = []
        while engine.active_slots():
            for slot, out in engine.step().items():
                tokens[slot] += out.token_ids
            served.append((engine.last_step_path, engine.last_step_slots))
        res[mode] = tokens, served, engine
    (got, served, fast), (want, _, _) = res["on"], res["off"]
    stats = {slot: fast.spec_stats(slot) for slot in got}
    return {"tokens_identical": got == want, "steps": sorted(set(served)),
            "graphs": sorted((*key, sorted(map(str, runners)))
                             for key, (_, runners) in fast.fast_path.spec_batches.items()),
            "drafts_verified": {slot: st.num_draft_tokens for slot, st in stats.items()},
            "drafts_accepted": {slot: st.num_accepted_tokens for slot, st in stats.items()},
            "first_difference": {slot: next((i for i, (a, b) in enumerate(zip(got[slot], want[slot])) if a != b), None)
                                 for slot in got}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default=",".join(ARCHS))
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--run-ahead-off", action="store_true",
                   help="Llama family: also decode with run-ahead off (its tokens against both)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="both engines' KV cache (fp8 / fp8_e4m3 / fp8_e5m2: the fast path's FP8-KV attention "
                        "against the reference step reading the same FP8 bytes); keys get it as a prefix")
    p.add_argument("--batch", action="store_true",
                   help="also five requests of each family in one batched step against each alone")
    p.add_argument("--batch-spec", action="store_true",
                   help="also requests of each dense-attention MTP family drafting together: 2 and 4 slots with 3 "
                        "drafts each, 5 with 1 (each slot's drafts verified in the batched step), greedy, and 4 x 3 "
                        "and 5 x 1 with every other slot sampled, against the reference engine's tokens")
    p.add_argument("--mla-batch-chain", action="store_true",
                   help="the DeepSeek family's batched block as one chain of Triton kernels (MlaStack.BATCH_CHAIN)")
    p.add_argument("--mla-verify-chain", action="store_true",
                   help="the DeepSeek family's verify block (MTP drafts) as one chain of Triton kernels "
                        "(MlaStack.VERIFY_CHAIN)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_fast_path_check.json")
    args = p.parse_args()
    if args.mla_batch_chain or args.mla_verify_chain:
        from services.decode.engine.cuda import mla

        mla.MlaStack.BATCH_CHAIN = mla.MlaStack.BATCH_CHAIN or args.mla_batch_chain
        mla.MlaStack.VERIFY_CHAIN = mla.MlaStack.VERIFY_CHAIN or args.mla_verify_chain
    out: dict = {"bench": "gpu_fast_path_check", "device": torch.cuda.get_device_name(0),
                 "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tokens": args.tokens}
    ok = True
    kv = args.kv_cache_dtype
    for arch in args.archs.split(","):
        path = Path(tempfile.mkdtemp(prefix=f"fpc-{arch}-"))
        save_checkpoint(arch, path, damp=True)  # near-bigram: wide greedy margins, as trained models have
        prompt = PROMPTS.get(arch, PROMPT)
        drafts = (0, 3) if arch in MTP_ARCHS else (0,)
        cases = [(k, False) for k in drafts] + [(0, True)]
        if args.batch and kv == "auto" and arch not in ("deepseek_v32", "glm_moe_dsa"):  # sparse: one slot a step
            try:
                prompts = [prompt, [5, 77, 200, 9, 61, 18, 140], [3, 44], [11, 12, 13], [250, 1, 90, 7, 33]]
                b = run_batch(path, args.tokens, prompts)  # five slots: the batch graph of 8 rows
                out.update({f"{arch}_batch5_{k2}": v for k2, v in b.items()})
                ok &= b["tokens_identical"] and b["steps"] == [("fast", 5)]
            except Exception as exc:  # noqa: BLE001
                ok = False
                out[f"{arch}_batch5_error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            print(f"{arch}_batch5", {k2: v for k2, v in out.items() if k2.startswith(f"{arch}_batch5")}, flush=True)
        if args.batch_spec and kv == "auto" and arch in ("deepseek_v3", "deepseek_v3_lite"):
            more = [[5, 77, 200, 9, 61, 18, 140], [3, 44], [11, 12, 13], [250, 1, 90, 7, 33]]
            # 8, 16 and 16 rows (five slots: the batch of 8); greedy, then with sampled slots
            for slots, k, sampled in ((2, 3, False), (4, 3, False), (5, 1, False), (4, 3, True), (5, 1, True)):
                key = f"{arch}_batch{slots}_k{k}" + ("_sampled" if sampled else "")
                try:
                    b = run_batch_spec(path, args.tokens, ([prompt] + more)[:slots], k, sampled)
                    out.update({f"{key}_{k2}": v for k2, v in b.items()})
                    ok &= b["tokens_identical"] and ("fast", slots) in b["steps"] and {p for p, _ in b["steps"]} == {"fast"}
                except Exception as exc:  # noqa: BLE001
                    ok = False
                    out[f"{key}_error"] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                print(key, {k2: v for k2, v in out.items() if k2.startswith(key)}, flush=True)
        for k, sampled in cases:
            key = ("" if kv == "auto" else f"kv_{kv}_") + f"{arch}_k{k}" + ("_sampled" if sampled else "")
            try:
                t0 = time.perf_counter()
                got, paths, reason = run(path, "on", k, args.tokens, prompt, sampled, kv_cache_dtype=kv)
                margins: list = []
                want, _, _ = run(path, "off", k, args.tokens, prompt, sampled,
                                 margins=margins if not sampled and k == 0 else None, kv_cache_dtype=kv)
                out.update({f"{key}_tokens_identical": got == want, f"{key}_paths": paths,
                            f"{key}_fast_path_reason": reason, f"{key}_s": round(time.perf_counter() - t0, 1)})
                agree = got == want
                if got != want:
                    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                    out[f"{key}_first_difference"] = i
                    if margins:  # token i came from step i - 1: the reference's top-2 gap there
                        out[f"{key}_reference_margin_there"] = margins[i - 1]
                        out[f"{key}_reference_min_margin"] = min(margins)
                        # an exact tie in the reference's logits: either token is its argmax, so the
                        # sequences agree up to a point where both are right, then part
                        agree = margins[i - 1] == 0.0
                    out[f"{key}_differs_only_at_a_reference_tie"] = agree
                ok &= agree and paths == ["fast"]
                if args.run_ahead_off and not arch.startswith("deepseek"):  # the Llama family runs ahead
                    plain, _, _ = run(path, "on", k, args.tokens, prompt, sampled, run_ahead=False)
                    out[f"{key}_run_ahead_off_tokens_identical"] = plain == want
                    out[f"{key}_run_ahead_on_equals_off"] = plain == got
            except Exception as exc:  # noqa: BLE001 - one family failing must not hide the others
                ok = False
                out[f"{key}_error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            print(key, {k2: v for k2, v in out.items() if k2.startswith(key)}, flush=True)
            out["all_identical"] = ok
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=2))  # after each: a cut-short run keeps what it has
    print(json.dumps(out, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
