"""Shared test helpers: the error measure used by every parity test, and seeded randomisation of torch models."""

import numpy as np


def max_rel_err(ours, ref) -> float:
    """max |ours - ref| / max |ref|: the maximum error relative to the reference's magnitude.

    Element-wise relative error is meaningless where the reference crosses zero, so the scale is the reference's
    largest magnitude. Shapes must match exactly (no broadcasting).
    """
    ours = np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, f"shape {ours.shape} != reference {ref.shape}"
    assert np.isfinite(ours).all(), "non-finite values in our output"
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


def randomize_(module, seed=0, scale=0.2):
    """Fill every parameter (not buffers) of a torch module with seeded noise, so that zero-initialised
    gates and identity norms cannot hide a wrong mapping."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if name.endswith("norm.weight") else 0.0))
    return module
