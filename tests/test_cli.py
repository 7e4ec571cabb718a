"""The `tierserve` console script, end to end on the packaged SmolLM2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import CONFIG


def tierserve(*args: str) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "tierserve")
    return subprocess.run([exe, *args], check=False, capture_output=True, text=True, timeout=300)


def test_generate_capital_of_france() -> None:
    res = tierserve(
        "generate", "--config", CONFIG, "--prompt", "The capital of France is",
        "--max-tokens", "8", "--temperature", "0", "--json", "--set", "cache.num_pages=64",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    assert out["meta_info"]["completion_tokens"] <= 8


def test_bad_config_key_exits_with_message() -> None:
    res = tierserve("generate", "--config", CONFIG, "--prompt", "x", "--set", "cache.bogus=1")
    assert res.returncode == 2
    assert "cache.bogus" in res.stderr
