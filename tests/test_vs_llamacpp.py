"""benchmarks/vs_llamacpp.py's pure parts: the workload, the bound arithmetic, the ratios
against the best peer, and the AMX scan of the built binaries. Nothing is built or served."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks import llamacpp_build, machine_bounds
from benchmarks import vs_llamacpp as bench
from benchmarks import vs_llamacpp_report as report


def test_the_workload_is_seeded_distinct_and_in_range() -> None:
    prompts = bench.make_workload(32, seed=0)
    assert prompts == bench.make_workload(32, seed=0)
    assert prompts != bench.make_workload(32, seed=1)
    for p in prompts:
        assert isinstance(p.body, str)
        assert 100 <= len(p.body.split()) <= 300
        assert 64 <= p.output_len <= 128
    # No two prompts share a first KV page (16 tokens ~ 16 words): neither server gets a hit.
    assert len({tuple(str(p.body).split()[:16]) for p in prompts}) == 32
    # The batch-1 prompts are not workload prompts either.
    assert not {p.body for p in bench.batch1_prompts(2, 0)} & {p.body for p in prompts}


def test_batch1_decode_rate_is_the_inverse_of_time_per_output_token() -> None:
    assert bench.decode_tok_s(0.025) == pytest.approx(40.0)
    assert bench.decode_tok_s(None) is None


def test_variants_parse_and_bad_ones_are_refused() -> None:
    assert bench.parse_variant("t1:model.num_threads=1,model.dtype=bfloat16") == (
        "t1", ["model.num_threads=1", "model.dtype=bfloat16"])
    for bad in ("t1", "t1:", ":model.dtype=float32", "t1:model.dtype"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_variant(bad)


def test_tierserve_reads_its_weights_as_its_numerics_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bandwidth bound counts what the engine's own rules make it read: dense bytes per
    weight of the resolved dtype, one byte a weight for int8, the GGUF's blocks for int4."""
    monkeypatch.setattr(bench, "gguf_sizes", lambda path: (1000, 600, "Q4_1"))
    monkeypatch.setattr(bench.numerics, "auto_dtype", lambda device: "bfloat16")
    monkeypatch.setattr(bench.numerics, "auto_quantization", lambda device, q4: "int4" if q4 else "none")
    packaged = Path("model.gguf")
    cases = {
        (): (600, "bfloat16+int4"),  # the default config: auto / auto
        ("model.quantization=none",): (2000, "bfloat16"),
        ("model.dtype=float32", "model.quantization=none"): (4000, "float32"),
        ("model.dtype=float32", "model.quantization=int8"): (1000, "float32+int8"),
    }
    for overrides, expected in cases.items():
        system = bench.tierserve("t", packaged, list(overrides))
        assert (system.weight_bytes, system.weight_dtype) == expected, overrides
    assert "server.port={port}" in system.argv


def test_bounds_match_the_issue_arithmetic() -> None:
    # 135M fp32 parameters (540 MB) at 24 GB/s: batch-1 decode is bounded near 45 tok/s.
    params = 135_000_000
    assert machine_bounds.decode_bound_tok_s(params * 4, 24.0) == pytest.approx(44.4, abs=0.1)
    assert machine_bounds.bandwidth_fraction(22.2, params * 4, 24.0) == pytest.approx(0.5, abs=0.01)
    # 1000 tokens through 135M parameters in 2 s: 135 GFLOP/s, 2/3 of a 202.5 GFLOP/s bound.
    assert machine_bounds.achieved_gflops(params, 1000, 2.0) == pytest.approx(135.0)
    assert machine_bounds.compute_fraction(params, 1000, 2.0, 202.5) == pytest.approx(2 / 3)
    b = machine_bounds.Bounds(fp32_gflops=200, bf16_gflops=700, read_gb_s=24)
    assert (b.gflops_for("F32"), b.gflops_for("float32"), b.gflops_for("BF16"), b.gflops_for("Q4_1")) == (
        200, 200, 700, 700)
    # tierserve's kind names its compute dtype first; GGUF quants take the fastest measured rate,
    # which is fp32 where bf16 is emulated (an AVX2-only CPU measures ~1 GFLOP/s for it), for BF16 too.
    assert (b.gflops_for("float32+int4"), b.gflops_for("bfloat16+int4")) == (200, 700)
    avx2 = machine_bounds.Bounds(fp32_gflops=109, bf16_gflops=1.3, read_gb_s=15.6)
    assert (avx2.gflops_for("Q4_1"), avx2.gflops_for("float32+int4"), avx2.gflops_for("BF16")) == (109, 109, 109)


def row(label: str, system: str, tok_s: float, ttft: float, decode: float | None,
        bandwidth: float | None = None, compute: float | None = None) -> dict[str, object]:
    return {"label": label, "system": system, "output_tok_per_s": tok_s, "ttft_mean_s": ttft,
            "decode_tok_s": decode, "bandwidth_frac": bandwidth, "compute_frac": compute}


def test_ratios_compare_with_the_best_peer_of_each_metric() -> None:
    peers = [row("F32", "llama-server", 60, 13.5, 39.3), row("Q4_1", "llama-server", 41, 26.0, 82.9)]
    r = report.ratios(row("ts", "tierserve", 180, 4.0, 170.0, 0.62, 0.75), peers)
    assert (r["vs_throughput"], r["vs_decode"]) == ("F32", "Q4_1")  # throughput peer, decode peer
    assert r["throughput"] == pytest.approx(3.0)
    assert r["ttft"] == pytest.approx(4.0 / 13.5)
    assert r["decode"] == pytest.approx(170 / 82.9)
    assert r["met"] == {"throughput": True, "ttft": True, "decode": True, "bandwidth": True, "compute": True}
    # issue 22's targets: 2x throughput and decode, TTFT <= 0.6x, 50 % of bandwidth, 70 % of compute
    short = report.ratios(row("ts", "tierserve", 113.1, 8.2, 160.0, 0.49, 0.69), peers)
    assert short["met"] == {"throughput": False, "ttft": False, "decode": False, "bandwidth": False,
                            "compute": False}
    assert any("49% of the read bandwidth bound" in line for line in report.ratio_lines([short]))
    assert not any("past the float bound" in line for line in report.ratio_lines([short, r]))
    beyond = report.ratios(row("ts", "tierserve", 180, 4.0, 170.0, 0.62, 2.47), peers)
    assert any("247% of the compute bound (past the float bound" in line for line in report.ratio_lines([beyond]))


def test_rounds_reduce_to_medians_and_bounds_are_added() -> None:
    rounds = [{"label": "x", "output_tok_per_s": v, "decode_tok_s": d} for v, d in ((1, None), (5, 2.0), (3, 4.0))]
    assert report.median_rows(rounds) == {"label": "x", "output_tok_per_s": 3, "decode_tok_s": 3.0}
    r = {"prompt_tokens": 900, "output_tokens": 100, "duration_s": 2.0, "weight_dtype": "F32",
         "weight_bytes": 540_000_000, "decode_tok_s": 22.2}
    out = report.add_bounds(r, machine_bounds.Bounds(202.5, 700, 24), 135_000_000)
    assert out["compute_frac"] == pytest.approx(2 / 3)
    assert out["bandwidth_frac"] == pytest.approx(0.5, abs=0.01)
    header, _, line = report.table([out | {"label": "x"}]).splitlines()
    cells = dict(zip((c.strip() for c in header.split("|")), (c.strip() for c in line.split("|"))))
    assert (cells["compute %"], cells["b1 BW %"], cells["b1 bound tok/s"], cells["out tok/s"]) == (
        "67", "50", "44", "-")  # a number this run lacks prints as "-"


def test_the_amx_scan_finds_tile_instructions_and_nothing_else() -> None:
    amx = b"  4011a0:\ttileloadd (%rsi,%rdx,1),%tmm0\n  4011a8:\ttdpbssd %tmm2,%tmm1,%tmm0\n"
    avx512 = b"  4011b0:\tvpdpbusd %zmm1,%zmm2,%zmm3\n  4011b8:\tvdpbf16ps %zmm1,%zmm2,%zmm3\n"
    assert set(llamacpp_build.AMX_MNEMONIC.findall(amx)) == {b"tileloadd", b"tdpbssd"}
    assert llamacpp_build.AMX_MNEMONIC.findall(avx512) == []


def test_ninja_progress_lines_are_parsed() -> None:
    m = llamacpp_build.NINJA_STEP.match("[17/210] Building CXX object x.o")
    assert m is not None and (m[1], m[2]) == ("17", "210")
    assert llamacpp_build.NINJA_STEP.match("FAILED: x.o") is None


def test_the_amx_build_is_a_tree_of_its_own_with_amx_on() -> None:
    plain, amx = llamacpp_build.LlamaCpp(Path("/x")), llamacpp_build.LlamaCpp(Path("/x"), amx=True)
    assert plain.build_dir != amx.build_dir and amx.binary("llama-server").parent.parent == amx.build_dir
    plain_args, amx_args = llamacpp_build.cmake_args(plain), llamacpp_build.cmake_args(amx)
    assert "-DGGML_AMX_INT8=OFF" in plain_args and "-DGGML_AMX_INT8=ON" in amx_args
    assert not any("-mno-amx" in a for a in amx_args)


def test_the_avx2_build_is_a_tree_of_its_own_without_native_flags() -> None:
    plain, avx2 = llamacpp_build.LlamaCpp(Path("/x")), llamacpp_build.LlamaCpp(Path("/x"), avx2=True)
    assert len({plain.build_dir, avx2.build_dir, llamacpp_build.LlamaCpp(Path("/x"), amx=True).build_dir}) == 3
    assert "-DGGML_NATIVE=ON" in llamacpp_build.cmake_args(plain)
    avx2_args = llamacpp_build.cmake_args(avx2)
    assert "-DGGML_NATIVE=OFF" in avx2_args and "-DGGML_AMX_INT8=OFF" in avx2_args
    assert bench.parse_args(["--llama-avx2"]).llama_avx2 and not bench.parse_args([]).llama_avx2


def test_no_amx_where_the_cpu_does_not_advertise_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from gpu import numerics

    monkeypatch.setattr(numerics, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert llamacpp_build.amx_runs(tmp_path) == "the CPU does not advertise AMX"
    assert llamacpp_build.build_amx(tmp_path, 1, False) is None  # nothing built


def test_the_amx_peer_serves_the_packaged_file(tmp_path: Path) -> None:
    packaged = bench.model_file()
    args = bench.parse_args(["--llama-types", ""])
    plain, amx = llamacpp_build.LlamaCpp(tmp_path), llamacpp_build.LlamaCpp(tmp_path, amx=True)
    labels = [(s.label, s.argv[0]) for s in bench.systems(args, plain, packaged, amx)]
    assert ("llama-server Q4_1 (packaged, AMX)", str(amx.binary("llama-server"))) in labels
    assert [label for label, _ in labels].count("llama-server Q4_1 (packaged)") == 1
    assert not any("AMX" in s.label for s in bench.systems(args, plain, packaged))


def test_a_server_killed_by_a_signal_says_which() -> None:
    """The AMX llama-server that a VM's trap kills reads "exited with -4, killed by SIGILL"."""
    from benchmarks.serving import signal_name

    assert signal_name(-4) == ", killed by SIGILL"
    assert signal_name(-9) == ", killed by SIGKILL"
    assert signal_name(0) == signal_name(1) == ""
