"""Speculative decoding, side by side in one run: tierserve without and with n-gram drafts,
llama-server (the pinned build) without and with its n-gram speculation.

    .venv/bin/python benchmarks/speculative.py                  # every system, c = 1, 4, 16; tierserve's pair 3 times
    .venv/bin/python benchmarks/speculative.py --quick          # c = 1 only, two prompts a workload
    .venv/bin/python benchmarks/speculative.py --no-llama       # tierserve only (no llama.cpp build)
    .venv/bin/python benchmarks/speculative.py --no-exactness   # without the float32 / int4-draft pair
    .venv/bin/python benchmarks/speculative.py --topk 3         # also ngram token trees (speculative.topk)
    .venv/bin/python benchmarks/speculative.py --rounds 1       # tierserve's pair once (faster, noisier)
    .venv/bin/python benchmarks/speculative.py --exactness-only --sampled 0.8   # exact vs rejection acceptance

Workloads, as chat completions (each server applies the model's own chat template):
input-grounded — `code` (rewrite a file of this repository with one name changed), `quote`
(copy a paragraph of the README word for word), `json` (extract fields of a short text
as JSON) — and open-ended `chat`. Greedy, `max_tokens` fixed, real stops (no ignore_eos).
Each server is started alone on the machine, every distinct prompt is sent once untimed
(warm-up), then each concurrency level sends max(c, prompts) requests with at most c in
flight, its prompts led by a tag of their own ("Task 4-2. ...") so that no level reuses
an answer an earlier one left in a cache (tierserve's ngram drafter would draft it).

Reported per workload and level: output tok/s (all completion tokens / wall time) and
mean per-request decode tok/s (after the first token), tierserve's speculative/plain
ratio of both (`decode`: the second, batch-1 decode speed at c = 1, which prefill does not
dilute), and tierserve ngram against llama-server's best n-gram mode. tierserve without
and with speculation run `--rounds N` times (3 by default), alternating (a shared VM drifts by
tens of percent between the minutes of two runs): the ratio columns are the medians of the
N per-round ratios, each round's decode ratio is listed, and the absolute rates are the
first round's. Exactness: tierserve's
speculative text must equal its plain text for the same prompt (`same` column: equal /
compared). llama-server's modes: `--spec-type ngram-simple` and `ngram-mod`, with their own
default draft sizes.

Exactness for those who need it (`--exactness`, on by default): tierserve with float32
weights alone, and the same float32 target drafted by the packaged weights in int4
(`speculative.method: draft`), at c = 1 on every workload: the speed ratio, and whether
the text is the same. With `--sampled T` the pair samples (temperature T, a fixed seed) and a
third system runs the same draft under `speculative.acceptance: rejection`, whose output
follows the target's distribution rather than repeating its tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import llamacpp_build
from benchmarks.serving import Progress, Prompt, Record, Target, open_loop, run_loop, send
from benchmarks.throughput import model_file, warn_if_busy
from benchmarks.vs_llamacpp import Server, System, llama_server, served_model, tierserve

OUTPUT_TOKENS = 192
LEVELS = (1, 4, 16)
CODE_FILES = ("handlers/fcfs.py", "handlers/evict_lru.py", "kernel/scheduling/chunk_planner.py",
              "kernel/results/events.py")
PEOPLE = (
    ("Maria Lopez", 34, "Madrid", "Spain", "architect", "Casa Studio", "maria.lopez@casastudio.es"),
    ("Kenji Watanabe", 51, "Osaka", "Japan", "chef", "Umami House", "kenji@umamihouse.jp"),
    ("Amara Okafor", 28, "Lagos", "Nigeria", "data analyst", "Sahel Bank", "a.okafor@sahelbank.ng"),
    ("Lars Nilsson", 45, "Uppsala", "Sweden", "teacher", "Fyris School", "lars.nilsson@fyris.se"),
)
CHATS = (
    "Write a short story about a dragon who learns to bake bread.",
    "What are three good habits for staying healthy? Explain each briefly.",
    "Describe a walk through a forest in autumn.",
    "Give me some ideas for a birthday party for a ten year old.",
)


class Run(NamedTuple):
    records: list[Record]
    duration: float
    drafts: tuple[int, int] | None = None  # tierserve's (drafted, accepted) tokens in this run


async def spec_counters(session: aiohttp.ClientSession, base_url: str) -> tuple[int, int] | None:
    """A tierserve server's cumulative (drafted, accepted) tokens; None for others or without speculation."""
    try:
        async with session.get(f"{base_url}/server_info") as resp:
            spec = (await resp.json()).get("speculative") if resp.status == 200 else None
    except (aiohttp.ClientError, ValueError):
        return None
    return (spec["drafted_tokens"], spec["accepted_tokens"]) if spec else None


Results = dict[str, dict[tuple[str, int], Run]]  # system label -> (workload, level) -> its run


def code_prompts() -> list[str]:
    out = []
    for path in CODE_FILES:
        text = (REPO / path).read_text()
        name = next(line.split()[1].split("(")[0].rstrip(":") for line in text.splitlines()
                    if line.startswith(("def ", "class ")))
        out.append(f"Here is a Python file:\n```python\n{text}```\nRewrite the whole file with `{name}` renamed "
                   f"to `{name}_v2`. Output only the code.")
    return out


def quote_prompts() -> list[str]:
    paragraphs = [p for p in (REPO / "README.md").read_text().split("\n\n") if 300 < len(p) < 900
                  and not p.lstrip().startswith(("|", "```", "#"))]
    picks = paragraphs[1:9:2][:4]
    return [f"Document:\n{p}\n\nCopy the document above exactly, word for word." for p in picks]


def json_prompts() -> list[str]:
    return [f"Text: {n} is {a} years old, lives in {c}, {k}, works as a {j} at {w}, and can be reached at {e}.\n"
            "Extract name, age, city, country, job, company and email from the text as a JSON object."
            for n, a, c, k, j, w, e in PEOPLE]


def workloads(quick: bool) -> dict[str, list[str]]:
    sets = {"code": code_prompts(), "quote": quote_prompts(), "json": json_prompts(), "chat": list(CHATS)}
    return {k: v[:2] if quick else v for k, v in sets.items()}


TREE = "tierserve ngram tree"
PAIR = ("tierserve", "tierserve ngram")  # what --rounds alternates


def systems(args: argparse.Namespace) -> list[System]:
    packaged = model_file()
    k = args.num_draft_tokens
    spec = ["speculative.method=ngram", f"speculative.num_draft_tokens={k}"]
    out = [tierserve("tierserve", packaged, []), tierserve("tierserve ngram", packaged, spec)]
    if args.topk > 1:
        out.append(tierserve(TREE, packaged, [*spec, f"speculative.topk={args.topk}"]))
    if args.llama:
        tree = llamacpp_build.build(args.cache, args.jobs, not args.no_progress, targets=("llama-server",))
        base = llama_server("llama-server", tree.binary("llama-server"), packaged, max(LEVELS), args.threads)
        # Room for the longest prompt (a code file, ~1.5k tokens) and the output in every slot.
        argv = tuple(a if a != str(max(LEVELS) * 512) else str(max(LEVELS) * 3072) for a in base.argv)
        base = dataclasses.replace(base, argv=argv)
        out.append(base)
        for mode in ("ngram-simple", "ngram-mod"):
            extra = ("--spec-type", mode)  # its own defaults for the draft sizes
            out.append(dataclasses.replace(base, label=f"llama-server {mode}", argv=base.argv + extra))
    return out


async def run_system(system: System, sets: dict[str, list[str]], levels: tuple[int, ...],
                     args: argparse.Namespace, sampling: dict[str, float] | None = None) -> dict[tuple[str, int], Run]:
    server = Server(system, args.log_dir)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=900)
    results: dict[tuple[str, int], Run] = {}
    try:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await server.ready(session)
            target = Target(f"{server.base_url}/v1", await served_model(session, server.base_url), "chat", False, {},
                            sampling or {})
            for name, prompts in sets.items():
                for text in prompts:  # untimed: every prefix cached, every code path warm
                    await send(session, target, Prompt(text, 8))
                for level in levels:
                    count = max(level, len(prompts))
                    # A level's own prompts: an earlier level's answers are in tierserve's radix
                    # tree, and its ngram drafter would draft them (a retry), not the input.
                    batch = [Prompt(f"Task {level}-{i % len(prompts)}. {prompts[i % len(prompts)]}", OUTPUT_TOKENS)
                             for i in range(count)]
                    progress = Progress(f"{system.label} {name} c={level}", count, not args.no_progress)
                    before = await spec_counters(session, server.base_url)
                    records, duration = await open_loop(batch, lambda p: send(session, target, p), float("inf"),
                                                        level, progress, random.Random(0))
                    after = await spec_counters(session, server.base_url)
                    for rec in records:
                        if rec.error:
                            print(f"  {system.label} {name}: {rec.error}")
                    drafts = (after[0] - before[0], after[1] - before[1]) if before and after else None
                    results[(name, level)] = Run(records, duration, drafts)
    finally:
        server.stop()
    return results


def rates(run: Run) -> tuple[float, float | None]:
    """(output tok/s, mean per-request decode tok/s)."""
    tokens = sum(r.output_tokens for r in run.records if r.ok)
    decode = [1 / t for r in run.records if r.ok and (t := r.tpot())]
    return tokens / run.duration, statistics.mean(decode) if decode else None


def exactness_systems(args: argparse.Namespace) -> list[System]:
    packaged = model_file()
    f32 = ["model.dtype=float32", "model.quantization=none", *args.exact_set]
    draft = [*f32, "speculative.method=draft", f"speculative.draft_model={packaged}",
             "speculative.draft_quantization=int4", f"speculative.num_draft_tokens={args.exact_draft_tokens}"]
    out = [tierserve("tierserve f32", packaged, f32), tierserve("tierserve f32 + int4 draft", packaged, draft)]
    if args.sampled is not None:
        out.append(tierserve(REJECTING, packaged, [*draft, "speculative.acceptance=rejection"]))
    return out


REJECTING = "tierserve f32 + int4 draft, rejection"


def report_exactness(results: dict[str, dict[tuple[str, int], Run]], sets: dict[str, list[str]],
                     sampled: float | None) -> None:
    plain = results["tierserve f32"]
    how = "greedy" if sampled is None else f"temperature {sampled}, seeded"
    print(f"\nfloat32 target, alone and drafted by its int4 weights (c=1, {how}): output tok/s "
          "(mean per-request decode tok/s)")
    for label in [lb for lb in results if lb != "tierserve f32"]:
        print(f" {label}:")
        for name in sets:
            (a, da), (b, db) = rates(plain[(name, 1)]), rates(results[label][(name, 1)])
            pairs = list(zip(plain[(name, 1)].records, results[label][(name, 1)].records))
            equal = sum("".join(x.text) == "".join(y.text) for x, y in pairs if x.ok and y.ok)
            decode = f"decode {db / da:.2f}x" if da and db else "decode -"
            # rejection acceptance keeps the target's distribution, not its tokens: no text to compare
            same = f"same text {equal}/{len(pairs)}" if label != REJECTING else "(distribution-equal)"
            drafts = results[label][(name, 1)].drafts
            kept = f"kept {drafts[1] / drafts[0]:.0%} of {drafts[0]}" if drafts and drafts[0] else "kept -"
            print(f"  {name:6s} {a:6.1f} ({da or 0:6.1f}) -> {b:6.1f} ({db or 0:6.1f})  {b / a:.2f}x  {decode}  "
                  f"{kept}  {same}")


def pair_ratios(rounds: Sequence[Results], key: tuple[str, int]) -> list[tuple[float, float]]:
    """tierserve ngram / tierserve per round: (output tok/s ratio, decode tok/s ratio)."""
    out = []
    for got in rounds:
        if all(label in got for label in PAIR):
            (o0, d0), (o1, d1) = (rates(got[label][key]) for label in PAIR)
            out.append((o1 / o0, d1 / d0 if d0 and d1 else float("nan")))
    return out


def report(all_results: dict[str, dict[tuple[str, int], Run]], sets: dict[str, list[str]],
           levels: tuple[int, ...], later: Sequence[Results] = ()) -> None:
    labels = list(all_results)
    rounds = [all_results, *later]
    print("\noutput tok/s (mean per-request decode tok/s)" + (f"; ratios: medians of {len(rounds)} rounds" if later else ""))
    tree = TREE in all_results
    head = ["workload", "c", *labels, "ts ngram / ts", "decode", *(["decode per round"] if later else []),
            *(["tree / ts"] if tree else []), "ts ngram / best llama ngram",
            "same", *(["same (tree)"] if tree else [])]
    rows = [head]
    for name in sets:
        for level in levels:
            got = {lb: rates(all_results[lb][(name, level)]) for lb in labels}
            row = [name, str(level)] + [f"{o:.1f} ({d:.1f})" if d else f"{o:.1f}" for o, d in got.values()]
            plain, spec = got.get("tierserve"), got.get("tierserve ngram")
            ratios = pair_ratios(rounds, (name, level))
            row.append(f"{statistics.median(r[0] for r in ratios):.2f}x" if ratios else "-")
            # the target: per-request decode speed (after the first token), prefill left out
            row.append(f"{statistics.median(r[1] for r in ratios):.2f}x" if ratios else "-")
            if later:
                row.append(" ".join(f"{r[1]:.2f}" for r in ratios))
            if tree:
                row.append(f"{got[TREE][0] / plain[0]:.2f}x" if plain else "-")
            llama_spec = [got[lb][0] for lb in labels if lb.startswith("llama-server ngram")]
            row.append(f"{spec[0] / max(llama_spec):.2f}x" if spec and llama_spec else "-")
            row.append(same_text(all_results, name, level, rounds=later))
            if tree:
                row.append(same_text(all_results, name, level, TREE))
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def same_text(all_results: dict[str, dict[tuple[str, int], Run]], name: str, level: int,
              label: str = "tierserve ngram", rounds: Sequence[Results] = ()) -> str:
    """Speculative texts equal to the plain ones, every round's against round 1's plain."""
    plain, spec = all_results.get("tierserve"), all_results.get(label)
    if plain is None or spec is None:
        return "-"
    specs = [spec, *(r[label] for r in rounds if label in r)]
    pairs = [pair for s in specs for pair in zip(plain[(name, level)].records, s[(name, level)].records)]
    equal = sum("".join(a.text) == "".join(b.text) for a, b in pairs if a.ok and b.ok)
    return f"{equal}/{len(pairs)}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="c = 1 only, two prompts a workload")
    p.add_argument("--no-llama", dest="llama", action="store_false", help="tierserve only")
    p.add_argument("--num-draft-tokens", type=int, default=10, help="speculative.num_draft_tokens (the default: 10)")
    p.add_argument("--topk", type=int, default=1,
                   help="> 1: also tierserve ngram with token trees of this topk (speculative.topk)")
    p.add_argument("--no-exactness", dest="exactness", action="store_false",
                   help="skip the float32 / int4-draft pair")
    p.add_argument("--exact-draft-tokens", type=int, default=8, help="num_draft_tokens of the int4 draft")
    p.add_argument("--exactness-only", action="store_true", help="only the float32 / int4-draft pair")
    p.add_argument("--sampled", type=float, metavar="T",
                   help="the float32 / int4-draft pair at this temperature (seeded), with a third system: "
                        "the same draft under speculative.acceptance rejection")
    p.add_argument("--exact-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="an override for both systems of the pair (deterministic=true: the bit-exact mode)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="llama.cpp build jobs")
    p.add_argument("--cache", type=Path, default=llamacpp_build.cache_root(), help="build and model cache")
    # NOTE: 3 by default: on the shared 2-core VMs the rounds of one invocation scatter
    # (quote's c = 1 decode ratio 3.73 / 2.46 / 2.57x on a Zen 5); their median is the number.
    p.add_argument("--rounds", type=int, default=3,
                   help="run tierserve without and with speculation this many times, alternating; "
                        "ratios are medians of the rounds'")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.log_dir = args.cache / "logs"
    args.log_dir.mkdir(parents=True, exist_ok=True)
    levels = (1,) if args.quick else LEVELS
    sets = workloads(args.quick)
    all_systems = [] if args.exactness_only else systems(args)
    warn_if_busy()
    results: dict[str, dict[tuple[str, int], Run]] = {}
    later: list[Results] = []  # rounds 2.. of tierserve's pair
    for system in all_systems:
        results[system.label] = run_loop(run_system(system, sets, levels, args))
    paired = [s for s in all_systems if s.label in PAIR]
    for _ in range(1, args.rounds if len(paired) == len(PAIR) else 1):
        later.append({s.label: run_loop(run_system(s, sets, levels, args)) for s in paired})
    exact: dict[str, dict[tuple[str, int], Run]] = {}
    if args.exactness or args.exactness_only:
        sampling = None if args.sampled is None else {"temperature": args.sampled, "seed": 1}
        for system in exactness_systems(args):
            exact[system.label] = run_loop(run_system(system, sets, (1,), args, sampling))
    if results:
        report(results, sets, levels, later)
    if exact:
        report_exactness(exact, sets, args.sampled)


if __name__ == "__main__":
    main()
