"""Train the embedded default model (klein-shapes): a tiny Flux2KleinPipeline that draws coloured shapes.

    python -m tools.train_klein_shapes.train --out weights/klein-shapes --work build/klein-train [--device cuda]

PyTorch + diffusers + transformers, on a CUDA GPU when there is one (the CPU works, hundreds of times slower), in
four stages; each writes into --work and is skipped when its output is already there, so a later stage can be re-run
alone. The training images are rendered once, up front (dataset.batch, seeded), and every stage samples from them.

  1. tokenizer: a word-level `tokenizers` model over the caption vocabulary (tools.train_klein_shapes.dataset.vocabulary) with
     Qwen3's special tokens and a Qwen3-style chat template, saved as a transformers fast tokenizer.
  2. vae: AutoencoderKLFlux2, 3 levels (64x64 -> 16x16x8 latents -> 8x8 tokens of 32 after the 2x2 patchify),
     trained on reconstruction (MSE + L1) with a small KL term; then its `bn` running mean/var are set from the
     patchified latents of 2048 of the images, as the pipeline normalises with them.
  3. text encoder: a 3-layer Qwen3ForCausalLM trained briefly as a causal LM on chat-formatted captions, then frozen.
     Frozen because the transformer then trains on fixed features, computed once for every training caption
     (cheap, and the prompt embedding is exactly what inference will compute); the short LM pre-training makes the hidden
     states contextual (a word's state depends on the words before it, and the padding positions, which attend to
     the whole prompt, summarise it) instead of random.
  4. transformer: Flux2Transformer2DModel (no guidance embedding) with the flow-matching objective exactly as
     Flux2KleinPipeline samples: patchified + bn-normalised latents packed to tokens, position ids as
     _prepare_latent_ids / _prepare_text_ids build them, prompt embeddings from the pipeline's own
     _get_qwen3_prompt_embeds at the taps TAPS, x_t = (1 - sigma) x0 + sigma noise, timestep = sigma, target
     noise - x0. 10% of captions are dropped to "" so classifier-free guidance works (klein base: is_distilled False,
     true CFG against "", 50 steps, guidance 4). Most batches use 64 text tokens (the length the model is meant to be
     run with); 1 in 32 uses 512, diffusers' default, so a default-length call is not out of distribution.
     The saved weights are an exponential moving average of the trained ones. Every --eval-every steps the average
     is sampled through diffusers' Flux2KleinPipeline on validation prompts (held-out combinations in small size,
     which the test does not use) and the semantic pass rate is logged; it is not used to pick a checkpoint.
     --resume-transformer continues from --work/transformer_ema (give another --transformer-seed).

--export DIR writes bfloat16 copies of the trained components and training.json (the record of every run), which is
how the weights came back from the lent GPU; weights/klein-shapes/README.md has the exact commands that made them.

The pipeline is saved with save_pretrained in bfloat16, plus keys that diffusers ignores and mlxdiff reads from
model_index.json: text_encoder_out_layers (the taps), max_sequence_length and sample_size (image side in pixels).
"""

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from . import dataset

TAPS = (1, 2, 3)                  # hidden_states indices of the 3-layer encoder: after layers 1, 2 and 3 (final-normed)
SEQ = 64                          # text tokens the model is trained for (and should be run with)
LONG_SEQ = 512                    # diffusers' default max_sequence_length
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "[UNK]"]
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")

VAE_CONFIG = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                  up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(32, 64, 64), layers_per_block=1,
                  latent_channels=8, norm_num_groups=16, sample_size=64)
TEXT_CONFIG = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=LONG_SEQ, rope_theta=10000.0,
                   tie_word_embeddings=True)
TRANSFORMER_CONFIG = dict(patch_size=1, in_channels=32, out_channels=None, num_layers=3, num_single_layers=6,
                          attention_head_dim=32, num_attention_heads=6, joint_attention_dim=3 * 64,
                          timestep_guidance_channels=64, mlp_ratio=3.0, axes_dims_rope=(8, 8, 8, 8), rope_theta=2000,
                          eps=1e-6, guidance_embeds=False)
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
                        time_shift_type="exponential")


def log(*args):
    print(time.strftime("%H:%M:%S"), *args, flush=True)


def to_tensor(images, device) -> torch.Tensor:
    """uint8 (N, H, W, 3) (numpy or tensor) -> float (N, 3, H, W) in [-1, 1] on device, as the image processor."""
    images = torch.as_tensor(images).to(device)
    return images.permute(0, 3, 1, 2).float() / 127.5 - 1


def cosine_lr(base, fraction, warmup_fraction=0.03, floor=0.1):
    if fraction < warmup_fraction:
        return base * fraction / warmup_fraction
    f = (fraction - warmup_fraction) / (1 - warmup_fraction)
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(f, 1.0))))


def progress_fraction(step, steps, start, minutes):
    """How far a stage is: by steps, or by wall time when the machine is slower than planned."""
    return max(step / steps, (time.time() - start) / (minutes * 60))


# ---- 1. tokenizer ----------------------------------------------------------------------------------------------

def build_tokenizer(folder: Path):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {tok: i for i, tok in enumerate(SPECIALS + dataset.vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 unk_token="[UNK]", padding_side="right", chat_template=QWEN3_TEMPLATE,
                                 additional_special_tokens=["<|im_start|>", "<think>", "</think>"])
    hf.save_pretrained(str(folder))
    return hf


# ---- 2. VAE ----------------------------------------------------------------------------------------------------

def train_vae(folder: Path, pool, seed: int, steps: int, minutes: float, device, batch_size=16, lr=2e-3):
    from diffusers import AutoencoderKLFlux2
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    vae = AutoencoderKLFlux2(**VAE_CONFIG).to(device)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    start, step = time.time(), 0
    while (fraction := progress_fraction(step, steps, start, minutes)) < 1:
        for g in opt.param_groups:
            g["lr"] = cosine_lr(lr, fraction)
        x = to_tensor(pool[torch.from_numpy(rng.integers(0, len(pool), batch_size))], device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            posterior = vae.encode(x).latent_dist
            # the mode plus a little noise: decoding full-variance samples made the first hundreds of steps learn
            # only luminance; the pipeline decodes denoised latents, not posterior samples
            z = posterior.mean + 0.1 * posterior.std * torch.randn_like(posterior.mean)
            y = vae.decode(z).sample.float()
        # shape pixels (about a tenth of the image) weigh 8x, so colour is learnt as fast as the background
        weight = 1 + 7 * saturated(x)[:, None].float()
        rec = (weight * ((y - x).pow(2) + 0.5 * (y - x).abs())).mean() / weight.mean()
        kl = posterior.kl().mean() / x[0].numel()
        loss = rec + 1e-5 * kl
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 200 == 0:
            log(f"vae step {step} rec {rec.item():.5f} kl/px {kl.item():.3f} lr {opt.param_groups[0]['lr']:.2e}")
    vae.eval()
    set_bn_statistics(vae, pool[-2048:], device)
    vae.save_pretrained(str(folder))
    log(f"vae: {step} steps x {batch_size} in {(time.time() - start) / 60:.1f} min")
    return vae


def saturated(x: torch.Tensor) -> torch.Tensor:
    """(N, H, W) bool: pixels with colour (max - min channel > 40 of 255), i.e. the shapes on the achromatic
    background; x in [-1, 1], (N, 3, H, W)."""
    return (x.amax(1) - x.amin(1)) > 40 / 127.5


@torch.no_grad()
def encode_latents(vae, images, device, batch_size=1024) -> torch.Tensor:
    """Patchified latents (N, 4 * latent_channels, h/2, w/2) of the posterior mode, as the pipeline's
    _encode_vae_image (before the bn normalisation)."""
    from diffusers import Flux2KleinPipeline
    out = []
    for i in range(0, len(images), batch_size):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            z = vae.encode(to_tensor(images[i:i + batch_size], device)).latent_dist.mode().float()
        out.append(Flux2KleinPipeline._patchify_latents(z))
    return torch.cat(out)


def set_bn_statistics(vae, images, device):
    z = encode_latents(vae, images, device)
    with torch.no_grad():
        vae.bn.running_mean.copy_(z.mean(dim=(0, 2, 3)))
        vae.bn.running_var.copy_(z.var(dim=(0, 2, 3)))
    log("vae bn: mean", np.round(vae.bn.running_mean.cpu().numpy(), 2), "std",
        np.round(vae.bn.running_var.sqrt().cpu().numpy(), 2))


def normalized_latents(vae, images, device):
    z = encode_latents(vae, images, device)
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return (z - mean) / std


# ---- 3. text encoder -------------------------------------------------------------------------------------------

def chat_ids(tokenizer, prompts, length):
    """input_ids / attention_mask exactly as Flux2KleinPipeline._get_qwen3_prompt_embeds tokenizes."""
    ids, masks = [], []
    for p in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
        enc = tokenizer(text, return_tensors="pt", padding="max_length", truncation=True, max_length=length)
        ids.append(enc["input_ids"])
        masks.append(enc["attention_mask"])
    return torch.cat(ids), torch.cat(masks)


def train_text_encoder(folder: Path, tokenizer, captions, seed: int, steps, device, batch_size=64, lr=2e-3):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    config = Qwen3Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **TEXT_CONFIG)
    model = Qwen3ForCausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    start = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(lr, step / steps)
        ids, mask = chat_ids(tokenizer, [captions[i] for i in rng.integers(0, len(captions), batch_size)], 40)
        ids, mask = ids.to(device), mask.to(device)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 50 == 0:
            log(f"text encoder step {step + 1} lm loss {loss.item():.3f}")
    model.eval()
    model.save_pretrained(str(folder))
    log(f"text encoder: {steps} steps in {(time.time() - start) / 60:.1f} min")
    return model


@torch.no_grad()
def prompt_embeds(text_encoder, tokenizer, prompts, length, device, batch_size=1024):
    from diffusers import Flux2KleinPipeline
    return torch.cat([Flux2KleinPipeline._get_qwen3_prompt_embeds(
        text_encoder, tokenizer, prompts[i:i + batch_size], dtype=torch.float32, device=device,
        max_sequence_length=length, hidden_states_layers=list(TAPS)) for i in range(0, len(prompts), batch_size)])


# ---- 4. transformer --------------------------------------------------------------------------------------------

def sample_sigmas(rng, n):
    """sigma = exponential time shift of u ~ U(0, 1) with mu ~ U(0, 2.2): covers the shifted schedules the pipeline
    samples (mu about 1.6 at 50 steps, 1.95 at 4 steps, for 64 image tokens) and the low-noise end."""
    u = rng.uniform(0.0, 1.0, n).clip(1e-4, 1.0)
    mu = rng.uniform(0.0, 2.2, n)
    return np.exp(mu) / (np.exp(mu) + (1 / u - 1))


@torch.no_grad()
def semantic_pass_rate(vae, text_encoder, tokenizer, transformer, device, prompts, steps=20, seed=0):
    """Fraction of prompts whose colour dominates their region (dataset.colour_in_region), sampled by diffusers."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    pipe = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae,
                              text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                              is_distilled=False)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(prompt=[p for p, _, _ in prompts], height=dataset.SIZE, width=dataset.SIZE,
                  num_inference_steps=steps, guidance_scale=4.0, max_sequence_length=SEQ,
                  text_encoder_out_layers=TAPS, generator=torch.Generator(device).manual_seed(seed)).images
    return dataset.pass_rate(images, prompts)[0]


def train_transformer(work: Path, pool, captions, vae, text_encoder, tokenizer, seed: int, steps: int,
                      minutes: float, device, batch_size=32, lr=5e-4, ema_decay=0.999, drop_prompt=0.1,
                      resume=False, eval_every=0):
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    resume_from = work / "transformer_ema"
    if resume:     # continue from the last saved average (fresh optimizer); main checked that it exists
        model = Flux2Transformer2DModel.from_pretrained(str(resume_from)).float().train()   # bf16 when exported
        log(f"transformer: resuming from {resume_from}")
    else:
        model = Flux2Transformer2DModel(**TRANSFORMER_CONFIG)
    model.to(device)
    if steps <= 0:
        return model.eval(), 0
    ema = Flux2Transformer2DModel(**TRANSFORMER_CONFIG).to(device)
    ema.load_state_dict(model.state_dict())
    ema.requires_grad_(False)

    t0 = time.time()
    latents = normalized_latents(vae, pool, device)                         # (N, 32, 8, 8)
    embeds_all = prompt_embeds(text_encoder, tokenizer, captions, SEQ, device)  # (N, SEQ, 3 * hidden)
    empty = prompt_embeds(text_encoder, tokenizer, [""], SEQ, device)
    log(f"transformer: {len(pool)} latents and captions encoded in {time.time() - t0:.0f} s; "
        f"latent std {latents.std():.3f}")
    img_ids = Flux2KleinPipeline._prepare_latent_ids(latents[:batch_size]).to(device)
    txt_ids = Flux2KleinPipeline._prepare_text_ids(embeds_all[:batch_size]).to(device)
    validation = dataset.held_out_prompts(size="small")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    params, ema_params = list(model.parameters()), list(ema.parameters())
    log(f"transformer: {sum(p.numel() for p in params) / 1e6:.2f} M parameters, batch {batch_size}")
    start, step, avg = time.time(), 0, None
    while (fraction := progress_fraction(step, steps, start, minutes)) < 1:
        for g in opt.param_groups:
            g["lr"] = cosine_lr(lr, fraction)
        idx = rng.integers(0, len(pool), batch_size)
        idx_t = torch.from_numpy(idx).to(device)
        drop = torch.from_numpy(rng.random(batch_size) < drop_prompt).to(device)
        if step % 32 == 31:       # a batch at diffusers' default prompt length
            embeds = prompt_embeds(text_encoder, tokenizer, ["" if d else captions[i] for i, d in
                                                             zip(idx, drop.tolist())], LONG_SEQ, device)
            ids = Flux2KleinPipeline._prepare_text_ids(embeds).to(device)
        else:
            embeds = torch.where(drop[:, None, None], empty, embeds_all[idx_t])
            ids = txt_ids
        x0 = Flux2KleinPipeline._pack_latents(latents[idx_t])   # (B, h*w, C)
        noise = torch.randn_like(x0)
        sigma = torch.from_numpy(sample_sigmas(rng, batch_size)).float().to(device)
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = model(hidden_states=xt, encoder_hidden_states=embeds, timestep=sigma, img_ids=img_ids,
                         txt_ids=ids, guidance=None, return_dict=False)[0]
        loss = (pred.float() - (noise - x0)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        decay = min(ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, params, 1 - decay)
        if step % 50 == 0:
            avg = loss.item() if avg is None else 0.9 * avg + 0.1 * loss.item()
        if step % 500 == 0:
            log(f"transformer step {step} loss {avg:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"({(time.time() - start) / step * 1000:.1f} ms/step)")
        if step % 2000 == 0:
            ema.save_pretrained(str(work / "transformer_ema"))
        if eval_every and step % eval_every == 0:
            ema.eval()
            log(f"transformer step {step}: validation pass rate "
                f"{semantic_pass_rate(vae, text_encoder, tokenizer, ema, device, validation):.1%}")
    log(f"transformer: {step} steps x {batch_size} in {(time.time() - start) / 60:.1f} min")
    ema.eval()
    ema.save_pretrained(str(work / "transformer_ema"))
    return ema, step


# ---- save ------------------------------------------------------------------------------------------------------

def save_pipeline(out: Path, vae, text_encoder, tokenizer, transformer, extra: dict):
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    pipe = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae,
                              text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                              is_distilled=False)
    pipe.to("cpu", torch.bfloat16)
    notes = {p.name: p.read_bytes() for p in out.glob("*") if p.suffix in (".md", ".txt")} if out.exists() else {}
    if out.exists():
        shutil.rmtree(out)
    pipe.save_pretrained(str(out))
    for name, data in notes.items():      # the folder's README and training log outlive a re-save
        (out / name).write_bytes(data)
    index_path = out / "model_index.json"
    index = json.loads(index_path.read_text())
    index.update(text_encoder_out_layers=list(TAPS), max_sequence_length=SEQ, sample_size=dataset.SIZE, **extra)
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    for p in out.rglob("generation_config.json"):
        p.unlink()     # a causal-LM leftover; the encoder never generates
    for p in out.glob("*/config.json"):     # from_pretrained records the local build path; it means nothing here
        config = json.loads(p.read_text())
        if config.pop("_name_or_path", None) is not None:
            p.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    log(f"saved {out}: {sum(p.stat().st_size for p in out.rglob('*') if p.is_file()) / 1e6:.1f} MB")


def export_bf16(work: Path, dest: Path):
    """bfloat16 copies of the trained components (what the saved pipeline holds anyway), small enough to move."""
    from safetensors.torch import load_file, save_file
    dest.mkdir(parents=True, exist_ok=True)
    if (work / "training.json").exists():
        shutil.copy(work / "training.json", dest / "training.json")
    for name in ("vae", "text_encoder", "transformer_ema"):
        (dest / name).mkdir(parents=True, exist_ok=True)
        shutil.copy(work / name / "config.json", dest / name / "config.json")
        for f in (work / name).glob("*.safetensors"):
            tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(f).items()}
            save_file(tensors, dest / name / f.name, metadata={"format": "pt"})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="weights/klein-shapes")
    p.add_argument("--work", default="build/klein-train")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--images", type=int, default=65536, help="training images rendered up front")
    p.add_argument("--vae-steps", type=int, default=6000)
    p.add_argument("--vae-batch", type=int, default=64)
    p.add_argument("--vae-minutes", type=float, default=2.0, help="wall-time cap on the VAE stage")
    p.add_argument("--text-steps", type=int, default=400)
    p.add_argument("--transformer-steps", type=int, default=30000)
    p.add_argument("--transformer-batch", type=int, default=256)
    p.add_argument("--transformer-minutes", type=float, default=5.0, help="wall-time cap on the transformer stage")
    p.add_argument("--transformer-lr", type=float, default=1e-3)
    p.add_argument("--transformer-seed", type=int, default=None, help="default: --seed + 3 (give another when "
                   "resuming, so the batches and noise differ from the first run's)")
    p.add_argument("--eval-every", type=int, default=0, help="log the validation pass rate every N steps (0: never)")
    p.add_argument("--final-eval", action=argparse.BooleanOptionalAction, default=True,
                   help="log the validation pass rate of the saved model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--export", help="also write bfloat16 copies of the trained components here")
    p.add_argument("--resume-transformer", action="store_true",
                   help="start the transformer stage from --work/transformer_ema (to train longer; with "
                        "--transformer-steps 0, only re-save the pipeline)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    from diffusers import AutoencoderKLFlux2
    from transformers import AutoTokenizer, Qwen3ForCausalLM
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.resume_transformer and not (work / "transformer_ema" / "config.json").exists():
        raise SystemExit(f"--resume-transformer: {work / 'transformer_ema'} holds no trained transformer; "
                         "run without --resume-transformer first")
    t_all = time.time()
    trains = (args.transformer_steps > 0 or not (work / "vae" / "config.json").exists()
              or not (work / "text_encoder" / "config.json").exists())
    pool, captions = None, None
    if trains:     # a save-only run needs no images
        images, captions, _ = dataset.batch(np.random.default_rng(args.seed), args.images)
        pool = torch.from_numpy(images).to(device)         # uint8 (N, 64, 64, 3)
        log(f"{args.images} training images rendered in {time.time() - t_all:.0f} s (seed {args.seed})")
    if not (work / "tokenizer" / "tokenizer.json").exists():
        build_tokenizer(work / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(work / "tokenizer"))
    vae = (AutoencoderKLFlux2.from_pretrained(str(work / "vae")).float().to(device) if (work / "vae" / "config.json").exists()
           else train_vae(work / "vae", pool, args.seed, args.vae_steps, args.vae_minutes, device,
                          batch_size=args.vae_batch)).eval()
    text_encoder = (Qwen3ForCausalLM.from_pretrained(str(work / "text_encoder")).float().to(device)
                    if (work / "text_encoder" / "config.json").exists()
                    else train_text_encoder(work / "text_encoder", tokenizer, captions, args.seed + 2,
                                            args.text_steps, device)).eval()
    text_encoder.requires_grad_(False)
    transformer_seed = args.seed + 3 if args.transformer_seed is None else args.transformer_seed
    transformer, steps = train_transformer(work, pool, captions, vae, text_encoder, tokenizer, transformer_seed,
                                           args.transformer_steps, args.transformer_minutes, device,
                                           batch_size=args.transformer_batch, lr=args.transformer_lr,
                                           resume=args.resume_transformer, eval_every=args.eval_every)
    # what trained the weights in --work: one entry per training run (a resumed run appends, a save-only run keeps)
    record_path = work / "training.json"
    runs = json.loads(record_path.read_text())["runs"] if record_path.exists() else []
    if steps:
        runs = (runs if args.resume_transformer else []) + [{
            "seed": args.seed, "images": args.images, "transformer_seed": transformer_seed,
            "transformer_steps": steps, "transformer_batch": args.transformer_batch,
            "transformer_lr": args.transformer_lr, "resumed": args.resume_transformer,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "minutes": round((time.time() - t_all) / 60, 1)}]
        record_path.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    record = {"runs": runs}
    if args.export:
        export_bf16(work, Path(args.export))
    if args.final_eval:
        rate = semantic_pass_rate(vae, text_encoder, tokenizer, transformer, device,
                                  dataset.held_out_prompts(size="small"))
        log(f"final validation pass rate (diffusers, 20 steps): {rate:.1%}")
    save_pipeline(Path(args.out), vae, text_encoder, tokenizer, transformer, {"_training": record})


if __name__ == "__main__":
    main()
