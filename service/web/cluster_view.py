"""The cluster page's figures: the device types of the service's cluster spec (flops,
memory, price), the nodes Ray has with their ``device:TYPE`` resources and what is in use,
and the links to Ray's dashboard.

The spec is the service's ``cluster`` setting (``--cluster``: a preset or a file), the one
the embedded Ray cluster is started from. The live nodes come from the jobs backend when
it can describe its cluster (:class:`~service.api.backend.ClusterSource`: the Ray Jobs
backend reads Ray's dashboard); another backend shows none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.cluster import ClusterSpec
from core.errors import PipeplanError
from service.api.backend import ClusterSource, ClusterState, JobsBackend, NodeState
from service.api.settings import Settings
from service.tasks.common import cluster_spec

RAY_PAGES = (("overview", "#/overview"), ("jobs", "#/jobs"), ("actors", "#/actors"),
             ("cluster", "#/cluster"), ("metrics", "#/metrics"))  # fmt: skip
"""The pages of Ray's dashboard the cluster page links to (label, fragment)."""


@dataclass(frozen=True)
class DeviceTypeRow:
    name: str
    flops: float | None
    memory_gb: float | None
    price_per_hour: float | None
    in_spec: int
    """Devices of the type in the spec."""
    live: float | None
    """Devices of the type on Ray's live nodes (None: no live cluster to ask)."""
    in_use: float | None


@dataclass(frozen=True)
class ClusterView:
    spec_ref: str
    embedded: bool
    """Whether the service's Ray cluster was started from the spec (no ``ray_address``)."""
    ray_address: str | None
    spec: ClusterSpec | None
    spec_error: str | None
    state: ClusterState | None
    """None: the backend cannot describe its cluster."""
    dashboard_url: str | None

    @property
    def live_nodes(self) -> tuple[NodeState, ...]:
        return tuple(n for n in self.state.nodes if n.alive) if self.state else ()

    @property
    def ray_links(self) -> list[tuple[str, str]]:
        url = self.dashboard_url
        return [] if url is None else [(label, f"{url}/{frag}") for label, frag in RAY_PAGES]

    def device_types(self) -> list[DeviceTypeRow]:
        """The spec's device types, then any type only the live nodes have."""
        live: dict[str, float] = {}
        used: dict[str, float] = {}
        known_use = all(n.devices_in_use is not None for n in self.live_nodes)
        for n in self.live_nodes:
            for t, count in n.devices.items():
                live[t] = live.get(t, 0.0) + count
                used[t] = used.get(t, 0.0) + (n.devices_in_use or {}).get(t, 0.0)
        asked = self.state is not None and self.state.error is None
        counts = self.spec.counts_by_type() if self.spec is not None else {}
        types = dict(self.spec.device_types) if self.spec is not None else {}
        rows = [
            DeviceTypeRow(
                t.name,
                t.flops,
                t.memory_gb,
                t.price_per_hour,
                counts.get(name, 0),
                live.get(name, 0.0) if asked else None,
                used.get(name, 0.0) if asked and known_use else None,
            )
            for name, t in types.items()
        ]
        for name in sorted(set(live) - set(types)):
            rows.append(
                DeviceTypeRow(
                    name, None, None, None, 0, live[name], used[name] if known_use else None
                )
            )
        return rows


def load_spec(ref: str) -> ClusterSpec:
    """A cluster file, or a preset by name (as ``pipeplan serve --cluster`` takes it)."""
    path = Path(ref)
    return ClusterSpec.load(path) if path.is_file() else cluster_spec(ref)


def cluster_view(settings: Settings, backend: JobsBackend) -> ClusterView:
    """What the cluster page shows now (asks Ray's dashboard, when there is one)."""
    spec, error = None, None
    try:
        spec = load_spec(settings.cluster)
    except (PipeplanError, OSError) as e:
        error = f"cluster: {settings.cluster!r}: {e}"
    source = backend if isinstance(backend, ClusterSource) else None
    return ClusterView(
        spec_ref=settings.cluster,
        embedded=settings.ray_address is None,
        ray_address=settings.ray_address,
        spec=spec,
        spec_error=error,
        state=source.cluster_state() if source is not None else None,
        dashboard_url=source.dashboard_url() if source is not None else None,
    )
