"""paper package."""
