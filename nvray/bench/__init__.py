"""nvray's benchmarks: programs that print and save figures (``python -m nvray.bench
SUBCOMMAND``; ``__main__`` parses the arguments and names each subcommand's module), never
tests: nothing here asserts a timing. One module per benchmark (``control_plane``,
``ray_overhead``, ``throughput``, ``gpu_busy``, ``sampler``, ``serve`` and its ``multiturn``
workload, ``soak``), each with a ``bench_*``/``run`` entry that returns its figures as a JSON-able
dict; shared pieces live in the module that owns them (``checkpoints``: the random Qwen3-shaped
checkpoints; ``floor``: the physical floors; ``http_load``: requests against the HTTP app), and
imports only go from a benchmark to those. Importing the package imports nothing else: each
benchmark imports torch, Ray or the engine only when it runs.
"""
