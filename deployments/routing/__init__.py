"""Routing: where a request finds an engine.

``engines`` (a replica's own engine, or engine replicas leased through handles),
``engine_replica`` (NvrayEngine, the engine deployment of a prefix-routed app), ``admission``
(a replica's limit on what it runs and lets wait), ``prefix_router`` (the Serve request router
that sends a prompt where its prefix is cached), ``prefix_index`` and ``prefix_table`` (which
engine holds which prefix).
"""
