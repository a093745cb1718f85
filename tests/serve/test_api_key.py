"""The API-key check on its own: only ``Bearer <the key>`` passes (the app's HTTP test in
test_app_options.py sends the same headers through Serve)."""

from __future__ import annotations

import pytest

from deployments.ingress.auth import bearer_key_matches

KEY = "s3cret-key"


@pytest.mark.parametrize("header", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}"])
def test_the_exact_key_passes(header):
    assert bearer_key_matches(header, KEY)


def test_a_key_with_spaces_passes_whole():
    assert bearer_key_matches("Bearer two words", "two words")
    assert not bearer_key_matches("Bearer words", "two words")


@pytest.mark.parametrize("header", [
    "", "Bearer", "Bearer ", f"Bearer {KEY[:-1]}", f"Bearer {KEY[:1]}", f"Bearer {KEY}x",
    f"Bearer {KEY} ", f"Bearer  {KEY}", f"Basic {KEY}", KEY, f"Token {KEY}",
    f"Bearer {KEY.upper()}", f"Bearer x{KEY}"])
def test_anything_else_is_refused(header):
    assert not bearer_key_matches(header, KEY)
