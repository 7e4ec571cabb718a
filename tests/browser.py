"""A real browser for the tests: Debian's `chromium`, driven by Playwright's Python package.

Chromium is installed with apt-get when it is missing and we are root (CI machines are
fresh); Playwright comes from the `test` extra and never downloads a browser of its own
(it launches /usr/bin/chromium). Where either cannot be had, the test skips with why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/lib/chromium/chromium")
INSTALL_TIMEOUT_S = 600
# A font for the page's text: fontconfig usually brings one, but a minimal image may not.
PACKAGES = ("chromium", "fonts-dejavu-core")


def _find_chromium() -> str | None:
    for path in CHROMIUM_PATHS:
        if os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


def ensure_chromium() -> str:
    """The chromium binary, installing Debian's package if needed; skips if impossible."""
    found = _find_chromium()
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed and cannot be installed here (not root / no apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]

    def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                                  timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.skip(f"{' '.join(cmd)} took over {INSTALL_TIMEOUT_S} s")

    if run(install).returncode != 0:
        run(["apt-get", "update", "-q"])
        done = run(install)
        if done.returncode != 0:
            pytest.skip(f"could not install chromium: {done.stderr[-300:]}")
    found = _find_chromium()
    if not found:
        pytest.skip("chromium still missing after apt-get install")
    return found


@contextmanager
def chromium_page(executable: str, viewport: tuple[int, int] = (1440, 1000)) -> Iterator[tuple[Any, Any]]:
    """(browser, page): one headless launch of `executable` (ensure_chromium()) for the
    whole `with` block."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra has it)")
    with sync_api.sync_playwright() as pw:
        # --disable-dev-shm-usage: containers often have a tiny /dev/shm.
        browser = pw.chromium.launch(executable_path=executable, args=["--disable-dev-shm-usage", "--disable-gpu"])
        try:
            width, height = viewport
            page = browser.new_page(viewport={"width": width, "height": height})
            yield browser, page
        finally:
            browser.close()


def save_artifact(path: Path) -> Path | None:
    """Copy `path` into $TIERSERVE_ARTIFACTS when that is set; the copy's path."""
    folder = os.environ.get("TIERSERVE_ARTIFACTS")
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy2(path, Path(folder) / path.name))
