"""LLM: the offline API (nano-vllm's and vLLM's): ``generate`` and ``chat`` over a list of prompts,
``embed`` and ``score`` (pooling: ``nvray/pooling.py``).

With ``runtime="ray"`` (the default) the engine runs on Ray — an EngineDriver actor and one
RankWorker actor per tensor-parallel rank, in one placement group — on the running cluster if
there is one, else on a local one. ``runtime="inprocess"`` runs TP=1 in this process (the
yardstick for Ray's overhead). Requests are queued together and run with continuous batching;
outputs come back in prompt order. A tqdm bar shows requests done and prefill/decode throughput.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import importlib
import itertools
import time
from dataclasses import dataclass
from typing import Any, Sequence as Seq

from tqdm.auto import tqdm

from nvray.config import EngineConfig
from nvray.lora.request import LoRARequest
from nvray.startup_phases import StartupPhases
from nvray.outputs import RequestOutput
from nvray.sampling_params import BeamSearchParams, SamplingParams, num_choices

Prompt = str | list[int]


@dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]
    prompt_token_ids: list[int]


@dataclass(frozen=True)
class ScoreOutput:
    score: float
    prompt_token_ids: list[int]


Message = dict[str, str]
_POLL_S = 0.5


class LLM:
    def __init__(self, model: str = "tiny", **engine_kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, **engine_kwargs)
        self.engine = None
        self.client = None
        self._ids = itertools.count()
        if self.config.runtime == "inprocess":
            start, phases = time.perf_counter(), StartupPhases()
            with phases.phase("imports"):
                from nvray.bootstrap import create_engine  # noqa: PLC0415
                from nvray.worker.executor import InProcessExecutor  # noqa: PLC0415

            self.engine = create_engine(self.config, InProcessExecutor, phases, start)
        else:
            self.client = _start_on_ray(self.config)
            atexit.register(self.shutdown)

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The model's tokenizer as transformers loads it (``AutoTokenizer``), on first use; the
        engine itself reads the same files without transformers (``nvray.lean_tokenizer``)."""
        from nvray.tokenizer import load_hf_tokenizer  # noqa: PLC0415

        return load_hf_tokenizer(self._model_path())

    @functools.cached_property
    def _engine_tokenizer(self) -> Any:
        """The tokenizer the engine runs (``nvray.tokenizer.load_tokenizer``'s)."""
        if self.engine is not None:
            return self.engine.tokenizer
        from nvray.tokenizer import load_tokenizer  # noqa: PLC0415

        return load_tokenizer(self._model_path())

    def _model_path(self) -> str:
        from nvray.models.tiny import resolve_model  # noqa: PLC0415

        return resolve_model(self.config.model)

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priorities: Seq[int] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt (a string or token ids); one output per prompt, in order
        (with ``n > 1``: ``n`` outputs per prompt, by ``index``, prompt after prompt).
        ``lora_request``: the adapter of every prompt, or one per prompt (None: the base)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        return self._generate(list(prompts), sampling_params, use_tqdm, priorities,  # type: ignore[arg-type]
                              lora_request)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Generate a reply to each conversation, formatted with the model's chat template
        (``chat_template_kwargs``: extra template variables, e.g. ``{"enable_thinking": False}``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, chat_template_kwargs)  # type: ignore[arg-type]
                   for c in conversations]
        return self._generate(prompts, sampling_params, use_tqdm, None, lora_request)

    def apply_chat_template(self, conversation: list[Message],
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The token ids the engine runs for ``conversation`` (the same path as the driver's)."""
        from nvray.chat_template import ChatPrompt, render_chat  # noqa: PLC0415

        return render_chat(self._engine_tokenizer, ChatPrompt(list(conversation),
                                                                dict(chat_template_kwargs or {})))

    def beam_search(self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = True) -> list[list[RequestOutput]]:
        """Beam search for each prompt: its ``beam_width`` best beams, best first (each with
        ``token_ids``, ``text``, ``cumulative_logprob`` and ``finish_reason``)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        flat = self._generate(prompts, [params] * len(prompts), use_tqdm, None)
        width = params.beam_width
        return [flat[i * width:(i + 1) * width] for i in range(len(prompts))]

    def embed(self, prompts: Prompt | Seq[Prompt], dimensions: int | None = None,
              normalize: bool | None = None, use_tqdm: bool = False) -> list[EmbeddingOutput]:
        """An embedding per prompt (``nvray/pooling.py``): its last token's final hidden state,
        its first ``dimensions`` values (Matryoshka), L2-normalised as the checkpoint's
        sentence-transformers modules say (a ``Normalize`` module; a checkpoint without
        modules.json: normalised), or as ``normalize`` says. Any checkpoint embeds; an
        embedding checkpoint (Qwen3-Embedding) is made for it."""
        from nvray.pooling import PoolingTask, embed_params, to_embedding  # noqa: PLC0415

        if normalize is None:  # as the Serve app's /v1/embeddings does
            normalize = PoolingTask.of(self._model_path()).normalize
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        outs = self._generate(list(prompts), embed_params(), use_tqdm, None)  # type: ignore[arg-type]
        return [EmbeddingOutput(to_embedding(o.pooled or [], dimensions, normalize),
                                o.prompt_token_ids) for o in outs]

    def score(self, query: str, documents: Seq[str], instruction: str | None = None,
              use_tqdm: bool = False) -> list[ScoreOutput]:
        """How well each document answers ``query``, in [0, 1]: a Qwen3-Reranker-style
        checkpoint's probability of "yes" over its judging prompt (``nvray/pooling.py``)."""
        from nvray.pooling import (RERANK_TOKENS, rerank_token_ids,  # noqa: PLC0415
                                   reranker_prompt, score_params, to_score)

        tok = self._engine_tokenizer
        params = score_params(*rerank_token_ids(
            [tok.encode(word, add_special_tokens=False) for word in RERANK_TOKENS]))
        prompts = [reranker_prompt(query, d, instruction) for d in documents]
        outs = self._generate(prompts, params, use_tqdm, None)
        return [ScoreOutput(to_score(o.pooled or [0.0, 0.0]), o.prompt_token_ids) for o in outs]

    def stats(self) -> dict[str, Any]:
        return self.engine.stats() if self.engine is not None else self.client.stats()

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.shutdown()
            self.client = None
            atexit.unregister(self.shutdown)
        if self.engine is not None:
            self.engine.executor.shutdown()
            self.engine = None

    # -------------------------------------------------------------- internals
    @staticmethod
    def _params_list(sampling_params: Any, n: int) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, (SamplingParams, dict)):
            return [SamplingParams.coerce(sampling_params)] * n
        params = [p if isinstance(p, BeamSearchParams) else SamplingParams.coerce(p)
                  for p in sampling_params]
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
        return params

    @staticmethod
    def _lora_list(lora_request: Any, n: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        loras = list(lora_request)
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} lora_request entries for {n} prompts")
        return loras

    def _generate(self, prompts: list[Any], sampling_params: Any, use_tqdm: bool,
                  priorities: Seq[int] | None, lora_request: Any = None) -> list[RequestOutput]:
        params = self._params_list(sampling_params, len(prompts))
        prios = list(priorities) if priorities is not None else [0] * len(prompts)
        loras = self._lora_list(lora_request, len(prompts))
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        bar = tqdm(total=sum(map(num_choices, params)), desc="Generating", dynamic_ncols=True,
                   disable=not use_tqdm)
        try:
            if self.engine is not None:
                return self._run_inprocess(ids, prompts, params, prios, loras, bar)
            return self._run_on_ray(ids, prompts, params, prios, loras, bar)
        finally:
            bar.close()

    def _run_inprocess(self, ids: list[str], prompts: list[Any], params: list[SamplingParams],
                       prios: list[int], loras: list[LoRARequest | None], bar: tqdm
                       ) -> list[RequestOutput]:
        engine = self.engine
        try:
            for rid, prompt, p, prio, lora in zip(ids, prompts, params, prios, loras):
                engine.add_request(rid, prompt, p, prio, lora_request=lora)
        except ValueError:
            for rid in ids:  # all or nothing: drop the ones queued before the bad one
                engine.abort_request(rid)
            raise
        results: dict[tuple[str, int], RequestOutput] = {}
        try:
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                outputs = engine.step()
                elapsed = max(time.perf_counter() - start, 1e-9)
                prefill, decode = engine.counters.last_step_tokens
                bar.set_postfix(prefill=f"{prefill / elapsed:.0f} tok/s",
                                decode=f"{decode / elapsed:.0f} tok/s")
                for out in outputs:
                    if out.finished:
                        results[out.request_id, out.index] = out
                        bar.update(1)
        except BaseException as e:  # a failed step or an interrupt: end this call's requests
            engine.fail_all(f"generate was interrupted: {type(e).__name__}: {e}")
            raise
        return [results[rid, i] for rid, p in zip(ids, params) for i in range(num_choices(p))]

    def _run_on_ray(self, ids: list[str], prompts: list[Any], params: list[SamplingParams],
                    prios: list[int], loras: list[LoRARequest | None], bar: tqdm
                    ) -> list[RequestOutput]:
        from nvray.request import EngineRequest  # noqa: PLC0415

        sink = self.client.submit([EngineRequest(p, sp, rid, prio, lora_request=lora)
                                   for rid, p, sp, prio, lora
                                   in zip(ids, prompts, params, prios, loras)])
        results: list[RequestOutput | None] = [None] * len(sink.request_ids)  # n per prompt
        last = (time.perf_counter(), self.client.stats()) if not bar.disable else (0.0, {})
        remaining = len(results)
        try:
            while remaining:  # no streaming: each request arrives once, finished
                try:
                    batch = sink.next_batch(timeout=_POLL_S)
                except TimeoutError:
                    batch = []
                for index, out in batch:
                    results[index] = out
                remaining -= len(batch)
                bar.update(len(batch))
                last = self._show_throughput(bar, last)
            return results  # type: ignore[return-value]
        except BaseException:
            sink.abort()
            raise

    def _show_throughput(self, bar: tqdm, last: tuple[float, dict]) -> tuple[float, dict]:
        if bar.disable or time.perf_counter() - last[0] < _POLL_S:
            return last
        now, stats = time.perf_counter(), self.client.stats()
        dt = max(now - last[0], 1e-9)
        if stats.get("healthy"):
            prefill = (stats["prompt_tokens"] - last[1].get("prompt_tokens", 0)) / dt
            decode = (stats["generation_tokens"] - last[1].get("generation_tokens", 0)) / dt
            bar.set_postfix(prefill=f"{prefill:.0f} tok/s", decode=f"{decode:.0f} tok/s")
        return now, stats


def _start_on_ray(config: EngineConfig) -> Any:
    """``start_engine``, its imports (torch, the engine: seconds) in a thread while this one
    connects to Ray. Ray must start from this thread: a local cluster's processes die with the
    thread that started them."""
    phases = StartupPhases()
    with phases.phase("imports"):
        from nvray.runtime.cluster import ensure_ray  # noqa: PLC0415 - Ray only, no torch
    with concurrent.futures.ThreadPoolExecutor(1, "nvray-imports") as pool:
        importing = pool.submit(importlib.import_module, "nvray.runtime.client")
        with phases.phase("ray_init"):
            ensure_ray()
        with phases.phase("imports"):  # and what connecting did not hide of the rest
            client_module = importing.result()
    return client_module.start_engine(config, phases=phases)
