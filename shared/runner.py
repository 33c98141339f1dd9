"""The service runner: connect, supervise, drain.

A service is an object with ``name``, ``async start(ctx)`` (subscribe, spawn its tasks through
``ctx.spawn``) and ``async stop()`` (stop taking work, finish or hand off what is in flight).
:func:`run_service` gives it a NATS connection (with JetStream), a Redis client and the registry,
all connected with retries; supervises its tasks (one that fails takes the service down with a
non-zero exit: a permanent failure must not look like uptime); and on SIGTERM/SIGINT runs the
phased shutdown: ``stop()``, drain NATS, cancel the remaining tasks, close Redis, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import NoPermissionError

from shared.backoff import retried
from shared.logging import configure_logging, get_logger
from shared.registry import Registry
from shared.security import inbox_prefix, url_user
from shared.settings import CommonSettings, mask_url, nats_servers, parse_sentinel_url
from shared.streams import ensure_streams
from shared.supervisor import Supervisor
from shared.tls import TlsFiles, nats_tls_kwargs, redis_tls_kwargs
from shared.video import ChunkRetention
from shared.wire import Subjects

log = get_logger("turboserve.runner")


class Service(Protocol):
    name: str

    async def start(self, ctx: ServiceContext) -> None: ...

    async def stop(self) -> None: ...


class ConnectError(RuntimeError):
    retryable = True


class CredentialsRefused(ConnectError):
    """NATS or Redis answered and refused the credentials (or the user may not even PING):
    waiting does not help, so the service stops at once (exit code 2). The message names the
    user and the masked URL, never the secret."""

    retryable = False


@dataclass
class ServiceContext:
    settings: CommonSettings
    nc: NATS
    js: JetStreamContext
    redis: aioredis.Redis
    registry: Registry
    subjects: Subjects
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    # Run after every reconnection to NATS (a NATS that restarted lost its memory streams and
    # the consumers on them): the streams are declared again first, then these, in order.
    reconnect_hooks: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    _failure: asyncio.Future[BaseException] | None = None
    _tasks: Supervisor = field(init=False)

    def __post_init__(self) -> None:
        self._tasks = Supervisor(on_failure=self._failed)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Start a supervised task: its failure stops the service; it is cancelled at shutdown."""
        return self._tasks.spawn(coro, name)

    def _failed(self, exc: BaseException) -> None:
        if self._failure is not None and not self._failure.done():
            self._failure.set_result(exc)

    async def cancel_tasks(self, grace_s: float) -> None:
        await self._tasks.cancel(wait_s=grace_s)


async def retry(
    what: str, attempt: Callable[[], Awaitable[Any]], timeout_s: float, first_delay: float = 0.2
) -> Any:
    """Call ``attempt`` until it succeeds or the next pause would end past ``timeout_s``
    (exponential backoff up to 5 s); refused credentials end it at once."""
    try:
        return await retried(
            attempt,
            "connect_retry",
            on=lambda exc: isinstance(exc, Exception) and not isinstance(exc, CredentialsRefused),
            first_s=first_delay,
            cap_s=5.0,
            within_s=timeout_s,
            say=log.warning,
            target=what,
        )
    except CredentialsRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - any connect failure is retried until the deadline
        # A timeout's text is empty: say what it was rather than nothing.
        why = str(exc) or type(exc).__name__
        raise ConnectError(f"could not connect to {what} within {timeout_s:.0f}s: {why}") from exc


# How long a connected service's reconnections may all be refused for its credentials before
# it gives up (exit 1, for its supervisor to start it again): its user was removed or, for a
# worker, its credential revoked while it was cut off. Long enough that a refusal while the
# provisioner that answers the auth callout is itself reconnecting passes.
REFUSED_RECONNECT_S = 60.0


async def connect_nats(
    settings: CommonSettings,
    name: str,
    reconnect_hooks: list[Callable[[], Awaitable[None]]] | None = None,
    on_lost: Callable[[Exception], None] | None = None,
) -> NATS:
    """Connected, or :class:`ConnectError`. Once connected, nats-py reconnects by itself;
    ``on_lost`` is told when it will not: every reconnection for REFUSED_RECONNECT_S was
    refused, or the client closed (nats-py closes for good on some server errors)."""
    # A user/password URL connects as that user, whose replies arrive under its own inbox
    # prefix (the only inboxes its NATS permissions let it read: shared/security.py).
    user = url_user(settings.nats_url)
    refused: list[Exception] = []  # before it is connected: the credentials were refused
    seen: list[Exception] = []  # what went wrong during an attempt, for its error's text
    connected = False
    last_error: list[Exception] = []  # once connected: the latest error only
    refused_since: dict[str, float] = {}  # since when every reconnection was refused

    async def _error_cb(exc: Exception) -> None:
        log.warning("nats_error", error=str(exc))
        is_refusal = "authorization violation" in str(exc).lower()
        if not connected:
            seen.append(exc)
            if is_refusal:
                refused.append(exc)
            return
        last_error[:] = [exc]
        if is_refusal and on_lost is not None:
            now = time.monotonic()
            since = refused_since.setdefault("at", now)
            if now - since >= REFUSED_RECONNECT_S and not refused_since.get("told"):
                refused_since["told"] = now
                on_lost(_refused("nats", settings.nats_url, "authorization violation"))

    async def _closed_cb() -> None:
        if connected and on_lost is not None:
            why = str(last_error[0]) if last_error else "closed"
            on_lost(ConnectionError(f"the NATS connection closed ({why})"))

    async def _reconnected_cb() -> None:
        refused_since.clear()
        log.info("nats_reconnected")
        for hook in list(reconnect_hooks or ()):
            try:
                await hook()
            except Exception as exc:  # noqa: BLE001 - one hook's failure must not stop the others
                log.warning(
                    "reconnect_hook_failed", hook=getattr(hook, "__name__", "?"), error=repr(exc)
                )

    async def _attempt() -> NATS:
        # With reconnects allowed, nats-py retries a *first* connect forever; bound each attempt
        # so that retry() owns the deadline, and close the half-open client on failure.
        nc = NATS()
        seen.clear()
        try:
            await asyncio.wait_for(
                nc.connect(
                    servers=nats_servers(settings.nats_url),
                    name=name,
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=1,
                    error_cb=_error_cb,
                    reconnected_cb=_reconnected_cb,
                    closed_cb=_closed_cb,
                    inbox_prefix=inbox_prefix(user) if user else "_INBOX",
                    **nats_tls_kwargs(settings.nats_url, settings.tls),
                ),
                # One attempt never outlasts the whole budget (ctl's is 2 s).
                timeout=min(3.0, settings.connect_timeout_s),
            )
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await nc.close()
            if refused:
                raise _refused("nats", settings.nats_url, "authorization violation") from None
            if isinstance(exc, TimeoutError) and seen:
                # nats-py retried inside the attempt until the timeout: the reason is the
                # last error it reported (connection refused, name not known, ...).
                raise ConnectionError(f"{mask_url(settings.nats_url)}: {seen[-1]}") from None
            raise
        return nc

    nc: NATS = await retry("nats", _attempt, settings.connect_timeout_s)
    connected = True
    return nc


def _refused(server: str, url: str, detail: str) -> CredentialsRefused:
    user = url_user(url)
    if user:
        who = f"the credentials of user {user!r}"
    elif "@" in url.partition("://")[2].partition("/")[0]:
        who = "the credentials in the URL"
    else:
        who = "a client without credentials"
    return CredentialsRefused(
        f"{server} at {mask_url(url)} refused {who} ({detail}): check "
        f"TURBOSERVE_{server.upper()}_URL"
    )


async def subscriptions_live(nc: NATS, timeout_s: float = 10.0) -> None:
    """Return once the server holds every subscription ``nc`` made before this call, so that a
    message published from any connection afterwards reaches them.

    ``nc.flush()`` does not promise that with nats-py: it writes its PING to the socket at once
    while a SUB may still wait in the client's buffer for the flusher task, so the PONG can come
    back before the server has the SUB (about 1 run in 200 lost its first message on a loaded
    host). A message the connection sends to itself travels behind its SUBs: its echo does."""
    inbox = nc.new_inbox()
    echo = await nc.subscribe(inbox, max_msgs=1)
    await nc.publish(inbox, b"")
    await echo.next_msg(timeout=timeout_s)


# Connections one service opens to Redis at most; more callers wait for one (a burst of a
# thousand streams must queue, not fail).
REDIS_MAX_CONNECTIONS = 64
# The longest a Redis reply may take before the connection is counted lost (redis-py's own
# default is 5 s, which a loaded host can exceed); a registry write that waits for replicas
# (``WAIT``) gets its wait on top.
REDIS_READ_TIMEOUT_S = 10.0


class _SentinelBlockingPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's pool (connections go to whichever Redis the sentinels name the master) that
    waits for a free connection as the plain one does, instead of failing at its limit."""


def redis_pool(
    url: str, tls: TlsFiles | None, max_connections: int, timeout_s: float, wait_ms: int = 0
) -> aioredis.ConnectionPool:
    """The connection pool of a ``TURBOSERVE_REDIS_URL``: a plain URL's, or, for the Sentinel
    form (shared/settings.py, ``parse_sentinel_url``), one that asks the sentinels for the
    master and follows a failover to the replica they promote. ``timeout_s``: how long a
    caller waits for a free connection; ``wait_ms``: the registry's ``WAIT`` budget."""
    common: dict[str, Any] = {
        "max_connections": max_connections,
        "timeout": timeout_s,
        "socket_timeout": REDIS_READ_TIMEOUT_S + wait_ms / 1000.0,
        "socket_connect_timeout": 2,
        "health_check_interval": 10,
    }
    target = parse_sentinel_url(url)
    if target is None:
        pool: aioredis.ConnectionPool = aioredis.BlockingConnectionPool.from_url(
            url, **common, **redis_tls_kwargs(url, tls)
        )
        return pool
    ssl = redis_tls_kwargs("rediss://", tls) if target.tls else {}
    if target.tls:
        ssl["ssl"] = True
    sentinel = Sentinel(
        list(target.sentinels),
        sentinel_kwargs={"socket_connect_timeout": 2, "socket_timeout": 2, **ssl},
    )
    return _SentinelBlockingPool(  # type: ignore[no-untyped-call]  # redis-py's is untyped
        target.master,
        sentinel,
        db=target.db,
        username=target.username,
        password=target.password,
        **common,
        **ssl,
    )


def redis_client(url: str, tls: TlsFiles | None, max_connections: int = 4) -> aioredis.Redis:
    """A client of any ``TURBOSERVE_REDIS_URL`` form (plain, TLS, Sentinel) for a tool: it
    owns its pool (``aclose()`` closes it) and connects at its first command."""
    return aioredis.Redis.from_pool(redis_pool(url, tls, max_connections, 10.0))


async def connect_redis(settings: CommonSettings) -> aioredis.Redis:
    pool = redis_pool(
        settings.redis_url, settings.tls, REDIS_MAX_CONNECTIONS, 10.0, settings.redis_wait_ms
    )
    client = aioredis.Redis.from_pool(pool)  # it owns the pool: aclose() closes it

    async def _attempt() -> aioredis.Redis:
        try:
            await client.ping()
        except (RedisAuthenticationError, NoPermissionError) as exc:
            raise _refused("redis", settings.redis_url, str(exc)) from None
        return client

    try:
        connected: aioredis.Redis = await retry("redis", _attempt, settings.connect_timeout_s)
        return connected
    except ConnectError:
        await client.aclose()
        raise


async def open_context(settings: CommonSettings, name: str) -> ServiceContext:
    hooks: list[Callable[[], Awaitable[None]]] = []
    contexts: list[ServiceContext] = []

    def lost(exc: Exception) -> None:
        """NATS will not come back by itself: the service fails (exit 1), unless stopping."""
        for ctx in contexts:
            if not ctx.stopping.is_set():
                log.error("nats_connection_lost", error=str(exc))
                ctx._failed(exc)

    nc = await connect_nats(settings, name, hooks, lost)
    try:
        client = await connect_redis(settings)
    except BaseException:
        await nc.close()
        raise
    ctx = ServiceContext(
        settings=settings,
        nc=nc,
        js=nc.jetstream(),
        redis=client,
        registry=Registry(
            client, settings.redis_namespace, settings.redis_wait_replicas, settings.redis_wait_ms
        ),
        subjects=settings.subjects,
        reconnect_hooks=hooks,
    )
    contexts.append(ctx)

    async def declare_streams() -> None:
        await ensure_streams(
            ctx.js, ctx.subjects, ChunkRetention.of(ctx.settings), ctx.settings.stream_replicas
        )

    hooks.append(declare_streams)
    return ctx


async def close_context(ctx: ServiceContext) -> None:
    ctx.stopping.set()  # the connection closes because we close it: not a loss
    with contextlib.suppress(Exception):
        if not ctx.nc.is_closed:
            await ctx.nc.drain()
    await ctx.cancel_tasks(grace_s=ctx.settings.shutdown_grace_s)
    with contextlib.suppress(Exception):
        await ctx.nc.close()
    with contextlib.suppress(Exception):
        await ctx.redis.aclose()


@contextlib.asynccontextmanager
async def running(service: Service, settings: CommonSettings) -> AsyncIterator[ServiceContext]:
    """Connect, start ``service``, and on exit run the phased shutdown (idempotent).

    Phase 1: ``service.stop()`` (stop taking work, finish or hand off what is in flight), bounded
    by the grace period. Phase 2: drain NATS (flush what we publish), cancel the remaining tasks,
    close Redis. ``serve`` uses it for the real processes; tests use it to run a service in-process.
    """
    ctx = await open_context(settings, f"turboserve-{service.name}")
    ctx._failure = asyncio.get_running_loop().create_future()
    try:
        await service.start(ctx)
        yield ctx
    finally:
        ctx.stopping.set()
        try:
            await asyncio.wait_for(service.stop(), timeout=settings.shutdown_grace_s)
        except (TimeoutError, Exception) as exc:  # noqa: BLE001 - shutdown goes on regardless
            log.warning("service_stop_incomplete", error=repr(exc))
        await close_context(ctx)


async def serve(service: Service, settings: CommonSettings) -> int:
    """Run ``service`` until a signal or a task failure; returns the exit code.

    A signal during start-up (still connecting, say) cancels the start-up and exits 0.
    """
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    main = asyncio.current_task()
    started = False

    def _on_signal() -> None:
        if started:
            stop_requested.set()
        elif main is not None:
            main.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, _on_signal)
    code = 0
    try:
        async with running(service, settings) as ctx:
            started = True
            log.info("service_started", settings=settings.public_dict())
            assert ctx._failure is not None
            stop_wait: asyncio.Future[Any] = asyncio.ensure_future(stop_requested.wait())
            failure: asyncio.Future[Any] = ctx._failure
            done, _ = await asyncio.wait({stop_wait, failure}, return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
            code = 1 if ctx._failure in done else 0
            log.info("service_stopping", reason="task_failed" if code else "signal")
    except asyncio.CancelledError:
        if started:
            raise
        log.info("startup_interrupted")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
    log.info("service_stopped", code=code)
    return code


def run_service(make_service: Callable[[], Service], settings: CommonSettings, name: str) -> int:
    """Entry point for ``turboserve <service>``: logging, then the loop, then the exit code."""
    configure_logging(settings.log_level, settings.log_format, service=name)
    try:
        return asyncio.run(serve(make_service(), settings))
    except ConnectError as exc:
        get_logger().error("startup_failed", error=str(exc))
        return 2
    except KeyboardInterrupt:
        return 0
