"""Keep Python's cyclic garbage collector off the step loop's critical path.

After start-up an engine process holds hundreds of thousands of long-lived objects that the
collector tracks (torch, Triton, Ray, the model's modules, the tokenizer: ~560k-640k in a rank
process on the H100 machine). A full (generation 2) collection walks every one of them: one
took 0.37 s mid-run in a rank process there — a pause the GPU waits through — and turned a
throughput run 10% slower than its neighbours.

``freeze_startup_objects()``, called once start-up is done in each process that runs steps
(``bootstrap.create_engine``, the Ray rank after its KV cache and CUDA graphs exist), collects
once and moves what survives into the permanent generation (``gc.freeze``): later collections
walk only what was allocated since. Frozen objects that die are still freed by reference
counting; only reference cycles among them wait until ``release_frozen_objects()``
(``gc.unfreeze``), which the executors call when they shut down, and which also runs at the
process's exit: the interpreter's last collections skip frozen objects, so a process whose
engine was never shut down (a script's ``LLM`` left to the end, a test session's) would end
with every frozen cycle uncollected, and Triton 3.9's bindings (nanobind) count what of theirs
is left at exit and print each as "leaked" (hundreds of lines).
"""

from __future__ import annotations

import atexit
import gc


def freeze_startup_objects() -> None:
    gc.collect()
    gc.freeze()
    atexit.unregister(release_frozen_objects)  # once, however many engines froze
    atexit.register(release_frozen_objects)


def release_frozen_objects() -> None:
    gc.unfreeze()
