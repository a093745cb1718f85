"""Rank 0's grammar matchers, one per constrained sequence, and the token masks they make.

A constrained sequence's first ``SampleSpec`` carries its ``GrammarSpec`` (``grammar``): rank 0
makes its matcher then and keeps it until a step lists the sequence in ``grammars_done`` (it
finished), across preemption and recompute.

The matchers advance off the launching thread. Once a step's sampling is queued,
``advance`` hands its constrained rows to one filler thread, which waits for that step's ids
on the host, has each row's matcher accept its token and fills the next mask of every matcher
still open into a pinned host buffer (xgrammar; many rows at once in its own threads, without
the GIL). Meanwhile the launching thread goes on: with overlapped steps the runner queues a
constrained step's sampling only at the next launch (``StepLauncher.execute_overlapped``), so
the engine reads the step before and schedules the next one while the filler works. ``mask``
then takes the filler's masks (waiting only for what is not done yet), fills the rows it has
none for (a first sample, a sequence back from preemption), copies them to the device and
sets -inf, in one kernel on the step's constrained rows only (``kernels/grammar_mask.py``,
compiled at start-up; xgrammar's op on the CPU), for every token their grammar forbids, after
penalties and before sampling. A batch without constrained rows pays a flag check; at most
one fill is in flight and every matcher is touched by one thread at a time (``mask`` and
``clear`` wait for the filler first).

Speculative decoding: a constrained sequence with drafts (known on the host: the n-gram
proposer; or the ranks' drafter's, read back once its forwards are done) samples a row per
draft more; ``mask`` walks its matcher through the drafts to mask
each row for the tokens before it, then rolls it back, and the filler has it accept the run its
drafts verified.

The grammar's stop tokens are the EOS ids: EOS is allowed only where the grammar may end, and
a complete grammar allows only EOS. JSON rows also lose the tokens with raw control characters
(``GrammarCompiler.json_safe_bitmask``). A token a matcher cannot accept (the engine dropped a
finished sequence's last token) leaves that matcher out of later masks instead of failing the
step.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib.util
import logging
import os
import time
from typing import Any, Callable, NamedTuple

import torch

from nvray.speculative import accepted_run
from nvray.step_protocol import StepInput, placeholder_row
from nvray.worker.device_lists import to_device
from nvray.worker.sampled_ids import SampledIds

logger = logging.getLogger(__name__)

# From this many rows, masks are filled (and tokens accepted) by xgrammar's batch matcher in
# threads: on an H100 host, 256 JSON rows took 3.3 ms one by one and 1.2 ms in 4 threads, but
# one row took 0.004 ms alone and 0.1-0.4 ms through the threads.
_PARALLEL_ROWS = 32
_FILL_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))


class FilledMasks(NamedTuple):
    """What one fill left in the mask buffers: the buffer row of each sequence's next mask
    (open matchers only), how many rows it used, the sequences whose token was refused, and
    the event of the rows' copy to the device (None on the CPU)."""
    rows: dict[int, int]
    count: int
    refused: list[int]
    copied: Any = None


_NOTHING_FILLED = FilledMasks({}, 0, [])
Constrained = tuple[int, int, tuple[int, ...]]  # (seq_id, its first sampled row, its drafts)


def _accept_run(matcher: Any, run: list[int]) -> bool:
    """Have ``matcher`` accept a verified run's tokens, none after its grammar ended (the engine
    ends the sequence at that stop token); False if it refuses one."""
    for token in run:
        if matcher.is_terminated():
            return True
        if not matcher.accept_token(token):
            return False
    return True


class MaskBuffers:
    """Token bitmasks [rows, words] (int32) in pinned host memory and their copy on the
    device; on the CPU the two are one tensor. ``copy`` sends rows on a side stream, so the
    filler's copy never waits behind the step running on the device."""

    def __init__(self, rows: int, words: int, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        with torch.inference_mode(False):
            self.host = torch.empty(rows, words, dtype=torch.int32, pin_memory=self.cuda)
        self.on_device = torch.empty_like(self.host, device=device) if self.cuda else self.host
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def copy(self, first: int, end: int, side_stream: bool) -> Any:
        """Copy host rows [first, end) to the device: on the side stream (returns the event
        to wait for), or queued on the current stream (returns None)."""
        if not self.cuda or end <= first:
            return None
        if not side_stream:
            self.on_device[first:end].copy_(self.host[first:end], non_blocking=True)
            return None
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), \
                torch.inference_mode():  # the filler's thread: the tensors are inference ones
            self.on_device[first:end].copy_(self.host[first:end], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return copied


def _mask_kernel(device: torch.device) -> Callable[..., None] | None:
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from kernels import mask_logits  # noqa: PLC0415 - GPU-only import

    return mask_logits


class GrammarMasks:
    def __init__(self, compiler: Callable[[], Any], max_rows: int, device: torch.device) -> None:
        self._make_compiler = compiler
        self._compiler: Any = None
        self._background = concurrent.futures.ThreadPoolExecutor(1, "nvray-grammar-prefetch")
        self._filler = concurrent.futures.ThreadPoolExecutor(1, "nvray-grammar-masks")
        self.device = device
        self.max_rows = max(max_rows, 1)
        self.matchers: dict[int, Any] = {}  # seq_id -> its matcher
        self.json_rows: set[int] = set()  # seq_ids of JSON grammars (see json_safe_bitmask)
        self.filling: concurrent.futures.Future[FilledMasks] | None = None  # the filler's job
        self.buffers: MaskBuffers | None = None  # the filler's rows first, then launch's
        self._kernel = _mask_kernel(device)  # kernels/grammar_mask.py on CUDA with Triton
        self._by_row: torch.Tensor | None = None  # without: [max_rows, words], a mask per row
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher: fills rows in threads
        # seconds the filler spent accepting tokens and filling masks, and the launching thread
        # spent waiting for it and filling rows itself (the bench reports them)
        self.host_seconds = {"accept": 0.0, "fill": 0.0, "wait": 0.0, "fill_at_launch": 0.0}

    @property
    def compiler(self) -> Any:
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler

    def update(self, step: StepInput) -> None:
        """Start compiling the grammars of new requests, in the background (the compiler is
        made there the first time); drop the finished sequences' matchers."""
        if step.grammars:
            specs = list(step.grammars)
            self._background.submit(lambda: [self.compiler.compile_async(s) for s in specs])
        for seq_id in step.grammars_done:
            self.matchers.pop(seq_id, None)
            self.json_rows.discard(seq_id)

    # ------------------------------------------------------------------ launch
    def mask(self, step: StepInput, logits: torch.Tensor,
             model_drafts: list[int] | None = None) -> list[Constrained]:
        """-inf, in place, for every token the grammar forbids in each constrained row of
        ``logits`` (the step's sampling rows); returns the constrained sequences as (seq_id,
        first row, drafts: what its matcher is to accept after sampling). ``model_drafts``: the
        ranks' drafter's ids, which a sequence's draft placeholders name."""
        filled = self._collect()
        rows, sources, unfilled, drafting, row = [], [], [], [], 0
        for seq in step.seqs:
            spec = seq.sample
            if spec is None:
                continue
            if spec.grammar is not None:
                self._start_matcher(seq.seq_id, spec.grammar)
            matcher = self.matchers.get(seq.seq_id)
            drafts = tuple(seq.token_ids[len(seq.token_ids) - seq.num_drafts:])
            if drafts and drafts[0] < 0:  # placeholders: the drafter's
                assert model_drafts is not None, "model drafts without the drafter's ids"
                drafts = tuple(model_drafts[placeholder_row(d)] for d in drafts)
            if matcher is not None and drafts and not matcher.is_terminated():
                drafting.append((seq.seq_id, row, drafts))
            elif seq.seq_id in filled.rows:
                rows.append((seq.seq_id, row, ()))
                sources.append(filled.rows[seq.seq_id])
            elif matcher is not None and not matcher.is_terminated():
                unfilled.append((seq.seq_id, row, ()))
            row += 1 + seq.num_drafts  # a speculating sequence samples a row per draft more
        logit_rows = [r for _, r, _ in rows]
        if unfilled:
            sources += self._fill_at_launch([s for s, _, _ in unfilled], filled.count,
                                            logits.shape[1])
            rows += unfilled
            logit_rows += [r for _, r, _ in unfilled]
        if drafting:
            first = filled.count + len(unfilled)
            more_rows, more_sources = self._fill_drafted(drafting, first, logits.shape[1])
            rows += drafting
            logit_rows += more_rows
            sources += more_sources
        if filled.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(filled.copied)
        if logit_rows:
            self._apply(logits, logit_rows, sources)
        return rows

    def _fill_drafted(self, drafting: list[Constrained], first: int, vocab_size: int
                      ) -> tuple[list[int], list[int]]:
        """The masks of speculating sequences' rows, on this thread: a sequence's row j is
        masked for its matcher after accepting drafts 1..j (each matcher rolled back after).
        Rows after a draft the grammar refuses are left unmasked: the row before cannot sample
        that draft, so no token of theirs is kept; so are rows after a draft that ends the
        grammar (its stop token: the engine ends the sequence there, and the matcher takes
        nothing after it). A special token that is not a stop token counts as refused without
        asking the matcher (xgrammar would warn). Returns the logits rows masked and their
        buffer rows."""
        start = time.perf_counter()
        buffers = self._buffers(first + sum(1 + len(d) for _, _, d in drafting), vocab_size)
        logit_rows, sources, at = [], [], first
        specials = self._special_ids
        for seq_id, row, drafts in drafting:
            matcher, accepted = self.matchers[seq_id], 0
            json_safe = seq_id in self.json_rows
            for j in range(len(drafts) + 1):
                self._fill([matcher], buffers.host[at:at + 1], [0] if json_safe else [])
                logit_rows.append(row + j)
                sources.append(at)
                at += 1
                if j == len(drafts) or (drafts[j] in specials
                                        and drafts[j] not in matcher.stop_token_ids):
                    break
                if not matcher.accept_token(drafts[j]):
                    break
                accepted += 1
                if matcher.is_terminated():
                    break
            if accepted:
                matcher.rollback(accepted)
        buffers.copy(first, at, side_stream=False)
        self.host_seconds["fill_at_launch"] += time.perf_counter() - start
        return logit_rows, sources

    def _start_matcher(self, seq_id: int, grammar: Any) -> None:
        self.matchers[seq_id] = self.compiler.matcher(self.compiler.compile(grammar))
        if grammar[0].startswith("json"):
            self.json_rows.add(seq_id)

    def _fill_at_launch(self, seq_ids: list[int], first: int, vocab_size: int) -> list[int]:
        """Fill the masks of ``seq_ids`` into the host rows from ``first`` on, on this thread."""
        start, end = time.perf_counter(), first + len(seq_ids)
        buffers = self._buffers(end, vocab_size)
        self._fill([self.matchers[s] for s in seq_ids], buffers.host[first:end],
                   [i for i, s in enumerate(seq_ids) if s in self.json_rows])
        buffers.copy(first, end, side_stream=False)
        self.host_seconds["fill_at_launch"] += time.perf_counter() - start
        return list(range(first, end))

    def _apply(self, logits: torch.Tensor, rows: list[int], sources: list[int]) -> None:
        """Mask logits row ``rows[i]`` with buffer row ``sources[i]`` (on the device)."""
        on_device = self.buffers.on_device  # type: ignore[union-attr]
        index = to_device([rows, sources], self.device)
        if self._kernel is not None:
            self._kernel(logits, on_device, index[0], index[1])
            return
        # xgrammar's own op reads the masks indexed like the logits: gather them so first
        if self._by_row is None or self._by_row.shape[0] < logits.shape[0]:
            self._by_row = torch.empty(max(logits.shape[0], self.max_rows), on_device.shape[1],
                                       dtype=torch.int32, device=self.device)
        self._by_row.index_copy_(0, index[0], on_device.index_select(0, index[1]))
        self.compiler.xgr.apply_token_bitmask_inplace(
            logits, self._by_row[:logits.shape[0]], vocab_size=logits.shape[1], indices=index[0],
            backend="cpu" if self.device.type == "cpu" else "torch_native")

    def warm(self, vocab_size: int, dtypes: tuple[torch.dtype, ...]) -> None:
        """Compile the mask kernel for logits of ``dtypes`` now, not at the first constrained
        step (a stall of ~0.1 s per variant)."""
        if self._kernel is None:
            return
        masks = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32, device=self.device)
        index = torch.zeros(1, dtype=torch.int64, device=self.device)
        for dtype in dtypes:
            logits = torch.zeros(1, vocab_size, dtype=dtype, device=self.device)
            self._kernel(logits, masks, index, index)

    # ---------------------------------------------------------------- the filler
    def advance(self, sampled: SampledIds, rows: list[Constrained]) -> None:
        """The launch's sampled ids: the filler has its constrained rows' matchers accept them
        (a speculating sequence's: its verified run) and fills their next masks, while the
        caller goes on."""
        if not rows:
            return
        self._collect()  # one fill at a time (normally ``mask`` took it already)
        jobs = [(seq_id, row, self.matchers[seq_id], seq_id in self.json_rows, drafts)
                for seq_id, row, drafts in rows if seq_id in self.matchers]
        self._buffers(len(jobs))
        self.filling = self._filler.submit(self._accept_and_fill, sampled, jobs)

    def _accept_and_fill(self, sampled: SampledIds, jobs: list[tuple[int, int, Any, bool,
                                                                       tuple[int, ...]]]
                         ) -> FilledMasks:
        """On the filler thread: wait for the ids, accept each job's token (a speculating
        job's run: ``nvray/speculative.py``'s ``accepted_run``), fill the masks of the
        matchers still open into host rows 0, 1, ..."""
        if sampled.event is not None:
            sampled.event.synchronize()  # also: the device has read the rows of the last fill
        start = time.perf_counter()
        ids = sampled.host.tolist()  # type: ignore[union-attr]
        matchers = [m for _, _, m, _, _ in jobs]
        runs = [accepted_run(d, ids[row:row + len(d) + 1]) if d else [ids[row]]
                for _, row, _, _, d in jobs]
        if len(jobs) >= _PARALLEL_ROWS and all(len(run) == 1 for run in runs):
            accepted = self.compiler.xgr.BatchGrammarMatcher.batch_accept_token(
                matchers, [run[0] for run in runs])
        else:
            accepted = [_accept_run(m, run) for m, run in zip(matchers, runs)]
        refused, open_jobs = [], []
        for job, run, ok in zip(jobs, runs, accepted):
            if not ok:
                logger.debug("sequence %d: a token of %s is outside its grammar", job[0], run)
                refused.append(job[0])
            elif not job[2].is_terminated():
                open_jobs.append(job)
        mid = time.perf_counter()
        self.host_seconds["accept"] += mid - start
        buffers, count = self.buffers, len(open_jobs)
        self._fill([m for _, _, m, _, _ in open_jobs], buffers.host[:count],  # type: ignore[union-attr]
                   [i for i, job in enumerate(open_jobs) if job[3]])
        copied = buffers.copy(0, count, side_stream=True)  # type: ignore[union-attr]
        self.host_seconds["fill"] += time.perf_counter() - mid
        return FilledMasks({job[0]: i for i, job in enumerate(open_jobs)}, count, refused, copied)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self.compiler.tokenizer_info.special_token_ids)

    def _fill(self, matchers: list[Any], host: torch.Tensor, json_rows: list[int]) -> None:
        if not matchers:
            return
        if len(matchers) >= _PARALLEL_ROWS:
            if self._batch is None:
                self._batch = self.compiler.xgr.BatchGrammarMatcher(_FILL_THREADS)
            self._batch.batch_fill_next_token_bitmask(matchers, host[:len(matchers)])
        else:
            for i, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(host, i)
        if len(json_rows) == len(matchers):
            host[:len(matchers)] &= self.compiler.json_safe_bitmask
        elif json_rows:
            host[json_rows] &= self.compiler.json_safe_bitmask

    def _collect(self) -> FilledMasks:
        """Wait for the filler's job, if one is out, and take its result."""
        job, self.filling = self.filling, None
        if job is None:
            return _NOTHING_FILLED
        start = time.perf_counter()
        filled = job.result()
        self.host_seconds["wait"] += time.perf_counter() - start
        for seq_id in filled.refused:
            self.matchers.pop(seq_id, None)
        return filled

    def clear(self) -> None:
        """Forget every matcher and the fill in flight (the engine failed its requests)."""
        job, self.filling = self.filling, None
        if job is not None:
            concurrent.futures.wait([job])
        self.matchers.clear()
        self.json_rows.clear()

    def _buffers(self, n: int, vocab_size: int | None = None) -> MaskBuffers:
        """The mask buffers, grown to at least ``n`` rows (of masks for ``vocab_size`` tokens;
        None: as wide as they are). Called with no fill in flight."""
        buffers = self.buffers
        words = (vocab_size + 31) // 32 if vocab_size is not None else buffers.host.shape[1]  # type: ignore[union-attr]
        if buffers is None or buffers.host.shape[0] < n or buffers.host.shape[1] != words:
            if buffers is not None and buffers.cuda:
                torch.cuda.synchronize(self.device)  # rare: nothing may still read the old ones
            self.buffers = buffers = MaskBuffers(max(n, 2 * self.max_rows), words, self.device)
        return buffers
