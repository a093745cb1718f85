"""Real Ray nodes for the tests, started the way users start them (``ray start``).

A head (``ray start --head``) and optionally a second node (``ray start --address``) on this
machine, each with its own ports and temp dir so they never meet the session's in-process
``ray_cluster``, with Ray's token authentication on; stopped by pid at the end (``ray stop``
would stop every Ray here).

Both nodes stay on the loopback interface. Ray's CLI rewrites the literal ``127.0.0.1`` of a
joining node (its ``--address`` and ``--node-ip-address``) to the machine's interface address
(``services.resolve_ip_for_localhost``) and refuses to start one at all while
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps the head on 127.0.0.1. So the second node joins
with that variable at 1, spells the GCS address as ``127.0.0.01`` (the same address, which Ray's
literal check leaves alone) and takes ``127.0.0.2`` as its own IP: another loopback address, so
it is a node with an IP of its own, as on a second machine, and no traffic leaves the host.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PYTHON_BIN = os.path.dirname(sys.executable)
RAY_CLI = os.path.join(PYTHON_BIN, "ray")
START_TIMEOUT_S = 180
SECOND_NODE_IP = "127.0.0.2"
SECOND_NODE_RESOURCE = "second_node"
# Ray's token authentication is on for these nodes: they, the CLIs and the drivers share it
TOKEN = secrets.token_hex(16)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=TOKEN, TOKENIZERS_PARALLELISM="false",
               PATH=PYTHON_BIN + os.pathsep + env.get("PATH", ""), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# ------------------------------------------------------------------ processes, from /proc
def process_tree(root: int) -> set[int]:
    """``root`` and every process descended from it."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [c for c, p in parents.items() if p == pid and c not in tree]
        tree.update(kids)
        frontier.extend(kids)
    return tree


def processes_using(marker: str) -> set[int]:
    """Processes whose command line mentions ``marker`` (a node's unique temp dir)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                    found.add(int(entry))
            except OSError:
                continue
    return found


def signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def alive(pids: set[int]) -> set[int]:
    """The pids still running (zombies count as gone)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.add(pid)
    return running


# ----------------------------------------------------------------------------- the nodes
@dataclass
class Node:
    proc: subprocess.Popen
    temp_dir: str
    log: Path
    gcs_address: str = ""

    def stop(self) -> None:
        """Stop only this node's processes."""
        pids = process_tree(self.proc.pid) | processes_using(self.temp_dir)
        signal_all(pids, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and alive(pids):
            time.sleep(0.5)
            pids |= processes_using(self.temp_dir)
        signal_all(alive(pids), signal.SIGKILL)
        self.proc.wait(timeout=30)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@dataclass
class Cluster:
    """A head, and the nodes that joined it."""

    gcs_address: str
    dashboard_url: str
    head: Node
    workers: list[Node] = field(default_factory=list)

    def stop(self) -> None:
        for node in [*self.workers, self.head]:
            node.stop()

    def cli(self, group: str, command: str, *args: str, timeout: float = 60) -> str:
        """``ray <group> <command> --address <dashboard> <args>``, e.g. ``ray job status <id>``."""
        proc = subprocess.run([RAY_CLI, group, command, "--address", self.dashboard_url, *args],
                              env=child_env(), capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    def live_actors(self) -> list[dict[str, Any]]:
        out = self.cli("list", "actors", "--filter", "state=ALIVE", "--format", "json",
                       "--limit", "1000", "--detail")
        return json.loads(out) if out.lstrip().startswith("[") else []  # else "No resource ..."

    def node_ips(self) -> dict[str, str]:
        """node id -> node IP, of the live nodes."""
        out = self.cli("list", "nodes", "--filter", "state=ALIVE", "--format", "json")
        return {n["node_id"]: n["node_ip"] for n in json.loads(out)}

    def run_driver(self, code: str, timeout: float) -> Any:
        """Run ``code`` as a Ray driver connected to this cluster (a fresh Python process); it
        prints one JSON line last, which is returned."""
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                              text=True, timeout=timeout,
                              env=child_env(RAY_ADDRESS=self.gcs_address))
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])


def _start(cmd: list[str], temp_dir: str, log: Path, env: dict[str, str]) -> Node:
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Node(proc, temp_dir, log)


def _head_command(num_cpus: int) -> tuple[list[str], str, int, int]:
    """``ray start --head --block`` on 127.0.0.1 with its own ports and temp dir: (command,
    temp dir, GCS port, dashboard port)."""
    temp_dir = tempfile.mkdtemp(prefix="nvh-", dir="/tmp")  # short: Unix socket paths
    gcs, dash, client, agent, agent_grpc, metrics, node, obj, rtenv = free_ports(9)
    cmd = [RAY_CLI, "start", "--head", "--block",
           "--node-ip-address=127.0.0.1", f"--port={gcs}", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
           f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--metrics-export-port={metrics}", f"--node-manager-port={node}",
           f"--object-manager-port={obj}", f"--runtime-env-agent-port={rtenv}",
           f"--num-cpus={num_cpus}", "--num-gpus=0", f"--temp-dir={temp_dir}",
           "--disable-usage-stats"]
    return cmd, temp_dir, gcs, dash


def start_head(log_dir: Path, num_cpus: int) -> Cluster:
    """``ray start --head`` on 127.0.0.1 with a dashboard (job and state APIs)."""
    cmd, temp_dir, gcs, dash = _head_command(num_cpus)
    head = _start(cmd, temp_dir, log_dir / "head.log", child_env())
    cluster = Cluster(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}", head)
    try:
        _wait_until(lambda: _answers(cluster, "job", "list"), head, "the head's job API")
    except BaseException:
        head.stop()
        raise
    return cluster


def default_auth_env(home: Path) -> dict[str, str]:
    """A user's environment: Ray's authentication settings left at their defaults, ``home``
    as the home directory (where ``ray start`` keeps the token it generates)."""
    env = {k: v for k, v in child_env().items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env["HOME"] = str(home)
    return env


def start_head_with_default_auth(log_dir: Path, home: Path, num_cpus: int) -> Node:
    """``ray start --head`` in ``default_auth_env(home)`` after a token was generated there (as
    a first local ``ray.init()`` does, into ``home/.ray/auth_token``): Ray then turns token
    authentication on by itself. Returns the node once it has started."""
    subprocess.run([RAY_CLI, "get-auth-token", "--generate"], env=default_auth_env(home),
                   capture_output=True, timeout=60, check=True)
    cmd, temp_dir, gcs, _ = _head_command(num_cpus)
    head = _start(cmd, temp_dir, log_dir / "head.log", default_auth_env(home))
    head.gcs_address = f"127.0.0.1:{gcs}"
    try:
        _wait_until(lambda: "Ray runtime started" in head.log.read_text(), head, "the head")
    except BaseException:
        head.stop()
        raise
    return head


def add_node(cluster: Cluster, log_dir: Path, num_cpus: int) -> Node:
    """``ray start --address`` a second node (IP 127.0.0.2, custom resource
    ``second_node``); returns once the cluster lists it."""
    temp_dir = tempfile.mkdtemp(prefix="nvw-", dir="/tmp")
    agent, agent_grpc, metrics, node, obj, rtenv = free_ports(6)
    port = cluster.gcs_address.rsplit(":", 1)[1]
    cmd = [RAY_CLI, "start", "--block", f"--address=127.0.0.01:{port}",
           f"--node-ip-address={SECOND_NODE_IP}", f"--num-cpus={num_cpus}", "--num-gpus=0",
           f"--resources={json.dumps({SECOND_NODE_RESOURCE: 1})}",
           f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--metrics-export-port={metrics}", f"--node-manager-port={node}",
           f"--object-manager-port={obj}", f"--runtime-env-agent-port={rtenv}",
           f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    worker = _start(cmd, temp_dir, log_dir / f"node-{len(cluster.workers) + 1}.log",
                    child_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1"))
    cluster.workers.append(worker)
    _wait_until(lambda: SECOND_NODE_IP in cluster.node_ips().values(), worker, "the second node")
    return worker


def _answers(cluster: Cluster, group: str, command: str) -> bool:
    try:
        probe = subprocess.run([RAY_CLI, group, command, "--address", cluster.dashboard_url],
                               env=child_env(), capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0


def _wait_until(ready: Any, node: Node, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {node.proc.returncode}:\n"
                               f"{node.log.read_text()[-4000:]}")
        try:
            if ready():
                return
        except AssertionError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{what} did not come up in {START_TIMEOUT_S} s:\n"
                       f"{node.log.read_text()[-4000:]}")
