"""Speculation on hybrid models where text matters: structured output (each verify
position samples under its grammar's mask after the drafts before it; drafts the grammar
refuses are never verified) and stops inside accepted runs (stop tokens, max_tokens,
stop strings) — chains and token trees, deterministic mode, `==` the plain engine's
tokens, text and logprobs. The tiny hybrids here carry SmolLM2's tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernel import Engine
from kernel.request import Request
from tests.conftest import HYBRID_FAMILIES
from tests.structured_cases import MAX_TOKENS, SMALL, TEXT, array, obj
from tests.test_speculative import ORACLE, same, spec_stats, stop_cases
from tests.test_speculative_hybrid import make, plain, reference, tokens
from tests.test_speculative_tree import TREE

DRAFTERS = {"chain": ORACLE, "tree": TREE}
SAMPLED = {"max_new_tokens": 20, "return_logprob": True, "temperature": 1.2, "top_p": 0.95, "seed": 5}


def build(family: str, folder: Path) -> str:
    from gpu.loader.random_models import save_tokenizer
    from tests.tiny_hybrid import build_tiny_lfm2, build_tiny_qwen3_5
    from tests.tiny_models import smollm_tokenizer

    tok = smollm_tokenizer()
    builder = build_tiny_qwen3_5 if family == "qwen3_5_text" else build_tiny_lfm2
    builder(folder, shape={"vocab_size": tok.vocab_size})
    save_tokenizer(tok, folder)
    return str(folder)


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    """(model folder, a plain deterministic engine: the reference)."""
    folder = build(request.param, tmp_path_factory.mktemp(f"text_{request.param}"))
    ref = plain(folder)
    yield folder, ref
    ref.shutdown()


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_grammar_and_stops_inside_verify_steps(family: tuple[str, Engine], drafter: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    folder, ref = family
    cuts: list[int] = []
    cut = Request.cut_output
    monkeypatch.setattr(Request, "cut_output", lambda self, keep: (cuts.append(keep), cut(self, keep))[1])
    engine = make(folder, "no_buffer", **DRAFTERS[drafter])
    try:
        schema = json.dumps(obj({"name": TEXT, "age": SMALL, "tags": array(TEXT)}))
        for i, params in enumerate(({"temperature": 0}, {"temperature": 1.1, "seed": 3})):
            prompt = tokens(80 + i, 9 + i)
            params = {**params, "json_schema": schema, "max_new_tokens": MAX_TOKENS, "return_logprob": True}
            want = reference(ref, prompt, params)
            out = engine.generate(prompt, params)
            same(out, want)  # type: ignore[arg-type]
            json.loads(out["text"])  # type: ignore[index,call-overload]
        prompt = tokens(90, 12)
        plain = reference(ref, prompt, SAMPLED)
        cases = stop_cases(plain, engine.tokenizer)
        assert len(cases) >= 4
        for case in cases:
            want = ref.generate(prompt, {**SAMPLED, **case})
            same(engine.generate(prompt, {**SAMPLED, **case}), want)  # type: ignore[arg-type]
        assert cuts, "no stop string ended a request inside a verify step's tokens"
        assert spec_stats(engine)["accepted_tokens"] > 0
    finally:
        engine.shutdown()
