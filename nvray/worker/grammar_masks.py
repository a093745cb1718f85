"""Rank 0's grammar matchers, one per constrained sequence, and the token masks they make.

A constrained sequence's first ``SampleSpec`` carries its ``GrammarSpec`` (``grammar``): rank 0
makes its matcher then and keeps it until a step lists the sequence in ``grammars_done`` (it
finished), across preemption and recompute. Each launch, once the step's forward is queued:

1. the tokens sampled for constrained sequences at the launch before are accepted by their
   matchers (this waits for that launch's ids on the host: the step before, done or nearly);
2. each constrained row's allowed tokens are filled into a host bitmask (xgrammar; many rows
   in parallel threads), copied to the device and applied to those rows only (-inf for every
   other token, one batched op), before penalties and sampling see the logits;
3. after sampling, the constrained rows are remembered for step 1 of the next launch.

So the host works on the masks while the device runs the forward pass, with overlapped steps
on; a batch without constrained rows pays a flag check. The grammar's stop tokens are the EOS
ids: EOS is allowed only where the grammar may end, and a complete grammar allows only EOS.
JSON rows also lose the tokens with raw control characters (``GrammarCompiler.json_safe_bitmask``).
A token a matcher cannot accept (the engine dropped a finished sequence's last token) leaves
that matcher out of later masks instead of failing the step.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from typing import Any, Callable

import torch

from nvray.step_protocol import StepInput
from nvray.worker.device_lists import to_device
from nvray.worker.sampled_ids import SampledIds

logger = logging.getLogger(__name__)

# From this many rows, masks are filled (and tokens accepted) by xgrammar's batch matcher in
# threads: on an H100 host, 256 JSON rows took 3.3 ms one by one and 1.2 ms in 4 threads, but
# one row took 0.004 ms alone and 0.1-0.4 ms through the threads.
_PARALLEL_ROWS = 32
_FILL_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))


class GrammarMasks:
    def __init__(self, compiler: Callable[[], Any], max_rows: int, device: torch.device) -> None:
        self._make_compiler = compiler
        self._compiler: Any = None
        self._background = concurrent.futures.ThreadPoolExecutor(1, "nvray-grammar-prefetch")
        self.device = device
        self.max_rows = max(max_rows, 1)
        self.matchers: dict[int, Any] = {}  # seq_id -> its matcher
        self.json_rows: set[int] = set()  # seq_ids of JSON grammars (see json_safe_bitmask)
        self.pending: tuple[SampledIds, list[tuple[int, int]]] | None = None  # last launch's rows
        self._bitmask: torch.Tensor | None = None  # host buffer [max_rows, words]
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher: fills rows in threads
        # host seconds spent accepting tokens and filling masks (the bench reports them)
        self.host_seconds = {"accept": 0.0, "fill": 0.0}

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

    def mask(self, step: StepInput, logits: torch.Tensor) -> list[tuple[int, int]]:
        """-inf, in place, for every token the grammar forbids in each constrained row of
        ``logits`` (the step's sampling rows); returns those rows as (seq_id, row)."""
        self.accept_pending()
        rows, row = [], 0
        for seq in step.seqs:
            spec = seq.sample
            if spec is None:
                continue
            if spec.grammar is not None:
                compiled = self.compiler.compile(spec.grammar)
                self.matchers[seq.seq_id] = self.compiler.matcher(compiled)
                if spec.grammar[0].startswith("json"):
                    self.json_rows.add(seq.seq_id)
            matcher = self.matchers.get(seq.seq_id)
            if matcher is not None and not matcher.is_terminated():
                rows.append((seq.seq_id, row))
            row += 1
        if rows:
            self._apply(logits, rows)
        return rows

    def remember(self, sampled: SampledIds, rows: list[tuple[int, int]]) -> None:
        """The launch's sampled ids: its constrained rows' tokens are accepted next launch."""
        self.pending = (sampled, rows) if rows else None

    def accept_pending(self) -> None:
        if self.pending is None:
            return
        sampled, rows = self.pending
        self.pending = None
        if sampled.event is not None:
            sampled.event.synchronize()
        start = time.perf_counter()
        ids = sampled.host.tolist()  # type: ignore[union-attr]
        live = [(seq_id, ids[row]) for seq_id, row in rows if seq_id in self.matchers]
        matchers = [self.matchers[seq_id] for seq_id, _ in live]
        tokens = [token for _, token in live]
        if len(live) >= _PARALLEL_ROWS:
            accepted = self.compiler.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        else:
            accepted = [m.accept_token(t) for m, t in zip(matchers, tokens)]
        for (seq_id, token), ok in zip(live, accepted):
            if not ok:
                logger.debug("sequence %d: token %d is outside its grammar", seq_id, token)
                self.matchers.pop(seq_id)
        self.host_seconds["accept"] += time.perf_counter() - start

    def clear(self) -> None:
        """Forget every matcher and pending token (the engine failed its requests)."""
        self.matchers.clear()
        self.json_rows.clear()
        self.pending = None

    def _apply(self, logits: torch.Tensor, rows: list[tuple[int, int]]) -> None:
        start = time.perf_counter()
        xgr = self.compiler.xgr
        bitmask = self._host_bitmask(len(rows), logits.shape[1])
        matchers = [self.matchers[s] for s, _ in rows]
        if len(rows) >= _PARALLEL_ROWS:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(_FILL_THREADS)
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(bitmask, i)
        json_rows = [i for i, (seq_id, _) in enumerate(rows) if seq_id in self.json_rows]
        if len(json_rows) == len(rows):
            bitmask &= self.compiler.json_safe_bitmask
        elif json_rows:
            bitmask[json_rows] &= self.compiler.json_safe_bitmask
        self.host_seconds["fill"] += time.perf_counter() - start
        index = to_device([r for _, r in rows], logits.device)
        sub = logits.index_select(0, index)
        on_gpu = logits.device.type == "cuda"
        xgr.apply_token_bitmask_inplace(sub, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=logits.shape[1],
                                        backend="triton" if on_gpu else "cpu")
        logits.index_copy_(0, index, sub)

    def _host_bitmask(self, n: int, vocab_size: int) -> torch.Tensor:
        """Rows [n] of one reused host buffer: the launch before read it (its ids are in)."""
        words = (vocab_size + 31) // 32
        buf = self._bitmask
        if buf is None or buf.shape[0] < n or buf.shape[1] != words:
            with torch.inference_mode(False):
                buf = torch.empty(max(n, self.max_rows), words, dtype=torch.int32,
                                  pin_memory=self.device.type == "cuda")
            self._bitmask = buf
        return buf[:n]
