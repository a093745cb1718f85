"""The ingress: what every request meets before and after its API.

``server`` (NvrayServer: the FastAPI app's routes, the engine handles), ``http_app`` (the one
FastAPI ``api``), ``auth`` (API keys), ``body_limit`` and ``client_left`` (ASGI middlewares),
``errors`` (OpenAI's and Anthropic's error shapes), ``lora_names`` (adapters by name),
``metrics`` (``/metrics``), ``console`` (Serve's console notices).
"""
