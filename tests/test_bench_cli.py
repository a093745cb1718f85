"""``python -m nvray.bench throughput``: arguments it cannot run are refused before anything
starts, with a message naming the problem (the benchmark's figures themselves are not tested:
tests never time things)."""

import subprocess
import sys

import pytest


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvray.bench", "throughput", *args],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize(("args", "message"), [
    (("--runtimes", "inprocess", "--tensor-parallel-size", "2"), "needs the ray runtime"),
    (("--tensor-parallel-size", "1,0"), "each must be >= 1"),
    (("--tensor-parallel-size", "two"), "give sizes"),
    (("--runtimes", "inprocess,cuda"), "choose from inprocess, ray"),
    (("--shape", "9b"), "invalid choice: '9b'"),
])
def test_throughput_refuses_what_it_cannot_run(args: tuple[str, ...], message: str) -> None:
    result = _bench(*args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
