"""`make gpu-check` (`python -m gpu_check`): which GPU tiers this host can run, then running them into one table."""
