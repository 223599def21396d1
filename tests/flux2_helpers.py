"""FLUX.2 test pieces shared by several test modules (no test module imports another): the tiny transformer twins of
tests/test_flux2_transformer.py."""

from helpers import randomize_


# Within each config every dimension differs from the others (heads, head dim, D, M, 2M, 3D+2M, D+M, in, out, joint,
# sinusoid channels, text length, image tokens), so a swapped axis cannot pass. The axes are equal within a config
# (config_from_original can only know their sum); unequal axes are tested on the RoPE table alone below.
CONFIGS = {
    # FLUX.2-dev-like: guidance embedder, out_channels null (= in), mlp ratio 2.5
    "dev": dict(patch_size=1, in_channels=20, out_channels=None, num_layers=2, num_single_layers=3,
                attention_head_dim=16, num_attention_heads=3, joint_attention_dim=28, timestep_guidance_channels=36,
                mlp_ratio=2.5, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, eps=1e-6, guidance_embeds=True),
    # klein-like: no guidance embedder, out != in, the real 256 sinusoid channels and mlp ratio 3
    "klein": dict(patch_size=1, in_channels=16, out_channels=12, num_layers=1, num_single_layers=2,
                  attention_head_dim=24, num_attention_heads=2, joint_attention_dim=40, timestep_guidance_channels=256,
                  mlp_ratio=3.0, axes_dims_rope=(6, 6, 6, 6), rope_theta=2000, eps=1e-6, guidance_embeds=False),
}


def make_torch_model(name, seed, dtype=None):
    import torch
    from diffusers import Flux2Transformer2DModel
    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(**CONFIGS[name])
    randomize_(model, seed=seed)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
