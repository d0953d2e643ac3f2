"""Provisioning from a catalogue (HeterPS): how many nodes of each kind to rent, and the plan
on them, at the least cost per sample that meets a throughput target.

- :mod:`~agents.provision.rental`: what a plan rents (``{node kind: count}``) and its prices;
- :mod:`~agents.provision.kinds`: the catalogue seen by kind (identical nodes are one kind:
  the symmetry the planners below exploit) and the stage costs they share;
- :mod:`~agents.provision.exact`: ``provision_dp``, exact over kind-count vectors;
- :mod:`~agents.provision.cpu_gpu`: ``heterps_cpu_gpu``, HeterPS's "first layer on the CPU,
  the rest on the GPU" baseline with its counts chosen;
- :mod:`~agents.provision.rl`: ``heterps_rl``, HeterPS's RL layer scheduler (layers to device
  kinds by REINFORCE, then counts).
"""
