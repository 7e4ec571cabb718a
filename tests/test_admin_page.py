"""The inspector's server side: its static page, the `policies` command and the
summarized snapshot (`{"type": "snapshot", "limit": N}`), in-process."""

from __future__ import annotations

import random
import re
import time
import tomllib
from typing import Any

from setuptools import find_packages

from kernel import registry
from plugins.admin.page import STATIC_DIR
from plugins.admin.summary import limited, summarize
from tests.conftest import TINY_OVERRIDES
from tests.inprocess import serve_http
from tests.test_admin_ws import GREEDY, KEY, PROMPT_A, PROMPT_B, ask, serve

PAGE = int(TINY_OVERRIDES["cache.page_size"])  # type: ignore[call-overload]
ROOT_DIR = STATIC_DIR.parent.parent.parent


def synthetic_tree(n: int, seed: int = 3) -> list[dict[str, Any]]:
    """`n` describe()-shaped nodes, root first, each below a random earlier one."""
    rng = random.Random(seed)
    root = {"id": 0, "parent": None, "num_tokens": 0, "num_pages": 0, "num_host_pages": 0, "lock_ref": 1,
            "hit_count": 0, "last_access": 0, "priority": 0, "tier": "device", "stored": False,
            "namespace": None, "state_slot": None, "state_len": None}
    nodes = [root]
    for i in range(1, n):
        pages = rng.randint(1, 8)
        tier = rng.choice(["device", "device+host", "host"])
        slot = i if rng.random() < 0.2 else None
        nodes.append({**root, "id": i, "parent": rng.randrange(i), "num_tokens": pages * PAGE,
                      "num_pages": 0 if tier == "host" else pages, "num_host_pages": 0 if tier == "device" else pages,
                      "lock_ref": int(rng.random() < 0.1), "hit_count": rng.randint(0, 50),
                      "last_access": i, "tier": tier, "stored": rng.random() < 0.3,
                      "state_slot": slot, "state_len": None if slot is None else pages * PAGE})
    return nodes


def test_summary_counts_every_node_but_the_root() -> None:
    nodes = synthetic_tree(10_000)
    s = summarize(nodes)
    rest = nodes[1:]
    assert s["nodes"] == 9_999 and s["tokens"] == sum(n["num_tokens"] for n in rest)
    assert sum(b["nodes"] for b in s["tiers"].values()) == 9_999
    for tier in ("device", "device+host", "host"):
        mine = [n for n in rest if n["tier"] == tier]
        assert s["tiers"][tier] == {"nodes": len(mine), "tokens": sum(n["num_tokens"] for n in mine)}
    assert s["stored"]["nodes"] == sum(n["stored"] for n in rest)
    assert s["locked"] == sum(n["lock_ref"] > 0 for n in rest)  # the root's lock is not counted
    assert s["with_state"] == sum(n["state_slot"] is not None for n in rest)
    assert summarize([])["nodes"] == 0


def test_limited_keeps_the_root_and_the_top_nodes_in_tree_order() -> None:
    nodes = synthetic_tree(10_000)
    started = time.perf_counter()
    out = limited(nodes, 200, "hits")
    assert time.perf_counter() - started < 0.5  # cheap enough to answer twice a second
    kept = out["nodes"]
    assert out["truncated"] is True and out["total_nodes"] == 10_000 and len(kept) == 200
    assert kept[0] is nodes[0]
    ids = [n["id"] for n in kept]
    assert ids == sorted(ids)  # tree (snapshot) order, not rank order
    floor = min(n["hit_count"] for n in kept[1:])
    assert all(n["hit_count"] <= floor for n in nodes[1:] if n["id"] not in set(ids))
    by_tokens = limited(nodes, 50, "tokens")["nodes"]
    assert min(n["num_tokens"] for n in by_tokens[1:]) == 8 * PAGE  # the largest ones
    small = limited(nodes[:10], 10, "hits")
    assert small["truncated"] is False and small["nodes"] == nodes[:10]
    assert limited(nodes, 1, "hits")["nodes"] == [nodes[0]]


async def test_summarized_snapshot_over_the_socket(tiny_chat_folder: str) -> None:
    async with serve(tiny_chat_folder) as (engine, client), client.ws_connect("/admin/ws") as ws:
        await engine.generate(PROMPT_A, GREEDY)
        await engine.generate(PROMPT_B, GREEDY)
        full = (await ask(ws, {"type": "snapshot"}))["nodes"]
        assert len(full) > 3
        whole = await ask(ws, {"type": "snapshot", "limit": 100, "id": 1})
        assert whole["truncated"] is False and whole["nodes"] == full and whole["id"] == 1
        assert whole["summary"]["tiers"]["device"]["tokens"] == sum(n["num_tokens"] for n in full)
        top = await ask(ws, {"type": "snapshot", "limit": 2, "by": "tokens"})
        assert top["truncated"] is True and top["total_nodes"] == len(full) and top["by"] == "tokens"
        assert top["nodes"] == [full[0], max(full[1:], key=lambda n: (n["num_tokens"], n["hit_count"]))]
        assert top["summary"] == whole["summary"]
        for bad in ({"limit": 0}, {"limit": "10"}, {"limit": True}, {"limit": 10, "by": "age"}):
            reply = await ask(ws, {"type": "snapshot", **bad})
            assert reply["type"] == "error" and "snapshot" in reply["message"]


async def test_policies_lists_the_names_set_policy_takes(tiny_chat_folder: str) -> None:
    async with serve(tiny_chat_folder) as (_, client), client.ws_connect("/admin/ws") as ws:
        reply = await ask(ws, {"type": "policies"})
        assert reply["current"] == {"schedule": "fcfs", "evict": "lru"}
        assert reply["known"] == {"schedule": registry.names("schedule"), "evict": registry.names("evict")}
        assert {"lru", "lfu", "fifo"} <= set(reply["known"]["evict"])
        for name in reply["known"]["evict"]:  # every listed name is accepted
            assert (await ask(ws, {"type": "set_policy", "kind": "evict", "name": name}))["ok"] is True
        assert (await ask(ws, {"type": "policies"}))["current"]["evict"] == reply["known"]["evict"][-1]
    async with serve(tiny_chat_folder, {"cache.prefix": "none"}) as (_, client), client.ws_connect("/admin/ws") as ws:
        assert (await ask(ws, {"type": "policies"}))["current"]["evict"] is None


async def test_page_is_served_with_its_modules(tiny_chat_folder: str) -> None:
    # The whole server app, with both keys set: the page itself needs neither.
    overrides = {"cache.prefix": "radix", "server.api_key": "api", "server.admin_api_key": KEY}
    async with serve_http(tiny_chat_folder, overrides) as (_, client):
        page = await client.get("/admin/")
        html = await page.text()
        assert page.status == 200 and page.content_type == "text/html"
        assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
        bare = await client.get("/admin", allow_redirects=False)
        assert bare.status == 302 and bare.headers["Location"] == "/admin/"
        assert 'src="static/inspector.js"' in html and "http://" not in html and "https://" not in html
        for name in ("inspector.js", "socket.js", "tree.js", "gauges.js", "chart.js", "inspector.css"):
            resp = await client.get(f"/admin/static/{name}")
            assert resp.status == 200, name
            text = await resp.text()
            assert "http://" not in text and "https://" not in text, f"{name} reaches outside the package"
            for module in re.findall(r'from "\./([\w.]+)"', text):
                assert (STATIC_DIR / module).is_file(), f"{name} imports a missing {module}"
        assert (await client.get("/admin/static/inspector.js")).content_type == "text/javascript"
        for missing in ("/admin/static/nope.js", "/admin/static/..%2fws.py", "/admin/static/ws.py"):
            assert (await client.get(missing)).status == 404, missing
        assert (await client.get("/admin/stats")).status == 401  # the data still needs the key


def test_static_files_ship_in_the_package() -> None:
    pyproject = tomllib.loads((ROOT_DIR / "pyproject.toml").read_text())
    setuptools = pyproject["tool"]["setuptools"]
    found = find_packages(str(ROOT_DIR), include=setuptools["packages"]["find"]["include"])
    assert "plugins.admin" in found
    patterns = setuptools["package-data"]["plugins.admin"]
    files = sorted(p.name for p in STATIC_DIR.iterdir())
    assert "index.html" in files
    shipped = {p.name for pattern in patterns for p in STATIC_DIR.parent.glob(pattern)}
    assert shipped == set(files), "every static file must match a package-data pattern"
