"""OpenAI-compatible and native HTTP API over `AsyncEngine` (aiohttp on uvloop).

Entry point: `plugins.http.server.run_server(config)`; `tierserve serve` (plugins/cli.py) calls it.
"""
