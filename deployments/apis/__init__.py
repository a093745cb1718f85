"""The APIs the app speaks, one place each, every file named by its API and its role.

- OpenAI chat and completions: ``openai_api`` (the request schema and its translation to engine
  requests), ``openai_format`` (answer bodies and SSE chunks), ``logprobs_format`` (their two
  log-probability shapes), ``tools`` (tool calls in, the model family's calls out);
- Anthropic Messages: ``messages_api`` (requests and routes), ``messages_format`` (answers,
  whole or streamed);
- OpenAI Responses: ``responses_api`` (requests), ``responses_format`` (answers, whole or
  streamed), ``responses_routes`` (its routes), ``response_store`` (the stored responses' actor);
- pooling (embeddings, classify, score, rerank): ``pooling_api`` (requests and answers),
  ``pooling_routes`` (its routes).

A new API is its request module, its format module and its routes here, and one line in the
ingress (``deployments/ingress/server.py``) that mounts them.
"""
