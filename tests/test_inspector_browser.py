"""The inspector page in a real browser (Debian's chromium driven by Playwright) against a
real `serve` process with an admin key, a small device pool, a host tier and a file
storage tier, at tensor-parallel size 2 (the page shows both ranks).

One browser launch: the page asks for the key (a wrong one is refused), shows the tree
as requests arrive, a node's tier badge turning from device(+host) to host when the
full device pool offloads it, the event stream and the hit chart; its controls switch
the eviction and scheduling policies (seen in /admin/stats), switch storage off and on,
run the integrity check and flush. A second tab, its socket answered by a stand-in
with a 10,000-node tree, shows the aggregate view and keeps its main thread responsive.
Screenshots of both land in the test's tmp_path (and in $TIERSERVE_ARTIFACTS when set).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from plugins.admin.summary import limited
from tests.browser import chromium_page, ensure_chromium, save_artifact
from tests.test_admin_page import synthetic_tree
from tests.test_http_fixtures import ServerProcess

KEY = "inspector-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT_TOKENS = 40  # 10 pages of 4; with 8 new tokens a request holds 12 of the 40 device pages
WAIT_MS = 15_000


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(50, 40000) for _ in range(PROMPT_TOKENS)]


def generate(server: ServerProcess, ids: list[int]) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    resp = requests.post(f"{server.url}/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def admin(server: ServerProcess, name: str) -> dict[str, Any]:
    resp = requests.get(f"{server.url}/admin/{name}", headers=AUTH, timeout=10)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def tier_of(server: ServerProcess, node_id: int) -> str | None:
    return next((n["tier"] for n in admin(server, "snapshot")["nodes"] if n["id"] == node_id), None)


def settle(server: ServerProcess, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (st := admin(server, "stats"))["idle"] or st["host"]["host_pages"]["copying"]:
        assert time.monotonic() < deadline, st
        time.sleep(0.05)


@pytest.fixture
def chromium() -> str:
    """Installed (apt-get, once per machine) before the server starts; skips where it cannot be."""
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra has it)")
    return ensure_chromium()


@pytest.fixture
def served(chromium: str, tiny_chat_folder: str, tmp_path: Path) -> Any:
    server = ServerProcess(
        tiny_chat_folder, "cache.prefix=radix", "cache.num_pages=41", "hicache.host_pages=200",
        "hicache.storage=file", f"hicache.storage_dir={tmp_path / 'kv'}", f"server.admin_api_key={KEY}",
        "parallel.tp_size=2",  # the page shows the ranks; the tiers run with the worker's shards
    )
    try:
        yield server
    finally:
        code = server.stop()
    assert code == 0, f"server exit code {code}"


@pytest.mark.timeout(900)  # a fresh machine installs chromium first (apt-get)
def test_inspector_page_in_chromium(chromium: str, served: ServerProcess, tmp_path: Path) -> None:
    started = time.monotonic()
    with chromium_page(chromium) as (browser, page):
        from playwright.sync_api import expect

        problems: list[str] = []
        page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
        page.on("console", lambda m: problems.append(f"console: {m.text} {m.location}") if m.type == "error" else None)
        page.set_default_timeout(WAIT_MS)
        expect.set_options(timeout=WAIT_MS)
        launched = time.monotonic()

        page.goto(f"{served.url}/admin/")
        conn = page.locator("#conn")
        expect(conn).to_have_attribute("data-state", "needs-key")
        page.fill("#admin-key", "not-the-key")
        page.click("#key-submit")
        expect(page.locator("#key-message")).to_have_text("That key was refused.")
        page.fill("#admin-key", KEY)
        page.click("#key-submit")
        expect(conn).to_have_attribute("data-state", "connected")
        assert page.evaluate("sessionStorage.getItem('tierserve.adminKey')") == KEY
        assert page.evaluate("localStorage.length") == 0

        rows = page.locator("#tree tr[data-node-id]")
        expect(rows).to_have_count(1)  # the root alone
        root = rows.first.get_attribute("data-node-id")
        expect(page.locator("#evict-policy")).to_have_attribute("data-current", "lru")

        # A request arrives: its node appears under the root, on device, then copied to host.
        generate(served, prompt(0))
        first = page.locator(f'#tree tr[data-parent="{root}"]').first
        expect(first).to_have_attribute("data-tier", "device+host")
        node_id = int(first.get_attribute("data-node-id") or -1)
        tracked = page.locator(f'#tree tr[data-node-id="{node_id}"]')
        expect(tracked.locator(".badge.device")).to_be_visible()

        # More prompts fill the 40-page device pool: the oldest prefix is offloaded to host.
        for seed in range(1, 12):
            generate(served, prompt(seed))
            if tier_of(served, node_id) == "host":
                break
        assert tier_of(served, node_id) == "host", admin(served, "snapshot")
        expect(tracked).to_have_attribute("data-tier", "host")
        expect(tracked.locator(".badge.device")).to_have_count(0)
        expect(tracked.locator(".badge.host")).to_be_visible()
        assert rows.count() > 3
        expect(page.locator('#events li[data-name="BlockStored"]').first).to_be_attached()
        expect(page.locator('#events li[data-name="finished"]').first).to_be_attached()
        expect(page.locator('[data-gauge="host"]')).to_be_visible()
        expect(page.locator('[data-gauge="rank-1"]')).to_have_attribute("data-alive", "true")
        expect(page.locator('[data-gauge="rank-0"] .gauge-legend')).to_contain_text("used")
        expect(page.locator('[data-gauge="collectives"]')).to_contain_text("2 ranks")

        # Hits on device (the newest prompt) and host (the offloaded one) reach the chart.
        generate(served, prompt(seed))
        generate(served, prompt(0))
        expect(page.locator("#hit-legend")).not_to_contain_text("host 0 ")

        page.select_option("#evict-policy", "lfu")
        page.click("#apply-evict")
        expect(page.locator("#status")).to_have_text("eviction policy set to lfu")
        page.select_option("#schedule-policy", "lpm")
        page.click("#apply-schedule")
        expect(page.locator("#status")).to_have_text("scheduling policy set to lpm")
        assert admin(served, "stats")["policies"] == {"evict": "lfu", "schedule": "lpm"}

        page.click("#storage-toggle")
        expect(page.locator("#status")).to_have_text("storage tier off")
        assert admin(served, "stats")["storage"]["enabled"] is False
        expect(page.locator("#storage-state")).to_have_text("off")
        page.click("#storage-toggle")
        expect(page.locator("#status")).to_have_text("storage tier on")

        page.click("#check")
        expect(page.locator("#status")).to_have_text("check ok")
        expect(page.locator("#status")).to_have_attribute("data-kind", "ok")
        page.wait_for_function("Number(document.getElementById('hit-chart').dataset.samples) >= 3")

        shot = tmp_path / "inspector.png"
        page.screenshot(path=str(shot), full_page=True)
        copied = save_artifact(shot)
        print(f"\ninspector screenshot: {shot}" + (f" (copied to {copied})" if copied else ""))

        settle(served)  # a flush waits for no request and no host copy in flight
        page.click("#flush")
        expect(page.locator("#status")).to_have_text("cache flushed")
        expect(rows).to_have_count(1)
        assert len(admin(served, "snapshot")["nodes"]) == 1

        stats = admin(served, "stats")
        aggregate_view(browser, served, stats, tmp_path / "inspector-10k.png")
        assert problems == [], problems
        print(f"browser launch {launched - started:.1f} s, page checks {time.monotonic() - launched:.1f} s")


def aggregate_view(browser: Any, served: ServerProcess, stats: dict[str, Any], shot: Path) -> None:
    """A second tab whose socket a stand-in answers with a 10,000-node tree: the page asks
    for a summarized snapshot, shows counts by tier and the top nodes, stays responsive."""
    from playwright.sync_api import expect

    tree = synthetic_tree(10_000)
    policies = {"type": "policies", "current": stats["policies"],
                "known": {"evict": ["lfu", "lru"], "schedule": ["fcfs", "lpm"]}}
    limits: list[int] = []

    def on_socket(ws: Any) -> None:
        def answer(text: str | bytes) -> None:
            msg = json.loads(text)
            kind = msg["type"]
            if kind == "snapshot":
                limits.append(msg["limit"])
                reply = {"type": "snapshot", "page_size": 4, **limited(tree, msg["limit"], msg["by"])}
            else:
                reply = {"stats": stats, "policies": policies}.get(kind, {"type": kind, "ok": True})
            ws.send(json.dumps({**reply, **({"id": msg["id"]} if "id" in msg else {})}))
            if kind == "snapshot":  # an event after each: the page refreshes as often as it may
                ws.send(json.dumps({"type": "kv_event", "event": "AllBlocksCleared"}))

        ws.on_message(answer)

    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.route_web_socket("**/admin/ws", on_socket)
    page.goto(f"{served.url}/admin/")
    view = page.locator('#tree [data-mode="aggregate"]')
    expect(view).to_be_visible()
    expect(page.locator("#tree-summary")).to_contain_text("10000 nodes")
    expect(page.locator('.tier-card[data-tier="host"] strong')).to_have_text(
        str(sum(n["tier"] == "host" for n in tree[1:])))
    # The main thread stays free while snapshots keep coming: the page asks for summarized
    # snapshots (201 nodes after the first) and renders 200 rows, asserted below. The longest
    # gap between 10 ms timers is printed, not bounded: on a loaded 2-core CI machine it is
    # the machine's scheduling as much as the page (328 ms seen once beside the suite).
    worst = page.evaluate("""() => new Promise((done) => {
        let last = performance.now(), worst = 0; const end = last + 1500;
        (function tick() { const now = performance.now(); worst = Math.max(worst, now - last); last = now;
          if (now < end) setTimeout(tick, 10); else done(worst); })(); })""")
    expect(view.locator("tr[data-node-id]")).to_have_count(200)
    assert limits[0] == 2000 and set(limits[1:]) == {201} and len(limits) >= 3, limits
    page.screenshot(path=str(shot))
    save_artifact(shot)
    print(f"10k-node tree: aggregate view ({shot}), longest main-thread gap {worst:.0f} ms over 1.5 s")
    page.close()
