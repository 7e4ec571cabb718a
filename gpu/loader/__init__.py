"""Checkpoint loading: GGUF files and Hugging Face folders into one in-memory form.

Every loader returns a `Checkpoint` whose weights use Hugging Face Llama-family names and
[out, in] shapes in the requested compute dtype, so model code never sees the file format.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from gpu.loader.checkpoint import Checkpoint
from gpu.loader.random_models import RANDOM_PREFIX, random_checkpoint  # transformers only when building

PACKAGE_PREFIX = "package:"

__all__ = ["Checkpoint", "load_checkpoint", "resolve_model_path"]


def resolve_model_path(path: str) -> str:
    """Turn a configured model path into a filesystem path.

    `package:<module>/<file>` names a file shipped inside an installed Python package; the
    package is located with find_spec and never imported (importing may have side effects).
    `random:<architecture>[@seed]` names a tiny random checkpoint, built on first use.
    """
    if path.startswith(PACKAGE_PREFIX):
        return _resolve_package_path(path[len(PACKAGE_PREFIX) :])
    if path.startswith(RANDOM_PREFIX):
        return random_checkpoint(path[len(RANDOM_PREFIX) :])
    resolved = os.path.expanduser(path)
    if not os.path.exists(resolved):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    return resolved


def load_checkpoint(path: str, dtype: torch.dtype, keep_blocks: bool = False) -> Checkpoint:
    """Load a `.gguf` file or a Hugging Face folder (config.json + *.safetensors);
    `keep_blocks`: also a GGUF file's raw Q4 blocks (a folder has none)."""
    resolved = resolve_model_path(path)
    # Imported here: only the format asked for is loaded (gguf or safetensors).
    if os.path.isdir(resolved):
        from gpu.loader.hf import load_hf_folder

        return load_hf_folder(resolved, dtype)
    if resolved.endswith(".gguf"):
        from gpu.loader.gguf import load_gguf

        return load_gguf(resolved, dtype, keep_blocks)
    raise ValueError(f"model path {path!r} is neither a .gguf file nor a Hugging Face folder")


def _resolve_package_path(spec: str) -> str:
    module, sep, rel = spec.partition("/")
    if not module or not sep or not rel:
        raise ValueError(f"expected 'package:<module>/<file>', got 'package:{spec}'")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:  # a dotted name whose parent is missing
        raise FileNotFoundError(f"package {module!r} is not installed ({e})") from e
    if found is None:
        raise FileNotFoundError(f"package {module!r} is not installed")
    roots = list(found.submodule_search_locations or [])
    if not roots and found.origin:
        roots = [os.path.dirname(found.origin)]
    for root in roots:
        candidate = os.path.join(root, rel)
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(f"package {module!r} has no file {rel!r} (looked in {roots})")
