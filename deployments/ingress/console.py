"""The console of ``serve run deployments:...``: Ray Serve's own notices that alarm for nothing.

``serve run`` imports this package (``build_app``) in its own process before it starts Serve, so
the app can act on what that process prints. On Ctrl-C, Serve's client calls the controller's
``graceful_shutdown`` and waits until the controller actor is killed: that is how the call is
meant to end (Ray Serve's controller says so). But the controller retries its tasks forever, so
Ray publishes the ending as "Task ServeController.graceful_shutdown failed. There are infinite
retries remaining ... killed by `ray.kill`" and the driver prints it as an error from the
raylet, after every clean shutdown. ``quiet_serve_shutdown_notice`` drops that one notice from
the driver's printer of cluster error messages; every other message still prints.

In each replica, ``quiet_health_polls`` leaves ``/health`` polls answered 200 out of Serve's
access log (a failing poll still logs). Serve's proxy logs its own access line for them, which
no app code can filter.
"""

from __future__ import annotations

import re
from typing import Any, Callable

SHUTDOWN_NOTICE = "Task ServeController.graceful_shutdown failed"


def _without_shutdown_notice(print_lines: Callable[..., Any]) -> Callable[..., Any]:
    def print_to_stdstream(data: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        lines = [line for line in data.get("lines", ()) if SHUTDOWN_NOTICE not in line]
        if lines or not data.get("lines"):
            return print_lines({**data, "lines": lines}, *args, **kwargs)
        return None

    print_to_stdstream.quiets_shutdown_notice = True  # type: ignore[attr-defined]
    return print_to_stdstream


def quiet_serve_shutdown_notice() -> None:
    """In this (the ``serve run``) process: drop Serve's shutdown notice (see above). Does
    nothing where Ray's printer is not where Ray 2.60 keeps it."""
    from ray._private import worker  # noqa: PLC0415

    printer = getattr(worker, "print_to_stdstream", None)
    if callable(printer) and not getattr(printer, "quiets_shutdown_notice", False):
        worker.print_to_stdstream = _without_shutdown_notice(printer)


HEALTH_ROUTE = "/health"


_HEALTHY_POLL = re.compile(r"\bGET \S*/health 200 ")  # under the app's route prefix too


def _is_a_healthy_health_poll(record: Any) -> bool:
    """Serve's access-log line of a ``/health`` poll answered 200 (a load balancer's, every
    few seconds)."""
    return (bool(getattr(record, "serve_access_log", False))
            and str(getattr(record, "route", "")).endswith(HEALTH_ROUTE)
            and _HEALTHY_POLL.search(record.getMessage()) is not None)


def quiet_health_polls() -> None:
    """In a replica: Serve's access log leaves out ``/health`` polls that answered 200 (one
    INFO line each, drowning the log); a failing poll and every other request still log."""
    import logging  # noqa: PLC0415

    serve_logger = logging.getLogger("ray.serve")
    if not any(getattr(f, "quiets_health_polls", False) for f in serve_logger.filters):
        class HealthPolls(logging.Filter):
            quiets_health_polls = True

            def filter(self, record: logging.LogRecord) -> bool:
                return not _is_a_healthy_health_poll(record)

        serve_logger.addFilter(HealthPolls())
