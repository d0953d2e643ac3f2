"""``pipeplan`` command line: one module per command group, each parsing its flags into a
request, calling one use-case (:mod:`service.tasks`) and rendering the result.

- :mod:`~service.cli.profile`: ``profile``;
- :mod:`~service.cli.simulate`: ``simulate``, ``validate``;
- :mod:`~service.cli.plan`: ``plan``, ``compare``;
- :mod:`~service.cli.run`: ``run``;
- :mod:`~service.cli.cluster`: ``cluster up|down|status``;
- :mod:`~service.cli.demo`: ``demo``;
- :mod:`~service.cli.serve`: ``serve`` (the service: REST API, jobs as Ray Jobs);
- :mod:`~service.cli.job`: ``job run`` (the entrypoint of a service job's Ray Job);
- :mod:`~service.cli.submit`: ``submit KIND`` (a job for the service);
- :mod:`~service.cli.jobs`: ``jobs ls|show|logs|cancel|events`` (the service's jobs);
- :mod:`~service.cli.deploy`: ``deploy render`` (the cluster-dependent parts of deploy/);
- :mod:`~service.cli.provision`: ``provision``; :mod:`~service.cli.calibrate`: ``calibrate``.

Every error is one line on stderr and a non-zero exit code; no tracebacks.
"""

from __future__ import annotations

import sys

import typer
from typer._click import exceptions as click_errors

from pipeplan.service.cli import (
    calibrate,
    cluster,
    demo,
    deploy,
    job,
    jobs,
    plan,
    profile,
    provision,
    run,
    serve,
    simulate,
    submit,
)
from pipeplan.service.cli.console import debug, say

app = typer.Typer(
    name="pipeplan",
    help="Plan and run pipeline-parallel DNN training on heterogeneous clusters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
for _group in (profile, simulate, plan, run, cluster, demo, serve, job, submit, jobs, deploy):
    _group.register(app)
provision.register(app)
calibrate.register(app)


def main() -> None:
    """Console entry point: usage errors are one line too."""
    args = sys.argv[1:] or ["--help"]
    try:
        rv = app(args, standalone_mode=False)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        say("aborted")
        sys.exit(130)
    except click_errors.ClickException as e:
        say(f"error: {e.format_message()}")
        sys.exit(2)
    except Exception as e:  # a bug, not bad input: still one line unless asked for more
        if debug():
            raise
        say(f"internal error: {type(e).__name__}: {e} (set PIPEPLAN_DEBUG=1 for the traceback)")
        sys.exit(3)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
