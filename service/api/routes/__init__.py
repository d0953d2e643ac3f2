"""The API's routes, one module per resource, each an ``APIRouter``:

- :mod:`~service.api.routes.jobs`: submit, list, get, cancel, logs;
- :mod:`~service.api.routes.artifacts`: the files a job left;
- :mod:`~service.api.routes.queue`: the queued jobs in start order;
- :mod:`~service.api.routes.events`: a job's events (read, live stream, the control endpoint);
- :mod:`~service.api.routes.simulate`: the cost model's estimate, synchronously;
- :mod:`~service.api.routes.catalog`: planners, models, cluster presets;
- :mod:`~service.api.routes.health`: ``/healthz``, ``/readyz``;
- :mod:`~service.api.routes.metrics`: ``/metrics``;
- :mod:`~service.api.routes.tokens`: users' tokens (admin).
"""
