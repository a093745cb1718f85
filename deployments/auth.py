"""API keys: whether a request's ``Authorization`` header carries the app's key.

Only ``Bearer <key>`` with exactly the app's key passes (the scheme in any case, one space,
then the key): a prefix of the key, a longer token, an empty token or another scheme does not.
Keys are compared in constant time, so the time to refuse tells nothing about the key.
"""

from __future__ import annotations

import hmac


def bearer_key_matches(authorization: str, api_key: str) -> bool:
    """``authorization``: the header's value ("" when absent)."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())
