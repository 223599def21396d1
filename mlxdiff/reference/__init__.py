"""The PyTorch (diffusers) reference path, for parity tests and footprint comparisons.

Imported only with the `reference` extra (torch, diffusers, transformers). Nothing in mlxdiff's own path imports it.
"""
