"""XLabs' x-flux ControlNet (XLabs-AI/x-flux, src/flux/controlnet.py: ControlNetFlux) in PyTorch, the reference for
mlxdiff's reading of its files (diffusers 0.42 has no reader for them).

x-flux's forward is diffusers' FluxControlNetModel's with `conditioning_embedding_channels`: img_in on the noise
plus pos_embed_input on the control image's input_hint_block output folded into 2 x 2 patches, the double blocks on
the prompt (BFL's DoubleStreamBlock, the ids text first), one controlnet_blocks linear per block (the caller scales
the residuals, as diffusers' conditioning_scale does). So the model here is diffusers' FluxControlNetModel with
x-flux's own pieces where x-flux names or builds them otherwise:
- input_hint_block: x-flux's nn.Sequential as it is built there (8 convs of 16 channels, SiLU between them, stride 2
  at the 3rd, 5th and 7th), loaded by x-flux's own names;
- pos_embed_input: x-flux's Linear, in the place of diffusers' controlnet_x_embedder (the same place in the forward);
- the BFL-named FLUX.1 parts (img_in, txt_in, time_in, vector_in, guidance_in, double_blocks) converted by diffusers'
  convert_flux_transformer_checkpoint_to_diffusers (`convert`: the test passes it with its width set; the converter
  wants a single block and a final layer, which x-flux's ControlNet has not: stand-ins are added and dropped).
"""


def xflux_hint_block():
    from torch import nn  # optional: the reference extra
    layers = [nn.Conv2d(3, 16, 3, padding=1), nn.SiLU()]
    for stride in (1, 2, 1, 2, 1, 2):
        layers += [nn.Conv2d(16, 16, 3, padding=1, stride=stride), nn.SiLU()]
    layers.append(nn.Conv2d(16, 16, 3, padding=1))
    return nn.Sequential(*layers)


def xflux_shapes(hidden, head_dim, in_channels, context, pooled, depth=2, guidance=True) -> dict:
    """{name: shape} of x-flux's ControlNetFlux state dict (its MLPEmbedders in_layer / out_layer, DoubleStreamBlock's
    modulation, qkv, QK norm scales, proj and MLP per stream; mlp_ratio 4, qkv_bias True, as FLUX.1's)."""
    shapes = {"img_in.weight": (hidden, in_channels), "img_in.bias": (hidden,),
              "txt_in.weight": (hidden, context), "txt_in.bias": (hidden,),
              "pos_embed_input.weight": (hidden, in_channels), "pos_embed_input.bias": (hidden,)}
    embedders = {"time_in": 256, "vector_in": pooled, **({"guidance_in": 256} if guidance else {})}
    for name, width in embedders.items():
        shapes.update({f"{name}.in_layer.weight": (hidden, width), f"{name}.in_layer.bias": (hidden,),
                       f"{name}.out_layer.weight": (hidden, hidden), f"{name}.out_layer.bias": (hidden,)})
    for i in range(depth):
        b = f"double_blocks.{i}."
        for s in ("img", "txt"):
            shapes.update({f"{b}{s}_mod.lin.weight": (6 * hidden, hidden), f"{b}{s}_mod.lin.bias": (6 * hidden,),
                           f"{b}{s}_attn.qkv.weight": (3 * hidden, hidden), f"{b}{s}_attn.qkv.bias": (3 * hidden,),
                           f"{b}{s}_attn.norm.query_norm.scale": (head_dim,),
                           f"{b}{s}_attn.norm.key_norm.scale": (head_dim,),
                           f"{b}{s}_attn.proj.weight": (hidden, hidden), f"{b}{s}_attn.proj.bias": (hidden,),
                           f"{b}{s}_mlp.0.weight": (4 * hidden, hidden), f"{b}{s}_mlp.0.bias": (4 * hidden,),
                           f"{b}{s}_mlp.2.weight": (hidden, 4 * hidden), f"{b}{s}_mlp.2.bias": (hidden,)})
        shapes.update({f"controlnet_blocks.{i}.weight": (hidden, hidden), f"controlnet_blocks.{i}.bias": (hidden,)})
    for name, p in xflux_hint_block().state_dict().items():
        shapes[f"input_hint_block.{name}"] = tuple(p.shape)
    return shapes


def xflux_controlnet(state_dict: dict, config: dict, convert):
    """x-flux's ControlNetFlux from its state dict ({name: torch tensor}) at diffusers' FluxControlNetModel `config`
    (conditioning_embedding_channels 16, patch_size 2, no single blocks), in float32."""
    import torch  # optional: the reference extra
    from diffusers import FluxControlNetModel  # optional: the reference extra
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    own = ("input_hint_block.", "pos_embed_input.", "controlnet_blocks.")
    bfl = {k: v.clone() for k, v in state_dict.items() if not k.startswith(own)}
    head = config["attention_head_dim"]
    stand_ins = {"single_blocks.0.linear1.weight": (7 * hidden, hidden),
                 "single_blocks.0.linear1.bias": (7 * hidden,),
                 "single_blocks.0.linear2.weight": (hidden, 5 * hidden), "single_blocks.0.linear2.bias": (hidden,),
                 "single_blocks.0.norm.query_norm.scale": (head,), "single_blocks.0.norm.key_norm.scale": (head,),
                 "single_blocks.0.modulation.lin.weight": (3 * hidden, hidden),
                 "single_blocks.0.modulation.lin.bias": (3 * hidden,),
                 "final_layer.linear.weight": (config["in_channels"], hidden),
                 "final_layer.linear.bias": (config["in_channels"],),
                 "final_layer.adaLN_modulation.1.weight": (2 * hidden, hidden),
                 "final_layer.adaLN_modulation.1.bias": (2 * hidden,)}
    bfl.update({k: torch.zeros(shape) for k, shape in stand_ins.items()})
    converted = convert(bfl)
    assert not bfl, f"diffusers' converter left {sorted(bfl)[:4]}"     # it pops what it converts
    converted = {k: v for k, v in converted.items()
                 if not k.startswith(("single_transformer_blocks.", "proj_out.", "norm_out."))}
    model = FluxControlNetModel(**{k: v for k, v in config.items() if not k.startswith("_")})
    model.input_hint_block = xflux_hint_block()
    weights = {**converted,
               **{k: v for k, v in state_dict.items() if k.startswith(("input_hint_block.", "controlnet_blocks."))},
               **{k.replace("pos_embed_input.", "controlnet_x_embedder."): v for k, v in state_dict.items()
                  if k.startswith("pos_embed_input.")}}
    model.load_state_dict(weights, strict=True)
    return model.float().eval()
