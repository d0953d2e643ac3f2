"""The use-cases every face calls (the CLI, the REST API, Ray Job entrypoints): a typed
request in (pydantic), a result out whose ``to_dict()`` is the JSON document, progress
through a :class:`~service.tasks.progress.Reporter`. No console, no typer, no HTTP here.

- :mod:`~service.tasks.profile`: ``profile(ProfileRequest)``, ``import_pipedream``;
- :mod:`~service.tasks.simulate`: ``simulate(SimulateRequest)``, ``validate(ValidateRequest)``;
- :mod:`~service.tasks.plan`: ``plan(PlanRequest)`` (with ``reward: measured`` it is the
  search of :mod:`~service.tasks.search`);
- :mod:`~service.tasks.compare`: ``compare(CompareRequest)``;
- :mod:`~service.tasks.run`: ``run(RunRequest)``;
- :mod:`~service.tasks.cluster`: ``cluster_up``, ``cluster_down``, ``cluster_status``;
- :mod:`~service.tasks.demo`: ``demo(DemoRequest)``.

Import the module of the use-case you need: this package imports none of them, so a face
that only validates does not load torch and Ray.
"""
