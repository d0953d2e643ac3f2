"""PPO's env runners by default: the cluster's spare CPUs (available less the driver's one,
rounded down, none below zero), at most one per ``MIN_STEPS_PER_RUNNER`` steps of a train
batch; an explicit ``num_env_runners`` wins. Checked on a live cluster in
``tests/service/test_cluster_use.py``."""

from __future__ import annotations

import pytest

from pipeplan.agents.problem import ProblemError

rllib_ppo = pytest.importorskip("pipeplan.agents.rllib_ppo")


@pytest.mark.parametrize(
    ("available", "train_batch", "runners"),
    [
        (0.0, 500, 0),  # nothing free: sample in the driver
        (0.5, 500, 0),
        (1.0, 500, 0),  # the driver's CPU only
        (1.9999, 500, 0),  # Ray's fractions round down
        (2.0, 500, 1),
        (3.0, 500, 2),
        (16.5, 500, 15),
        (64.0, 500, 15),  # 500 // 32: every runner samples at least 32 steps
        (64.0, 64, 2),
        (8.0, 31, 0),  # a batch smaller than one runner's share: the driver samples it
    ],
)
def test_default_is_the_spare_cpus_capped_by_the_train_batch(
    available: float, train_batch: int, runners: int
) -> None:
    assert rllib_ppo.default_env_runners(available, train_batch) == runners


def test_bad_inputs_are_refused_naming_them() -> None:
    with pytest.raises(ProblemError, match="available CPUs must be >= 0.*got -1.0 and 500"):
        rllib_ppo.default_env_runners(-1.0, 500)
    with pytest.raises(ProblemError, match="ppo.num_env_runners: must be >= 0, got -1"):
        rllib_ppo.PPOOptions(num_env_runners=-1)


def test_an_explicit_count_wins_and_needs_no_cluster() -> None:
    assert rllib_ppo.env_runners(rllib_ppo.PPOOptions(num_env_runners=3)) == 3
    assert rllib_ppo.env_runners(rllib_ppo.PPOOptions(num_env_runners=0)) == 0


def test_the_default_reads_rays_available_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rllib_ppo.ray, "available_resources", lambda: {"CPU": 5.0, "GPU": 1.0})
    assert rllib_ppo.env_runners(rllib_ppo.PPOOptions()) == 4
    assert rllib_ppo.env_runners(rllib_ppo.PPOOptions(train_batch=64)) == 2
    monkeypatch.setattr(rllib_ppo.ray, "available_resources", lambda: {})  # no CPU at all
    assert rllib_ppo.env_runners(rllib_ppo.PPOOptions()) == 0
