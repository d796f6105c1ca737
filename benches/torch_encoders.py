"""The PyTorch twin of benches/encoders.rs, and the maker of the random full-size pipeline both
read: CLIP-L (text_encoder/), OpenCLIP bigG with projection (text_encoder_g/), T5-XXL
(text_encoder_2/) and the Flux autoencoder (vae/) at their released configurations, random
N(0, 0.02) weights (norm scales 1) in bf16, saved as transformers / diffusers folders; with
--transformer also a random FLUX.1-dev transformer (transformer/) and the fixture tokenizers
(tokenizer/, tokenizer_2/), so `train` can run on the folder as a pipeline. Then times, in bf16
on the GPU, eager with the default SDPA backend: T5-XXL on 512 tokens, CLIP-L and bigG on 77,
the VAE's encode of a 1024^2 image and decode of its latents; warm-up 2, 5 timed, peak memory
per model (weights included). With --family sd3 or sdxl instead, DIR becomes a random full-size
SD3.5-large or SDXL pipeline (its text encoders, autoencoder, transformer or UNet and the
fixture tokenizers) for the whole-run memory rows, and nothing is timed. Usage:
    python3 torch_encoders.py --make DIR [--transformer] [--time]
    python3 torch_encoders.py --make DIR --family sd3|sdxl"""
import os
import shutil
import sys
import time

import torch

from torch_timing import timed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def randomized(model):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in n or "layer_norm" in n) and n.endswith("weight"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                p.normal_(0, 0.02)
    return model.eval().requires_grad_(False)


def build(make):
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        m = make()
        torch.set_default_dtype(torch.float32)
    return randomized(m)


def clip_l(projection=False):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    # openai/clip-vit-large-patch14 text config (the text_encoder/ of Flux, SDXL, SD3; SD3's
    # with its projection).
    cfg = CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072,
                         num_hidden_layers=12, num_attention_heads=12,
                         max_position_embeddings=77, hidden_act="quick_gelu",
                         projection_dim=768, eos_token_id=2, bos_token_id=0, pad_token_id=1)
    kind = CLIPTextModelWithProjection if projection else CLIPTextModel
    return build(lambda: kind(cfg))


def clip_g():
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection
    # SDXL's text_encoder_2/config.json (OpenCLIP ViT-bigG/14).
    cfg = CLIPTextConfig(vocab_size=49408, hidden_size=1280, intermediate_size=5120,
                         num_hidden_layers=32, num_attention_heads=20,
                         max_position_embeddings=77, hidden_act="gelu", projection_dim=1280,
                         eos_token_id=2, bos_token_id=0, pad_token_id=1)
    return build(lambda: CLIPTextModelWithProjection(cfg))


def t5xxl():
    from transformers import T5Config, T5EncoderModel
    # google/t5-v1_1-xxl (FLUX.1-dev text_encoder_2/config.json).
    cfg = T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                   num_heads=64, relative_attention_num_buckets=32,
                   relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
                   is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False)
    return build(lambda: T5EncoderModel(cfg))


def vae(scaling_factor=0.3611, shift_factor=0.1159):
    from diffusers import AutoencoderKL
    # FLUX.1-dev vae/config.json; SD3.5's differs only in its latent scale and shift.
    return build(lambda: AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[128, 256, 512, 512], layers_per_block=2, norm_num_groups=32,
        use_quant_conv=False, use_post_quant_conv=False, scaling_factor=scaling_factor,
        shift_factor=shift_factor))


def transformer():
    from diffusers import FluxTransformer2DModel
    # FLUX.1-dev transformer/config.json.
    return build(lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
        pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56)))


def sd3_vae():
    # stabilityai/stable-diffusion-3.5-large vae/config.json.
    return vae(scaling_factor=1.5305, shift_factor=0.0609)


def sd35_large():
    from diffusers import SD3Transformer2DModel
    # stabilityai/stable-diffusion-3.5-large transformer/config.json.
    return build(lambda: SD3Transformer2DModel(
        sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
        num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
        pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192,
        qk_norm="rms_norm"))


def sdxl_vae():
    from diffusers import AutoencoderKL
    # stabilityai/stable-diffusion-xl-base-1.0 vae/config.json.
    return build(lambda: AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[128, 256, 512, 512], layers_per_block=2, norm_num_groups=32,
        sample_size=1024, scaling_factor=0.13025))


def sdxl_unet():
    from diffusers import UNet2DConditionModel
    # stabilityai/stable-diffusion-xl-base-1.0 unet/config.json.
    return build(lambda: UNet2DConditionModel(
        sample_size=128, in_channels=4, out_channels=4,
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        block_out_channels=[320, 640, 1280], layers_per_block=2, cross_attention_dim=2048,
        transformer_layers_per_block=[1, 2, 10], attention_head_dim=[5, 10, 20],
        use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
        norm_num_groups=32))


def make_family(out, family):
    """A random full-size SD3.5-large or SDXL pipeline folder at `out`."""
    parts = {
        "sd3": [("clip_l", lambda: clip_l(projection=True), "text_encoder"),
                ("clip_g", clip_g, "text_encoder_2"), ("t5xxl", t5xxl, "text_encoder_3"),
                ("vae", sd3_vae, "vae"), ("transformer", sd35_large, "transformer")],
        "sdxl": [("clip_l", clip_l, "text_encoder"), ("clip_g", clip_g, "text_encoder_2"),
                 ("vae", sdxl_vae, "vae"), ("unet", sdxl_unet, "unet")],
    }[family]
    for name, make, folder in parts:
        t = time.perf_counter()
        m = make()
        m.save_pretrained(os.path.join(out, folder), safe_serialization=True,
                          max_shard_size="50GB")
        print(f"made {name} in {time.perf_counter() - t:.1f} s", flush=True)
        del m
        torch.cuda.empty_cache()
    fx = os.path.join(ROOT, "tests", "fixtures", "encoders")
    tokenizers = [("clip_tokenizer", "tokenizer"), ("clip_tokenizer_2", "tokenizer_2")]
    if family == "sd3":
        tokenizers.append(("t5_tokenizer", "tokenizer_3"))
    for src, dst in tokenizers:
        shutil.copytree(os.path.join(fx, src), os.path.join(out, dst), dirs_exist_ok=True)


def report(name, model, f):
    gib = 1 << 30
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        s = timed(f, warmup=2, iters=5)
    peak = torch.cuda.max_memory_allocated()
    print(f"torch {name:<12} {s * 1e3:8.1f} ms | weights {weights / gib:6.2f} GiB | "
          f"peak {peak / gib:6.2f} GiB", flush=True)


def main():
    args = sys.argv[1:]
    out = args[args.index("--make") + 1]
    if "--family" in args and args[args.index("--family") + 1] != "flux":
        make_family(out, args[args.index("--family") + 1])
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    ids77 = torch.randint(0, 49406, (1, 77), device="cuda")
    ids77[0, -1] = 49407
    ids512 = torch.randint(0, 32000, (1, 512), device="cuda")
    img = torch.rand(1, 3, 1024, 1024, device="cuda", dtype=torch.bfloat16) * 2 - 1
    for name, make, folder in [("clip_l", clip_l, "text_encoder"),
                               ("clip_g", clip_g, "text_encoder_g"),
                               ("t5xxl", t5xxl, "text_encoder_2"), ("vae", vae, "vae")]:
        t = time.perf_counter()
        m = make()
        m.save_pretrained(os.path.join(out, folder), safe_serialization=True)
        print(f"made {name} in {time.perf_counter() - t:.1f} s", flush=True)
        if "--time" in args:
            if name == "vae":
                report("vae encode", m, lambda: m.encode(img).latent_dist.mean)
                z = m.encode(img).latent_dist.mean
                report("vae decode", m, lambda: m.decode(z).sample)
            elif name == "t5xxl":
                report(name, m, lambda: m(ids512).last_hidden_state)
            else:
                report(name, m, lambda: m(ids77, output_hidden_states=True))
        del m
        torch.cuda.empty_cache()
    if "--transformer" in args:
        t = time.perf_counter()
        m = transformer()
        m.save_pretrained(os.path.join(out, "transformer"), safe_serialization=True,
                          max_shard_size="50GB")
        print(f"made the transformer in {time.perf_counter() - t:.1f} s", flush=True)
        del m
        fx = os.path.join(ROOT, "tests", "fixtures", "encoders")
        for src, dst in [("clip_tokenizer", "tokenizer"), ("t5_tokenizer", "tokenizer_2")]:
            shutil.copytree(os.path.join(fx, src), os.path.join(out, dst), dirs_exist_ok=True)


if __name__ == "__main__":
    main()
