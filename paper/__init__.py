"""The paper: LaTeX tables and matplotlib figures rebuilt from experiment summaries (``paper/results``).

This package reads result files only; it imports nothing from specdec, moe, kernels or experiments
(an import-linter contract in pyproject.toml enforces it).
"""
