import pytest

from shared.settings import (
    CommonSettings,
    GatewaySettings,
    ProvisionerSettings,
    SettingsError,
    WorkerSettings,
    mask_url,
)


def test_defaults_are_valid():
    for cls in (CommonSettings, GatewaySettings, WorkerSettings, ProvisionerSettings):
        cls.from_env({})


def test_reads_prefixed_variables_with_types():
    s = GatewaySettings.from_env(
        {
            "TURBOSERVE_PORT": "9001",
            "TURBOSERVE_SSE_KEEPALIVE_S": "2.5",
            "TURBOSERVE_SUBJECT_PREFIX": "prod",
            "PORT": "1",
        }
    )
    assert s.port == 9001 and s.sse_keepalive_s == 2.5 and s.subject_prefix == "prod"
    assert s.subjects.session_events == "prod.session.events"


def test_optional_and_bool_parsing():
    s = WorkerSettings.from_env({"TURBOSERVE_CHECKPOINT": "/models/x.safetensors"})
    assert s.checkpoint == "/models/x.safetensors"
    assert WorkerSettings.from_env({"TURBOSERVE_CHECKPOINT": "none"}).checkpoint is None


def test_all_faults_reported_together():
    with pytest.raises(SettingsError) as info:
        GatewaySettings.from_env(
            {
                "TURBOSERVE_PORT": "http",
                "TURBOSERVE_LOG_LEVEL": "loud",
                "TURBOSERVE_NATS_URL": "http://x",
            }
        )
    text = str(info.value)
    assert "TURBOSERVE_PORT" in text
    # The port fault is a parse fault; validation faults appear once parsing succeeds.
    with pytest.raises(SettingsError) as info2:
        GatewaySettings.from_env(
            {
                "TURBOSERVE_PORT": "70000",
                "TURBOSERVE_LOG_LEVEL": "loud",
                "TURBOSERVE_NATS_URL": "http://x",
            }
        )
    assert len(info2.value.faults) == 3
    assert "TURBOSERVE_LOG_LEVEL" in str(info2.value) and "TURBOSERVE_NATS_URL" in str(info2.value)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("TURBOSERVE_WORKER_ID", "bad id"),
        ("TURBOSERVE_MAX_SESSIONS", "0"),
        ("TURBOSERVE_HEARTBEAT_S", "-1"),
        ("TURBOSERVE_VIDEO_BITRATE", "1000"),
        ("TURBOSERVE_ENCODE_THREADS", "0"),
        ("TURBOSERVE_STREAM_SESSIONS", "0"),
    ],
)
def test_worker_validation(var, value):
    with pytest.raises(SettingsError, match=var):
        WorkerSettings.from_env({var: value})


def test_the_gateway_makes_jpeg_at_a_quality_it_validates():
    assert GatewaySettings.from_env({}).jpeg_quality == 80
    with pytest.raises(SettingsError, match="TURBOSERVE_JPEG_QUALITY"):
        GatewaySettings.from_env({"TURBOSERVE_JPEG_QUALITY": "101"})


def test_provisioner_bounds():
    with pytest.raises(SettingsError, match="MAX_WORKERS"):
        ProvisionerSettings.from_env({"TURBOSERVE_MIN_WORKERS": "5", "TURBOSERVE_MAX_WORKERS": "2"})


def test_secrets_masked_when_printed():
    s = GatewaySettings.from_env(
        {"TURBOSERVE_API_TOKEN": "hunter2", "TURBOSERVE_REDIS_URL": "redis://:pa55@db:6379/0"}
    )
    text = str(s)
    assert "hunter2" not in text and "pa55" not in text
    assert "***" in text
    assert s.api_token == "hunter2"  # masked only when printed


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://user:pw@h:1/0", "redis://user:***@h:1/0"),
        ("redis://:p@ss@h:6379/0", "redis://:***@h:6379/0"),
        ("nats://s3cr3t@host:4222", "nats://***@host:4222"),
        ("nats://h:4222", "nats://h:4222"),
        ("unix:///tmp/redis.sock", "unix:///tmp/redis.sock"),
    ],
)
def test_mask_url(url, masked):
    assert mask_url(url) == masked


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_durations_must_be_finite_and_positive(value):
    with pytest.raises(SettingsError, match="TURBOSERVE_SHUTDOWN_GRACE_S"):
        CommonSettings.from_env({"TURBOSERVE_SHUTDOWN_GRACE_S": value})


def test_settings_are_frozen():
    s = CommonSettings.from_env({})
    with pytest.raises(AttributeError):
        s.nats_url = "x"  # type: ignore[misc]


def test_handoff_host_auto_is_this_hosts_address():
    import socket

    assert WorkerSettings.from_env({}).handoff_address() == "127.0.0.1"
    given = WorkerSettings.from_env({"TURBOSERVE_HANDOFF_HOST": "10.0.0.7"})
    assert given.handoff_address() == "10.0.0.7"
    auto = WorkerSettings.from_env({"TURBOSERVE_HANDOFF_HOST": "auto"})
    assert auto.handoff_address() == socket.gethostbyname(socket.gethostname())


def test_max_workers_has_one_default_everywhere() -> None:
    from shared.settings import DEFAULT_MAX_WORKERS, SchedulerSettings, ToolSettings

    for cls in (ProvisionerSettings, SchedulerSettings, ToolSettings):
        assert cls.from_env({}).max_workers == DEFAULT_MAX_WORKERS, cls.__name__
