"""Ray runtime: one engine = a placement group holding an EngineDriver actor (tokenizer,
scheduler, block manager, step loop) and one RankWorker actor per tensor-parallel rank.

``start_engine(config)`` places and starts an engine and returns an ``EngineClient``; the
driver's methods are the one API that the offline LLM, Serve and batch jobs use.
"""

from nvray.runtime.client import EngineClient, start_engine
from nvray.runtime.errors import EngineDeadError

__all__ = ["EngineClient", "EngineDeadError", "start_engine"]
