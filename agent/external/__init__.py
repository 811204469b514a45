"""Agents of the user's own: the recording proxy, its calls stitched into trajectories, the runner."""
