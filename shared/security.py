"""Who may do what on NATS and Redis: one user per service, each allowed only its own traffic.

Pure functions of the subject prefix (or Redis namespace) and the passwords. ``turboserve up``
writes them to the files of the servers it starts; ``compose.yaml`` holds the same NATS
authorization and Redis users with its passwords taken from the environment (a test checks
that the two agree).

NATS: every service connects as its role's user (``nats://gateway:<password>@host:4222``) and
may publish and subscribe only what its role does (a worker cannot publish session events, a
gateway cannot command workers), plus its own inboxes ``_INBOX.<user>.>`` (the runner sets the
inbox prefix from the user name, see :func:`inbox_prefix`). The operator user (``turboserve
ctl``, tests, tools) may do everything.

Redis: the default user is off; each role has its own user, limited to the keys of the
deployment's namespace and to the commands that are not ``@dangerous`` (no FLUSHALL, CONFIG,
KEYS, ...). Key-level separation between services does not fit: the registry's Lua
compare-and-set scripts touch the keys of several services at once.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from shared.callout import AUTH_SUBJECT, IssuerKey
from shared.enrol import ENROL_USER
from shared.video import ChunkRetention, nats_limits_config
from shared.wire import Subjects

GATEWAY = "gateway"
SCHEDULER = "scheduler"
WORKER = "worker"
PROVISIONER = "provisioner"
OPERATOR = "operator"
SERVICE_ROLES = (GATEWAY, SCHEDULER, WORKER, PROVISIONER)
ROLES = (*SERVICE_ROLES, OPERATOR)

# The scheduler's durable consumer on the sessions stream (shared/streams.py).
_SCHEDULER_DURABLE = "scheduler"
_USER_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A secret goes into a quoted NATS config string and a Redis ACL rule: no quote, backslash,
# whitespace or control character.
_SECRET_RE = re.compile(r"[!#-\[\]-~]{1,256}")


class SecurityConfigError(ValueError):
    """A role, user or password that cannot go into a server's configuration."""

    retryable = False


@dataclass(frozen=True, slots=True)
class NatsPermissions:
    """What one NATS user may publish and subscribe to (allow lists; everything else is
    refused). ``allow_responses``: it may answer the requests it receives."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


def inbox_prefix(user: str) -> str:
    """The inbox prefix of a NATS user: its request replies and JetStream deliveries arrive
    under ``<prefix>.>``, where no other user may subscribe."""
    return f"_INBOX.{user}"


def _stream_admin(subjects: Subjects) -> tuple[str, ...]:
    """Create or bring up to date the two streams: every service declares them when it connects
    and again after each reconnection (a NATS that restarted lost its memory streams)."""
    return tuple(
        f"$JS.API.STREAM.{op}.{stream}"
        for stream in (subjects.sessions_stream, subjects.chunks_stream)
        for op in ("CREATE", "UPDATE")
    )


def worker_permissions(
    subjects: Subjects, worker_id: str, inbox: str | None = None
) -> NatsPermissions:
    """What the worker ``worker_id`` may do: publish chunks, and heartbeats, migration reports
    and handoff messages on subjects that name it; read its own commands and handoff messages,
    the input frames and the pool's events; answer the requests it gets."""
    p = subjects.prefix
    inbox = inbox or f"{inbox_prefix(worker_id)}.>"
    return NatsPermissions(
        publish=(
            subjects.chunks_wildcard,
            subjects.worker_heartbeat(worker_id),
            subjects.migrations(worker_id),
            f"{p}.worker.*.handoff.{worker_id}",  # offers and outcomes to a migration's peer
            *_stream_admin(subjects),
            inbox,
        ),
        subscribe=(
            subjects.worker_cmd(worker_id),
            subjects.worker_handoffs_to(worker_id),
            subjects.session_input_wildcard,
            subjects.provisioner_events,
            inbox,
        ),
        allow_responses=True,
    )


def nats_permissions(
    role: str, subjects: Subjects, callout: bool = False
) -> NatsPermissions | None:
    """The permissions of ``role`` under ``subjects``' prefix; None for the operator (all).
    ``callout``: the server hands workers' connections to the provisioner."""
    p = subjects.prefix
    inbox = f"{inbox_prefix(role)}.>"
    chunks, sessions = subjects.chunks_stream, subjects.sessions_stream
    if role == GATEWAY:
        return NatsPermissions(
            publish=(
                subjects.session_events,  # through JetStream: its ack comes to the inbox
                subjects.chunks_wildcard,  # the StreamEnd of a session it closes
                subjects.session_input_wildcard,  # a video-to-video session's input frames
                *_stream_admin(subjects),
                # an ephemeral push consumer per watched session, deleted when nobody watches
                f"$JS.API.CONSUMER.CREATE.{chunks}",
                f"$JS.API.CONSUMER.DELETE.{chunks}.*",
                inbox,
            ),
            subscribe=(subjects.chunks_wildcard, inbox),
        )
    if role == SCHEDULER:
        durable = f"{sessions}.{_SCHEDULER_DURABLE}"
        return NatsPermissions(
            publish=(
                f"{p}.worker.*.cmd",
                subjects.provisioner_cmd,
                *_stream_admin(subjects),
                # its durable pull consumer: looked up, created (with or without a subject
                # filter token), fetched from, acknowledged
                f"$JS.API.CONSUMER.INFO.{durable}",
                f"$JS.API.CONSUMER.CREATE.{durable}",
                f"$JS.API.CONSUMER.CREATE.{durable}.>",
                f"$JS.API.CONSUMER.MSG.NEXT.{durable}",
                f"$JS.ACK.{durable}.>",
                inbox,
            ),
            subscribe=(
                subjects.worker_heartbeats,
                subjects.provisioner_events,
                subjects.all_migrations,
                inbox,
            ),
        )
    if role == WORKER:
        # The one user of every worker, where workers are not given one each (a NATS secured
        # without the auth callout: ``turboserve up`` never does that): the wildcard of each
        # worker subject, so any worker could read another's commands or speak in its name.
        # With the callout each worker is a user of its own instead (:func:`worker_permissions`;
        # compose's fixed pool enrols: shared/enrol.py).
        return worker_permissions(subjects, "*", inbox=inbox)
    if role == PROVISIONER:
        return NatsPermissions(
            publish=(subjects.provisioner_events, *_stream_admin(subjects), inbox),
            subscribe=(
                subjects.worker_heartbeats,
                subjects.provisioner_cmd,
                inbox,
                # It answers the server's auth callout for the workers (services/provisioner/
                # callout.py), and the enrolment of workers it did not start (shared/enrol.py):
                # only where the server hands it the workers' connections.
                *((AUTH_SUBJECT, subjects.provisioner_enrol) if callout else ()),
            ),
            allow_responses=True,
        )
    if role == ENROL_USER:
        # A worker the provisioner did not start, before it has a user of its own: it may ask
        # for one, and read the answer (sealed to its key: every enrol holder reads here).
        return NatsPermissions(publish=(subjects.provisioner_enrol,), subscribe=(inbox,))
    if role == OPERATOR:
        return None
    raise SecurityConfigError(
        f"unknown role {role!r}: one of {', '.join(ROLES)}, or {ENROL_USER} (NATS only)"
    )


def check_secret(secret: str, what: str) -> None:
    if not _SECRET_RE.fullmatch(secret):
        raise SecurityConfigError(
            f"{what}: 1-256 printable characters without spaces, quotes or backslashes"
        )


def _allow(values: tuple[str, ...], indent: str) -> list[str]:
    """An allow list, one subject a line."""
    return ["{allow: [", *(f'{indent}  "{v}"' for v in values), f"{indent}]}}"]


def nats_authorization(
    subjects: Subjects, passwords: Mapping[str, str], callout_issuer: str | None = None
) -> str:
    """The ``authorization`` block of a nats-server config: one user per role in
    ``passwords`` (role -> password), with the role's permissions. With ``callout_issuer``
    (the public nkey of shared/callout.py's issuer), every other user (a worker, by its id)
    goes to the auth callout that the provisioner answers."""
    lines = ["authorization {", "  users = ["]
    callout = callout_issuer is not None
    for role, password in passwords.items():
        check_secret(password, f"the NATS password of {role}")
        perms = nats_permissions(role, subjects, callout=callout)
        entry = f'    {{user: "{role}", password: "{password}"'
        if perms is None:
            lines.append(entry + "}")
            continue
        publish, subscribe = _allow(perms.publish, " " * 6), _allow(perms.subscribe, " " * 6)
        lines += [
            entry + ", permissions: {",
            "      publish: " + publish[0],
            *publish[1:],
            "      subscribe: " + subscribe[0],
            *subscribe[1:],
        ]
        if perms.allow_responses:
            lines.append("      allow_responses: true")
        lines.append("    }}")
    lines.append("  ]")
    if callout_issuer is not None:
        if not re.fullmatch(r"A[A-Z2-7]{55}", callout_issuer):
            raise SecurityConfigError(f"callout issuer {callout_issuer!r}: not an account nkey")
        users = ", ".join(f'"{role}"' for role in passwords)
        lines += [
            "  auth_callout {",
            f'    issuer: "{callout_issuer}"',
            f"    auth_users: [{users}]",
            "  }",
        ]
    lines.append("}")
    return "\n".join(lines) + "\n"


def nats_server_config(
    subjects: Subjects,
    passwords: Mapping[str, str],
    *,
    host: str,
    port: int,
    store_dir: str,
    retention: ChunkRetention | None = None,
    callout_issuer: str | None = None,
) -> str:
    """A whole nats-server config: listen address, the limits that carry the chunks
    (``max_payload``, JetStream's store and memory), authorization."""
    return (
        f'listen: "{host}:{port}"\n'
        + nats_limits_config(retention or ChunkRetention(), store_dir)
        + nats_authorization(subjects, passwords, callout_issuer)
    )


NATS_CLUSTER_NAME = "turboserve"


def nats_cluster_config(
    server_name: str, listen: str, routes: Iterable[str], route_tls: str = ""
) -> str:
    """What makes one nats-server a node of a JetStream cluster: its unique name (JetStream's
    Raft groups need one), where it listens for the other nodes, the other nodes' routes
    (``nats-route://host:port``), and optionally a TLS block for the routes
    (``shared/tls.py``, ``nats_tls_config``, with the server's certificate, which also
    authenticates a client). Streams then take replicas (``TURBOSERVE_STREAM_REPLICAS``)."""
    routes = list(routes)
    if not routes:
        raise SecurityConfigError("a cluster node needs the routes of the others")
    lines = [
        f'server_name: "{server_name}"',
        "cluster {",
        f"  name: {NATS_CLUSTER_NAME}",
        f'  listen: "{listen}"',
        "  routes: [",
        *(f'    "{route}"' for route in routes),
        "  ]",
    ]
    lines += [f"  {line}" for line in route_tls.splitlines()]
    lines.append("}")
    return "\n".join(lines) + "\n"


def redis_users(namespace: str, passwords: Mapping[str, str]) -> list[str]:
    """``user`` directives for redis.conf (Redis >= 6.2): the default user off, each role in
    ``passwords`` on with its password; services get the namespace's keys and every command
    but the ``@dangerous`` ones, the operator everything."""
    lines = ["user default off"]
    for role, password in passwords.items():
        if role not in ROLES:
            raise SecurityConfigError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
        check_secret(password, f"the Redis password of {role}")
        if role == OPERATOR:
            rules = "~* &* +@all"
        else:
            rules = f"~{namespace}:* resetchannels +@all -@dangerous"
        lines.append(f"user {role} on >{password} {rules}")
    return lines


# The Redis users of replication: the replicas (``masteruser``) and the sentinels
# (``sentinel auth-user``) authenticate as these to whichever node is primary.
REPLICA_USER = "replica"
SENTINEL_USER = "sentinel"
SENTINEL_MASTER = "turboserve"  # the name the sentinels monitor the primary under


def redis_replication_users(replica_password: str, sentinel_password: str) -> list[str]:
    """``user`` directives every node of a replicated Redis carries (any of them may be
    promoted): the replicas' user may only replicate, the sentinels' only what Sentinel
    sends (its documented minimum)."""
    check_secret(replica_password, "the Redis password of the replicas")
    check_secret(sentinel_password, "the Redis password of the sentinels")
    return [
        f"user {REPLICA_USER} on >{replica_password} +psync +replconf +ping",
        f"user {SENTINEL_USER} on >{sentinel_password} allchannels +multi +slaveof +ping +exec"
        " +subscribe +config|rewrite +role +publish +info +client|setname +client|kill"
        " +script|kill",
    ]


def redis_replica_config(primary_host: str, primary_port: int, replica_password: str | None) -> str:
    """What makes a Redis start as a replica of the primary (the sentinels re-point it after
    a failover). ``replica_password``: of the nodes' replica user (None: no users)."""
    text = f"replicaof {primary_host} {primary_port}\n"
    if replica_password is not None:
        text += f"masteruser {REPLICA_USER}\nmasterauth {replica_password}\n"
    return text


def redis_sentinel_config(
    listen_host: str,
    port: int,
    primary_host: str,
    primary_port: int,
    sentinel_password: str | None,
    *,
    quorum: int = 2,
    down_after_ms: int = 5000,
    failover_timeout_ms: int = 60000,
    hostnames: bool = False,
) -> str:
    """One sentinel's config (the file must be writable: the sentinel records what it learns
    in it). ``sentinel_password``: of the nodes' sentinel user (None: the nodes have no
    users); ``down_after_ms``: how long the primary may not answer before it is down;
    ``hostnames``: the nodes are named by host name, not address (compose, Kubernetes)."""
    m = SENTINEL_MASTER
    lines = [
        f"port {port}",
        f"bind {listen_host}",
        f"sentinel monitor {m} {primary_host} {primary_port} {quorum}",
        f"sentinel down-after-milliseconds {m} {down_after_ms}",
        f"sentinel failover-timeout {m} {failover_timeout_ms}",
        f"sentinel parallel-syncs {m} 1",
    ]
    if sentinel_password is not None:
        lines += [
            f"sentinel auth-user {m} {SENTINEL_USER}",
            f"sentinel auth-pass {m} {sentinel_password}",
        ]
    if hostnames:
        lines[:0] = ["sentinel resolve-hostnames yes", "sentinel announce-hostnames yes"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True, repr=False)
class Credentials:
    """A password per role for NATS and for Redis, and the key of the NATS auth callout's
    issuer (``repr`` shows no secret). With the callout, NATS has no ``worker`` password:
    each worker gets a credential of its own from the provisioner."""

    nats: Mapping[str, str]
    redis: Mapping[str, str]
    callout: IssuerKey | None = None

    @classmethod
    def generate(cls, callout: bool = True) -> Credentials:
        nats_roles = [r for r in ROLES if r != WORKER] if callout else list(ROLES)
        return cls(
            {role: secrets.token_urlsafe(24) for role in nats_roles},
            {role: secrets.token_urlsafe(24) for role in ROLES},
            IssuerKey.generate() if callout else None,
        )

    def __repr__(self) -> str:
        return f"Credentials(roles={list(self.nats)})"


def with_user(url: str, user: str, password: str) -> str:
    """``url`` with ``user:password`` as its credentials (any it had are replaced); each URL of
    a comma-separated list (a NATS cluster's nodes); a Sentinel URL's one set, before its
    sentinels (``redis+sentinel://user:password@host:port,host:port/master/db``)."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme.endswith("+sentinel"):
        _check_user(user, password)
        hosts = rest.rpartition("@")[2] if "@" in rest.partition("/")[0] else rest
        return f"{scheme}://{user}:{password}@{hosts}"
    if "," in url:
        return ",".join(with_user(part.strip(), user, password) for part in url.split(","))
    _check_user(user, password)
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}"))


def _check_user(user: str, password: str) -> None:
    if not _USER_RE.fullmatch(user):
        raise SecurityConfigError(f"user {user!r}: 1-64 of [A-Za-z0-9_-]")
    check_secret(password, f"the password of {user}")


def url_user(url: str) -> str | None:
    """The user of a ``scheme://user:password@host`` URL (of a list's first); None without
    one, or for a bare ``scheme://token@host`` (a token is a secret, not a name)."""
    parts = urlsplit(url.split(",")[0].strip())
    if parts.password is None or not parts.username:
        return None
    return parts.username if _USER_RE.fullmatch(parts.username) else None


def env_password(role: str) -> str:
    """The environment variable that holds ``role``'s NATS password where the server's config
    reads it from its environment (Kubernetes: the Secret ``turboserve-nats``; compose's .env)."""
    return f"NATS_{role.upper()}_PASSWORD"


# The variable of the callout issuer's public key (``turboserve callout-key`` prints it).
CALLOUT_ISSUER_VAR = "NATS_CALLOUT_ISSUER"


def nats_authorization_from_env(subjects: Subjects, roles: tuple[str, ...]) -> str:
    """:func:`nats_authorization` with the auth callout, for a server that reads each role's
    password and the issuer from its environment (``password: $NATS_GATEWAY_PASSWORD``:
    nats-server looks up a variable its config does not define in its environment), so that
    the config itself holds no secret."""
    marks = {role: f"@{role}@" for role in roles}
    issuer = IssuerKey(bytes(32)).public_nkey  # a placeholder, replaced below
    text = nats_authorization(subjects, marks, issuer)
    for role in roles:
        text = text.replace(f'"@{role}@"', f"${env_password(role)}")
    return text.replace(f'"{issuer}"', f"${CALLOUT_ISSUER_VAR}")
