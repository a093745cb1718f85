"""The serve-run console filter drops Serve's shutdown notice and nothing else."""

from __future__ import annotations

from deployments.ingress.console import _without_shutdown_notice

NOTICE = ("Task ServeController.graceful_shutdown failed. There are infinite retries remaining, "
          "so the task will be retried. Error: The actor is dead because it was killed by "
          "`ray.kill`.")


def test_only_the_shutdown_notice_is_dropped():
    printed = []
    printer = _without_shutdown_notice(lambda data, **kw: printed.append((data, kw)))
    printer({"lines": [NOTICE], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert printed == []
    other = "Task EngineDriver.start failed: CUDA out of memory"
    printer({"lines": [NOTICE, other], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert printed == [({"lines": [other], "pid": "raylet", "is_err": False},
                        {"ignore_prefix": False})]
