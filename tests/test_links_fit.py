"""bench.links' fit of a link class (latency + bytes / bandwidth) to measured sends."""

import pytest

from bench.links import Fit, fit_link


def test_the_fit_recovers_latency_and_bandwidth() -> None:
    truth = Fit(latency_s=0.008, bytes_per_s=1e9)
    sizes = [2**16, 2**20, 2**24, 2**28]
    fit = fit_link(sizes, [truth.predict(n) for n in sizes])
    assert fit.latency_s == pytest.approx(0.008, rel=1e-9)
    assert fit.bytes_per_s == pytest.approx(1e9, rel=1e-9)
    assert fit.to_dict() == pytest.approx({"latency_us": 8000, "bandwidth_gbps": 8.0})


def test_the_fit_weighs_errors_relatively() -> None:
    # A 10% slower small send moves the latency, barely the bandwidth that large sends pin.
    truth = Fit(latency_s=0.01, bytes_per_s=1e9)
    sizes = [2**16, 2**20, 2**26, 2**28]
    times = [truth.predict(n) for n in sizes]
    times[0] *= 1.1
    fit = fit_link(sizes, times)
    assert fit.latency_s > truth.latency_s
    assert fit.bytes_per_s == pytest.approx(1e9, rel=0.05)


def test_a_fit_without_a_positive_latency_is_refused() -> None:
    with pytest.raises(ValueError, match="no positive fit"):
        fit_link([1, 2, 3], [3.0, 2.0, 1.0])
