"""``ray start`` that keeps a loopback ``--node-ip-address`` (run as ``python -m``).

Ray turns ``--node-ip-address=127.0.0.1`` into the machine's external address unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, and with that setting it refuses to start worker
nodes. This entry point keeps the address it is given
(:func:`executor.runtime.keep_given_node_ip`), then runs the ordinary ``ray`` command line:
every node of a persistent pipeplan cluster (:mod:`executor.local.persistent_cluster`)
binds loopback only.
"""

from __future__ import annotations

import sys

from ray.scripts.scripts import main

from pipeplan.executor import runtime

if __name__ == "__main__":
    runtime.keep_given_node_ip()
    sys.exit(main())
