"""The provisioner's settings, wire messages and pod naming."""

from __future__ import annotations

import re

import pytest

from services.provisioner.backends.k8s import pod_name, pool_label
from shared.settings import CommonSettings, ProvisionerSettings, SettingsError
from shared.wire import (
    MAX_WORKERS_PER_COMMAND,
    ProvisionerCmdKind,
    ProvisionerCommand,
    ProvisionerEvent,
    ProvisionerRefusal,
    ProvisionerReply,
    WireError,
    WorkerStatus,
    decode,
    encode,
)


def test_provisioner_settings_from_the_environment():
    s = ProvisionerSettings.from_env(
        {
            "TURBOSERVE_BACKEND": "kubernetes",
            "TURBOSERVE_BOOT_DELAY_S": "2.5",
            "TURBOSERVE_EMULATE": "H20",
            "TURBOSERVE_GPUS": "GPU-1,GPU-2",
            "TURBOSERVE_K8S_NAMESPACE": "gpu-pool",
            "TURBOSERVE_K8S_POD_TEMPLATE": "worker-h100",
            "TURBOSERVE_METRICS_PORT": "9090",
        }
    )
    assert (s.backend, s.boot_delay_s, s.emulate, s.gpus) == (
        "kubernetes",
        2.5,
        "H20",
        "GPU-1,GPU-2",
    )
    assert (s.k8s_namespace, s.k8s_pod_template, s.metrics_port) == (
        "gpu-pool",
        "worker-h100",
        9090,
    )
    assert not hasattr(s, "worker_preset")  # workers take TURBOSERVE_PRESET as everyone does


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("TURBOSERVE_BACKEND", "docker"),
        ("TURBOSERVE_BOOT_DELAY_S", "-1"),
        ("TURBOSERVE_BOOT_TIMEOUT_S", "0"),
        ("TURBOSERVE_K8S_POLL_S", "0"),
        ("TURBOSERVE_GPUS", "GPU 1"),
        ("TURBOSERVE_K8S_POD_TEMPLATE", "Not_A_Name"),
        ("TURBOSERVE_K8S_NAMESPACE", "x" * 64),
        ("TURBOSERVE_METRICS_PORT", "-2"),
        ("TURBOSERVE_METRICS_PORT", "65536"),
        ("TURBOSERVE_BOOT_DELAY_S", "300"),  # as long as the boot timeout: no worker could boot
    ],
)
def test_bad_provisioner_settings_are_named(var, value):
    with pytest.raises(SettingsError, match=var):
        ProvisionerSettings.from_env({var: value})


def test_metrics_port_is_common_to_every_service():
    assert CommonSettings.from_env({}).metrics_port == 0
    assert CommonSettings.from_env({"TURBOSERVE_METRICS_PORT": "-1"}).metrics_port == -1


def test_command_reply_and_event_round_trip():
    cmd = ProvisionerCommand(
        kind=ProvisionerCmdKind.START, worker_ids=["g1"], gpu_kind="H20", command_id="c7"
    )
    assert decode("p", encode(cmd), ProvisionerCommand) == cmd
    reply = ProvisionerReply(
        kind=ProvisionerCmdKind.STOP,
        ok=False,
        command_id="c7",
        stopping=["a"],
        unchanged=["b"],
        refused=[ProvisionerRefusal("not_drained", "g1", "holds 1 session(s)")],
    )
    assert decode("p", encode(reply), ProvisionerReply) == reply
    event = ProvisionerEvent(
        worker_id="g1", status=WorkerStatus.READY, boot_s=3.2, emulated="H20", gpu_kind="H20"
    )
    assert decode("p", encode(event), ProvisionerEvent) == event
    # the fields added later have defaults: an event from an older provisioner still decodes
    old = decode(
        "p", b'{"type":"provisioner_event","worker_id":"g1","status":"gone"}', ProvisionerEvent
    )
    assert old.code == "" and old.gpu_seconds is None


def test_a_command_names_a_bounded_number_of_workers():
    ids = ",".join(f'"w{i}"' for i in range(MAX_WORKERS_PER_COMMAND + 1))
    with pytest.raises(WireError, match="worker_ids"):
        decode(
            "p",
            f'{{"type":"provisioner_cmd","kind":"start","worker_ids":[{ids}]}}'.encode(),
            ProvisionerCommand,
        )


DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
LABEL_VALUE = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]")


@pytest.mark.parametrize(
    ("prefix", "worker_id"),
    [
        ("ts", "w-1a2b3c4d"),
        ("Prod_EU", "GPU_7"),
        ("_x_", "-"),
        ("ts", "W" * 128),
        ("a" * 32, "_" * 128),
    ],
)
def test_pod_names_are_valid_and_distinct(prefix, worker_id):
    name = pod_name(prefix, worker_id)
    assert DNS_LABEL.fullmatch(name), name
    assert name == pod_name(prefix, worker_id)  # deterministic: a repeat is the same pod
    assert name != pod_name(prefix, worker_id + "x") and name != pod_name(prefix + "x", worker_id)
    assert LABEL_VALUE.fullmatch(pool_label(prefix))


def test_ids_that_differ_only_in_case_get_different_pods():
    assert pod_name("ts", "GPU-1") != pod_name("ts", "gpu-1")
