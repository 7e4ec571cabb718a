"""Tool-call parsers (registry kind `tool_parser`), one file each: a package of their own
so that checking `server.tool_parser` at config time imports only them."""
