"""Shared fixtures: random HF checkpoints (the embedded tiny model and other shapes), the HF
transformers oracle, and helpers. Checkpoints go to a per-session cache directory."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_SESSION_CACHE = tempfile.mkdtemp(prefix="nvray-test-cache-")  # removed at the session's end
# What a run still prints that nvray does not cause, and so leaves alone: Ray 2.60's own
# PydanticDeprecatedSince20 warnings, one per field of ray.serve's config models as they are
# imported (Ray passes update_type= to pydantic's Field). nvray's own are gone: Serve's
# metrics_interval_s deprecation (deployments.build_app), transformers' past_key_values and
# quantization_config notices (oracle.py, fp8_checkpoints.py), Ray's token-authentication notice
# and compiled-graph teardown lines (nvray.runtime.cluster, ray_executor), and the hundreds of
# "nanobind: leaked" lines Triton 3.9 printed after the summary: objects frozen out of the GC by
# an engine never shut down were never collected at exit (nvray.gc_freeze now releases them).
os.environ.setdefault("NVRAY_CACHE_DIR", _SESSION_CACHE)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Single-machine Ray: nodes, GCS and every rendezvous stay on 127.0.0.1 (Ray otherwise
# rewrites loopback to the machine's interface address). Set before Ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray's token authentication on for every cluster the tests start, and for every CLI and child
# process (Ray 2.60 turns it on by default only for a new local ray.init cluster).
os.environ.setdefault("RAY_AUTH_MODE", "token")
# Serve's autoscaler sees load within a second instead of ten (autoscaling test).
os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")

# Another Qwen3 shape: untied head, wider heads, 3 layers, GQA 3:1.
OTHER_QWEN3 = {"hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 3,
               "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32,
               "tie_word_embeddings": False, "rope_theta": 1000000.0}
QWEN2 = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from nvray.models.tiny import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def other_qwen3_path(tmp_path_factory) -> str:
    from nvray.models.tiny import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("other-qwen3")), OTHER_QWEN3, seed=1)


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory) -> str:
    from nvray.models.tiny import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("qwen2")), QWEN2, seed=2,
                            architecture="Qwen2ForCausalLM")




# Uneven sharding for TP=2: 6 query heads (3 per rank) over ONE KV head (replicated on both
# ranks), and a vocabulary of 501 that leaves the second vocab shard padded.
UNEVEN_QWEN3 = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 6, "num_key_value_heads": 1, "head_dim": 8,
                "tie_word_embeddings": False}


@pytest.fixture(scope="session")
def uneven_qwen3_path(tmp_path_factory) -> str:
    from nvray.models.tiny import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("uneven-qwen3")), UNEVEN_QWEN3, seed=3,
                            tokenizer_vocab_size=501)


@pytest.fixture(scope="session")
def family_path(tmp_path_factory, tiny_path):
    """``family_path(name)``: the HF-written random checkpoint of ``hf_checkpoints.SHAPES[name]``
    or ``HYBRID_SHAPES[name]`` (Llama 3, Mistral, Qwen3-MoE, Gemma 3, Qwen3.5 shapes), built
    once per session."""
    from hf_checkpoints import HYBRID_SHAPES, SHAPES, write_hf_checkpoint

    paths: dict[str, str] = {}

    def path_of(name: str) -> str:
        if name not in paths:
            target = str(tmp_path_factory.mktemp(name))
            shape = SHAPES[name] if name in SHAPES else HYBRID_SHAPES[name]
            paths[name] = write_hf_checkpoint(target, shape, tiny_path, seed=7)
        return paths[name]
    return path_of


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster on 127.0.0.1 for the whole test session."""
    import ray

    assert not os.environ.get("RAY_ADDRESS"), "tests start their own local cluster"

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, include_dashboard=True, dashboard_host="127.0.0.1",
                 log_to_driver=False, runtime_env={"env_vars": {
                     "NVRAY_CACHE_DIR": os.environ["NVRAY_CACHE_DIR"],
                     "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def two_nodes(tmp_path_factory):
    """A real two-node Ray cluster on this machine (``ray start --head`` on 127.0.0.1 and
    ``ray start --address`` on 127.0.0.2, 2 CPUs each, own ports and temp dirs; see
    ``ray_nodes``), started when a test first asks, stopped at the end of the session."""
    from ray_nodes import add_node, start_head

    logs = tmp_path_factory.mktemp("two-nodes")
    cluster = start_head(logs, num_cpus=2)
    try:
        add_node(cluster, logs, num_cpus=2)
        yield cluster
    finally:
        cluster.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_http(ray_cluster) -> str:
    """Ray Serve's HTTP proxy on 127.0.0.1 (one per test session); returns its base URL."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


# NVRAY_TESTS_FAST_FIRST=1 (set by .ci/mutation): unit tests run before those that build an
# engine, run kernels under the interpreter or start Ray, so that with -x a mutant fails fast.
_SLOW_TESTS_BY_RANK = (("tests/engine/test_penalties.py", "tests/engine/test_beam_search.py"),
                       ("tests/kernels/",), ("tests/runtime/", "tests/serve/test_"))


def _speed_rank(item) -> int:
    path = item.nodeid.split("::")[0]
    if path.endswith(("test_api_key.py", "test_block_manager.py", "test_scheduler.py",
                      "test_sampler.py")):
        return 0
    return 1 + next((rank for rank, prefixes in enumerate(_SLOW_TESTS_BY_RANK)
                     if path.startswith(prefixes)), 0)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("NVRAY_TESTS_FAST_FIRST"):
        items.sort(key=_speed_rank)
    # the README's recipes first: they start Ray on its default ports, which the tests' own
    # clusters (started later, on demand) would otherwise hold (test_readme.py)
    items.sort(key=lambda item: not item.nodeid.startswith("tests/test_readme.py"))


@pytest.hookimpl(trylast=True)  # after the runner's own teardown of the session's fixtures
def pytest_sessionfinish(session, exitstatus):
    """The session's cache directory (checkpoints, compiled kernels) goes with the session:
    each run used to leave one in the temp directory."""
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
