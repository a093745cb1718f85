"""How request failures map to what a client sees, and what the log says about them."""

from __future__ import annotations

import logging

from ray.exceptions import TaskCancelledError

from deployments.ingress.errors import to_openai_error


def test_a_client_that_left_is_a_disconnect_not_an_internal_error(caplog):
    """Serve cancels a request whose client disconnected; its handler then sees the cancel.
    That is no server fault: no 500, no traceback in the log."""
    with caplog.at_level(logging.INFO, logger="deployments.ingress.errors"):
        error = to_openai_error(TaskCancelledError())
    assert error.status == 499 and error.code == "client_closed_request"
    assert not any(r.levelno >= logging.ERROR or r.exc_info for r in caplog.records)
    assert any("disconnected" in r.getMessage() for r in caplog.records)


def test_an_unexpected_error_is_a_500_with_its_traceback_logged(caplog):
    with caplog.at_level(logging.INFO, logger="deployments.ingress.errors"):
        error = to_openai_error(RuntimeError("boom"))
    assert error.status == 500 and "boom" not in error.message
    assert any(r.levelno >= logging.ERROR and r.exc_info for r in caplog.records)
