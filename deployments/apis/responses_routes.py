"""The Responses API's routes (OpenAI's ``/v1/responses``), a route group of NvrayServer
(``deployments/ingress/server.py``): requests are translated to chat completions
(``deployments/apis/responses_api.py``), answered in the Responses shape
(``deployments/apis/responses_format.py``) and kept in the app's response store
(``deployments/apis/response_store.py``), which every replica reaches, so ``previous_response_id``
continues a response whichever replica served it.

A mixin: it uses the server's plumbing (``_authorize``, ``_adapter``, ``_name_for``,
``_require``, ``_finals``, ``_streaming_response``, ``_spelling``) and its ``stored``,
``reasoning`` and ``tool_parser``.

No ``from __future__ import annotations`` (FastAPI reads the route annotations)."""

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from deployments.ingress.errors import OpenAIError
from deployments.ingress.http_app import api
from deployments.apis.openai_api import UnsupportedParameter
from deployments.apis.openai_format import ChatFormat
from deployments.apis.responses_api import ResponsesRequest
from deployments.apis.responses_format import ResponsesFormat, input_items_page
from nvray.reasoning import THINK_END


class ResponsesRoutes:
    @api.post("/v1/responses")
    async def responses(self, body: ResponsesRequest, request: Request) -> Any:
        """OpenAI's Responses API over the chat machinery (``deployments/apis/responses_api.py``),
        kept in the app's response store (``deployments/apis/response_store.py``)."""
        self._authorize(request)
        lora = self._adapter(body.model)
        self._require("generate", request)
        conversation = await self._conversation(body.previous_response_id)
        conversation += body.input_messages()
        chat = body.to_chat(conversation)
        try:
            chat.check_supported()
            params = chat.sampling_params(chat.output_limit(),
                                          reasoning=self.reasoning is not None,
                                          tool_format=self.tool_parser.xgrammar_format)
        except UnsupportedParameter as e:
            raise body.chat_error(e) from None
        fmt = ResponsesFormat(ChatFormat(self._name_for(lora), self.reasoning, None,
                                         self.tool_parser if chat.calls_tools else None,
                                         chat.tool_schemas()), body, await self._think_end_id())
        if body.stream:
            return await self._streaming_response(
                [chat.prompt()], params, fmt, chat,
                lambda events: self._kept_at_end(events, body, fmt, conversation), lora=lora)
        response = fmt.full(await self._finals([chat.prompt()], params, body.priority, lora))
        await self._keep(body, fmt, conversation)
        return JSONResponse(response)

    @api.get("/v1/responses/{response_id}")
    async def stored_response(self, response_id: str, request: Request) -> JSONResponse:
        self._authorize(request)
        record = await self.stored.get(response_id)
        if record is None:
            raise OpenAIError(404, f"no stored response with id '{response_id}'", "response_id")
        return JSONResponse(record["response"])

    @api.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(self, response_id: str, request: Request, limit: int = 20,
                                   order: str = "desc", after: str | None = None
                                   ) -> JSONResponse:
        """A stored response's input items (its own ``input``, not the conversation before)."""
        self._authorize(request)
        if not 1 <= limit <= 100 or order not in ("asc", "desc"):
            raise OpenAIError(400, "limit must be in [1, 100] and order 'asc' or 'desc'",
                              "limit" if not 1 <= limit <= 100 else "order")
        record = await self.stored.get(response_id)
        if record is None:
            raise OpenAIError(404, f"no stored response with id '{response_id}'", "response_id")
        return JSONResponse(input_items_page(record["input_items"], limit, order, after))

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request) -> JSONResponse:
        self._authorize(request)
        if not await self.stored.delete(response_id):
            raise OpenAIError(404, f"no stored response with id '{response_id}'", "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def _conversation(self, response_id: str | None) -> list[dict[str, Any]]:
        """The chat messages that ``previous_response_id`` continues (none without one)."""
        if response_id is None:
            return []
        record = await self.stored.get(response_id)
        if record is None:
            raise OpenAIError(400, f"previous_response_id: no stored response with id "
                                   f"'{response_id}'", "previous_response_id")
        return record["messages"]

    async def _keep(self, body: ResponsesRequest, fmt: ResponsesFormat,
                    conversation: list[dict[str, Any]]) -> None:
        if body.store and fmt.final is not None:
            await self.stored.put(fmt.id, {"response": fmt.final,
                                           "messages": conversation + [fmt.assistant_turn()],
                                           "input_items": body.input_items()})

    async def _kept_at_end(self, events: AsyncIterator[str], body: ResponsesRequest,
                           fmt: ResponsesFormat, conversation: list[dict[str, Any]]
                           ) -> AsyncIterator[str]:
        """A response's events; once it is whole, it is stored before its last event goes
        out (a client that continues it at once finds it, through any replica)."""
        kept = False
        async for text in events:
            if fmt.final is not None and not kept:
                kept = True
                await self._keep(body, fmt, conversation)
            yield text

    async def _think_end_id(self) -> int | None:
        """The token ending a think block (None without a reasoning parser, or when the tag is
        not one token)."""
        if self.reasoning is None:
            return None
        ids = await self._spelling(THINK_END)
        return ids[0] if len(ids) == 1 else None
