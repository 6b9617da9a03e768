"""Who may call the worker's control endpoints: pure policy, no server."""

import pytest

from workers.server.config import control_exposure_error, is_loopback
from workers.server.service import bearer_matches


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "::1", "[::1]", "localhost"])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.7", "worker-3.internal", ""])
def test_hosts_beyond_loopback(host):
    assert not is_loopback(host)


def test_an_open_control_endpoint_is_refused_only_beyond_loopback_without_a_key():
    assert control_exposure_error("127.0.0.1", None, insecure=False) is None
    assert control_exposure_error("0.0.0.0", "key", insecure=False) is None
    assert control_exposure_error("0.0.0.0", None, insecure=True) is None
    message = control_exposure_error("0.0.0.0", None, insecure=False)
    assert message is not None and "--insecure-control" in message
    assert control_exposure_error("0.0.0.0", "", insecure=False) is not None


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("Bearer k3y", True),
        ("bearer k3y", True),
        ("Bearer  k3y ", True),
        ("Bearer k3y2", False),
        ("k3y", False),
        ("Basic k3y", False),
        ("", False),
        (None, False),
    ],
)
def test_bearer_matches(header, ok):
    assert bearer_matches(header, "k3y") is ok
