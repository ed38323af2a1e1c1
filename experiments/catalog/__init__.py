"""The named experiments (registered in experiments.registry)."""
