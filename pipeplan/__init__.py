"""pipeplan: plan and run pipeline-parallel DNN training on heterogeneous clusters.

The subpackages live in the repository's top-level folders and are installed under this one
name (``pyproject.toml`` maps them): :mod:`pipeplan.core` (formats, the cost model),
:mod:`pipeplan.models` (profiler, zoo), :mod:`pipeplan.envs` (the placement MDP),
:mod:`pipeplan.agents` (planners), :mod:`pipeplan.executor` (Ray and torch.distributed) and
:mod:`pipeplan.service` (CLI, REST API, dashboard). Importing this package imports none of
them, so neither torch nor Ray.
"""

__version__ = "0.1.0"
