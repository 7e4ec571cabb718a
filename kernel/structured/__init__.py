"""Structured outputs and tool calls: grammars, the admission gate that compiles them, tool-call parsing."""
