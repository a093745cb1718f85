"""The control plane, pure Python: no CUDA, Triton or Ray is imported here.

``LLMEngine`` (``engine.py``) runs the step loop over an ``Executor`` (``nvray/step_protocol.py``):
requests come in through ``intake.py``, wait and run as ``Sequence``s ordered by the
``Scheduler`` over the ``BlockManager``'s paged, prefix-cached KV blocks, cross to the ranks as
``StepInput``s built by ``step_builder.py``, and come back as tokens that ``output_processor.py``
turns into ``RequestOutput``s (stop rules, text); ``beam_search.py`` runs beam searches on the
same scheduler.
"""
