"""The README's recipes, run as written: every ```bash and ```python block, in order, as one user
at one terminal would (the tiny model, the real CLIs, a real ``ray start --head`` cluster).

How a block runs:
- a ``serve run ...`` line starts the app as a terminal of its own would (its own process group,
  Ctrl-C able); the next line runs once ``/health`` on 127.0.0.1:8000 answers 200;
- the other lines of a bash block run as one ``bash -euo pipefail`` script, its ``export``s kept
  for the blocks after it (the same shell session);
- a python block runs as ``python -c`` in the checkout, with that shell's environment.
Each must exit 0 and print no OpenAI error body. An HTML comment right above a block directs:
``readme-test: skip: <why>`` (it cannot run here: the reason is required), ``readme-test: fresh
shell`` (first stop the app, the cluster and the exports, as the README tells the user to), or
``readme-test: ctrl-c`` (first stop the app only).

Isolation: the recipes run first in the session (``conftest.py`` puts this module first), before
any of the tests' own clusters, so Ray's default ports are free; Ray's records go to a temp dir
of their own (``RAY_TMPDIR``) and a home of their own (``~/.ray``'s token), so no later test
joins the cluster they start; at the end everything they started is stopped by pid (``ray stop``
would stop every Ray on the machine).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from nvray.bench.startup import ctrl_c_enabled
from ray_nodes import PYTHON_BIN, REPO, alive, processes_using, signal_all

README = REPO / "README.md"
APP_URL = "http://127.0.0.1:8000"
APP_START_TIMEOUT_S = 240
BLOCK_TIMEOUT_S = 300
_FENCE = re.compile(r"(?:<!-- readme-test: (?P<directive>[^>]*?) -->\n)?```(?P<lang>\w*)\n"
                    r"(?P<code>.*?)^```", re.DOTALL | re.MULTILINE)
_DIRECTIVES = ("skip:", "fresh shell", "ctrl-c")
_OPENAI_ERROR = re.compile(r'"error":\s*\{')


@dataclass
class Block:
    lang: str
    code: str
    directive: str
    line: int


def readme_blocks() -> list[Block]:
    text = README.read_text()
    return [Block(m["lang"], m["code"], (m["directive"] or "").strip(),
                  text.count("\n", 0, m.start("code")))
            for m in _FENCE.finditer(text) if m["lang"] in ("bash", "python")]


class Terminal:
    """One user's shell session and the app it started, on a Ray of its own."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ray_tmp = tempfile.mkdtemp(prefix="nvr-", dir="/tmp")  # short: Unix socket paths
        (root / "home").mkdir()
        self.app: subprocess.Popen | None = None
        self.env = self.base_env()

    def base_env(self) -> dict[str, str]:
        """A user's environment: no Ray address or authentication settings of the tests'."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "PYTEST"))}
        env.update(PATH=PYTHON_BIN + os.pathsep + env.get("PATH", ""), RAY_TMPDIR=self.ray_tmp,
                   HOME=str(self.root / "home"), PYTHONUNBUFFERED="1")
        return env

    # ------------------------------------------------------------------------ blocks
    def run_bash(self, code: str) -> str:
        out, script = [], []
        for line in code.splitlines():
            if line.startswith("serve run "):
                out.append(self.run_script("\n".join(script)))
                script = []
                self.start_app(line)
            else:
                script.append(line)
        out.append(self.run_script("\n".join(script)))
        return "".join(out)

    def run_script(self, script: str) -> str:
        """The lines as one bash script; its environment at the end is the shell's from then."""
        if not script.strip():
            return ""
        env_file = self.root / "env"
        wrapped = f"set -euo pipefail\n{script}\nenv -0 > {shlex.quote(str(env_file))}\n"
        proc = subprocess.run(["bash", "-c", wrapped], cwd=REPO, env=self.env, text=True,
                              capture_output=True, timeout=BLOCK_TIMEOUT_S)
        assert proc.returncode == 0, f"{script}\n--- exit {proc.returncode}\n" \
                                     f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        pairs = [item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item]
        self.env = {k: v for k, v in pairs if not k.startswith(("BASH_", "SHLVL", "_"))}
        return proc.stdout

    def run_python(self, code: str) -> str:
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=self.env, text=True,
                              capture_output=True, timeout=BLOCK_TIMEOUT_S)
        assert proc.returncode == 0, f"--- exit {proc.returncode}\n{proc.stdout[-3000:]}\n" \
                                     f"{proc.stderr[-5000:]}"
        return proc.stdout

    # --------------------------------------------------------------------------- app
    def start_app(self, line: str) -> None:
        assert self.app is None, "a second `serve run` while the first runs: stop it first"
        log = open(self.root / "serve.log", "a")  # noqa: SIM115 - the app's lifetime
        # as a terminal starts it, Ctrl-C enabled: a CI job run in the background (``&``) has
        # SIGINT ignored, the app inherited that, and the README's Ctrl-C never stopped it
        self.app = subprocess.Popen(ctrl_c_enabled(shlex.split(line, comments=True)), cwd=REPO,
                                    env=self.env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + APP_START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.app.poll() is None, f"`{line}` exited:\n{self.app_log()}"
            try:
                if requests.get(f"{APP_URL}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"`{line}` not healthy in {APP_START_TIMEOUT_S} s:\n{self.app_log()}")

    def app_log(self) -> str:
        return (self.root / "serve.log").read_text()[-5000:]

    def ctrl_c(self) -> None:
        """Ctrl-C in the app's terminal; killed if it has not stopped after a minute."""
        app, self.app = self.app, None
        if app is None:
            return
        os.killpg(app.pid, signal.SIGINT)
        try:
            app.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(app.pid, signal.SIGKILL)
            app.wait(timeout=30)

    def fresh_shell(self) -> None:
        """The app stopped, the cluster stopped (as ``ray stop`` would, for this Ray only), a
        new shell's environment."""
        self.ctrl_c()
        pids = processes_using(self.ray_tmp)
        signal_all(pids, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and alive(pids):
            time.sleep(0.5)
        signal_all(alive(pids | processes_using(self.ray_tmp)), signal.SIGKILL)
        self.env = self.base_env()

    def close(self) -> None:
        self.fresh_shell()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def test_every_block_has_a_known_directive_and_a_skip_says_why():
    blocks = readme_blocks()
    assert len(blocks) >= 8
    for block in blocks:
        assert not block.directive or block.directive.startswith(_DIRECTIVES), block
        assert block.directive != "skip:" and not re.fullmatch(r"skip:\s*", block.directive)


def test_the_readme_recipes_run_as_written(tmp_path):
    terminal = Terminal(tmp_path)
    ran = 0
    try:
        for block in readme_blocks():
            if block.directive.startswith("skip:"):
                continue
            if block.directive == "fresh shell":
                terminal.fresh_shell()
            elif block.directive == "ctrl-c":
                terminal.ctrl_c()
            try:
                out = (terminal.run_bash if block.lang == "bash" else terminal.run_python)(
                    block.code)
            except BaseException as e:
                app = terminal.app_log() if (tmp_path / "serve.log").exists() else ""
                raise AssertionError(f"README.md line {block.line} ({block.lang}) failed: {e}\n"
                                     f"--- the app's log:\n{app}") from None
            assert not _OPENAI_ERROR.search(out), f"README.md line {block.line}: {out[-3000:]}"
            ran += 1
    finally:
        terminal.close()
    assert ran >= 6
    assert not processes_using(terminal.ray_tmp)
    with pytest.raises(requests.RequestException):
        requests.get(f"{APP_URL}/health", timeout=5)
