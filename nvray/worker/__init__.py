"""One model rank: what runs a ``StepInput`` (``nvray/step_protocol.py``) on a device.

``ModelRunner`` (``model_runner.py``) holds the model shard, its paged KV cache and CUDA graphs,
and executes steps; ``setup.py`` builds it and ``startup.py`` sizes the cache, warms the kernels
and captures the graphs; ``executor.py`` is the in-process ``Executor`` over one runner (TP=1).
Knows the step protocol, never the scheduler: nothing here imports ``nvray.engine`` or Ray.
"""
