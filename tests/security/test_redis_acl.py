"""Redis ACL users against a real redis-server started with the generated users."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError

from shared.registry import Registry
from shared.runner import CredentialsRefused, connect_redis
from shared.security import OPERATOR, SERVICE_ROLES, with_user
from shared.settings import CommonSettings
from tests.security.conftest import PREFIX

pytestmark = pytest.mark.integration


def url_of(mesh, role: str) -> str:
    return mesh.redis_url if role == OPERATOR else mesh.service_env(role)["TURBOSERVE_REDIS_URL"]


@pytest.mark.parametrize("role", SERVICE_ROLES)
async def test_a_service_user_works_in_its_namespace_only(secure_infra, role):
    client = aioredis.from_url(url_of(secure_infra, role))
    try:
        # the registry's Lua compare-and-set runs as this user
        registry = Registry(client, PREFIX)
        sid = f"acl-{role}"
        record = await registry.create_session(sid, "a prompt", 3)
        claimed = await registry.claim(sid, "w1", record.epoch)
        assert claimed.owner == "w1" and claimed.epoch == record.epoch + 1
        with pytest.raises(NoPermissionError):
            await client.set("elsewhere:key", "x")
        with pytest.raises(NoPermissionError):
            await client.get("ts:session:someone-elses")
        for dangerous in (
            ("FLUSHALL",),
            ("CONFIG", "GET", "requirepass"),
            ("KEYS", "*"),
            ("ACL", "LIST"),
            ("DEBUG", "SLEEP", "0"),
            ("SHUTDOWN",),
        ):
            with pytest.raises(NoPermissionError):
                await client.execute_command(*dangerous)
        assert await client.exists(registry.session_key(sid)) == 1  # still there
    finally:
        await client.delete(
            f"{PREFIX}:session:acl-{role}", f"{PREFIX}:pending", f"{PREFIX}:placement"
        )
        await client.aclose()


async def test_the_operator_may_do_everything(secure_infra):
    client = aioredis.from_url(secure_infra.redis_url)
    try:
        await client.set("elsewhere:key", "x")
        assert await client.execute_command("ACL", "WHOAMI") == b"operator"
        users = await client.execute_command("ACL", "USERS")
        assert sorted(u.decode() for u in users) == sorted(["default", *SERVICE_ROLES, OPERATOR])
        await client.delete("elsewhere:key")
    finally:
        await client.aclose()


@pytest.mark.parametrize("case", ["wrong password", "unknown user", "default user"])
async def test_redis_refuses_the_wrong_user(secure_infra, case):
    base = secure_infra.secured["redis"]
    url = {
        "wrong password": with_user(base, "gateway", "not-the-password-0123"),
        "unknown user": with_user(base, "mallory", "not-the-password-0123"),
        "default user": base,
    }[case]
    client = aioredis.from_url(url)
    try:
        with pytest.raises(AuthenticationError):
            await client.ping()
    finally:
        await client.aclose()
    # a service's connect gives up at once, naming the user but never the password
    started = time.monotonic()
    with pytest.raises(CredentialsRefused) as refused:
        await connect_redis(CommonSettings(redis_url=url, connect_timeout_s=30.0))
    assert time.monotonic() - started < 10
    assert "TURBOSERVE_REDIS_URL" in str(refused.value)
    assert "not-the-password" not in str(refused.value)
