"""The cluster page's figures: the device types of the service's cluster spec (flops,
memory, price), the nodes Ray has with their ``device:TYPE`` resources and what is in use,
and the links to Ray's dashboard.

The spec is the service's ``cluster`` setting (``--cluster``: a preset or a file), the one
the embedded Ray cluster is started from. The live nodes come from the jobs backend when
it can describe its cluster (:class:`~service.api.backend.ClusterSource`: the Ray Jobs
backend reads Ray's dashboard); another backend shows none.

The calibration from use (:mod:`service.api.calibration`): for the service's spec first,
then every other cluster the jobs measured plans on, the current calibration beside the
spec's own terms, how many runs it read and its held-out error before and after.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeplan.core.calibration import LINK_CLASSES, Calibration
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.service.api.backend import ClusterSource, ClusterState, JobsBackend, NodeState
from pipeplan.service.api.calibration import view
from pipeplan.service.api.schemas import ClusterCalibration
from pipeplan.service.api.settings import Settings
from pipeplan.service.api.store import Store
from pipeplan.service.tasks.observations import spec_sha256
from pipeplan.service.tasks.requests import cluster_spec

MAX_CALIBRATIONS_SHOWN = 20

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
class TypeTerms:
    """One device type's fitted terms."""

    name: str
    scale: float
    fwd_s: float
    bwd_s: float
    spec_update_gbps: float | None = None
    """The spec's memory bandwidth of the type (rule 8's update); None for a type the spec
    does not have."""
    fitted_update_gbps: float | None = None
    """The calibration's (rule 8u); None where it kept the spec's."""


@dataclass(frozen=True)
class LinkTerms:
    """One link class's sends, or its ring all-reduce rounds (``NAME all-reduce``): the spec's
    and the fitted bandwidth (Gbit/s) and latency (µs); fitted is None where no run used it."""

    name: str
    spec_gbps: float
    spec_us: float
    fitted_gbps: float | None
    fitted_us: float | None


@dataclass(frozen=True)
class CalibrationPanel:
    """A cluster's calibration from use, as the page draws it."""

    info: ClusterCalibration
    this_service: bool
    """Whether it is the calibration of the service's own spec."""
    types: tuple[TypeTerms, ...]
    links: tuple[LinkTerms, ...]
    step_overhead_s: float | None
    models: tuple[tuple[str, float], ...] = ()
    """Each model's compute scale (rule 1c's ``model_scale``), by model key."""

    @property
    def anchor(self) -> str:
        return f"calibration-{self.info.cluster}"


def calibration_panel(info: ClusterCalibration, spec: ClusterSpec, ours: bool) -> CalibrationPanel:
    """The terms of ``info``'s calibration beside ``spec``'s (uncalibrated) links."""
    cal = Calibration.from_dict(info.calibration) if info.calibration else None
    types: tuple[TypeTerms, ...] = ()
    if cal is not None:
        types = tuple(
            TypeTerms(
                t,
                cal.scale(t),
                cal.overhead(t).fwd_s,
                cal.overhead(t).bwd_s,
                spec.device_types[t].memory_bandwidth_gbps if t in spec.device_types else None,
                cal.memory_bandwidth_gbps.get(t),
            )
            for t in sorted(
                set(cal.compute_scale) | set(cal.call_overhead) | set(cal.memory_bandwidth_gbps)
            )
        )
    links = []
    for k in LINK_CLASSES:
        link = getattr(spec.network, k)
        sends = cal.network.get(k) if cal is not None else None
        links.append(LinkTerms(k, link.bandwidth_gbps, link.latency_us, *(sends or (None, None))))
        ring = cal.all_reduce.get(k) if cal is not None else None
        if ring is not None or link.ring_bandwidth_gbps is not None:
            ring_spec = (link.ring_bandwidth_gbps, link.ring_latency_us)  # rule 8r's own numbers
            if ring_spec[0] is None or ring_spec[1] is None:
                ring_spec = (link.bandwidth_gbps, link.latency_us)  # else the link's
            links.append(LinkTerms(f"{k} all-reduce", *ring_spec, *(ring or (None, None))))
    return CalibrationPanel(
        info,
        ours,
        types,
        tuple(links),
        cal.step_overhead_s if cal is not None else None,
        tuple(sorted(cal.model_scale.items())) if cal is not None else (),
    )


def calibrations(store: Store, spec: ClusterSpec | None) -> list[CalibrationPanel]:
    """The service spec's calibration first (when there is one), then the others."""
    ours = (spec.name, spec_sha256(spec)) if spec is not None else None
    panels = []
    for record in store.calibrations(MAX_CALIBRATIONS_SHOWN):
        try:
            recorded = ClusterSpec.from_dict(record.spec)
        except PipeplanError:
            continue  # a spec this version cannot read is not drawn
        this = (record.name, record.spec_sha256) == ours
        panels.append(calibration_panel(view(record), recorded, this))
    return sorted(panels, key=lambda p: not p.this_service)


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
    calibrations: tuple[CalibrationPanel, ...] = ()

    @property
    def own_calibration(self) -> CalibrationPanel | None:
        return next((p for p in self.calibrations if p.this_service), None)

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


def cluster_view(
    settings: Settings, backend: JobsBackend, store: Store | None = None
) -> ClusterView:
    """What the cluster page shows now (asks Ray's dashboard, when there is one; the
    calibrations when given the ``store``)."""
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
        calibrations=tuple(calibrations(store, spec)) if store is not None else (),
    )
