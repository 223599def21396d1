"""One rule for every pipeline parity test (issue 47): compare the final latents (float32, max relative error
<= LATENT_TOL) beside the image (<= IMAGE_LEVELS 8-bit levels), and prove that each input the test claims to cover
reaches the reference: changing that input alone moves diffusers' own latents by more than LATENT_TOL (so the latent
comparison, the stricter of the two, cannot pass with the input dropped or swapped) and changes its decoded image
(at least one level: the input reaches the image), or the test is broken (a twin too weak to see the input would let
a swapped CFG or a dropped prompt pass).

Why the image need not move past IMAGE_LEVELS: the tiny VAEs decode a latent change of 1e-3 to 1e-2 into 1-2 levels
for many inputs (init, control and reference images, prompts at low guidance: measured when levels() was mended to
read float reference images, which it had truncated, so this half of the rule had never been checked for them);
the latents carry the proof, the image comparison proves the decode.
"""

import numpy as np

LATENT_TOL = 1e-4          # float32 parity of latents (the guide's bar)
IMAGE_LEVELS = 2           # images from the same injected noise


def rel_diff(a, b) -> float:
    """max |a - b| / max |b|, as helpers.max_rel_err, without its finiteness assertion on `a` (both are references)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"shape {a.shape} != {b.shape}"
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def eight_bit(image) -> np.ndarray:
    """An image as int32 8-bit levels: a float image in [0, 1] rounded as diffusers' PIL output is, else as it is."""
    image = np.asarray(image)
    return np.round(image * 255).astype(np.int32) if image.dtype.kind == "f" else image.astype(np.int32)


def levels(ours_image, ref) -> int:
    """The largest difference in 8-bit levels between two images, each a PIL image, an 8-bit array or a float image
    in [0, 1] (rounded as diffusers' PIL output is): assert_moves compares two reference images, often both float."""
    ours, ref = eight_bit(ours_image), eight_bit(ref)
    assert ours.shape == ref.shape, f"shape {ours.shape} != {ref.shape}"
    return int(np.abs(ours - ref).max())


def assert_moves(name, base_latents, moved_latents, base_image=None, moved_image=None, latent_tol=LATENT_TOL):
    """The reference run with input `name` changed moved its latents by more than latent_tol (relative) and, where
    images are given, changed its image (at least one level; the module's docstring says why not IMAGE_LEVELS):
    else the parity test cannot see that input."""
    moved = rel_diff(moved_latents, base_latents)
    assert moved > latent_tol, (f"the reference's latents moved by {moved:.2e} when {name} changed: not more than "
                                f"the {latent_tol:g} tolerance, so the test cannot see {name}")
    if base_image is not None:
        shift = levels(moved_image, base_image)
        assert shift >= 1, (f"the reference's image did not change when {name} changed (its latents moved by "
                            f"{moved:.2e}): {name} does not reach the decoded image")
    return moved


def assert_inputs_matter(run_reference, base: dict, changes: dict, images=True, **tols):
    """run_reference(**kwargs) -> (latents, image or None). For each {name: {kwarg: value, ...}} in `changes`, run
    the reference with `base` updated by those kwargs and check it moved (assert_moves). Returns the base run's
    (latents, image), so the caller compares mlxdiff with it without running diffusers again."""
    base_latents, base_image = run_reference(**base)
    for name, update in changes.items():
        latents, image = run_reference(**{**base, **update})
        assert_moves(name, base_latents, latents, base_image if images else None, image if images else None,
                     **tols)
    return base_latents, base_image
