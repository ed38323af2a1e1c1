"""Closed-form theory the experiments compare measurements against."""
