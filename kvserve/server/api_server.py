"""The OpenAI-compatible HTTP server: FastAPI app, routes, and running it under uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from typing import Annotated, Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.client import EngineClient, EngineDeadError, KVEventsInfo
from kvserve.engine_args import engine_config
from kvserve.kv_events.publisher import connectable
from kvserve.logger import logger
from kvserve.server.async_utils import with_cancellation
from kvserve.server.auth import ApiKeys, server_cache_secret
from kvserve.server.dashboard import add_dashboard_routes
from kvserve.server.dashboard_history import DashboardHistory
from kvserve.server.dashboard_state import replica_state
from kvserve.server.errors import APIError, add_exception_handlers
from kvserve.server.fields import UnknownFields
from kvserve.server.kv_transfer import handoff_params
from kvserve.server.kv_transfer import router as kv_transfer_router
from kvserve.server.metrics import CONTENT_TYPE, ServerMetrics
from kvserve.server.middleware import BodySizeLimit
from kvserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    KVEventsInfoResponse,
    LoadResponse,
    ModelCard,
    ModelList,
    RequestModel,
    ServerInfoResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from kvserve.server.serving_chat import OpenAIServingChat
from kvserve.server.serving_completion import OpenAIServingCompletion
from kvserve.server.serving_tokenization import OpenAIServingTokenization
from kvserve.server.stats_logger import StatsLogger

router = APIRouter()
_bearer = HTTPBearer(auto_error=False)
_ERRORS: dict[int | str, dict[str, Any]] = {c: {"model": ErrorResponse} for c in (400, 401, 404, 413, 429, 500)}
_STREAMABLE = {**_ERRORS, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or events if stream"}}


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_keys: ApiKeys
    cache_secret: bytes
    max_request_body_size: int
    stats_log_interval: float
    host: str = "127.0.0.1"
    strict_fields: bool = False
    kv_load_failure_policy: str = "recompute"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSettings:
        if args.api_keys:
            keys = ApiKeys.from_file(args.api_keys)
        else:
            keys = ApiKeys.from_key(args.api_key) if args.api_key else ApiKeys({})
        secret = server_cache_secret(args.cache_secret, engine_config(args))
        return cls(
            args.served_model_name or args.model,
            keys,
            secret,
            args.max_request_body_size,
            args.stats_log_interval,
            args.host,
            args.strict_fields,
            args.kv_load_failure_policy,
        )


def authenticate(
    raw_request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    """The caller's tenant, from `Authorization: Bearer <key>`; 401 without a valid key."""
    tenant = raw_request.app.state.api_keys.tenant(credentials.credentials if credentials else None)
    if tenant is None:
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.", code="invalid_api_key")
    return tenant


Tenant = Annotated[str, Depends(authenticate)]


def check_fields(request: RequestModel, raw_request: Request) -> None:
    raw_request.app.state.unknown_fields.check(request)


@router.post("/v1/completions", response_model=CompletionResponse, responses=_STREAMABLE)
@with_cancellation
async def create_completion(request: CompletionRequest, raw_request: Request, tenant: Tenant) -> Any:
    check_fields(request, raw_request)
    response = await raw_request.app.state.openai_serving_completion.create_completion(request, tenant)
    return _with_handoff_address(response, raw_request)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_STREAMABLE)
@with_cancellation
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request, tenant: Tenant) -> Any:
    check_fields(request, raw_request)
    response = await raw_request.app.state.openai_serving_chat.create_chat_completion(request, tenant)
    return _with_handoff_address(response, raw_request)


def _with_handoff_address(response: Any, raw_request: Request) -> Any:
    """A prefill replica's answer names this engine and the address the caller reached it by."""
    params = getattr(response, "kv_transfer_params", None)
    if params is not None:
        host, port = raw_request.scope["server"]
        engine: EngineClient = raw_request.app.state.engine
        response.kv_transfer_params = handoff_params(params, engine.replica_info.engine_id, host, port)
    return response


@router.get("/v1/models", response_model=ModelList, responses=_ERRORS)
async def show_available_models(raw_request: Request, tenant: Tenant) -> ModelList:
    serving = raw_request.app.state.openai_serving_chat
    card = ModelCard(
        id=serving.served_model_name, root=serving.engine.model_info.model, max_model_len=serving.max_model_len
    )
    return ModelList(data=[card])


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
async def tokenize(
    request: TokenizeCompletionRequest | TokenizeChatRequest, raw_request: Request, tenant: Tenant
) -> TokenizeResponse:
    check_fields(request, raw_request)
    return await raw_request.app.state.openai_serving_tokenization.create_tokenize(request)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
async def detokenize(request: DetokenizeRequest, raw_request: Request, tenant: Tenant) -> DetokenizeResponse:
    check_fields(request, raw_request)
    return await raw_request.app.state.openai_serving_tokenization.create_detokenize(request)


@router.get("/health", response_model=HealthResponse, responses={503: {"model": ErrorResponse}})
async def health(raw_request: Request) -> Any:
    try:
        raw_request.app.state.engine.check_health()
    except EngineDeadError as e:
        raise APIError(503, str(e), type="server_error") from e
    return HealthResponse(status="ok")


@router.get("/load", response_model=LoadResponse)
async def load(raw_request: Request) -> LoadResponse:
    """For routers, without a key (like /health), as SGLang's /get_load and vLLM's /load: read every
    second, where rendering /metrics here and parsing its ~12 kB there (~1.3 ms) bought three numbers."""
    now = raw_request.app.state.engine.load()
    return LoadResponse(
        num_requests_running=now.num_running,
        num_requests_waiting=now.num_waiting,
        kv_cache_usage_perc=now.kv_cache_usage,
    )


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
async def metrics(raw_request: Request) -> Response:
    return Response(raw_request.app.state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/version", response_model=VersionResponse)
async def show_version() -> VersionResponse:
    return VersionResponse(version=version("kvserve"))


@router.get("/server_info", response_model=ServerInfoResponse)
async def server_info(raw_request: Request) -> ServerInfoResponse:
    """For routers and tools, without a key (like /health): how this replica keys and announces its cache."""
    state = raw_request.app.state
    engine: EngineClient = state.engine
    info, model = engine.replica_info, engine.model_info
    return ServerInfoResponse(
        kvserve_version=version("kvserve"),
        model=model.model,
        served_model_name=state.served_model_name,
        tokenizer_dir=info.tokenizer_dir,
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        kv_capacity_tokens=info.kv_capacity_tokens,
        kv_cache_dtype=info.kv_cache_dtype,
        kv_bytes_per_token=info.kv_bytes_per_token,
        max_model_len=model.max_model_len,
        kv_events=_kv_events_info(info.kv_events, state.host),
        kv_tiers=list(info.kv_tiers),
        api_keys_required=not state.api_keys.open,
        role=info.role,
        kv_transfer_endpoint=_transfer_endpoint(info.role, raw_request),
    )


def _transfer_endpoint(role: str, raw_request: Request) -> str | None:
    if role == "decode":
        return None
    host, port = raw_request.scope["server"]
    return f"http://{host}:{port}/kv_transfer/pull"


def _kv_events_info(events: KVEventsInfo | None, host: str) -> KVEventsInfoResponse | None:
    """Addresses a client can dial: a wildcard host becomes the server's --host, or 127.0.0.1
    where that is a wildcard too (a router elsewhere puts in the host it reaches us by)."""
    if events is None:
        return None
    dial = "127.0.0.1" if host in ("", "0.0.0.0", "::", "*") else host
    replay = connectable(events.replay_endpoint, dial) if events.replay_endpoint else None
    return KVEventsInfoResponse(
        endpoint=connectable(events.endpoint, dial),
        replay_endpoint=replay,
        topic=events.topic,
        token_ids=events.token_ids,
    )


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine: EngineClient = app.state.engine
    engine.start()
    stats_logger = asyncio.create_task(StatsLogger(engine, app.state.stats_log_interval).run())
    history = asyncio.create_task(app.state.dashboard_history.run())
    try:
        yield
    finally:
        stats_logger.cancel()
        history.cancel()
        await engine.stop()


def build_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="kvserve", version=version("kvserve"), lifespan=lifespan)
    app.include_router(router)
    app.include_router(kv_transfer_router)
    add_exception_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_body_size)
    metrics = ServerMetrics(engine)
    engine.on_step.append(metrics.latency)
    state = app.state
    state.engine, state.api_keys, state.metrics = engine, settings.api_keys, metrics
    state.stats_log_interval, state.cache_secret = settings.stats_log_interval, settings.cache_secret
    state.served_model_name, state.host = settings.served_model_name, settings.host
    state.unknown_fields = UnknownFields(settings.strict_fields)
    serving = (engine, settings.served_model_name, metrics, settings.cache_secret, settings.kv_load_failure_policy)
    state.openai_serving_completion = OpenAIServingCompletion(*serving)
    state.openai_serving_chat = OpenAIServingChat(*serving)
    state.openai_serving_tokenization = OpenAIServingTokenization(*serving)
    state.dashboard_history = history = DashboardHistory(engine, metrics)
    add_dashboard_routes(
        app,
        lambda request: request.app.state.api_keys,
        lambda request: replica_state(engine, metrics, history, settings.served_model_name),
    )
    return app


def create_server(args: argparse.Namespace) -> uvicorn.Server:
    """Load the model and build the app; the returned server listens once run."""
    settings = ServerSettings.from_args(args)
    if settings.api_keys.open and not _is_loopback(args.host):
        logger.warning(
            "no --api-key or --api-keys: anyone who can reach %s:%d can use this server", args.host, args.port
        )
    engine = AsyncLLMEngine.from_config(engine_config(args), args.max_queued_requests)
    app = build_app(engine, settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=args.shutdown_timeout)
    return uvicorn.Server(config)


def run_server(args: argparse.Namespace) -> None:
    server = create_server(args)
    # Start-up's objects (torch, the model, the tokenizer: ~370,000) out of the collector's sight, as
    # vLLM does: a full collection over them held the GIL for ~220 ms, a stall of every stream.
    gc.collect()
    gc.freeze()
    with _exit_cleanly_after_signal():
        server.run()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextmanager
def _exit_cleanly_after_signal() -> Iterator[None]:
    """uvicorn drains on SIGTERM/SIGINT, then re-raises the signal to the handler it found.

    That handler is this no-op, so a drained shutdown returns normally and exits with status 0.
    """
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
