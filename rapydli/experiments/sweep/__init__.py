"""Sweeps: the search space, trials as multi-rank jobs, pruning and why, parameter importance."""
