"""Run plans for real: a local heterogeneous Ray cluster, stage actors and a pipeline driver.

Only this package (and ``agents/rllib_ppo.py``) imports Ray. Importing it keeps in-process Ray
clusters on loopback: Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, when it is first
imported, and binds the machine's external address unless it is ``0`` (DESIGN.md, "Facts
about this environment"). The submodules import Ray, this file does not.
"""

from __future__ import annotations

import os

# Before any `import ray` in this process (an explicit setting by the user wins).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
