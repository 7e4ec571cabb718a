"""Text <-> token ids and chat-template rendering, over a `tokenizers.Tokenizer`.

The wrapped tokenizer only splits and merges text; BOS insertion, stop tokens and the chat
template are decided here from the checkpoint's metadata, so a GGUF file and a Hugging Face
folder behave the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import tokenizers
from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# End-of-turn markers of common chat formats. A chat model ends its reply with one of these,
# which is often not the checkpoint's declared EOS (e.g. Llama 3 declares <|end_of_text|>).
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>", "<|eom_id|>")


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode plus stop tokens and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.chat_template = chat_template
        self.special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self.eos_token_ids = self._collect_eos_ids(eos_token_id, extra_eos_token_ids)
        self.eos_token_id = eos_token_id
        self._compiled: Template | None = None

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (e.g. to save it as tokenizer.json)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else None

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary entry of id `i` (byte-level spelling for BPE vocabularies)."""
        tok = self._backend.id_to_token(i)
        return None if tok is None else str(tok)

    def token_to_id(self, token: str) -> int | None:
        i = self._backend.token_to_id(token)
        return None if i is None else int(i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it map to their ids.

        BOS is prepended only when the checkpoint asks for it, and not twice when the text
        (typically a rendered chat template) already starts with it.
        """
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` with the model's chat template (sandboxed Jinja).

        `extra` becomes template variables too (e.g. `tools`, `enable_thinking`).
        """
        template = self._template()
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except TemplateError as e:  # includes raise_exception() and sandbox violations
            raise ValueError(f"chat template failed: {e}") from e

    def _template(self) -> Template:
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template; send a plain prompt (completions) instead of messages"
            )
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        return self._compiled

    def _collect_eos_ids(self, eos_token_id: int | None, extra: Iterable[int]) -> frozenset[int]:
        ids = set(extra)
        if eos_token_id is not None:
            ids.add(eos_token_id)
        # Only chat models end turns with a marker; for base models the declared EOS is enough.
        if self.chat_template is not None:
            for marker in _END_OF_TURN_TOKENS:
                i = self.token_to_id(marker)
                if i is not None and i in self.special_ids:
                    ids.add(i)
        return frozenset(ids)


def compile_chat_template(source: str) -> Template:
    """Compile a Hugging Face-style chat template in an immutable sandbox.

    Templates come with downloaded checkpoints, so they must not reach Python internals or
    mutate the caller's messages.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    # jinja's own tojson HTML-escapes <, > and &, which would corrupt tool schemas in prompts.
    env.filters["tojson"] = _to_json
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _to_json(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
