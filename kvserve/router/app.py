"""The router's HTTP front: the replicas' OpenAI API, authenticated at the edge, routed, retried, migrated.

Endpoints: /v1/completions, /v1/chat/completions (streamed or whole), /v1/models,
/tokenize and /detokenize (passed to a replica), /health (200 while a replica is
routable), /metrics (the router's own), /router/replicas (each replica's state, index and
load), /dashboard and /debug/kv_state (one panel per replica, each its replica's own
/debug/kv_state: router/dashboard.py), /version. The caller's key is checked here (the
replicas' --api-keys file) and forwarded as it came, so each replica derives the same
tenant and salt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Annotated, Any

import httpx
import uvicorn
from fastapi import Depends, FastAPI, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve.kv_cache.block_keys import HASHED_IN
from kvserve.logger import logger
from kvserve.router.args import KV_OVERLAP_SCORE_WEIGHT, MAX_LOCAL_PREFILL_TOKENS
from kvserve.router.dashboard import router_state
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policy import make_policy
from kvserve.router.proxy import Proxy
from kvserve.router.replicas import EventsInfo, Replica, ReplicaSet
from kvserve.router.request import Kind, RoutedRequest, Tokenization, block_keys, client_salt
from kvserve.router.tokenizer import RouterTokenizer
from kvserve.server.async_utils import with_cancellation
from kvserve.server.auth import ApiKeys
from kvserve.server.dashboard import add_dashboard_routes
from kvserve.server.errors import APIError, add_exception_handlers, bad_request
from kvserve.server.middleware import BodySizeLimit
from kvserve.server.protocol import HealthResponse, ModelCard, ModelList, VersionResponse

_bearer = HTTPBearer(auto_error=False)
# what the router tokenizes itself and then checks against a replica's /tokenize at discovery
PROBE_TEXTS = (
    "Hello, world!",
    "  leading spaces, trailing ones  ",
    "naïve café, 日本語のテキスト, emoji 🙂👍🏽",
    "<|im_start|>user\nspecial tokens written as text<|im_end|>",
    "line one\nline two\n\n\ttabbed\r\nwindows",
)
PROBE_CHATS = (
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "¿Qué tal? 👋"},
        {"role": "assistant", "content": "Bien."},
        {"role": "user", "content": "Tell me more\nin two lines."},
    ],
)


@dataclass(frozen=True)
class RouterSettings:
    replicas: list[str]
    policy: str
    api_keys: ApiKeys
    probe_key: str | None  # a key from the file, for the tokenizer check against a replica
    cache_secret: bytes | None
    health_interval: float = 0.5
    request_timeout: float = 600.0
    max_request_body_size: int = 4 * 2**20
    tokenizer_dir: str | None = None  # default: the replicas' tokenizer_dir
    prefill_weight: float = KV_OVERLAP_SCORE_WEIGHT
    # each replica's role from the command line (--prefill, --decode), None where it reports its own
    roles: list[str | None] | None = None
    max_local_prefill_tokens: int = MAX_LOCAL_PREFILL_TOKENS

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterSettings:
        if not 0 < args.health_check_interval <= 1:
            raise ValueError(f"--health-check-interval must be in (0, 1] seconds, got {args.health_check_interval}")
        if args.api_keys:
            keys, probe = ApiKeys.from_file(args.api_keys), _first_key(Path(args.api_keys))
        elif args.api_key:
            keys, probe = ApiKeys.from_key(args.api_key), args.api_key
        else:
            keys, probe = ApiKeys({}), None
        secret = args.cache_secret.encode() if args.cache_secret else None
        make_policy(args.policy, args.kv_overlap_score_weight)  # checked before anything starts
        # indexes (logs, metrics, x-kvserve-replica) follow this order: --replica, --prefill, --decode
        urls = [*args.replica, *args.prefill, *args.decode]
        roles: list[str | None] = [None] * len(args.replica)
        roles += ["prefill"] * len(args.prefill) + ["decode"] * len(args.decode)
        if not args.replica and not args.decode:
            raise ValueError("give at least one --replica or --decode: prefill replicas answer no client")
        if args.max_local_prefill_tokens < 0:
            raise ValueError(f"--max-local-prefill-tokens must be >= 0, got {args.max_local_prefill_tokens}")
        return cls(
            urls,
            args.policy,
            keys,
            probe,
            secret,
            args.health_check_interval,
            args.request_timeout,
            args.max_request_body_size,
            args.tokenizer,
            args.kv_overlap_score_weight,
            roles,
            args.max_local_prefill_tokens,
        )


def _first_key(path: Path) -> str | None:
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return line.split()[0]
    return None


def _subscribe(info: EventsInfo, on_batch: Any) -> Any:
    from kvserve.kv_events.subscriber import KVEventSubscriber

    return KVEventSubscriber(info.endpoint, info.replay_endpoint, info.topic, on_batch)


class Router:
    """Everything one router process holds; the routes reach it as `app.state.router`."""

    def __init__(self, settings: RouterSettings):
        self.settings = settings
        self.metrics = RouterMetrics()
        timeout = httpx.Timeout(settings.request_timeout, connect=2.0)
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        if settings.cache_secret is None:
            logger.warning(
                "router: no --cache-secret: replicas' KV events cannot be matched to requests; "
                "routing by what the router sent each replica"
            )
        if HASHED_IN == "Python":
            logger.warning("router: block keys hashed in Python (the C extension is not built): ~4x slower decisions")
        # without the replicas' secret a random one still keys the router's own record consistently
        self.secret = settings.cache_secret or secrets.token_bytes(32)
        subscribe = _subscribe if settings.cache_secret is not None else None
        self.replicas = ReplicaSet(settings.replicas, self.client, subscribe, settings.health_interval, settings.roles)
        self.replicas.listeners.append(self.metrics.replica_state)
        self.replicas.on_discovered.append(self._discovered)
        self.tokenization = Tokenization(remote=self._remote_tokenize, on_fallback=self.metrics.tokenize_fallbacks.inc)
        self._tokenizer_lock = asyncio.Lock()
        policy = make_policy(settings.policy, settings.prefill_weight)
        self.proxy = Proxy(
            self.replicas,
            policy,
            self.metrics,
            self.secret,
            settings.request_timeout,
            max_local_prefill_tokens=settings.max_local_prefill_tokens,
        )

    async def start(self) -> None:
        await self.proxy.start()
        await self.replicas.start()

    async def close(self) -> None:
        await self.replicas.close()
        await self.proxy.close()
        await self.client.aclose()

    async def prepare(self, kind: Kind, body: dict[str, Any], tenant: str, authorization: str | None) -> RoutedRequest:
        """Token ids and block keys, timed apart from the routing decision."""
        started = time.perf_counter()
        prompts = await self.tokenization.prompts(kind, body, authorization)
        info = self.replicas.info()
        keys = block_keys(prompts, info.block_size, self.secret, tenant, client_salt(body)) if info else []
        self.metrics.tokenize_seconds.observe(time.perf_counter() - started)
        return RoutedRequest(kind, body, tenant, authorization, prompts if keys else [], keys)

    async def _remote_tokenize(self, authorization: str | None, payload: dict[str, Any]) -> list[int] | None:
        for r in self.replicas.routable():
            headers = {"authorization": authorization} if authorization else {}
            try:
                response = await self.client.post(f"{r.url}/tokenize", json=payload, headers=headers)
            except httpx.HTTPError:
                continue
            if response.status_code == 200:
                return response.json()["tokens"]
            if response.status_code < 500:
                return None  # the request's own fault
        return None

    async def _discovered(self, replica: Replica) -> None:
        """The first replica found gives the tokenizer, checked against its /tokenize before it is trusted."""
        async with self._tokenizer_lock:  # replicas are discovered together: load and check it once
            if self.tokenization.tokenizer is None and replica.info is not None:
                await self._load_tokenizer(replica)

    async def _load_tokenizer(self, replica: Replica) -> None:
        assert replica.info is not None
        if replica.info.api_keys_required and self.settings.api_keys.open:
            logger.warning("router: %s requires API keys but the router has none: it will refuse requests", replica.url)
        where = self.settings.tokenizer_dir or replica.info.tokenizer_dir
        try:
            tokenizer = await asyncio.to_thread(RouterTokenizer.from_dir, where)
        except Exception as e:  # not readable here, a tokenizer.json too new, a template jinja cannot compile
            logger.warning(
                "router: cannot load the tokenizer in %s (%s): tokenizing on the replicas",
                where,
                e,
            )
            return
        self.tokenization.tokenizer = self.proxy.tokenizer = tokenizer
        self.tokenization.local = await self._tokenizer_matches(replica, tokenizer)

    async def _tokenizer_matches(self, replica: Replica, tokenizer: RouterTokenizer) -> bool:
        headers = {"authorization": f"Bearer {self.settings.probe_key}"} if self.settings.probe_key else {}
        probes: list[tuple[dict[str, Any], Any]] = [
            ({"prompt": t}, lambda t=t: tokenizer.encode(t)) for t in PROBE_TEXTS
        ]
        if tokenizer.chat_template is not None:
            probes += [({"messages": c}, lambda c=c: tokenizer.encode_chat(c)) for c in PROBE_CHATS]
        for payload, local in probes:
            try:
                response = await self.client.post(f"{replica.url}/tokenize", json=payload, headers=headers)
            except httpx.HTTPError:
                response = None
            if response is None or response.status_code != 200:
                logger.warning("router: could not check the tokenizer against %s; trusting it", replica.url)
                return True
            try:
                mine = local()
            except Exception as e:  # the template fails here but not there
                logger.warning("router: local tokenization fails (%s): tokenizing on the replicas", e)
                return False
            if mine != response.json()["tokens"]:
                logger.warning("router: local tokenization differs from %s's: tokenizing on the replicas", replica.url)
                return False
        logger.info("router: tokenizing locally (checked against %s)", replica.url)
        return True


def authenticate(
    raw_request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    """As a replica does: the caller's tenant from `Authorization: Bearer <key>`; 401 without a valid key."""
    tenant = raw_request.app.state.router.settings.api_keys.tenant(credentials.credentials if credentials else None)
    if tenant is None:
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.", code="invalid_api_key")
    return tenant


Tenant = Annotated[str, Depends(authenticate)]


async def _json_body(raw_request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await raw_request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


async def _generate(kind: Kind, raw_request: Request, tenant: str) -> Response:
    router: Router = raw_request.app.state.router
    body = await _json_body(raw_request)
    # the router's to set (P/D): a client's own would point a decode replica at blocks of its choosing
    body.pop("kv_transfer_params", None)
    request = await router.prepare(kind, body, tenant, raw_request.headers.get("authorization"))
    return await router.proxy.forward(request)


def build_app(settings: RouterSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await app.state.router.start()
        try:
            yield
        finally:
            await app.state.router.close()

    app = FastAPI(title="kvserve router", version=version("kvserve"), lifespan=lifespan)
    add_exception_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_body_size)
    app.state.router = Router(settings)
    _add_routes(app)
    add_dashboard_routes(app, lambda request: settings.api_keys, _dashboard_state)
    return app


async def _dashboard_state(raw_request: Request) -> dict[str, Any]:
    router: Router = raw_request.app.state.router
    authorization = raw_request.headers.get("authorization")
    return await router_state(router.replicas.replicas, router.metrics, router.client, authorization)


def _add_routes(app: FastAPI) -> None:
    @app.post("/v1/completions")
    @with_cancellation
    async def completions(raw_request: Request, tenant: Tenant) -> Response:
        return await _generate("completion", raw_request, tenant)

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def chat_completions(raw_request: Request, tenant: Tenant) -> Response:
        return await _generate("chat", raw_request, tenant)

    @app.get("/v1/models", response_model=ModelList)
    async def models(raw_request: Request, tenant: Tenant) -> ModelList:
        info = raw_request.app.state.router.replicas.info()
        if info is None:
            raise APIError(503, "no replica is available", type="server_error", code="no_replica")
        return ModelList(data=[ModelCard(id=info.served_model_name, root=info.model, max_model_len=info.max_model_len)])

    @app.post("/tokenize")
    async def tokenize(raw_request: Request, tenant: Tenant) -> Response:
        return await _pass_on(raw_request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(raw_request: Request, tenant: Tenant) -> Response:
        return await _pass_on(raw_request, "/detokenize")

    @app.get("/health", response_model=HealthResponse)
    async def health(raw_request: Request) -> HealthResponse:
        if not raw_request.app.state.router.replicas.routable():
            raise APIError(503, "no replica is available", type="server_error", code="no_replica")
        return HealthResponse(status="ok")

    @app.get("/metrics")
    async def metrics(raw_request: Request) -> Response:
        return Response(raw_request.app.state.router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/replicas")
    async def replicas(raw_request: Request, tenant: Tenant) -> list[dict[str, Any]]:
        return [r.summary() for r in raw_request.app.state.router.replicas.replicas]

    @app.get("/version", response_model=VersionResponse)
    async def show_version() -> VersionResponse:
        return VersionResponse(version=version("kvserve"))


async def _pass_on(raw_request: Request, path: str) -> Response:
    headers = {k: v for k, v in raw_request.headers.items() if k in ("authorization", "content-type")}
    return await raw_request.app.state.router.proxy.pass_on(path, await raw_request.body(), headers)


def create_router(args: argparse.Namespace) -> uvicorn.Server:
    settings = RouterSettings.from_args(args)
    app = build_app(settings)
    return uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port))


def run_router(args: argparse.Namespace) -> None:
    create_router(args).run()
