"""LLM: the offline API (nano-vllm's and vLLM's): ``generate`` and ``chat`` over a list of prompts.

Requests are queued together and run with continuous batching until all finish; outputs come
back in prompt order. A tqdm bar shows requests done and prefill/decode throughput.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence as Seq

from tqdm.auto import tqdm

from nvray.bootstrap import create_engine
from nvray.config import EngineConfig
from nvray.engine.engine import LLMEngine
from nvray.outputs import RequestOutput
from nvray.sampling_params import SamplingParams
from nvray.worker.executor import InProcessExecutor

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    def __init__(self, model: str = "tiny", **engine_kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, **engine_kwargs)
        self.engine: LLMEngine = create_engine(self.config, InProcessExecutor)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priorities: Seq[int] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a string or token ids); one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = self._params_list(sampling_params, len(prompts))
        priorities = list(priorities) if priorities is not None else [0] * len(prompts)
        ids: list[str] = []
        try:
            for prompt, p, prio in zip(prompts, params, priorities):
                ids.append(f"offline-{next(self._ids)}")
                self.engine.add_request(ids[-1], prompt, p, prio)
        except ValueError:
            for request_id in ids:  # all or nothing: drop the ones queued before the bad one
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate a reply to each conversation, formatted with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[Message]) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @staticmethod
    def _params_list(sampling_params: Any, n: int) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, (SamplingParams, dict)):
            return [SamplingParams.coerce(sampling_params)] * n
        params = [SamplingParams.coerce(p) for p in sampling_params]
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
        return params

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            start = time.perf_counter()
            outputs = self.engine.step()
            elapsed = max(time.perf_counter() - start, 1e-9)
            prefill, decode = self.engine.last_step_tokens
            bar.set_postfix(prefill=f"{prefill / elapsed:.0f} tok/s", decode=f"{decode / elapsed:.0f} tok/s")
            for out in outputs:
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[i] for i in request_ids]

    def shutdown(self) -> None:
        self.engine.executor.shutdown()
