"""``python -m nvray.bench control-plane``: the control plane's time per step, without a model.

An ``LLMEngine`` over an executor that answers every step at once with pseudo-random tokens
(``InstantExecutor``) is filled with ``num_seqs`` running sequences (prompts of 100 to 1024
tokens, ignore_eos); then ``steps`` decode steps time the scheduler alone, the step input
(schedule output to ``StepInput`` plus accounting), and the whole control plane (schedule, step
input, stop checks, detokenization), and the outputs' wire form as the driver pickles it for
its consumers. ``stream``: every request streams (an output per step, detokenized as it goes).
Medians (and the full step's p90), in microseconds.
"""

from __future__ import annotations

import pickle
import random
import statistics
import time
from typing import Any

from nvray.config import EngineConfig
from nvray.engine.engine import LLMEngine, ModelLimits
from nvray.outputs import to_wire
from nvray.sampling_params import SamplingParams
from nvray.step_protocol import StepInput, StepOutput


class InstantExecutor:
    """Answers every step at once with pseudo-random tokens: isolates the control plane."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

        self.previous: StepOutput | None = None

    def execute(self, step: StepInput) -> StepOutput:
        return StepOutput([self.rng.randrange(3, self.vocab) for _ in range(step.num_samples)])

    def execute_overlapped(self, step: StepInput | None) -> StepOutput | None:
        if step is not None and step.answer_now:
            return self.execute(step)
        previous, self.previous = self.previous, (None if step is None else self.execute(step))
        return previous

    def discard_in_flight(self) -> None:
        self.previous = None

    def check_health(self) -> None:
        pass

    def idle(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _engine(num_seqs: int, block_size: int, tokenizer: Any, vocab: int) -> LLMEngine:
    limits = ModelLimits(max_model_len=4096, vocab_size=vocab, num_kvcache_blocks=200_000,
                         block_size=block_size, eos_token_ids=())
    config = EngineConfig(max_num_seqs=num_seqs, max_num_batched_tokens=1 << 20,
                          kvcache_block_size=block_size)
    return LLMEngine(config, tokenizer, InstantExecutor(vocab), limits)


def _fill(engine: LLMEngine, num_seqs: int, vocab: int, stream: bool) -> None:
    rng = random.Random(0)
    for i in range(num_seqs):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(100, 1024))]
        engine.add_request(f"b{i}", prompt, SamplingParams(temperature=0.6, max_tokens=2000,
                                                           ignore_eos=True), stream=stream)
    engine.step()  # one prefill step admits everyone; what follows are pure decode steps


def bench_control_plane(num_seqs: int = 256, steps: int = 200, block_size: int = 16,
                        stream: bool = False) -> dict[str, Any]:
    from nvray.tokenizer import load_tokenizer  # noqa: PLC0415
    from nvray.models.tiny import tiny_model_path  # noqa: PLC0415

    tokenizer = load_tokenizer(tiny_model_path())
    vocab = len(tokenizer)
    engine = _engine(num_seqs, block_size, tokenizer, vocab)
    _fill(engine, num_seqs, vocab, stream)
    sched_us, input_us, step_us = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        t1 = time.perf_counter()
        launched = engine.launch_scheduled(out)  # step input + accounting
        t2 = time.perf_counter()
        sampled = engine.executor.execute(launched.step_input)
        engine.update_from_output(launched, sampled)
        sched_us.append((t1 - t0) * 1e6)
        input_us.append((t2 - t1) * 1e6)
    wire_us = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        pickle.dumps([to_wire(o) for o in outputs])  # what the driver sends its consumers
        step_us.append((t1 - t0) * 1e6)
        wire_us.append((time.perf_counter() - t1) * 1e6)
    assert len(engine.scheduler.running) == num_seqs
    return {"benchmark": "control-plane", "num_running_seqs": num_seqs, "block_size": block_size,
            "steps": steps, "stream": stream,
            "outputs_to_wire_us_median": statistics.median(wire_us), "schedule_us_median": statistics.median(sched_us),
            "step_input_us_median": statistics.median(input_us),
            "full_control_plane_step_us_median": statistics.median(step_us),
            "full_control_plane_step_us_p90": sorted(step_us)[int(0.9 * steps)]}


def add_arguments(p: Any) -> None:
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--stream", action="store_true",
                   help="every request streams (an output per step, detokenized as it goes)")


def run(args: Any) -> dict[str, Any]:
    return bench_control_plane(args.num_seqs, args.steps, args.block_size, args.stream)
