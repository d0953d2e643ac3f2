"""torch: the torch.fx layer profiler and the model zoo (kept out of ``core``, which is pure
Python + numpy)."""
