"""shared/security.py's pure functions: users, permissions and URLs, without any server."""

from __future__ import annotations

import pytest

from shared.callout import IssuerKey
from shared.security import (
    OPERATOR,
    ROLES,
    SERVICE_ROLES,
    Credentials,
    SecurityConfigError,
    nats_authorization,
    nats_permissions,
    nats_server_config,
    redis_users,
    url_user,
    with_user,
    worker_permissions,
)
from shared.wire import Subjects

SUBJECTS = Subjects("px")


def test_with_user_sets_or_replaces_the_credentials():
    assert with_user("nats://nats:4222", "gateway", "pw-1") == "nats://gateway:pw-1@nats:4222"
    assert (
        with_user("redis://old:secret@redis:6379/0", "worker", "pw-2")
        == "redis://worker:pw-2@redis:6379/0"
    )
    for user, password in (
        ("bad user", "pw"),
        ("gateway", "has space"),
        ("gateway", 'quo"te'),
        ("gateway", "back\\slash"),
        ("gateway", ""),
    ):
        with pytest.raises(SecurityConfigError):
            with_user("nats://h:1", user, password)


def test_url_user_names_a_user_never_a_token():
    assert url_user("nats://gateway:pw@h:4222") == "gateway"
    assert url_user("redis://worker:pw@h:6379/0") == "worker"
    assert url_user("nats://s3cr3t-token@h:4222") is None  # a bare token is a secret
    assert url_user("nats://h:4222") is None
    assert url_user("nats://we.ird:pw@h:4222") is None  # not usable as a subject token


def test_every_role_has_permissions_and_the_operator_all():
    for role in SERVICE_ROLES:
        perms = nats_permissions(role, SUBJECTS)
        assert perms is not None
        # its own inboxes, nobody else's
        assert f"_INBOX.{role}.>" in perms.publish and f"_INBOX.{role}.>" in perms.subscribe
        assert not [
            s
            for s in (*perms.publish, *perms.subscribe)
            if s.startswith("_INBOX.") and s != f"_INBOX.{role}.>"
        ]
        # everything under the deployment's prefix or its streams
        assert all(
            s.startswith(
                (
                    "px.",
                    "$JS.API.STREAM.CREATE.px_",
                    "$JS.API.STREAM.UPDATE.px_",
                    "$JS.API.CONSUMER.",
                    "$JS.ACK.px_",
                    "_INBOX.",
                )
            )
            for s in perms.publish
        ), role
    assert nats_permissions(OPERATOR, SUBJECTS) is None
    with pytest.raises(SecurityConfigError):
        nats_permissions("mallory", SUBJECTS)


def test_nats_config_lists_each_user_once_and_refuses_bad_passwords():
    text = nats_server_config(
        SUBJECTS, {r: f"pw-{r}" for r in ROLES}, host="127.0.0.1", port=4333, store_dir="/tmp/js"
    )
    assert text.startswith('listen: "127.0.0.1:4333"\nmax_payload: 1048576\njetstream {\n')
    assert '  store_dir: "/tmp/js"\n  max_memory_store: ' in text
    for role in ROLES:
        assert text.count(f'{{user: "{role}", password: "pw-{role}"') == 1
    assert text.count("allow_responses: true") == 2  # the worker and the provisioner answer
    with pytest.raises(SecurityConfigError):
        nats_authorization(SUBJECTS, {"gateway": 'pw"}, {user: "x'})


def test_redis_users_switch_the_default_user_off_and_fence_the_namespace():
    lines = redis_users("px", {r: f"pw-{r}" for r in ROLES})
    assert lines[0] == "user default off"
    assert "user gateway on >pw-gateway ~px:* resetchannels +@all -@dangerous" in lines
    assert "user operator on >pw-operator ~* &* +@all" in lines
    with pytest.raises(SecurityConfigError):
        redis_users("px", {"mallory": "pw"})
    with pytest.raises(SecurityConfigError):
        redis_users("px", {"gateway": "two words"})


def test_generated_credentials_are_distinct_url_safe_and_never_shown():
    creds = Credentials.generate()
    assert creds.callout is not None
    secrets = [*creds.nats.values(), *creds.redis.values(), creds.callout.text()]
    # NATS has no worker password: each worker gets its own through the callout
    assert set(creds.nats) == set(ROLES) - {"worker"} and set(creds.redis) == set(ROLES)
    assert set(Credentials.generate(callout=False).nats) == set(ROLES)
    assert len(set(secrets)) == len(secrets)
    for secret in secrets:
        assert len(secret) >= 32
        with_user("nats://h:1", "gateway", secret)  # fits a URL and a config file
        assert secret not in repr(creds) and secret not in str(creds)


def test_the_callout_config_admits_the_services_by_password_and_sends_the_rest_to_it():
    key = IssuerKey.generate()
    text = nats_authorization(
        Subjects("px"), {"gateway": "pw-g", "provisioner": "pw-p"}, key.public_nkey
    )
    assert f'issuer: "{key.public_nkey}"' in text
    assert 'auth_users: ["gateway", "provisioner"]' in text
    # the provisioner may read the callout's requests only where there is a callout
    assert '"$SYS.REQ.USER.AUTH"' in text
    assert '"$SYS.REQ.USER.AUTH"' not in nats_authorization(Subjects("px"), {"provisioner": "p"})
    with pytest.raises(SecurityConfigError):
        nats_authorization(Subjects("px"), {"gateway": "pw"}, "not-an-nkey")


def test_a_workers_permissions_name_its_id_only():
    perms = worker_permissions(Subjects("px"), "w1")
    assert set(perms.subscribe) == {
        "px.worker.w1.cmd",
        "px.worker.w1.handoff.*",
        "px.session.*.input",
        "px.provisioner.events",
        "_INBOX.w1.>",
    }
    own = {"px.worker.w1.heartbeat", "px.worker.w1.migrations", "px.worker.*.handoff.w1"}
    assert own <= set(perms.publish)
    assert not [p for p in perms.publish if p.startswith("px.worker.") and p not in own]
