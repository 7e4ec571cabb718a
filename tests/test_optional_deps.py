"""An install without extras serves everything that is not optional.

Each optional dependency (kernel/registry.py OPTIONAL_MODULES: `redis`, `triton`) is made
unimportable in a fresh interpreter (`sys.modules[name] = None`, which is what a missing
package looks like to `import` and to `importlib.util.find_spec`), and there: registry
discovery of every kind works, the default config starts and serves a request, the `file`
storage tier starts and serves one, and choosing an optional part fails at start-up with a
message naming its extra (`hicache.storage: redis` before the weights load).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kernel.registry import OPTIONAL_MODULES

ROOT = Path(__file__).resolve().parent.parent

# Runs in a fresh interpreter; argv[1] is a scratch folder. Prints one JSON line per check.
PROBE = """
import json, sys
from kernel.registry import OPTIONAL_MODULES
for name in OPTIONAL_MODULES:
    sys.modules[name] = None  # as if not installed
{plant}
import torch
from kernel import Engine, registry
from kernel import components, model_build

def emit(check, **fields):
    print("PROBE " + json.dumps({{"check": check, **fields}}), flush=True)

try:
    emit("discovery", names={{kind: registry.names(kind) for kind in registry.KINDS}})
except ImportError as exc:
    emit("discovery", error=repr(exc))
    sys.exit(0)

loads = []
real_load = model_build.load_checkpoint
model_build.load_checkpoint = lambda *a, **k: loads.append(1) or real_load(*a, **k)
small = {{"cache.num_pages": 256, "model.num_threads": 1}}
tiered = {{**small, "hicache.host_pages": 256}}
greedy = {{"max_new_tokens": 4, "temperature": 0.0}}
for check, overrides in (
    ("default", small),
    ("file", {{**tiered, "hicache.storage": "file", "hicache.storage_dir": sys.argv[1] + "/kv"}}),
):
    engine = Engine("config/default.yaml", overrides)
    out = engine.generate("The capital of France is", greedy)
    storage = engine.config.hicache.storage
    engine.shutdown()
    emit(check, tokens=len(out["output_ids"]), storage=storage)

before = len(loads)
try:
    Engine("config/default.yaml", {{**tiered, "hicache.storage": "redis"}})
    emit("redis", error=None)
except Exception as exc:
    emit("redis", error=str(exc), type=type(exc).__name__, weights_loaded=len(loads) - before)

emit("triton_auto", backend=components.attention_backend("auto", torch.device("cuda")))
from cache.kv_pool import KVPool
pool = KVPool(1, 4, 4, 1, 16, torch.float32, torch.device("cpu"))
try:
    registry.lookup("attention", "triton")(pool, torch.zeros((2, 16), dtype=torch.int64))
    emit("triton", error=None)
except RuntimeError as exc:
    emit("triton", error=str(exc))
"""

# A built-in storage module that imports an optional dependency at module level (what
# plugins/storage/redis_backend.py once did): discovery of the kind then fails.
PLANT_MODULE_LEVEL_IMPORT = """
import pathlib, tempfile, plugins.storage
_extra = pathlib.Path(tempfile.mkdtemp())
(_extra / "eager_redis.py").write_text("import redis\\n")
plugins.storage.__path__.append(str(_extra))
"""


def run_probe(tmp_path: Path, plant: str = "") -> dict[str, dict[str, object]]:
    res = subprocess.run(
        [sys.executable, "-c", PROBE.format(plant=plant), str(tmp_path)], cwd=ROOT,
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    checks = [json.loads(line[6:]) for line in res.stdout.splitlines() if line.startswith("PROBE ")]
    return {c.pop("check"): c for c in checks}


def check_discovery(results: dict[str, dict[str, object]]) -> dict[str, list[str]]:
    discovery = results["discovery"]
    if "error" in discovery:
        raise AssertionError(f"registry discovery imported an optional dependency: {discovery['error']}")
    names = discovery["names"]
    assert isinstance(names, dict)
    return names


def test_without_extras_every_non_optional_part_starts(tmp_path: Path) -> None:
    results = run_probe(tmp_path)
    names = check_discovery(results)
    assert "redis" in names["storage"] and "file" in names["storage"]
    assert {"torch", "triton"} <= set(names["attention"])
    assert results["default"] == {"tokens": 4, "storage": "none"}
    assert results["file"] == {"tokens": 4, "storage": "file"}
    redis = results["redis"]
    assert redis["type"] == "MissingExtraError" and "pip install 'tierserve[redis]'" in str(redis["error"])
    assert "hicache.storage: redis" in str(redis["error"])
    assert redis["weights_loaded"] == 0  # refused before the weights load
    assert results["triton_auto"] == {"backend": "torch"}  # auto on CUDA without triton
    assert "pip install 'tierserve[cuda]'" in str(results["triton"]["error"])


def test_red_a_module_level_optional_import_breaks_discovery(tmp_path: Path) -> None:
    """Planted: a built-in module importing `redis` at module level. Discovery of its kind
    (and so `hicache.storage: file`) fails without the extra, and the check says so."""
    results = run_probe(tmp_path, plant=PLANT_MODULE_LEVEL_IMPORT)
    with pytest.raises(AssertionError, match="registry discovery imported an optional dependency.*redis"):
        check_discovery(results)


def test_every_optional_module_has_its_extra_and_the_suite_installs_it() -> None:
    """pyproject.toml: each optional module is an extra (not a runtime dependency), and
    the `test` extra pulls every one of them in."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    test_extra = " ".join(extras["test"])
    distribution = {"zmq": "pyzmq"}  # where the import name is not the package's
    for module, extra in OPTIONAL_MODULES.items():
        assert any(req.startswith(distribution.get(module, module)) for req in extras[extra]), (module, extra)
        assert f'"{module}' not in json.dumps(project["dependencies"]), runtime
        assert extra in test_extra.partition("tierserve[")[2].partition("]")[0].split(","), extra
