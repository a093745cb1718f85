"""The Serve tests' shared apps: one "default" nvray app (tiny model) for the whole package,
the openai client pointed at it, and the offline in-process LLM as the oracle; a "thinker"
app whose model is scripted to think then answer, with the qwen3 reasoning parser and an API
key (Anthropic's Messages and OpenAI's Responses tests, each module its own)."""

from __future__ import annotations

import openai
import pytest
from ray import serve

from deployments import build_app
from nvray import LLM
from nvray.bench.http_load import wait_healthy
from serve_helpers import (MAX_MODEL_LEN, THINKER_KEY, THINKER_LEN, THINKER_MODEL,
                           build_scripted_thinker, thinker_script)


@pytest.fixture(scope="package")
def base_url(serve_http):
    serve.run(build_app({"max_model_len": MAX_MODEL_LEN, "num_cpus_per_rank": 1}),
              name="default", route_prefix="/")
    wait_healthy(serve_http)  # serve.run returns once the replica runs, its engine may be starting
    yield serve_http
    serve.delete("default")


@pytest.fixture(scope="package")
def long_base_url(serve_http):
    """A second app with room for long prompts: the tiny tokenizer spends ~800 tokens on the
    chat template's tool preamble (tools, langchain)."""
    serve.run(build_app({"max_model_len": 2048, "num_cpus_per_rank": 1}), name="long",
              route_prefix="/long")
    wait_healthy(f"{serve_http}/long")
    yield f"{serve_http}/long"
    serve.delete("long")


@pytest.fixture(scope="package")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def offline() -> LLM:
    return LLM("tiny", runtime="inprocess", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def thinker_url(serve_http, tmp_path_factory) -> str:
    """Module-scoped: the test cluster's CPUs hold the package's apps and a module's, not
    every module's at once."""
    path = build_scripted_thinker(str(tmp_path_factory.mktemp("thinker")), *thinker_script(),
                                  THINKER_LEN)
    serve.run(build_app({"model": path, "served_model_name": THINKER_MODEL,
                         "reasoning_parser": "qwen3", "api_key": THINKER_KEY,
                         "max_model_len": THINKER_LEN}),
              name="thinker", route_prefix="/thinker")
    yield f"{serve_http}/thinker"
    serve.delete("thinker")
