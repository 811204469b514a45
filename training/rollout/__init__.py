"""Rollouts: the worker, the asynchronous producer, fault reruns, the weight sync to the engine, the SFT oracle."""
