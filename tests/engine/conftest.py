"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from tiny_engines import tiny_inprocess


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "no-overlap"])
def overlap_llm(request):
    """The tiny model in-process (block size ``tiny_engines.BLOCK``), with overlapped steps on
    and off."""
    llm = tiny_inprocess(overlap_scheduling=request.param)
    yield llm
    llm.shutdown()
