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
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

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


def nats_permissions(role: str, subjects: Subjects) -> NatsPermissions | None:
    """The permissions of ``role`` under ``subjects``' prefix; None for the operator (all)."""
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
                subjects.worker_heartbeat,
                subjects.provisioner_events,
                subjects.migrations,
                inbox,
            ),
        )
    if role == WORKER:
        return NatsPermissions(
            publish=(
                subjects.chunks_wildcard,
                subjects.worker_heartbeat,
                subjects.migrations,
                f"{p}.worker.*.handoff",  # offers and outcomes to the peer of a migration
                *_stream_admin(subjects),
                inbox,
            ),
            # One user for every worker (ids are chosen at launch): a worker could read another
            # worker's commands, but only the scheduler and the operator may send them.
            subscribe=(
                f"{p}.worker.*.cmd",
                f"{p}.worker.*.handoff",
                subjects.session_input_wildcard,
                subjects.provisioner_events,
                inbox,
            ),
            allow_responses=True,
        )
    if role == PROVISIONER:
        return NatsPermissions(
            publish=(subjects.provisioner_events, *_stream_admin(subjects), inbox),
            subscribe=(subjects.worker_heartbeat, subjects.provisioner_cmd, inbox),
            allow_responses=True,
        )
    if role == OPERATOR:
        return None
    raise SecurityConfigError(f"unknown role {role!r}: one of {', '.join(ROLES)}")


def check_secret(secret: str, what: str) -> None:
    if not _SECRET_RE.fullmatch(secret):
        raise SecurityConfigError(
            f"{what}: 1-256 printable characters without spaces, quotes or backslashes"
        )


def _allow(values: tuple[str, ...], indent: str) -> list[str]:
    """An allow list, one subject a line."""
    return ["{allow: [", *(f'{indent}  "{v}"' for v in values), f"{indent}]}}"]


def nats_authorization(subjects: Subjects, passwords: Mapping[str, str]) -> str:
    """The ``authorization`` block of a nats-server config: one user per role in
    ``passwords`` (role -> password), with the role's permissions."""
    lines = ["authorization {", "  users = ["]
    for role, password in passwords.items():
        check_secret(password, f"the NATS password of {role}")
        perms = nats_permissions(role, subjects)
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
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def nats_server_config(
    subjects: Subjects,
    passwords: Mapping[str, str],
    *,
    host: str,
    port: int,
    store_dir: str,
    retention: ChunkRetention | None = None,
) -> str:
    """A whole nats-server config: listen address, the limits that carry the chunks
    (``max_payload``, JetStream's store and memory), authorization."""
    return (
        f'listen: "{host}:{port}"\n'
        + nats_limits_config(retention or ChunkRetention(), store_dir)
        + nats_authorization(subjects, passwords)
    )


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


@dataclass(frozen=True, slots=True, repr=False)
class Credentials:
    """A password per role for NATS and for Redis (``repr`` shows no secret)."""

    nats: Mapping[str, str]
    redis: Mapping[str, str]

    @classmethod
    def generate(cls) -> Credentials:
        return cls(
            {role: secrets.token_urlsafe(24) for role in ROLES},
            {role: secrets.token_urlsafe(24) for role in ROLES},
        )

    def __repr__(self) -> str:
        return f"Credentials(roles={list(self.nats)})"


def with_user(url: str, user: str, password: str) -> str:
    """``url`` with ``user:password`` as its credentials (any it had are replaced)."""
    if not _USER_RE.fullmatch(user):
        raise SecurityConfigError(f"user {user!r}: 1-64 of [A-Za-z0-9_-]")
    check_secret(password, f"the password of {user}")
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}"))


def url_user(url: str) -> str | None:
    """The user of a ``scheme://user:password@host`` URL; None without one, or for a bare
    ``scheme://token@host`` (a token is a secret, not a name)."""
    parts = urlsplit(url)
    if parts.password is None or not parts.username:
        return None
    return parts.username if _USER_RE.fullmatch(parts.username) else None
