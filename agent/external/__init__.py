"""Agents of the user's own: the recording training proxy, the stitching of its calls into trajectories, the runner."""
