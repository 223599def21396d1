"""What the transformer families' ControlNet tests (tests/test_controlnet_flux1.py, tests/test_controlnet_sd3.py)
share: a diffusers ControlNet twin, seeded and randomised, and the module's torch runs on one thread."""

import pytest
import torch

from helpers import randomize_


def controlnet_twin(class_name, config, seed):
    """diffusers' ControlNet class `class_name` (FluxControlNetModel, SD3ControlNetModel) at `config`: seeded, its
    weights randomised (scale 0.15), in eval mode."""
    import diffusers     # deferred: collecting the tests does not import diffusers
    torch.manual_seed(seed)
    return randomize_(getattr(diffusers, class_name)(**config), seed=seed, scale=0.15).eval()


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """An autouse fixture for the module that imports it: torch on one thread, then as it was."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
