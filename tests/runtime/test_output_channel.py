"""The per-step output channel without Ray: the step loop hands a consumer's outputs over in
one delivery per step however many requests it has, and the deltas it carries rebuild every
request's final text and tokens."""

from __future__ import annotations

import asyncio

import pytest

from nvray import EngineConfig, SamplingParams
from nvray.outputs import RequestOutput, from_wire
from nvray.runtime.consumer_channel import ConsumerChannel
from nvray.request import EngineRequest
from nvray.runtime.engine_loop import EngineLoop
from oracle import random_prompts

MAX_TOKENS = 12


class CountingChannel(ConsumerChannel):
    def __init__(self) -> None:
        super().__init__()
        self.deliveries = 0

    def deliver(self, outputs: list[RequestOutput]) -> None:
        self.deliveries += 1
        super().deliver(outputs)


@pytest.fixture(scope="module")
def engine(tiny_path):
    from nvray.bootstrap import create_engine
    from nvray.worker.executor import InProcessExecutor

    engine = create_engine(EngineConfig(model="tiny", device="cpu", max_model_len=256), InProcessExecutor)
    yield engine
    engine.executor.shutdown()


async def stream_through_channel(engine, prompts: list[list[int]]) -> tuple[dict, int, int]:
    loop = EngineLoop(engine)
    channel = CountingChannel()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [EngineRequest(p, params, f"r{len(prompts)}-{i}", stream=True) for i, p in enumerate(prompts)]
    added = await asyncio.wrap_future(loop.add(requests, channel))
    assert added == [len(p) for p in prompts]
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    finished = 0
    async with asyncio.timeout(120):
        async for message in channel.messages():
            for out in map(from_wire, message):
                outputs[out.request_id].append(out)
                finished += out.finished
            if finished == len(prompts):
                break
    loop.stop()
    return outputs, channel.deliveries, loop.num_steps


@pytest.mark.parametrize("num_requests", [1, 16])
def test_one_delivery_per_step_whatever_the_number_of_requests(engine, num_requests):
    prompts = random_prompts(num_requests, 5, 40, seed=num_requests)
    outputs, deliveries, steps = asyncio.run(stream_through_channel(engine, prompts))
    # every step made progress for every request: one delivery per step, not one per request
    # (an overlapped engine's first step only launches: its outputs come with the second)
    assert deliveries == steps - (1 if engine.overlap else 0)
    assert steps <= MAX_TOKENS + 2  # the prompts fit one prefill step (two at most)
    expected = engine_greedy(engine, prompts)
    for outs, exp in zip(outputs.values(), expected):
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1])
        assert "".join(o.delta_text for o in outs) == final.text == exp.text
        assert [t for o in outs for t in o.delta_token_ids] == final.token_ids == exp.token_ids


def engine_greedy(engine, prompts: list[list[int]]) -> list[RequestOutput]:
    """The same requests without streaming, stepped directly (the reference)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"ref-{len(prompts)}-{i}", p, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return [finals[f"ref-{len(prompts)}-{i}"] for i in range(len(prompts))]
