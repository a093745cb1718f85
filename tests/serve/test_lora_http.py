"""LoRA adapters over HTTP with the real openai client: an adapter named in ``lora_modules``,
by name and as ``<base>:<adapter>``; one found by name under ``lora_path`` on first use;
adapters loaded and unloaded at run time (``allow_runtime_lora_updating``); ``/v1/models``
listing them with their parent; unknown names a 404 naming them; an adapter nvray cannot serve
refused at load with the reason. The oracle is the offline engine with the same adapter (which
``tests/engine/test_lora.py`` holds to PEFT); every adapter's answer differs from the base's."""

from __future__ import annotations

import openai
import pytest
import requests
from ray import serve

from deployments import build_app
from lora_adapters import ATTENTION, MLP, write_adapter
from nvray import LLM, LoRARequest
from nvray.bench.http_load import wait_healthy
from serve_helpers import MAX_MODEL_LEN, greedy

PROMPT = "the quick brown fox jumps over"
MSG = [{"role": "user", "content": "name three colours"}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_path) -> dict[str, str]:
    root = tmp_path_factory.mktemp("http-loras")
    return {
        "sql": write_adapter(tiny_path, str(root / "declared" / "sql"), 8, ATTENTION + MLP,
                             seed=11),
        "found": write_adapter(tiny_path, str(root / "store" / "found"), 4,
                               ["q_proj", "v_proj"], seed=12, std=0.3),
        "extra": write_adapter(tiny_path, str(root / "extra"), 8, MLP, seed=13),
        "wide": write_adapter(tiny_path, str(root / "wide"), 32, ["q_proj"], seed=14),
        "store": str(root / "store"),
    }


@pytest.fixture(scope="module")
def lora_url(serve_http, adapters):
    serve.run(build_app({"max_model_len": MAX_MODEL_LEN, "num_cpus_per_rank": 1, "max_loras": 2,
                         "lora_modules": f"sql={adapters['sql']}", "lora_path": adapters["store"],
                         "allow_runtime_lora_updating": True}),
              name="lora", route_prefix="/lora")
    wait_healthy(f"{serve_http}/lora")
    yield f"{serve_http}/lora"
    serve.delete("lora")


@pytest.fixture(scope="module")
def offline_lora():
    llm = LLM("tiny", runtime="inprocess", max_model_len=MAX_MODEL_LEN, enable_lora=True)
    yield llm
    llm.shutdown()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(url: str, model: str) -> openai.types.Completion:
    return _client(url).completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})


def _offline(llm: LLM, adapters: dict[str, str], name: str | None) -> str:
    lora = LoRARequest(name, 1, adapters[name]) if name else None
    return llm.generate([PROMPT], greedy(12), use_tqdm=False, lora_request=lora)[0].text


def test_a_declared_adapter_answers_by_name_and_as_base_colon_name(lora_url, adapters,
                                                                  offline_lora):
    want = _offline(offline_lora, adapters, "sql")
    assert want != _offline(offline_lora, adapters, None), "the adapter must change the text"
    for model in ("sql", "tiny:sql"):
        out = _complete(lora_url, model)
        assert out.choices[0].text == want
        assert out.model == "sql"
    assert _complete(lora_url, "tiny").choices[0].text == _offline(offline_lora, adapters, None)
    chat = _client(lora_url).chat.completions.create(
        model="sql", messages=MSG, max_tokens=10, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    offline = offline_lora.chat(MSG, greedy(10), use_tqdm=False,
                                lora_request=LoRARequest("sql", 1, adapters["sql"]))[0].text
    assert streamed == offline


def test_an_adapter_under_lora_path_is_found_on_first_use_and_listed(lora_url, adapters,
                                                                    offline_lora):
    out = _complete(lora_url, "found")
    assert out.choices[0].text == _offline(offline_lora, adapters, "found")
    cards = {m.id: m for m in _client(lora_url).models.list().data}
    assert {"tiny", "sql", "found"} <= set(cards)
    assert cards["found"].model_extra["parent"] == "tiny"


def test_unknown_adapters_are_404s_naming_them(lora_url):
    for model in ("nope", "other-base:sql", "tiny:nope"):
        with pytest.raises(openai.NotFoundError, match=model):
            _complete(lora_url, model)


def test_adapters_load_and_unload_at_run_time(lora_url, adapters, offline_lora):
    load = f"{lora_url}/v1/load_lora_adapter"
    ok = requests.post(load, json={"lora_name": "extra", "lora_path": adapters["extra"]},
                       timeout=60)
    assert ok.status_code == 200, ok.text
    assert _complete(lora_url, "extra").choices[0].text == _offline(offline_lora, adapters,
                                                                    "extra")
    assert "extra" in {m.id for m in _client(lora_url).models.list().data}
    again = requests.post(load, json={"lora_name": "extra", "lora_path": adapters["extra"]},
                          timeout=60)
    assert again.status_code == 400 and "already loaded" in again.text
    gone = requests.post(f"{lora_url}/v1/unload_lora_adapter", json={"lora_name": "extra"},
                         timeout=60)
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.NotFoundError, match="extra"):
        _complete(lora_url, "extra")
    wide = requests.post(load, json={"lora_name": "wide", "lora_path": adapters["wide"]},
                         timeout=60)
    assert wide.status_code == 400 and "max_lora_rank=16" in wide.json()["error"]["message"]
    missing = requests.post(load, json={"lora_name": "m", "lora_path": "/nowhere/at/all"},
                            timeout=60)
    assert missing.status_code == 400 and "not a directory" in missing.text
    assert _complete(lora_url, "sql").choices[0].text == _offline(offline_lora, adapters, "sql")


def test_an_app_without_runtime_updating_has_no_load_route(base_url, adapters):
    r = requests.post(f"{base_url}/v1/load_lora_adapter",
                      json={"lora_name": "sql", "lora_path": adapters["sql"]}, timeout=60)
    assert r.status_code == 404 and "allow_runtime_lora_updating" in r.text
    with pytest.raises(openai.NotFoundError, match="sql"):
        _complete(base_url, "sql")
