"""The `tierserve` console script: kernel/cli.py's commands, with `serve` wired to the
HTTP server (plugins/http/server.py)."""

from __future__ import annotations

from collections.abc import Sequence

from kernel import cli
from kernel.config import Config


def _serve(config: Config) -> int:
    # Imported here so that `generate` does not load the HTTP stack.
    from plugins.http.server import run_server

    return run_server(config)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(argv, serve=_serve)


if __name__ == "__main__":
    raise SystemExit(main())
