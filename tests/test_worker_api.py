"""The routes routers call on a worker (plugins/http/worker_api.py), in the shapes SGLang's
and vLLM's routers parse, through the server's own app."""

from __future__ import annotations

import asyncio

from tests.inprocess import serve_http

RADIX = {"cache.prefix": "radix"}


async def test_model_and_server_info_name_the_model(tiny_chat_folder: str) -> None:
    async with serve_http(tiny_chat_folder, RADIX) as (engine, http):
        for path in ("/model_info", "/get_model_info"):
            info = await (await http.get(path)).json()
            assert info["model_path"] == tiny_chat_folder and info["tokenizer_path"] == tiny_chat_folder
            assert info["is_generation"] is True and info["served_model_name"] == engine.info.model_name
            assert info["model_type"] == "llama" and info["architectures"] == ["llama"]
            assert info["vocab_size"] == engine.info.vocab_size
        plain, sglang = await (await http.get("/server_info")).json(), await (await http.get("/get_server_info")).json()
        assert plain == sglang
        assert plain["model_path"] == tiny_chat_folder and plain["served_model_name"] == engine.info.model_name
        assert plain["block_size"] == engine.info.page_size and plain["max_total_num_tokens"] == engine.info.pool_tokens
        assert plain["dp_size"] == 1 and plain["max_running_requests"] == 16


async def test_load_counts_requests_and_held_tokens(tiny_chat_folder: str) -> None:
    async with serve_http(tiny_chat_folder, RADIX) as (engine, http):
        assert await (await http.get("/get_load")).json() == [
            {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        body = {"input_ids": list(range(100, 140)), "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
                "stream": True}
        async with http.post("/generate", json=body) as resp:
            await resp.content.readline()  # the first chunk: it is running
            load = (await (await http.get("/get_load")).json())[0]
            assert load["num_reqs"] == 1 and load["num_tokens"] >= 40, load
            flush = await http.post("/flush_cache")
            assert flush.status == 400 and "in flight" in (await flush.json())["error"]["message"]
        for _ in range(200):
            if engine.is_idle():
                break
            await asyncio.sleep(0.02)
        cached = engine.stats()["pages"]["cached"]
        assert cached > 0
        flush = await http.post("/flush_cache")
        assert flush.status == 200 and (await flush.json())["ok"] is True
        assert engine.stats()["pages"]["cached"] == 0
        assert (await (await http.get("/get_load")).json())[0]["num_tokens"] == 0


def test_http2_probes_leave_no_traceback() -> None:
    """sglang-router probes each worker for gRPC (an HTTP/2 preface) before HTTP: aiohttp's
    400 for it is expected, so its error record is dropped; other errors are kept."""
    import logging
    import sys

    from aiohttp.http_exceptions import BadHttpMessage

    from plugins.http.server import Http2Probe

    def record(exc: Exception) -> logging.LogRecord:
        try:
            raise exc
        except (BadHttpMessage, RuntimeError):
            return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request", None,
                                     sys.exc_info())

    probe = Http2Probe()
    assert not probe.filter(record(BadHttpMessage("Pause on PRI/Upgrade")))
    assert probe.filter(record(BadHttpMessage("Invalid method encountered")))
    assert probe.filter(record(RuntimeError("boom")))
