"""LoRA for the SD3.5 (MMDiT) and FLUX.2 (dev, klein) transformers and the SD 1.x / SDXL UNet: the file formats,
how their names reach mlxdiff's layers, the low-rank wrappers, apply and remove.

A LoRA adds, to a linear layer y = base(x), the low-rank term scale * (x @ A^T) @ B^T with
scale = user scale * alpha / rank (alpha / sqrt(rank) for rsLoRA). It is added in the forward (`LoRALinear`), so
any base works unchanged: nn.Linear, nn.QuantizedLinear, the dequantize-per-call layer (loading/matmul.py), GGUF's
RawLinear and Fp8Linear; a 4-bit base is never dequantized, and the model grows by the LoRA's own bytes. Several
LoRAs on one layer each keep their own scale. A UNet's convolutions take LoRAs too (kohya's LoCon, PEFT's Conv2d
LoRA: `LoRAConv`): A is a convolution with the base's kernel, stride and padding (rank x in x kh x kw, as PyTorch
stores it), B a 1x1 convolution (out x rank x 1 x 1); the 1x1-conv projections of SD 1.5's transformers are such a
pair with a 1x1 A.

Formats (what the tools write), told apart by their names:
- diffusers / PEFT (`save_lora_weights`, `get_peft_model_state_dict`): `transformer.<module>.lora_A.weight` /
  `.lora_B.weight` in diffusers' module names, which are mlxdiff's own module paths; alpha from the
  `lora_adapter_metadata` header entry (PEFT's LoraConfig: r, lora_alpha, rank_pattern, alpha_pattern, use_rslora,
  as PEFT reads them), or from `<module>.alpha` keys (never both), else alpha = rank (scale 1), as diffusers reads
  it. Bare names (no `transformer.`) and PEFT's
  `base_model.model.` are read the same way.
- kohya / ComfyUI: `lora_unet_<module with dots as underscores>.lora_down.weight` / `.lora_up.weight` / `.alpha`
  (the original model's names, as kohya's trainers name them; diffusers' names are accepted too), and
  `diffusion_model.<name>.lora_A|lora_down...` (ai-toolkit, ComfyUI) in the original or diffusers names.
- original names (BFL's FLUX.2 `double_blocks.N.img_attn.qkv`, `single_blocks.N.linear1`, ...; Stability's SD3
  `joint_blocks.N.x_block.attn.qkv`, ...) go through the model's own ORIGINAL_KEYMAP (models/flux2.py,
  models/mmdit.py): the table that maps a base checkpoint maps its LoRA. lora_B has the base weight's rows, so it is
  split, reordered (swap_halves) exactly as the base weight is; lora_A (the input side) is shared by the parts.
  FLUX.2's single-block linear1 stays fused as in mlxdiff; its row ranges reach the LoRA through
  `LoRALinear.rows` (formats/quantized.linear_rows). FLUX.1's linear1 is q, k, v and the MLP in mlxdiff (models/
  flux1.py): its lora_B's rows go to the four layers (the MLP's four widths together).
- DoRA as PEFT saves it (use_dora=True: a `<module>.lora_magnitude_vector` beside lora_A / lora_B), on linear
  layers of any base form and on convolutions (PEFT's DoraConv2dLayer): each layer's m / ||W + scale B A|| (the
  norm of every output row of the changed weight, a convolution's over its kh x kw x in kernel; W read off the base
  as base(I) - bias, a convolution's decoded kernel) scales what the layer gives and the LoRA's term, as PEFT's
  DoraLinearLayer does. LyCORIS's / kohya's DoRA (`<module>.dora_scale` beside lora_down / lora_up or LoHa / LoKr
  factors) is the same magnitude; its shape tells its side, as LyCORIS's wd_on_out option makes it
  (lycoris/functional/general.py _weight_decompose, modules/locon.py LoConModule.__init__): (out, 1) (a
  convolution's (out, 1, 1, 1)) per output row (wd_on_out, its default), or (1, in) ((1, in, 1, 1)) per input
  column / channel (wd_on_out=False), W' = (W + scale dW) diag(m / its column norms): the layer's input scaled by
  that factor, then the layer and the LoRA's term; a fused original layer's parts (FLUX.1's qkv, linear1) share its
  columns, whose norms are taken over all of their rows. At user scale 1 this is LyCORIS's apply_weight_decompose
  (its + eps on the norm aside) and ComfyUI's weight_adapter/base.py weight_decompose; at other scales mlxdiff keeps
  PEFT's rule (the norm of W + scale dW), where LyCORIS and ComfyUI blend the decomposed weight linearly.
  Nothing is fused into the weights, so a quantized / GGUF / fp8 base stays as it is: its W is read once through
  the layer itself (base(I) - bias) for the norm.
- LyCORIS's LoHa (`hada_w1_a`, `hada_w1_b`, `hada_w2_a`, `hada_w2_b`) and LoKr (`lokr_w1` or `lokr_w1_a` /
  `lokr_w1_b`, `lokr_w2` or `lokr_w2_a` / `lokr_w2_b`), with `.alpha`, in any of the namings above (PEFT's
  LoHaConfig / LoKrConfig write the same factor names): each layer's factors become one exact low-rank pair (A, B)
  with B A = the layer's weight change (`_lycoris` says the math and its sources), then go the LoRA path, on any
  base and on the UNet's convolutions (their w1_b / w2_b flattened as PyTorch's (rows, in x kh x kw)). Their Tucker
  forms on a kh x kw convolution (LyCORIS's use_tucker) too: LoHa's `hada_t1` / `hada_t2` cores (with hada_wN_a
  (r, out), hada_wN_b (r, in)), LoKr's `lokr_t2` (with lokr_w2_a (r, out / a), lokr_w2_b (r, in / c)), and LoCon's
  `lora_mid` (r, r, kh, kw) between a 1x1 lora_down and lora_up, which with lora_down is one kh x kw down
  convolution (`_tucker_locon`).
- XLabs (x-flux, FLUX.1): `double_blocks.N.processor.qkv_lora1|proj_lora1|qkv_lora2|proj_lora2.down|up.weight`
  (1: the image stream, 2: the text stream) and `single_blocks.N.processor.qkv_lora|proj_lora`, no alpha (scale 1),
  through models/flux1.py's table.

UNet LoRAs (SD 1.x / SDXL): kohya's `lora_unet_<diffusers module, dots as underscores>` (sd-scripts' SD 1.x
names; SDXL's SGM names `input_blocks_N_M_...` go through models/unet.py's original-name table when it has one),
diffusers' `unet.<module>`, and the bare / `lora_unet_` names of the files above when they name UNet layers
(down_blocks, mid_block, up_blocks, input_blocks, ...): such a file's denoiser part is the pipeline component
"unet", every other one's "transformer".

Text-encoder parts (kohya `lora_te_` (SD 1.x's CLIP-L), `lora_te1_` / `lora_te2_` / `lora_te3_`, PEFT
`text_encoder.` / `text_encoder_2.` / `text_encoder_3.`) go to the CLIP and T5 encoders (SD3.5's CLIP-L, CLIP-G
and T5; SDXL's CLIP-L and CLIP-G; their module paths are transformers' names); the pipeline adds a file to every
component it has layers for (Pipeline.load_lora).

Refused, each in one line naming the file and the key: a name that reaches no layer of its component, a shape that
does not fit the layer, a LoRA of another architecture (SD3 on FLUX.2, FLUX.1, an SD/SDXL UNet), text-encoder LoRAs
for FLUX.2's LLM encoders, a Tucker core on LoKr's first factor (lokr_t1: LyCORIS never writes one), Tucker cores of
another rank than their factors, LoHa / LoKr factors that are no pair or whose product does not fit the layer, LoRA
biases; one layer reached twice from one file (two namings of the same layer), and a component's layers named two
ways in one file (prefixes or lora_A / lora_down styles mixed: each tool reads such a file its own way); factors
stored other than float32 / float16 / bfloat16; a tensor holding NaN or infinity, or factors and scale whose product
leaves the compute dtype's range (every LoRA tensor is read whole when the file is checked: they are the file's own
bytes); an .alpha that is not one positive number; PEFT metadata of the wrong types, or that disagrees with the
tensors (its ranks, the layers it names), or that asks for what mlxdiff does not apply (PiSSA-style inits that
change the base weights, layer replication, ...); alpha given twice (.alpha tensors and metadata); a path that is
not a regular .safetensors file. With PEFT metadata the file is read as PEFT's LoraConfig reads it (defaults r = 8,
lora_alpha = 8, rank_pattern / alpha_pattern matched as PEFT matches them); without, alpha = rank unless .alpha
tensors say otherwise.
"""

# The package's modules, by job: layers (the wrappers), files (reading, value checks), peft (PEFT's LoraConfig),
# lycoris (LoHa / LoKr / Tucker forms as a low-rank pair), names (naming detection, ARCHITECTURES, original-name
# rules), apply (plan, check, apply, remove, describe). The public names are all here; private ones are imported
# from their module.
from ..formats.quantized import linear_dims, linear_rows, split_rows
from .apply import apply_loras, check, components, describe, lora_nbytes, plan, remove_loras
from .files import ALPHA_DTYPES, FACTOR_DTYPES
from .layers import LoRAConv, LoRALinear, conv_dims
from .lycoris import LYCORIS_FACTORS
from .names import (ARCHITECTURES, DENOISERS, LORA_DENOISERS, LYCORIS_ROLES, NOT_LORA, PREFIXES, ROLES,
                    TEXT_ENCODERS, UNET_LAYERS, XLABS_MODULE, XLABS_ROLES, takes_loras)
from .peft import MAX_PATTERN_CHARS, MAX_PATTERN_REPEATS, MAX_PATTERNS, PEFT_DEFAULTS, PEFT_FIELDS, PLAIN_INITS

__all__ = [
    "ALPHA_DTYPES", "ARCHITECTURES", "DENOISERS", "FACTOR_DTYPES", "LORA_DENOISERS", "LYCORIS_FACTORS",
    "LYCORIS_ROLES", "MAX_PATTERNS", "MAX_PATTERN_CHARS", "MAX_PATTERN_REPEATS", "NOT_LORA", "PEFT_DEFAULTS",
    "PEFT_FIELDS", "PLAIN_INITS", "PREFIXES", "ROLES", "TEXT_ENCODERS", "UNET_LAYERS", "XLABS_MODULE", "XLABS_ROLES",
    "LoRAConv", "LoRALinear", "apply_loras", "check", "components", "conv_dims", "describe", "linear_dims",
    "linear_rows", "lora_nbytes", "plan", "remove_loras", "split_rows", "takes_loras",
]
