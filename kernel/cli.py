"""`tierserve` command line: the parser, and `generate` (offline).

`serve` needs the HTTP server, which lives in plugins/; the console script's entry
point is `plugins.cli:main`, which passes the server in (`kernel/` never imports
`plugins/`). Run alone (`python -m kernel.cli`), this module only generates.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import orjson

from kernel.config import Config, ConfigError, load_config, parse_set_args
from kernel.logging_setup import setup_logging


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierserve", description="tierserve LLM serving engine")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("serve", "serve a model"), ("generate", "generate offline and print")):
        cmd = sub.add_parser(name, help=help_)
        cmd.add_argument("--config", default=None, help="YAML launch file (config/default.yaml)")
        cmd.add_argument(
            "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key"
        )
    gen = sub.choices["generate"]
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    return p


def main(argv: Sequence[str] | None = None, serve: Callable[[Config], int] | None = None) -> int:
    """Run a command; `serve(config)` runs the server (plugins/cli.py passes it)."""
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, parse_set_args(args.set))
    except (ConfigError, OSError) as exc:
        print(f"tierserve: config error: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.logging.level, config.logging.json)
    if args.command == "generate":
        return _generate(config, args)
    if serve is None:
        print("tierserve: `serve` runs through the `tierserve` console script (plugins.cli)", file=sys.stderr)
        return 2
    return serve(config)


def _generate(config: Config, args: argparse.Namespace) -> int:
    from kernel.engine import Engine

    params = {
        "max_new_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "return_logprob": args.json,
    }
    engine = Engine(config)
    try:
        prompts = list(args.prompt)
        if args.chat:
            assert engine.tokenizer is not None
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        outputs = engine.generate(prompts, params)
        assert isinstance(outputs, list)
        for prompt, out in zip(args.prompt, outputs):
            if args.json:
                sys.stdout.write(orjson.dumps({"prompt": prompt, **out}).decode() + "\n")
            else:
                sys.stdout.write(f"{prompt}{out['text']}\n")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
