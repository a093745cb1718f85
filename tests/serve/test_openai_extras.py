"""The OpenAI API's smaller pieces over real HTTP: /v1/models/{id}, /tokenize and /detokenize,
``priority``, ``usage.prompt_tokens_details.cached_tokens``, ``chat_template_kwargs`` (Qwen3's
``enable_thinking``), the qwen3 reasoning parser, and unknown fields rejected by name.

Most tests use the package's default app (tiny model). A second app ("extras": the qwen3
reasoning parser, an API key, ``scheduling_policy="priority"`` with one sequence at a time)
serves a "scripted" checkpoint: a real Qwen3 checkpoint whose weights make greedy decoding
follow a chain of tokens written in this file (attention and MLP outputs zeroed, so each next
token depends only on the current one), so the model answers
``<think>REASONING</think>CONTENT`` and the expected split is known from the chain, not from
the code under test.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import uuid

import openai
import pytest
import requests
from ray import serve

from deployments import build_app
from deployments.args import AppArgs
from serve_helpers import MAX_MODEL_LEN, build_scripted_thinker, greedy, metric

MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello there!"}]
REASONING, CONTENT = "The quick fox", "Hello world!"
EXTRAS_KEY = "extras-key"
EXTRAS_MODEL = "acme/scripted-thinker"  # a name with a slash, as HF ids have
LONG = 8192  # the extras app's max_model_len


def post(base: str, path: str, body: dict, key: str | None = None) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(f"{base}{path}", json=body, headers=headers, timeout=120)


def sse_chunks(resp: requests.Response) -> list[dict]:
    assert resp.status_code == 200, resp.text[:500]
    events = [e[len("data: "):] for e in resp.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def assert_openai_error(resp: requests.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, resp.text[:500]
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# ----------------------------------------------------------------- /v1/models/{id}
def test_model_card_by_id_equals_the_listed_card(client):
    [listed] = client.models.list().data
    assert client.models.retrieve("tiny").model_dump() == listed.model_dump()
    # the tiny model on CPU: fp32 weights, compute and KV cache
    assert listed.model_dump()["dtypes"] == {"weights": "float32", "compute": "float32",
                                             "kv_cache": "float32"}
    assert listed.model_dump()["architecture"] == "Qwen3ForCausalLM"  # the tiny model's


@pytest.mark.parametrize("model_id", ["no-such-model", "org/no-such-model"])
def test_unknown_model_id_is_a_404_naming_it(base_url, model_id):
    resp = requests.get(f"{base_url}/v1/models/{model_id}", timeout=30)
    error = assert_openai_error(resp, 404, None)
    assert error["code"] == "model_not_found" and model_id in error["message"]


# ------------------------------------------------------------ /tokenize, /detokenize
def test_tokenize_text_gives_the_engines_prompt_tokens(base_url, client, offline):
    prompt = "The engine schedules a batch"
    body = post(base_url, "/tokenize", {"model": "tiny", "prompt": prompt}).json()
    assert body["tokens"] == offline.generate(prompt, greedy(1), use_tqdm=False)[0].prompt_token_ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    usage = client.completions.create(model="tiny", prompt=prompt, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]
    assert post(base_url, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": prompt}


def test_tokenize_chat_counts_what_a_chat_completion_prompts(base_url, client, offline):
    body = post(base_url, "/tokenize", {"messages": MESSAGES}).json()
    usage = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1).usage
    assert body["count"] == usage.prompt_tokens
    assert body["tokens"] == offline.chat(MESSAGES, greedy(1), use_tqdm=False)[0].prompt_token_ids
    text = post(base_url, "/detokenize", {"model": "tiny", "tokens": body["tokens"]}).json()["prompt"]
    assert "<|im_start|>user\nHello there!<|im_end|>" in text  # special tokens kept
    no_reply = post(base_url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    shorter = no_reply.json()["tokens"]
    assert len(shorter) < body["count"] and body["tokens"][:len(shorter)] == shorter


MSG = [{"role": "user", "content": "x"}]
BAD_TOKENIZER_BODIES = [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MSG}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("/tokenize", {"messages": MSG, "chat_template_kwargs": "enable_thinking"}, 400,
     "chat_template_kwargs"),
    ("/tokenize", {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs"),
    ("/tokenize", {"messages": MSG, "chat_template_kwargs": {"continue_final_message": True}},
     400, "chat_template_kwargs"),
    ("/tokenize", {"messages": MSG, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"prompt": "a", "frobnicate": 1}, 400, "frobnicate"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 10**7]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_TOKENIZER_BODIES)
def test_bad_tokenizer_bodies_are_openai_errors_naming_the_field(base_url, path, body, status,
                                                                 param):
    assert_openai_error(post(base_url, path, body), status, param)
    assert requests.get(f"{base_url}/health", timeout=30).status_code == 200


# ------------------------------------------------------------------------ priority
def test_priority_is_accepted_on_completions_and_chat(client):
    out = client.completions.create(model="tiny", prompt="urgent", max_tokens=3,
                                    extra_body={"priority": -5, "ignore_eos": True})
    assert out.usage.completion_tokens == 3
    chat = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3, stream=True,
                                          extra_body={"priority": 7, "ignore_eos": True})
    assert chat.response.status_code == 200
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)


@pytest.mark.parametrize("path,base_body", [("/v1/completions", {"prompt": "x"}),
                                            ("/v1/chat/completions", {"messages": MSG})])
@pytest.mark.parametrize("priority", ["high", 1.5, True, None, [1]])
def test_a_non_integer_priority_is_a_400_naming_it(base_url, path, base_body, priority):
    resp = post(base_url, path, {**base_body, "max_tokens": 2, "priority": priority})
    assert_openai_error(resp, 400, "priority")


# --------------------------------------------------------------- cached prompt tokens
def test_a_repeated_prompt_reports_whole_cached_blocks(client):
    block = AppArgs().kvcache_block_size  # the default app's
    prompt = f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 8
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2).usage
    assert first.prompt_tokens > 3 * block
    assert first.prompt_tokens_details.cached_tokens == 0  # a unique first block
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2).usage
    cached = second.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.prompt_tokens and cached % block == 0
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    final = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert 0 < final < second.prompt_tokens and final % block == 0


def test_chat_usage_has_cached_tokens_too(client):
    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} " + "Hello world! " * 20}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    usage = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1).usage
    assert usage.prompt_tokens_details.cached_tokens > 0


# ------------------------------------------------------ chat_template_kwargs, thinking
def test_enable_thinking_reaches_the_chat_template(base_url, client, offline):
    def tokens(kwargs: dict) -> list[int]:
        resp = post(base_url, "/tokenize", {"messages": MSG, "chat_template_kwargs": kwargs})
        return resp.json()["tokens"]

    [think_end] = post(base_url, "/tokenize", {"prompt": "</think>"}).json()["tokens"]
    off, on = tokens({"enable_thinking": False}), tokens({"enable_thinking": True})
    assert off != on and think_end in off and think_end not in on
    assert tokens({}) == on  # thinking is Qwen3's default
    off_text = post(base_url, "/detokenize", {"tokens": off}).json()["prompt"]
    assert off_text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    resp = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True, "chat_template_kwargs":
                                                      {"enable_thinking": False}})
    assert resp.usage.prompt_tokens == len(off)
    expected = offline.chat(MSG, greedy(6), use_tqdm=False,
                            chat_template_kwargs={"enable_thinking": False})[0]
    assert resp.choices[0].message.content == expected.text


@pytest.mark.parametrize("kwargs", ["enable_thinking", ["enable_thinking"], 1,
                                    {"add_generation_prompt": False}])
def test_bad_chat_template_kwargs_are_a_400_naming_them(base_url, kwargs):
    resp = post(base_url, "/v1/chat/completions",
                {"messages": MSG, "max_tokens": 2, "chat_template_kwargs": kwargs})
    assert_openai_error(resp, 400, "chat_template_kwargs")


# ------------------------------------------------------------------ unknown fields
UNKNOWN_FIELDS = [
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1, "Wibble": 2}, "frobnicate,Wibble"),
    ("/v1/completions", {"prompt": "x", "stream": True,
                         "stream_options": {"include_usage": True, "bogus": 1}},
     "stream_options.bogus"),
    ("/v1/chat/completions", {"messages": MSG, "frobnicate": True}, "frobnicate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "colour": "red"}]},
     "messages.0.colour"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {}}]}]}, "messages.0.content.0.cache_control"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": False}, "skip_special_tokens"),
]


@pytest.mark.parametrize("path,body,param", UNKNOWN_FIELDS)
def test_unknown_fields_are_a_400_naming_them(base_url, path, body, param):
    error = assert_openai_error(post(base_url, path, {"max_tokens": 2, **body}
                                     if path.startswith("/v1") else body), 400, param)
    for name in param.split(","):
        assert name.split(".")[-1] in error["message"]


def test_harmless_fields_openai_clients_send_are_accepted(base_url):
    chat = post(base_url, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "terse", "name": "rules"},
                     {"role": "user", "content": "hi", "name": "ann"}],
        "max_tokens": 2, "user": "ann", "parallel_tool_calls": False, "tool_choice": "none",
        "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert sse_chunks(chat)[-1]["usage"]["completion_tokens"] >= 1
    completion = post(base_url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "user": "ann"})
    assert completion.status_code == 200, completion.text[:500]


# ------------------------------------------- the extras app: reasoning parser, priority
@pytest.fixture(scope="module")
def scripted_thinker(tmp_path_factory) -> str:
    """A Qwen3 checkpoint whose greedy answer to MESSAGES is
    ``<think>REASONING</think>CONTENT`` then EOS."""
    return build_scripted_thinker(str(tmp_path_factory.mktemp("scripted-thinker")), MESSAGES,
                                  REASONING, CONTENT, LONG)


@pytest.fixture(scope="module")
def extras_url(serve_http, scripted_thinker) -> str:
    serve.run(build_app({"model": scripted_thinker, "served_model_name": EXTRAS_MODEL,
                         "reasoning_parser": "qwen3", "api_key": EXTRAS_KEY,
                         "scheduling_policy": "priority", "max_num_seqs": 1,
                         "max_model_len": LONG}), name="extras", route_prefix="/extras")
    yield f"{serve_http}/extras"
    serve.delete("extras")


@pytest.fixture(scope="module")
def thinker(extras_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{extras_url}/v1", api_key=EXTRAS_KEY, max_retries=0,
                         timeout=120)


def test_reasoning_is_split_the_same_streamed_and_not(thinker):
    resp = thinker.chat.completions.create(model=EXTRAS_MODEL, messages=MESSAGES, temperature=0,
                                           max_tokens=32)
    message = resp.choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, CONTENT)
    assert resp.choices[0].finish_reason == "stop"
    chunks = list(thinker.chat.completions.create(model=EXTRAS_MODEL, messages=MESSAGES,
                                                  temperature=0, max_tokens=32, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
                "".join(d.content or "" for d in deltas))
    assert streamed == (REASONING, CONTENT)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_thinking_cut_by_max_tokens_is_all_reasoning(thinker, offline):
    reasoning_tokens = len(offline.tokenizer.encode(REASONING, add_special_tokens=False))
    resp = thinker.chat.completions.create(model=EXTRAS_MODEL, messages=MESSAGES, temperature=0,
                                           max_tokens=1 + reasoning_tokens)  # no </think>
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason == "length"
    assert (message.reasoning_content, message.content) == (REASONING, None)


def test_an_assistant_message_with_reasoning_can_be_sent_back(thinker):
    first = thinker.chat.completions.create(model=EXTRAS_MODEL, messages=MESSAGES, max_tokens=32,
                                            temperature=0)
    history = [*MESSAGES, first.choices[0].message, {"role": "user", "content": "More?"}]
    again = thinker.chat.completions.create(model=EXTRAS_MODEL, messages=history, max_tokens=2)
    assert again.usage.prompt_tokens > first.usage.prompt_tokens


def test_without_a_parser_there_is_no_reasoning_field(base_url):
    body = post(base_url, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2}).json()
    assert "reasoning_content" not in body["choices"][0]["message"]


def test_the_api_key_guards_tokenizer_routes_and_model_cards(extras_url):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert_openai_error(post(extras_url, path, body), 401, None)
        assert post(extras_url, path, body, key=EXTRAS_KEY).status_code == 200
    card = requests.get(f"{extras_url}/v1/models/{EXTRAS_MODEL}", timeout=30)
    assert card.status_code == 401
    card = requests.get(f"{extras_url}/v1/models/{EXTRAS_MODEL}", timeout=30,
                        headers={"Authorization": f"Bearer {EXTRAS_KEY}"})
    assert card.status_code == 200 and card.json()["id"] == EXTRAS_MODEL


def wait_for_waiting(base: str, count: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(base, "nvray_num_requests_waiting") != count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(base, "nvray_num_requests_waiting") == count


def test_priority_decides_which_waiting_request_runs_first(extras_url):
    """One sequence at a time: while a long request runs, a less urgent request (priority 10)
    and then a more urgent one (-10) queue; when the long one is cancelled, the urgent one runs
    first."""
    finished_at: dict[str, float] = {}

    def complete(name: str, priority: int) -> None:
        resp = post(extras_url, "/v1/completions", {"prompt": name, "max_tokens": 40,
                                                    "ignore_eos": True, "priority": priority},
                    key=EXTRAS_KEY)
        assert resp.status_code == 200, resp.text[:500]
        finished_at[name] = time.monotonic()

    long_body = {"prompt": "hold the engine", "max_tokens": LONG - 16, "ignore_eos": True,
                 "stream": True}  # runs for many seconds: it is aborted long before it ends
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with requests.post(f"{extras_url}/v1/completions", json=long_body, stream=True,
                           headers={"Authorization": f"Bearer {EXTRAS_KEY}"}, timeout=120) as resp:
            lines = resp.iter_lines()  # kept: a dropped iterator would close the connection
            assert next(lines).startswith(b"data: {")  # it runs
            later = pool.submit(complete, "later", 10)
            wait_for_waiting(extras_url, 1)
            sooner = pool.submit(complete, "sooner", -10)
            wait_for_waiting(extras_url, 2)
        # the long stream is closed: it is aborted and frees the only slot
        later.result(timeout=120), sooner.result(timeout=120)
    assert finished_at["sooner"] < finished_at["later"]


DIGIT_TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "required": ["n"], "additionalProperties": False,
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}}}


def test_a_think_block_comes_before_required_tool_calls(thinker):
    """With the reasoning parser, a required call may follow the model's think block: the
    reasoning is the thinking, the call is parsed after it (streamed the same), no content."""
    asked = dict(model=EXTRAS_MODEL, messages=MESSAGES, temperature=0, max_tokens=160,
                 tools=[DIGIT_TOOL], tool_choice="required", parallel_tool_calls=False)
    resp = thinker.chat.completions.create(**asked)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", repr(choice.message.content)
    assert choice.message.reasoning_content == REASONING and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "pick" and 0 <= json.loads(call.function.arguments)["n"] <= 9
    reasoning, arguments = "", ""
    for chunk in thinker.chat.completions.create(**asked, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        assert not delta.content
        for part in delta.tool_calls or ():
            arguments += part.function.arguments or ""
    assert (reasoning, arguments) == (REASONING, call.function.arguments)
