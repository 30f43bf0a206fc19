"""The admin API: FastAPI routes over a :class:`~tutti_control.backend.NodeBackend` (one node) or a
:class:`~tutti_control.cluster.ClusterBackend` (every node in the cluster directory).

Health (``/livez``, ``/readyz``) is open, and is also served apart from the API by
:func:`create_health_app` (``serve.py`` runs it on its own listener); every ``/v1`` route, and the
schema and its pages (``/openapi.json``, ``/docs``, ``/redoc``) unless ``open_docs``, need
``Authorization: Bearer <token>``; ``/metrics`` is open, or needs the scrape token where one is set.
Every error, validation errors included, is one JSON shape
(:class:`~tutti_control.errors.ErrorBody`), and every status a route can answer is in the schema.
The request metrics' labels come from closed sets (the app's route templates, the HTTP methods,
status codes): whatever a client sends adds no series.
"""

import logging
import time
from typing import Annotated, Any, Callable, Protocol

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tutti_control import __version__
from tutti_control.auth import CHALLENGE, TokenFile, token_matches
from tutti_control.errors import ApiError, ErrorBody, error_body
from tutti_control.metrics import TuttiCollector
from tutti_control.models import (
    ConfigResponse, DrainRequest, DrainResponse, EvictResult, Health, HexKey, HexPrefix, KeysRequest,
    NodeId, NodeInfo, NodeList, ObjectList, PinList, PinRequest, PinResult, PinTier, Readiness, StatsResponse,
    UnpinResult,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
# Keys in one query string: 256 keys are ~5.4 KB of URL, well inside what HTTP servers take
# (uvicorn's h11 refuses request heads above 16 KiB).
MAX_QUERY_KEYS = 256
Node = Annotated[NodeId, Path(description="A node id.")]  # the largest valid body (4096 keys) is ~90 KiB


class Backend(Protocol):
    cluster: bool

    def readiness(self) -> Readiness: ...
    def nodes(self) -> NodeList: ...
    def node(self, node_id: str) -> NodeInfo: ...
    def stats(self) -> StatsResponse: ...
    def snapshot(self) -> tuple[NodeList, StatsResponse]: ...
    def config_view(self) -> ConfigResponse: ...
    def objects(self, keys: list[str] | None, prefix: str | None, limit: int) -> ObjectList: ...
    def evict(self, prefix: str | None, node: str | None, everything: bool, keys: list[str] | None = None) -> EvictResult: ...
    def pin(self, keys: list[str], tier: PinTier = "any") -> PinResult: ...
    def unpin(self, keys: list[str]) -> UnpinResult: ...
    def pins(self) -> PinList: ...
    def drain(self, node_id: str, mode: str) -> tuple[str, Any]: ...
    def undrain(self, node_id: str) -> tuple[str, Any]: ...
    def close(self) -> None: ...


Responses = dict[int | str, dict[str, Any]]


def _err(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


# Every route may answer these (body limits, validation, auth, a node daemon that is away).
COMMON: Responses = {400: _err("Bad request (a request the node refuses)"), 413: _err("Body larger than 1 MiB"),
          422: _err("Invalid request: malformed JSON, wrong types, unknown fields or parameters"),
          502: _err("The node daemon sent a bad reply"), 503: _err("The node daemon (or a node) is unavailable")}
AUTHED: Responses = {**COMMON, 401: _err("Missing or wrong bearer token")}
OPEN: Responses = {413: _err("Body larger than 1 MiB")}
NOT_FOUND: Responses = {404: _err("No such node")}
# The values of the request metrics' `method` label; any other method is counted as OTHER, as is a
# request that matched no route (its `route` label).
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"})
OTHER = "other"


class BodyLimit:
    """Refuses request bodies over ``limit`` bytes with 413 before any route sees them (chunked
    bodies included: the body is read up to the limit and replayed)."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.limit
                except ValueError:
                    too_big = False
                if too_big:
                    await self._refuse(scope, receive, send)
                    return
        body, more, messages = 0, True, []
        while more:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            body += len(msg.get("body", b""))
            more = msg.get("more_body", False)
            if body > self.limit:
                await self._refuse(scope, receive, send)
                return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        resp = JSONResponse(error_body(413, f"request body larger than {self.limit} bytes"), status_code=413)
        await resp(scope, receive, send)


def only_params(*allowed: str) -> Callable[[Request], None]:
    """A dependency refusing query parameters a route does not know (a typo in ``DELETE /v1/cache``
    must never widen what it deletes)."""

    def check(request: Request) -> None:
        unknown = sorted(set(request.query_params) - set(allowed))
        if unknown:
            raise ApiError(422, "invalid_request", f"unknown query parameter(s): {', '.join(unknown)}",
                           {"errors": [{"loc": ["query", u], "msg": "unknown parameter", "type": "extra_forbidden"}
                                       for u in unknown]})

    return check


def _clean_errors(errors: list[Any]) -> list[dict[str, Any]]:
    out = []
    for e in errors[:20]:
        out.append({"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))})
    return out


def _error_handlers(app: FastAPI, routes: list[Route]) -> None:
    """Every error in the one shape: API errors, validation errors, Starlette's 404/405, crashes.
    ``routes``: every route of the app, those of included routers too (newer FastAPI keeps an
    included router as one entry of ``app.router.routes``)."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = _clean_errors(list(exc.errors()))
        first = errs[0] if errs else {"loc": [], "msg": "invalid request"}
        where = ".".join(first["loc"])
        return JSONResponse(error_body(422, f"invalid request: {where}: {first['msg']}", {"errors": errs}),
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            # One route per method: Allow lists every method of every route on this path.
            probe = {"type": "http", "path": request.url.path, "method": "", "root_path": ""}
            allowed: set[str] = set()
            for route in routes:
                if route.matches(probe)[0] != Match.NONE:
                    allowed |= set(route.methods or ())
            headers["Allow"] = ", ".join(sorted(allowed))
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=headers or None)

    @app.exception_handler(Exception)
    async def crashed(_: Request, exc: Exception) -> JSONResponse:
        log.exception("admin request failed")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)


def _health_routes(app: FastAPI, backend: Backend) -> None:
    @app.get("/livez", response_model=Health, tags=["health"], responses=OPEN, summary="The process is up")
    def livez() -> Health:
        return Health()

    @app.get("/readyz", response_model=Readiness, tags=["health"],
             responses={**OPEN, 503: {"model": Readiness, "description": "Not ready: the reasons are in the body"}},
             summary="Ready when the node daemon (and, in cluster mode, etcd) answers")
    def readyz() -> JSONResponse:
        r = backend.readiness()
        return JSONResponse(r.model_dump(), status_code=200 if r.ready else 503)


def create_health_app(backend: Backend) -> FastAPI:
    """``GET /livez`` and ``GET /readyz`` alone, for the health listener: probes answered apart from
    the API's connections (serve.py gives it its own socket, thread and limits). No schema, no docs."""
    app = FastAPI(title="Tutti admin health", version=__version__, openapi_url=None, docs_url=None, redoc_url=None)
    _health_routes(app, backend)
    _error_handlers(app, [r for r in app.router.routes if isinstance(r, Route)])
    return app


def create_app(backend: Backend, token: str, *, title: str = "Tutti admin API", open_docs: bool = False,
               metrics_token: TokenFile | None = None) -> FastAPI:
    """The admin app over ``backend``; ``token`` guards the ``/v1`` routes and, unless ``open_docs``,
    the schema and its pages; ``metrics_token``, where given, guards ``/metrics``."""
    app = FastAPI(title=title, version=__version__, description=(
        "Admin plane of Tutti-cluster, the SSD-backed KV-cache store: what each node holds, how full it is, "
        "how well it hits; evict, pin and drain. Keys are 16 hex digits. Every error is "
        "`{\"error\": {\"code\", \"message\", \"details\"}}`."), responses={},
        openapi_url=None, docs_url=None, redoc_url=None)  # served below, behind the token
    app.state.backend = backend
    registry = CollectorRegistry()
    registry.register(TuttiCollector(backend))
    requests = Counter("tutti_admin_requests", "Admin API requests answered", ["route", "method", "status"],
                       registry=registry)
    latency = Histogram("tutti_admin_request_seconds", "Admin API request latency", ["route"], registry=registry,
                        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
    app.state.registry = registry
    bearer = HTTPBearer(auto_error=False, description="The node's admin token (TUTTI_ADMIN_TOKEN).")

    def require_token(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        given = creds.credentials if creds is not None and creds.scheme.lower() == "bearer" else None
        if not token_matches(given, token):
            raise ApiError(401, "unauthorized", "missing or wrong bearer token" if given else "bearer token required",
                           headers={"WWW-Authenticate": CHALLENGE})

    routes: list[Route] = []  # every route of the app, filled once they all exist
    route_names: set[str] = set()  # their path templates

    @app.middleware("http")
    async def count(request: Request, call_next: Any) -> Response:
        t0 = time.perf_counter()
        resp = await call_next(request)
        # Label values from closed sets only: a method or a path of the client's own choosing would
        # add series (and memory) per request.
        name = getattr(request.scope.get("route"), "path", None)
        name = name if name in route_names else OTHER
        method = request.method if request.method in HTTP_METHODS else OTHER
        status = str(resp.status_code) if 100 <= resp.status_code < 600 else OTHER
        requests.labels(name, method, status).inc()
        latency.labels(name).observe(time.perf_counter() - t0)
        return resp

    app.add_middleware(BodyLimit)
    _error_handlers(app, routes)

    # -- open routes ------------------------------------------------------------------------------
    _health_routes(app, backend)

    def require_scrape_token(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        given = creds.credentials if creds is not None and creds.scheme.lower() == "bearer" else None
        if metrics_token is not None and not metrics_token.matches(given):
            raise ApiError(401, "unauthorized", "missing or wrong scrape token" if given else "scrape token required",
                           headers={"WWW-Authenticate": CHALLENGE})

    # The committed schema shows /metrics open; a node with a scrape token serves a schema that
    # says /metrics needs it (and may answer 401).
    scraped: Responses = {**OPEN, 200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                        "description": "Prometheus text exposition"}}
    if metrics_token is not None:
        scraped[401] = _err("Missing or wrong scrape token")

    @app.get("/metrics", tags=["health"], summary="Prometheus metrics", responses=scraped, response_class=Response,
             dependencies=[Depends(require_scrape_token)] if metrics_token is not None else [])
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # -- the schema and its pages: behind the admin token unless open_docs --------------------------
    docs_guard = [] if open_docs else [Depends(require_token)]

    @app.get("/openapi.json", include_in_schema=False, dependencies=docs_guard)
    def openapi_json() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=docs_guard)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{title} - Swagger UI")

    @app.get("/redoc", include_in_schema=False, dependencies=docs_guard)
    def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{title} - ReDoc")

    # -- /v1 --------------------------------------------------------------------------------------
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], responses=AUTHED)

    @v1.get("/nodes", response_model=NodeList, tags=["nodes"], dependencies=[Depends(only_params())])
    def list_nodes() -> NodeList:
        return backend.nodes()

    @v1.get("/nodes/{node_id}", response_model=NodeInfo, tags=["nodes"], responses=NOT_FOUND,
            dependencies=[Depends(only_params())])
    def get_node(node_id: Node) -> NodeInfo:
        return backend.node(node_id)

    @v1.post("/nodes/{node_id}/drain", response_model=DrainResponse, tags=["nodes"], responses=NOT_FOUND,
             dependencies=[Depends(only_params())],
             summary="Stop taking new units; keep serving reads; evict as the mode says")
    def drain(node_id: Node, body: DrainRequest | None = None) -> DrainResponse:
        nid, status = backend.drain(node_id, body.mode if body is not None else "replicated")
        return DrainResponse(node_id=nid, drain=status)

    @v1.delete("/nodes/{node_id}/drain", response_model=DrainResponse, tags=["nodes"], responses=NOT_FOUND,
               dependencies=[Depends(only_params())], summary="End a drain: take new units again")
    def undrain(node_id: Node) -> DrainResponse:
        nid, status = backend.undrain(node_id)
        return DrainResponse(node_id=nid, drain=status)

    @v1.get("/stats", response_model=StatsResponse, tags=["cache"], dependencies=[Depends(only_params())])
    def stats() -> StatsResponse:
        return backend.stats()

    @v1.get("/config", response_model=ConfigResponse, tags=["nodes"], dependencies=[Depends(only_params())],
            summary="Each node's settings, secrets redacted")
    def config() -> ConfigResponse:
        return backend.config_view()

    @v1.get("/objects", response_model=ObjectList, tags=["cache"],
            dependencies=[Depends(only_params("key", "prefix", "limit"))],
            summary="Units by key or key prefix, with the nodes that hold them")
    # Neither parameter is nullable in the schema: a query string has no null, and an empty `prefix`
    # already means every key.
    def objects(key: Annotated[list[HexKey], Query(max_length=MAX_QUERY_KEYS,
                                                   description="Keys to look up (repeat the parameter)")] = [],  # noqa: B006
                prefix: Annotated[HexPrefix, Query(description="Only keys starting with this hex prefix")] = "",
                limit: Annotated[int, Query(ge=1, le=10000)] = 1000) -> ObjectList:
        """With ``key``: those units (also the ones no node holds); with ``prefix``: the units whose key
        starts so; with both, the given keys that match the prefix; with neither, every unit."""
        if key:
            keys = [k for k in (x.lower().rjust(16, "0") for x in key) if k.startswith(prefix.lower())]
            if not keys:
                return ObjectList(objects=[], truncated=False)
            return backend.objects(keys, None, limit)
        return backend.objects(None, prefix.lower(), limit)

    @v1.delete("/cache", response_model=EvictResult, tags=["cache"], responses=NOT_FOUND,
               dependencies=[Depends(only_params("all", "prefix", "node"))],
               summary="Evict units: all of them, by key prefix, or a node's")
    def evict(all: Annotated[bool, Query(description=(
                  "Required, so that an eviction never happens by default: `true` selects every unpinned unit, "
                  "`false` only the units `prefix` and `node` select (none, without them)"))],
              prefix: Annotated[HexPrefix | None, Query(min_length=1, description="Only units whose key starts so")] = None,
              node: Annotated[NodeId | None, Query(description="Only this node's units")] = None) -> EvictResult:
        """Evicts unpinned units: ``all=true`` every one, ``prefix`` those whose key starts so,
        ``node`` those of one node; given together, the units that match all of them. ``all`` is
        required: a request without it is invalid (422), and ``all=false`` alone selects nothing
        and evicts nothing."""
        if not all and prefix is None and node is None:
            return EvictResult(evicted=0, pinned_kept=0, unreachable=0)
        return backend.evict(prefix.lower() if prefix is not None else None, node, all)

    @v1.get("/pins", response_model=PinList, tags=["pins"], dependencies=[Depends(only_params())])
    def list_pins() -> PinList:
        return backend.pins()

    @v1.post("/pins", response_model=PinResult, tags=["pins"], dependencies=[Depends(only_params())],
             summary="Pin units (protect them from eviction; with tier `memory`, keep them in the memory tier)")
    def pin(body: PinRequest) -> PinResult:
        return backend.pin(list(body.keys), body.tier)

    @v1.delete("/pins", response_model=UnpinResult, tags=["pins"], dependencies=[Depends(only_params())],
               summary="Unpin units")
    def unpin(body: KeysRequest) -> UnpinResult:
        return backend.unpin(list(body.keys))

    app.include_router(v1)
    routes.extend(r for r in (*app.router.routes, *v1.routes) if isinstance(r, Route))
    route_names.update(r.path for r in routes)
    return app
