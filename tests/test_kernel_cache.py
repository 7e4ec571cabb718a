"""The C++ CPU kernel cache keeps one entry per key (gpu/kernels/cpu/__init__.py).

Two installs on one machine whose keys differ (another torch, other flags) each keep their
own entry: neither rebuilds nor removes the other's. Installs with the same key load the
one entry without compiling. A concurrent build of the same key never replaces a
published entry. The compiler is replaced by a fake that writes the library file and
counts builds, and loading records the path (no C++ toolchain needed); the cache lives
under a temporary TIERSERVE_CACHE.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu.kernels import cpu

NAME = "paged_attention"


class FakeToolchain:
    """Builds are counted; `key` is what `_digest` answers (the install's key)."""

    def __init__(self) -> None:
        self.key = "a" * 16
        self.builds: list[str] = []
        self.loaded: list[Path] = []
        self.during_build: list[object] = []  # callables run inside the next build

    def compile(self, module: str, source: Path, build: Path) -> None:
        assert source.parent == build and source.is_file()  # compiled from the private copy
        self.builds.append(self.key)
        (build / f"{module}.so").write_text(f"built for {self.key} (build {len(self.builds)})")
        while self.during_build:
            self.during_build.pop()()  # type: ignore[operator]

    def start(self) -> bool:
        """One engine start of this install: a fresh process's `load`."""
        cpu._load.cache_clear()
        return cpu.load(NAME)


@pytest.fixture(autouse=True)
def switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests drive the cache itself: the suite's `TIERSERVE_CPU_KERNELS=off` run must not
    switch it off under them."""
    monkeypatch.delenv("TIERSERVE_CPU_KERNELS", raising=False)


@pytest.fixture
def toolchain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeToolchain]:
    fake = FakeToolchain()
    monkeypatch.setenv("TIERSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu, "_digest", lambda source: fake.key)
    monkeypatch.setattr(cpu, "_compile", fake.compile)
    monkeypatch.setattr(cpu, "_load_library", fake.loaded.append)
    cpu._load.cache_clear()
    yield fake
    cpu._load.cache_clear()  # the real kernels load again (from the real cache) afterwards


def check_two_installs(fake: FakeToolchain) -> None:
    """Install A starts, install B (another key) starts, then each starts again."""
    key_a, key_b = "a" * 16, "b" * 16
    for key in (key_a, key_b, key_a, key_b, key_a):
        fake.key = key
        assert fake.start()
    if fake.builds != [key_a, key_b]:
        raise AssertionError(f"an install rebuilt its kernel after the other's build: builds {fake.builds}")
    for key in (key_a, key_b):
        library = cpu.library_path(NAME, key)
        assert library.read_text().startswith(f"built for {key}"), library
    assert fake.loaded[-1] == cpu.library_path(NAME, key_a)


def test_two_keys_keep_their_own_entries(toolchain: FakeToolchain) -> None:
    check_two_installs(toolchain)
    entries = sorted(p.name for p in cpu.cache_dir().iterdir())
    assert entries == [f"{NAME}-{'a' * 16}", f"{NAME}-{'b' * 16}"]  # no build or stale folder left


def test_red_one_folder_per_kernel_rebuilds_on_every_switch(
    toolchain: FakeToolchain, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: the old layout, one folder per kernel whatever the key. Each install's
    build takes the other's place, so every start after a switch compiles again."""
    monkeypatch.setattr(cpu, "entry_dir", lambda name, key: cpu.cache_dir() / name)
    with pytest.raises(AssertionError, match="an install rebuilt its kernel after the other's build"):
        check_two_installs(toolchain)


def check_concurrent_build(fake: FakeToolchain) -> str:
    """While this process compiles, another one builds the same key and publishes first.
    Ours is dropped; the published entry stays as it was. Returns the entry's content."""
    fake.during_build.append(lambda: cpu._build_entry(NAME, fake.key, cpu.SOURCES / f"{NAME}.cpp"))
    assert fake.start()
    content = cpu.library_path(NAME, fake.key).read_text()
    if content != f"built for {fake.key} (build 2)":
        raise AssertionError(f"a concurrent build replaced the published entry: {content!r}")
    return content


def test_a_concurrent_build_of_the_same_key_keeps_the_published_entry(toolchain: FakeToolchain) -> None:
    check_concurrent_build(toolchain)
    assert len(toolchain.builds) == 2
    assert [p.name for p in cpu.cache_dir().iterdir()] == [f"{NAME}-{toolchain.key}"]
    assert toolchain.start() and len(toolchain.builds) == 2  # the next start just loads it


def test_red_publishing_over_an_entry_replaces_it(toolchain: FakeToolchain, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a publish that replaces whatever entry is there."""

    def replace(work: Path, entry: Path, library: Path) -> None:
        shutil.rmtree(entry, ignore_errors=True)
        os.rename(work, entry)

    monkeypatch.setattr(cpu, "_publish", replace)
    with pytest.raises(AssertionError, match="a concurrent build replaced the published entry"):
        check_concurrent_build(toolchain)


def test_a_folder_without_its_library_is_rebuilt(toolchain: FakeToolchain) -> None:
    """A folder left by a failed or interrupted build (sources, no library) is not an
    entry: the next start builds and publishes in its place."""
    leftover = cpu.entry_dir(NAME, toolchain.key)
    leftover.mkdir(parents=True)
    (leftover / "build.ninja").write_text("half a build\n")
    assert toolchain.start()
    assert cpu.library_path(NAME, toolchain.key).is_file() and not (leftover / "build.ninja").exists()
    assert [p.name for p in cpu.cache_dir().iterdir()] == [leftover.name]
    assert toolchain.start() and len(toolchain.builds) == 1


def test_switched_off_loads_nothing_and_turns_the_setting_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """`TIERSERVE_CPU_KERNELS=off` (how the suite runs its torch fallback everywhere): no
    kernel loads, not even one loaded before, and `model.cpu_kernels: auto` resolves off."""
    from kernel.config import load_config
    from kernel.numerics_choice import use_cpu_kernels

    config = load_config(None, {"model.cpu_kernels": "auto"})
    on = use_cpu_kernels(config, torch.device("cpu"))
    monkeypatch.setenv("TIERSERVE_CPU_KERNELS", "off")
    assert not any(cpu.load(name) for name in cpu.names())
    assert not use_cpu_kernels(config, torch.device("cpu"))
    monkeypatch.delenv("TIERSERVE_CPU_KERNELS")
    assert use_cpu_kernels(config, torch.device("cpu")) == on
