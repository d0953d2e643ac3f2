"""What a measured plan tells the service's calibration: the ``observation`` an evaluation
event carries (``../shared/API.md``; README, "Calibration from use").

A ``run`` job and a measured search measure plans on a cluster; each measured plan's
``evaluation`` event carries, beside its plan and measured batch time, what
:class:`core.observations.Observation` needs to refit the cluster's calibration (its
document, :meth:`~core.observations.Observation.to_doc`, beside the cluster and profile):

- ``cluster``: the spec the plan ran on, **uncalibrated** (the service files observations
  under its name and the hash of this document, so a changed spec starts over);
- ``profile``: the profile the prediction came from, and ``profile_sha256``, its hash (a job
  sends a profile's document once; later observations of the job name it by hash only);
- ``batch_time_s``, and per stage ``forward_s`` and ``backward_s``: the busiest replica's
  mean forward and backward **per call** (per microbatch), and ``allreduce_s``: the
  replicas' ring all-reduce per step (0 for a stage without replicas), and ``update_s``: the
  busiest replica's optimizer update per step (both optional, so that observations sent
  before them stay valid);
- ``emulated``: whether the devices were emulated.

The plan is the event's own ``plan``.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.observations import Observation
from pipeplan.core.profile import ModelProfile

if TYPE_CHECKING:  # a name for annotations: the API process imports this module without torch
    from pipeplan.executor.measure import Measurement

OBSERVATION_KEY = "observation"
"""The key of an evaluation event's data that holds the observation."""


def document_sha256(doc: Any) -> str:
    """The hash of a JSON document (keys sorted, no spaces): the same document, the same
    hash, wherever it was written."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def spec_sha256(spec: ClusterSpec) -> str:
    """The hash of a cluster spec without its calibration (what observations are filed by)."""
    return document_sha256(spec.calibrated(None).to_dict())


def observation_doc(
    measurement: Measurement, profile: ModelProfile, cluster: ClusterSpec
) -> dict[str, Any]:
    """The ``observation`` of one measured plan (module docstring)."""
    profile_doc = profile.to_dict()
    return {
        "cluster": cluster.calibrated(None).to_dict(),
        "profile": profile_doc,
        "profile_sha256": document_sha256(profile_doc),
        **Observation.of(measurement, profile).to_doc(),
        "emulated": measurement.emulated,
    }
