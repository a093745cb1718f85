"""API keys: whether a request's ``Authorization`` header (or, as Anthropic's clients send it,
its ``x-api-key`` header) carries the app's key.

Only ``Bearer <key>`` (or an ``x-api-key`` of just the key) with exactly the app's key passes (the scheme in any case, one space,
then the key): a prefix of the key, a longer token, an empty token or another scheme does not.
Keys are compared in constant time, so the time to refuse tells nothing about the key.
"""

from __future__ import annotations

import hmac


def bearer_key_matches(authorization: str, api_key: str) -> bool:
    """``authorization``: the header's value ("" when absent)."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())


def header_key_matches(x_api_key: str, api_key: str) -> bool:
    """``x_api_key``: the ``x-api-key`` header's value ("" when absent)."""
    return bool(x_api_key) and hmac.compare_digest(x_api_key.encode(), api_key.encode())
