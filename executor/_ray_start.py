"""``ray start`` that keeps a loopback ``--node-ip-address`` (run as ``python -m``).

Ray turns ``--node-ip-address=127.0.0.1`` into the machine's external address
(``services.resolve_ip_for_localhost``) unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
and with that setting it refuses to start worker nodes. This entry point keeps the address
it is given, then runs the ordinary ``ray`` command line: every node of a persistent
pipeplan cluster binds loopback only.
"""

from __future__ import annotations

import sys

from ray._private import services
from ray.scripts.scripts import main


def _keep(host: str) -> str:
    return host


if __name__ == "__main__":
    services.resolve_ip_for_localhost = _keep
    sys.exit(main())
