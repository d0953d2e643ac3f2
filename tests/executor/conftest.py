"""Fixtures of the executor's Ray tests.

``cluster``: the module's own local Ray cluster (:class:`executor.local_cluster.LocalCluster`,
one Ray node per node of the module's ``SPEC``, object stores of ``OBJECT_STORE_MB``, default
100, and the module's ``CLUSTER_OPTIONS``, other arguments of ``LocalCluster``), the driver
connected to it; started once for the module's tests and stopped after the last one
(``tests/conftest.py`` fails the module if anything of it is left).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pipeplan.executor.local_cluster import LocalCluster

OBJECT_STORE_MB = 100


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    spec = request.module.SPEC
    object_store_mb = getattr(request.module, "OBJECT_STORE_MB", OBJECT_STORE_MB)
    options = getattr(request.module, "CLUSTER_OPTIONS", {})
    with LocalCluster(spec, object_store_mb=object_store_mb, **options) as c:
        yield c
