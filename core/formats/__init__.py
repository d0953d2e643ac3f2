"""Importers of third-party model profiles into :class:`core.profile.ModelProfile`.

- :mod:`core.formats.pipedream`: PipeDream's ``graph.txt`` (``load_pipedream``).
"""
