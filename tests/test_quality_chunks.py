"""benchmarks/quality.py's pure parts: llama-perplexity's chunking and scored positions, the
transformers-side shift, the llama-perplexity log parsing and the two target checks.
Nothing is built, loaded or served."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from benchmarks import quality as q


def test_chunks_are_consecutive_with_the_tail_dropped() -> None:
    ids = list(range(100, 100 + 2 * 8 + 5))
    chunks = q.make_chunks(ids, 8, None)
    assert chunks == [ids[0:8], ids[8:16]]  # 5 tail tokens dropped, nothing overlaps
    assert q.make_chunks(ids, 8, None, limit=1) == [ids[0:8]]
    assert q.make_chunks(ids, 8, None, limit=5) == chunks


def test_bos_replaces_each_chunks_first_token() -> None:
    """llama-perplexity overwrites (not prepends) token 0 of every chunk with BOS."""
    ids = list(range(100, 124))
    chunks = q.make_chunks(ids, 8, 1)
    assert [c[0] for c in chunks] == [1, 1, 1]
    assert [c[1:] for c in chunks] == [ids[1:8], ids[9:16], ids[17:24]]
    assert ids[0] == 100  # the caller's ids are left as they were


def test_a_text_under_two_chunks_is_refused() -> None:
    with pytest.raises(SystemExit, match="has 15 tokens; perplexity at n_ctx=8 needs 16"):
        q.make_chunks(list(range(15)), 8, None)


def test_scored_positions_are_llama_perplexitys_second_half() -> None:
    # llama-perplexity: first = n_ctx/2; logits first .. n_ctx-2 score n_ctx - first - 1 tokens.
    assert q.first_scored(512) == 257
    assert 512 - q.first_scored(512) == 512 - 512 // 2 - 1 == 255


def test_each_token_is_scored_from_the_previous_positions_logits() -> None:
    """Logits at p put all the mass on ids[p + 1]: read at any other position, a target gets
    a log-prob near -1e4."""
    n_ctx, vocab, first = 8, 5, 5
    ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    logits = torch.full((1, n_ctx, vocab), -1e4)
    for p in range(n_ctx - 1):
        logits[0, p, ids[0, p + 1]] = 0.0
    got = q.scored_logprobs(logits, ids, first)
    assert got.shape == (1, n_ctx - first)
    assert torch.allclose(got, torch.tensor([[0.0, 0.0, 0.0]]), atol=1e-4)
    # Targets planted one position late are scored from the wrong logits.
    wrong = q.scored_logprobs(logits, torch.roll(ids, 1, dims=1), first)
    assert wrong.max() < -100


def test_perplexity_is_exp_of_the_mean_nll() -> None:
    s = q.Score()
    s.add([-1.0, -2.0])
    s.add([-3.0])
    assert s.count == 3 and s.nll == 6.0
    assert s.ppl == pytest.approx(math.exp(2.0))


LOG = "perplexity: calculating perplexity over 3 chunks, n_ctx=512, batch_size=512, n_seq=1\n" \
      "[1]17.1,[2]16.2,[3]15.3,\nFinal estimate: PPL = 15.3412 +/- 0.51234\n"


def test_the_llama_log_gives_its_final_ppl_for_the_asked_chunks() -> None:
    assert q.parse_llama_log(LOG, 0, 3) == 15.3412
    assert len(q.CHUNK_DONE.findall(LOG.encode())) == 3  # the progress bar's three ticks
    with pytest.raises(SystemExit, match="did not score 4 chunks of 512"):
        q.parse_llama_log(LOG, 0, 4)
    with pytest.raises(SystemExit, match=r"llama-perplexity failed \(1\)"):
        q.parse_llama_log(LOG, 1, 3)


def rows(f32: float, int4: float) -> list[q.Row]:
    return [
        q.Row("transformers", "float32", "dense", 10.0),
        q.Row("llama.cpp F32", "F32", "ggml", 10.0),
        q.Row("llama.cpp Q4_1", "Q4_1", "ggml", 10.3),  # a 3 % loss
        q.Row("tierserve float32/none", "float32/none", "dense", f32),
        q.Row("tierserve float32/int4 (default here)", "float32/int4", "quantized op", int4),
    ]


def test_the_targets_pass_and_fail_at_their_bounds() -> None:
    ok = q.checks(rows(10.009, 10.009 * 1.0399))
    assert ok[0].startswith("PASS: tierserve float32 10.0090 vs transformers 10.0000: +0.0900%")
    assert "+3.000%" in ok[1] and "loss <= +4.000%" in ok[1]
    assert ok[2].startswith("PASS: tierserve float32/int4 (default here), quantized op")
    bad = q.checks(rows(10.011, 10.011 * 1.0401))
    assert bad[0].startswith("FAIL") and bad[2].startswith("FAIL") and "+4.010%" in bad[2]


def test_prompts_in_quant_op_steps_run_the_quantized_op() -> None:
    """The step is a power of two (it is the page size) within every quantized op's row limit."""
    from gpu.quant.linears import Int4Linear, Int8Linear

    rows = q.quant_op_rows()
    limits = (Int4Linear.kernel_max_rows, Int4Linear.kernel_max_rows_amx, Int8Linear.kernel_max_rows)
    assert rows & (rows - 1) == 0 and rows <= min(limits)
    assert q.quant_op_overrides(rows)["scheduler.max_num_batched_tokens"] == rows


def test_the_text_is_written_as_llama_perplexity_reads_it(tmp_path: Path) -> None:
    """Its `-f` drops one trailing newline; llama-tokenize and tierserve then see those bytes."""
    src = tmp_path / "text"
    src.write_text("one\ntwo\n\n")
    assert q.as_llama_reads(src, tmp_path / "cache").read_text() == "one\ntwo\n"
    src.write_text("no newline")
    assert q.as_llama_reads(src, tmp_path / "cache").read_text() == "no newline"
