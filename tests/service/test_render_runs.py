"""The lines a measured search prints, from its document: the local command and a service
job's ``--wait`` print them alike."""

from __future__ import annotations

from pipeplan.service.render import measured_lines

BEST = {"batch_time_s": 0.0125, "batch_time_std_s": 0.0004, "steps": 3, "emulated": True}


def test_measured_lines_quote_the_best_run_beside_the_cost_model() -> None:
    doc = {
        "best": BEST,
        "runs": 3,
        "pipelines_started": 2,
        "evaluated": [{"error": None}, {"error": "does not fit"}, {"error": None}],
    }
    assert measured_lines(doc, 0.0100) == [
        "measured        12.500 ms/batch (mean of 3 runs, std 0.40) EMULATED; cost model "
        "10.000 ms (-20.0%)",
        "runs            3 plans run on the cluster, 1 refused or failed, 2 sets of stage "
        "actors started",
    ]


def test_a_search_where_nothing_ran_says_so() -> None:
    doc = {"best": None, "runs": 0, "pipelines_started": 0, "evaluated": [{"error": "x"}]}
    assert measured_lines(doc, 0.01) == [
        "runs            0 plans run on the cluster, 1 refused or failed, 0 sets of stage "
        "actors started"
    ]
