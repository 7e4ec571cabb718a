"""Bearer keys: read `Authorization: Bearer <key>` and compare keys in constant time.

Shared by the API key check (plugins/http/auth.py) and the admin API's (plugins/admin/auth.py),
so both accept the same header forms and neither leaks a key through response timing.
"""

from __future__ import annotations

import hmac


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization` header: None without one, "" for another scheme."""
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def key_matches(given: object, expected: str) -> bool:
    # Constant-time comparison: the key must not leak through response timing.
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def has_bearer_key(header: str | None, expected: str) -> bool:
    """Whether an `Authorization` header carries exactly `expected`."""
    return key_matches(bearer_token(header), expected)
