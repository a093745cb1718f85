"""Anthropic's streamed Messages events when the model calls two tools: each call is a
``tool_use`` content block of its own (its own index, started, filled by ``input_json_delta``
and stopped), after the text block, whether both calls arrive in one output or across outputs.
The model's text goes through the real chat format and the Hermes tool parser. (An app cannot
script this answer: two calls repeat tokens, and the scripted checkpoints of
``serve_helpers`` need each token to have one successor.)"""

from __future__ import annotations

import json

import pytest

from deployments.apis.messages_format import MessagesFormat
from deployments.apis.openai_format import ChatFormat
from deployments.apis.tools import HERMES
from nvray.outputs import RequestOutput

TEXT = "Checking both."
CALLS = [{"name": "weather", "arguments": {"city": "Paris"}},
         {"name": "time", "arguments": {"zone": "CET", "24h": True}}]
ANSWER = TEXT + "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in CALLS)


def _events(pieces: list[str]) -> list[dict]:
    fmt = MessagesFormat(ChatFormat("m", tools=HERMES))
    stream = "".join(fmt.first_chunks(1))
    text, ids = "", []
    for k, piece in enumerate(pieces):
        text, ids = text + piece, ids + [k]
        last = k == len(pieces) - 1
        out = RequestOutput("r", [1, 2], text=text, token_ids=list(ids), delta_text=piece,
                            delta_token_ids=[k], finished=last,
                            finish_reason="stop" if last else None)
        stream += fmt.sse(fmt.chunk(0, out) or "")
    return [json.loads(line[len("data: "):]) for line in stream.splitlines()
            if line.startswith("data: ")]


def _blocks(events: list[dict]) -> list[dict]:
    """The content blocks as a client assembles them from the events, checking the order."""
    blocks: dict[int, dict] = {}
    open_at = None
    for e in events:
        if e["type"] == "content_block_start":
            assert open_at is None and e["index"] not in blocks, e
            open_at, blocks[e["index"]] = e["index"], {**e["content_block"], "json": ""}
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_at, e
            block, delta = blocks[e["index"]], e["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                block["json"] += delta["partial_json"]
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_at, e
            open_at = None
    assert open_at is None, "a block was never stopped"
    return [blocks[i] for i in sorted(blocks)]


@pytest.mark.parametrize("pieces", [[ANSWER], [ANSWER[:40], ANSWER[40:90], ANSWER[90:]]],
                         ids=["one-output", "three-outputs"])
def test_two_streamed_tool_calls_are_two_tool_use_blocks(pieces):
    events = _events(pieces)
    blocks = _blocks(events)
    assert [b["type"] for b in blocks] == ["text", "tool_use", "tool_use"], blocks
    assert blocks[0]["text"] == TEXT
    assert [(b["name"], json.loads(b["json"])) for b in blocks[1:]] == \
        [(c["name"], c["arguments"]) for c in CALLS]
    assert blocks[1]["id"] != blocks[2]["id"]
    stop = [e for e in events if e["type"] == "message_delta"]
    assert stop[-1]["delta"]["stop_reason"] == "tool_use"
