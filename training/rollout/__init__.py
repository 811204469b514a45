"""Rollouts: the worker, asynchronous rollouts, fault reruns, weight sync to the engine, the SFT oracle."""
