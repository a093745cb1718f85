"""The Serve tests' shared app: one "default" nvray app (tiny model) for the whole package,
the openai client pointed at it, and the offline in-process LLM as the oracle."""

from __future__ import annotations

import openai
import pytest
from ray import serve

from deployments import build_app
from nvray import LLM
from nvray.bench.http_load import wait_healthy
from serve_helpers import MAX_MODEL_LEN


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
