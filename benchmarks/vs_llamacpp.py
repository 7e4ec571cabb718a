"""tierserve's default config against llama.cpp's `llama-server`, the CPU peer, in one run.

    .venv/bin/python benchmarks/vs_llamacpp.py            # 32 concurrent requests per system
    .venv/bin/python benchmarks/vs_llamacpp.py --quick    # 8 requests, to try the script
    .venv/bin/python benchmarks/vs_llamacpp.py --tierserve-variant threads-1:model.num_threads=1

Builds llama-server once (benchmarks/llamacpp_build.py: pinned llama-cpp-python sdist,
native flags without AMX, cached), requantizes the packaged GGUF to F32 and BF16, then for
each system in turn — llama-server F32, BF16 and the packaged Q4_1 with 32 parallel slots
and continuous batching, then `tierserve serve` with config/default.yaml — starts the
server alone on the machine, sends one untimed warm-up request, measures batch-1 decode
(one request alone, tok/s after its first token, best of `--batch1-repeats`) and then the
workload: every request at once, streamed over `/v1/completions` by benchmarks/serving.py's
client (`temperature: 0`, `ignore_eos`, `max_tokens` fixed per request). `--rounds` repeats
the whole cycle, interleaved, and reports medians. Where the CPU runs AMX, a second
llama.cpp build with AMX (llamacpp_build.build_amx) also serves the packaged file (ggml's AMX
int8 kernels take its Q4_1 weights), so the best peer is the one an AMX machine would run;
`--no-amx` leaves it out. `--model FILE` serves another GGUF file the same way (benchmarks/moe.py
`--llama-server`: a mixture-of-experts model converted by llama.cpp's own converter).

Fairness: every system gets the same seeded prompts (100-300 random common words, distinct,
so no request shares a prefix page with another) and a freshly started server, so both
caches start cold and stay cold: neither system gets a prefix hit. Useful output tokens are
the completion tokens the server reports in its usage chunk (ignore_eos: exactly
max_tokens; a shorter stream is counted as reported, and flagged). Both servers use every
core of the process's affinity mask. The machine's bounds (benchmarks/machine_bounds.py)
are measured by this process before any server starts.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import signal
import socket
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import gguf
import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/vs_llamacpp.py` puts benchmarks/, not the repo, on the path

from benchmarks import llamacpp_build, machine_bounds
from benchmarks import vs_llamacpp_report as report
from benchmarks.serving import (
    WORDS,
    Level,
    Progress,
    Prompt,
    Target,
    open_loop,
    run_loop,
    send,
    summarize,
    wait_healthy,
)
from benchmarks.throughput import model_file, warn_if_busy
from gpu import numerics

PROMPT_WORDS = (100, 300)
OUTPUT_TOKENS = (64, 128)
BATCH1_OUTPUT = 128
SLOT_CONTEXT = 512  # llama-server context per slot: the longest prompt (~300 tokens) + 128 out, rounded up
TIERSERVE_CONFIG = REPO / "config" / "default.yaml"


@dataclass(frozen=True)
class System:
    label: str
    system: str  # "llama-server" | "tierserve"
    weight_dtype: str  # what its matmuls read: decides the compute bound
    weight_bytes: int  # weight bytes one decode step reads (the bandwidth bound)
    argv: tuple[str, ...]  # the server command, `{port}` where the port goes
    env: tuple[tuple[str, str], ...] = ()
    optional: bool = False  # a server that fails (the AMX peer) is dropped from the table, not fatal


# ---- workload ----------------------------------------------------------------------------


def make_prompt(rng: random.Random, words: int, output_len: int) -> Prompt:
    return Prompt(" ".join(rng.choice(WORDS) for _ in range(words)), output_len)


def make_workload(n: int, seed: int) -> list[Prompt]:
    """n distinct prompts of 100-300 words (~1 token each) with 64-128 output tokens, seeded."""
    rng = random.Random(f"{seed}:workload")
    return [make_prompt(rng, rng.randint(*PROMPT_WORDS), rng.randint(*OUTPUT_TOKENS)) for _ in range(n)]


def batch1_prompts(repeats: int, seed: int) -> list[Prompt]:
    rng = random.Random(f"{seed}:batch1")
    return [make_prompt(rng, PROMPT_WORDS[0], BATCH1_OUTPUT) for _ in range(repeats)]


def decode_tok_s(tpot_s: float | None) -> float | None:
    """Batch-1 decode rate from time per output token (first token excluded)."""
    return None if not tpot_s else 1 / tpot_s


# ---- the model files ---------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def gguf_sizes(path: Path) -> tuple[int, int, str]:
    """(parameters one token computes with, weight bytes one decode step reads, main weight
    type) of a GGUF file.

    A tied embedding is read whole by the LM head every step; an untied one only a row (and
    computes nothing). A mixture-of-experts model's stacked experts (`ffn_*_exps`) count for
    the used ones only: `expert_used_count` of `expert_count`.
    Cached: reading the file's metadata (its 49k-token vocabulary) takes seconds.
    """
    reader = gguf.GGUFReader(str(path))
    tensors = reader.tensors
    params = sum(int(t.n_elements) for t in tensors)
    read = sum(int(t.n_bytes) for t in tensors)
    if "output.weight" in {t.name for t in tensors}:
        params -= sum(int(t.n_elements) for t in tensors if t.name == "token_embd.weight")
        read -= sum(int(t.n_bytes) for t in tensors if t.name == "token_embd.weight")
    arch = str(reader.fields["general.architecture"].contents())
    if f"{arch}.expert_count" in reader.fields:
        used = int(reader.fields[f"{arch}.expert_used_count"].contents())
        count = int(reader.fields[f"{arch}.expert_count"].contents())
        experts = [t for t in tensors if "_exps." in t.name]
        params -= sum(int(t.n_elements) for t in experts) * (count - used) // count
        read -= sum(int(t.n_bytes) for t in experts) * (count - used) // count
    kind = Counter(t.tensor_type.name for t in tensors if len(t.shape) > 1).most_common(1)[0][0]
    return params, read, kind


def llama_server(label: str, binary: Path, model: Path, slots: int, threads: int, optional: bool = False) -> System:
    _, read, kind = gguf_sizes(model)
    argv = (str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", "{port}",
            "--parallel", str(slots), "-c", str(slots * SLOT_CONTEXT), "--cont-batching",
            "-t", str(threads), "-tb", str(threads), "--no-webui",
            # No host-RAM prompt cache: with distinct prompts it can't hit, only copy slot states.
            "--cache-ram", "0")
    return System(label, "llama-server", kind, read, argv, optional=optional)


def tierserve(label: str, packaged: Path, overrides: list[str]) -> System:
    """`tierserve serve` with the default config on the model file `packaged` (`model.path`
    among `overrides` where it is not the config's); its numerics resolved by the engine's
    own rules (gpu/numerics.py), so the bandwidth bound counts the bytes it really reads."""
    dtype, quant = tierserve_numerics(packaged, overrides)
    params, gguf_read, _ = gguf_sizes(packaged)
    # int4: the checkpoint's Q4 blocks as stored (and its Q8_0 head as int8 per channel),
    # i.e. the GGUF's own bytes; int8: one byte a weight; otherwise the dense dtype.
    read = gguf_read if quant == "int4" else params * (1 if quant == "int8" else 4 if dtype == "float32" else 2)
    sets = [a for o in ["server.port={port}", *overrides] for a in ("--set", o)]
    argv = (sys.executable, "-m", "plugins.cli", "serve", "--config", str(TIERSERVE_CONFIG), *sets)
    env = (("PYTHONPATH", str(REPO)),)  # this checkout's packages, not another editable install's
    kind = dtype if quant == "none" else f"{dtype}+{quant}"
    return System(label, "tierserve", kind, read, argv, env)


def tierserve_numerics(packaged: Path, overrides: list[str]) -> tuple[str, str]:
    """(dtype, quantization) a CPU launch of the default config with `overrides` runs."""
    config = yaml.safe_load(TIERSERVE_CONFIG.read_text())["model"]
    for o in overrides:
        key, _, value = o.partition("=")
        if key in ("model.dtype", "model.quantization"):
            config[key.split(".")[1]] = value
    cpu = torch.device("cpu")
    dtype = numerics.auto_dtype(cpu) if config.get("dtype", "auto") == "auto" else config["dtype"]
    quant = config.get("quantization", "auto")
    if quant == "auto":
        quant = numerics.auto_quantization(cpu, gguf_sizes(packaged)[2].startswith("Q4"))
    return dtype, quant


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`label:section.key=value,section.key=value` -> (label, overrides)."""
    label, sep, rest = text.partition(":")
    overrides = [o for o in rest.split(",") if o]
    if not label or not sep or not overrides or not all("=" in o for o in overrides):
        raise argparse.ArgumentTypeError(f"expected LABEL:section.key=value[,...], got {text!r}")
    return label, overrides


# ---- one server --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server subprocess in its own session (its threads and children stop with it)."""

    def __init__(self, system: System, log_dir: Path) -> None:
        self.port = free_port()
        self.log_path = log_dir / f"{system.label.replace(' ', '_')}.log"
        argv = [a.replace("{port}", str(self.port)) for a in system.argv]
        env = os.environ | dict(system.env)
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                         start_new_session=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def ready(self, session: aiohttp.ClientSession, timeout: float = 600) -> None:
        problem = await wait_healthy(session, self.base_url, self.proc.poll, timeout, 0.5)
        if problem is not None:
            raise SystemExit(f"server {problem}; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as resp:
        return str((await resp.json())["data"][0]["id"])


async def measure_batch1(session: aiohttp.ClientSession, target: Target, prompts: list[Prompt]) -> float | None:
    rates = []
    for prompt in prompts:
        rec = await send(session, target, prompt)
        if rec.ok and (rate := decode_tok_s(rec.tpot())) is not None:
            rates.append(rate)
        elif rec.error:
            print(f"  batch-1 request failed: {rec.error}")
    return max(rates, default=None)  # best of the repeats: a shared machine only slows a run


async def measure_stoppable(system: System, workload: list[Prompt], args: argparse.Namespace) -> dict[str, Any]:
    """`measure`, cancelled by SIGTERM/SIGINT so that its `finally` stops the server (one left
    behind would share the CPUs with the next run). uvloop runs no `signal.signal` handler
    while it waits, hence the loop's own."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await measure(system, workload, args)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def measure(system: System, workload: list[Prompt], args: argparse.Namespace) -> dict[str, Any]:
    server = Server(system, args.log_dir)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    try:
        # A fresh connection per request: reusing one the server closed after a stream fails the
        # next request at once (seen with llama-server's batch-1 request after the warm-up).
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await server.ready(session)
            target = Target(f"{server.base_url}/v1", await served_model(session, server.base_url),
                            "completions", True, {})
            warm = await send(session, target, Prompt("hello " * 16, 4))
            if not warm.ok:
                raise SystemExit(f"{system.label}: warm-up failed: {warm.error}")
            decode = await measure_batch1(session, target, batch1_prompts(args.batch1_repeats, args.seed))
            progress = Progress(system.label, len(workload), not args.no_progress)
            records, duration = await open_loop(
                workload, lambda p: send(session, target, p), float("inf"), len(workload), progress,
                random.Random(0),
            )
    finally:
        server.stop()
    summary = summarize(Level(system.label, len(workload), records, duration))
    errors = sorted({r.error for r in records if r.error})
    for e in errors[:3]:
        print(f"  {system.label} error: {e}")
    return summary | {"label": system.label, "system": system.system, "weight_dtype": system.weight_dtype,
                      "weight_bytes": system.weight_bytes, "decode_tok_s": decode}


# ---- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32, help="concurrent requests of the workload")
    p.add_argument("--quick", action="store_true", help="8 requests, one batch-1 repeat: try the script")
    p.add_argument("--rounds", type=int, default=1, help="repeat every system this often, interleaved")
    p.add_argument("--batch1-repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, help="a GGUF file to serve instead of the packaged SmolLM2 "
                   "(both systems; tierserve with model.path set to it)")
    p.add_argument("--llama-types", default="F32,BF16",
                   help="requantizations of the model file to serve (the file itself is always served)")
    p.add_argument("--tierserve-variant", type=parse_variant, action="append", default=[],
                   metavar="LABEL:KEY=VALUE[,...]", help="an extra tierserve row with config overrides")
    p.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="build jobs")
    p.add_argument("--cache", type=Path, default=llamacpp_build.cache_root(), help="build and model cache")
    p.add_argument("--plot", type=Path, default=Path("vs_llamacpp.png"))
    p.add_argument("--json", type=Path, help="also write every number here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-amx", action="store_true", help="no AMX llama.cpp build, even where the CPU runs AMX")
    p.add_argument("--llama-avx2", action="store_true",
                   help="llama.cpp built for AVX2-only CPUs (no AMX build): the peer of tierserve run as one "
                        "on a bigger CPU (TIERSERVE_EMULATE_CPU=avx2 PYTHONPATH=tests/emulate_cpu, README)")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.batch1_repeats = 8, 1
    if args.requests < 1 or args.rounds < 1 or args.batch1_repeats < 1:
        p.error("--requests, --rounds and --batch1-repeats must be >= 1")
    return args


def systems(args: argparse.Namespace, tree: llamacpp_build.LlamaCpp, packaged: Path,
            amx_tree: llamacpp_build.LlamaCpp | None = None) -> list[System]:
    threads, slots = len(os.sched_getaffinity(0)), args.requests
    _, _, packaged_kind = gguf_sizes(packaged)
    binary = tree.binary("llama-server")
    out = []
    for ftype in [t for t in args.llama_types.split(",") if t]:
        model = llamacpp_build.requantize(tree, packaged, ftype)
        out.append(llama_server(f"llama-server {ftype}", binary, model, slots, threads))
    given = "given" if args.model else "packaged"
    out.append(llama_server(f"llama-server {packaged_kind} ({given})", binary, packaged, slots, threads))
    if amx_tree is not None:
        amx_binary = amx_tree.binary("llama-server")
        out.append(llama_server(f"llama-server {packaged_kind} (packaged, AMX)", amx_binary, packaged, slots, threads,
                                optional=True))
    path = [f"model.path={packaged}"] if args.model else []
    out.append(tierserve("tierserve default", packaged, path))
    out += [tierserve(f"tierserve {label}", packaged, path + overrides) for label, overrides in args.tierserve_variant]
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tree = llamacpp_build.build(args.cache, args.jobs, not args.no_progress, avx2=args.llama_avx2)
    no_amx = args.no_amx or args.llama_avx2
    amx_tree = None if no_amx else llamacpp_build.build_amx(args.cache, args.jobs, not args.no_progress)
    packaged = args.model.resolve() if args.model else model_file()
    all_systems = systems(args, tree, packaged, amx_tree)
    args.log_dir = args.cache / "logs"
    args.log_dir.mkdir(parents=True, exist_ok=True)
    warn_if_busy()
    bounds = machine_bounds.measure()
    print(f"machine: fp32 matmul {bounds.fp32_gflops:.0f} GFLOP/s, bf16 {bounds.bf16_gflops:.0f} GFLOP/s, "
          f"read {bounds.read_gb_s:.1f} GB/s; {len(os.sched_getaffinity(0))} cores")
    workload = make_workload(args.requests, args.seed)
    rounds: dict[str, list[dict[str, Any]]] = {s.label: [] for s in all_systems}
    for _ in range(args.rounds):
        for system in all_systems:
            if system.label not in rounds:
                continue  # dropped in an earlier round
            try:
                result = run_loop(measure_stoppable(system, workload, args))
            except asyncio.CancelledError:
                raise SystemExit(f"stopped during {system.label}; its server is stopped") from None
            except SystemExit as failed:
                if not system.optional:
                    raise
                print(f"  {system.label}: dropped, it failed ({failed}); the table goes on without it", flush=True)
                del rounds[system.label]
                continue
            rounds[system.label].append(result)
            print(f"  {system.label}: {result['output_tok_per_s']:.1f} out tok/s, TTFT mean "
                  f"{result['ttft_mean_s'] or 0:.2f} s, batch-1 {result['decode_tok_s'] or 0:.1f} tok/s, "
                  f"{result['completed']}/{len(workload)} ok", flush=True)
    params, _, _ = gguf_sizes(packaged)
    rows = [report.add_bounds(report.median_rows(rs), bounds, params) for rs in rounds.values()]
    show(rows, bounds, args)


def show(rows: list[dict[str, Any]], bounds: machine_bounds.Bounds, args: argparse.Namespace) -> None:
    peers = [r for r in rows if r["system"] == "llama-server"]
    all_ratios = [report.ratios(r, peers) for r in rows if r["system"] == "tierserve"]
    print(f"\n{args.requests} concurrent requests, {args.rounds} round(s), medians; "
          "compute % of the matching dtype's matmul bound; b1 BW % of the read bandwidth bound")
    print(report.table(rows))
    print("\n".join(report.ratio_lines(all_ratios)))
    title = (f"tierserve vs llama-server, {args.requests} concurrent requests "
             f"(fp32 {bounds.fp32_gflops:.0f} / bf16 {bounds.bf16_gflops:.0f} GFLOP/s, {bounds.read_gb_s:.0f} GB/s)")
    if report.plot(rows, args.plot, title):
        print(f"plot: {args.plot}")
    if args.json:
        import json

        args.json.write_text(json.dumps({"bounds": asdict(bounds), "rows": rows, "ratios": all_ratios},
                                        indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
