"""Two hosts as network namespaces (tests/support/netns.py), made and removed per test."""

from collections.abc import Iterator

import pytest

from tests.support.netns import TwoHosts, require_netns, two_hosts


@pytest.fixture
def hosts() -> Iterator[TwoHosts]:
    require_netns()
    with two_hosts() as made:
        yield made
