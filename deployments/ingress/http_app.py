"""The ingress's FastAPI app: the one ``api`` that NvrayServer (``server.py``) and
its route groups (``deployments/apis/responses_routes.py``, ``deployments/apis/pooling_routes.py``)
register their routes on, with the OpenAI error handlers and the request-body and
client-disconnect middlewares every route shares. Serve binds the routes of every class in
NvrayServer's MRO to the replica."""

from fastapi import FastAPI

from deployments.ingress.body_limit import BodySizeLimit
from deployments.ingress.client_left import ClientLeft
from deployments.ingress.errors import install_error_handlers

api = FastAPI(title="nvray", description="OpenAI-compatible API of an nvray engine")
install_error_handlers(api)
api.add_middleware(BodySizeLimit)
api.add_middleware(ClientLeft)  # outermost: Serve's cancellation of a request is its disconnect
