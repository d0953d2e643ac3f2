"""Run plans for real: Ray clusters, stage actors and a pipeline driver, and what they measured.

Ray is imported only in this package and in ``agents/rllib_ppo.py``. Within it,
:mod:`executor.runtime` is the one module that starts, joins or shuts down Ray and the one
that touches Ray's private API; the modules that run actors (stage workers, the pipeline,
the profiler, waiting, pinning) import ``ray`` for its public API only. Importing any of
them has no side effect: the loopback settings are applied when a cluster is started or
joined (:func:`executor.runtime.use_loopback`).
"""
