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
fixture tokenizers) for the whole-run memory rows, and nothing is timed; with --family klein4b,
klein9b or zimage, a random full-size FLUX.2 [klein] 4B / 9B or Z-Image pipeline (transformer,
autoencoder, Qwen3; FLAME's built-in tokenizer vocabulary serves); with --family flux-gguf,
DIR/flux-q8 and DIR/flux-q4k, ComfyUI `models/` folders with a random full-size FLUX.1-dev
GGUF in Q8_0 / Q4_K (scripts/random_flux_gguf.py) beside CLIP-L, T5-XXL and the autoencoder
as single files (FLAME's built-in vocabularies serve). Usage:
    python3 torch_encoders.py --make DIR [--transformer] [--time]
    python3 torch_encoders.py --make DIR --family sd3|sdxl|klein4b|klein9b|zimage|flux-gguf"""
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


def qwen3(hidden, intermediate, layers=36, heads=32, kv_heads=8, head_dim=128,
          vocab=151936):
    """A random Qwen3 text encoder as transformers saves `Qwen3ForCausalLM` (Qwen/Qwen3-4B and
    Qwen3-8B config.json: 36 layers, 32 heads over 8 key/value heads of 128, RoPE base 1e6,
    the 4B's embeddings tied), written key by key so that no transformers release with Qwen3
    is needed: (config, {name: tensor}) in bf16 on the GPU."""
    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    w = lambda *s: torch.empty(*s, **bf).normal_(0, 0.02)
    ones = lambda n: torch.ones(n, **bf)
    t = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
                  p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
                  p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
                  p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
                  p + "self_attn.q_norm.weight": ones(head_dim),
                  p + "self_attn.k_norm.weight": ones(head_dim),
                  p + "mlp.gate_proj.weight": w(intermediate, hidden),
                  p + "mlp.up_proj.weight": w(intermediate, hidden),
                  p + "mlp.down_proj.weight": w(hidden, intermediate),
                  p + "input_layernorm.weight": ones(hidden),
                  p + "post_attention_layernorm.weight": ones(hidden)})
    tied = hidden == 2560
    if not tied:
        t["lm_head.weight"] = w(vocab, hidden)
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
           "hidden_size": hidden, "intermediate_size": intermediate,
           "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu",
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False,
           "max_position_embeddings": 40960, "tie_word_embeddings": tied,
           "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645}
    return cfg, t


def flux2_vae():
    from diffusers import AutoencoderKLFlux2
    # AutoencoderKLFlux2's defaults are the released FLUX.2 autoencoder's configuration.
    return build(lambda: AutoencoderKLFlux2())


def klein_transformer(layers, single, heads, context):
    from diffusers import Flux2Transformer2DModel
    # FLUX.2 [klein] 4B / 9B (BFL's Klein4BParams / Klein9BParams, FLAME's
    # `Flux2Config::klein_4b` / `klein_9b`): no guidance embedding.
    return build(lambda: Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=layers, num_single_layers=single,
        attention_head_dim=128, num_attention_heads=heads, joint_attention_dim=context,
        guidance_embeds=False, axes_dims_rope=(32, 32, 32, 32)))


def zimage_transformer():
    from diffusers import ZImageTransformer2DModel
    # ZImageTransformer2DModel's defaults are Z-Image 6B's configuration.
    return build(lambda: ZImageTransformer2DModel())


def make_qwen_pipeline(out, family):
    """A random full-size FLUX.2 [klein] 4B / 9B or Z-Image pipeline folder at `out`: the
    transformer, the autoencoder and Qwen3 as diffusers saves them, the scheduler of the
    released pipelines, no tokenizer folder (FLAME's built-in Qwen3 vocabulary serves)."""
    import json
    from safetensors.torch import save_file
    sizes = {"klein4b": (5, 20, 24, 7680, 2560, 9728), "klein9b": (8, 24, 32, 12288, 4096, 12288)}
    if family == "zimage":
        parts = [("transformer", zimage_transformer), ("vae", vae)]
        hidden, inter, pipeline = 2560, 9728, "ZImagePipeline"
        vae_class, transformer_class = "AutoencoderKL", "ZImageTransformer2DModel"
    else:
        layers, single, heads, context, hidden, inter = sizes[family]
        parts = [("transformer", lambda: klein_transformer(layers, single, heads, context)),
                 ("vae", flux2_vae)]
        pipeline = "Flux2KleinPipeline"
        vae_class, transformer_class = "AutoencoderKLFlux2", "Flux2Transformer2DModel"
    for folder, make in parts:
        t = time.perf_counter()
        m = make()
        m.save_pretrained(os.path.join(out, folder), safe_serialization=True,
                          max_shard_size="50GB")
        print(f"made {folder} in {time.perf_counter() - t:.1f} s", flush=True)
        del m
        torch.cuda.empty_cache()
    t = time.perf_counter()
    cfg, tensors = qwen3(hidden, inter)
    te = os.path.join(out, "text_encoder")
    os.makedirs(te, exist_ok=True)
    with open(os.path.join(te, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(te, "model.safetensors"), metadata={"format": "pt"})
    print(f"made text_encoder in {time.perf_counter() - t:.1f} s", flush=True)
    del tensors
    torch.cuda.empty_cache()
    # The released pipelines' scheduler_config.json: FLUX.2 shifts by the image's tokens,
    # Z-Image by a fixed 3.
    sched = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256,
             "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
             "num_train_timesteps": 1000, "shift": 3.0, "time_shift_type": "exponential",
             "use_dynamic_shifting": family != "zimage"}
    os.makedirs(os.path.join(out, "scheduler"), exist_ok=True)
    with open(os.path.join(out, "scheduler", "scheduler_config.json"), "w") as f:
        json.dump(sched, f, indent=2)
    index = {"_class_name": pipeline, "_diffusers_version": "0.42.1",
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "Qwen3ForCausalLM"],
             "tokenizer": ["transformers", "Qwen2Tokenizer"],
             "transformer": ["diffusers", transformer_class], "vae": ["diffusers", vae_class]}
    if family != "zimage":
        index["is_distilled"] = False
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)


def save_single(model, path, config):
    """`model`'s weights as one .safetensors file at `path`, its config (a JSON string) in the
    file's metadata; tensors sharing storage (T5's tied embeddings) are written apart."""
    from safetensors.torch import save_file
    seen, tensors = set(), {}
    for k, v in model.state_dict().items():
        v = v.contiguous()
        if v.data_ptr() in seen:
            v = v.clone()
        seen.add(v.data_ptr())
        tensors[k] = v
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(tensors, path, metadata={"format": "pt", "config": config})


def make_gguf_flux(out):
    """Random full-size FLUX.1-dev GGUF models in two ComfyUI `models/` folders under `out`:
    flux-q8/ (unet/flux1-dev-Q8_0.gguf) and flux-q4k/ (unet/flux1-dev-Q4_K_S.gguf), made by
    scripts/random_flux_gguf.py in city96's layout, beside text_encoders/clip_l.safetensors,
    text_encoders/t5xxl_bf16.safetensors and vae/ae.safetensors as single files (configs in
    their metadata), written once in flux-q8/ and linked from flux-q4k/."""
    import json
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import random_flux_gguf as rg
    q8, q4k = os.path.join(out, "flux-q8"), os.path.join(out, "flux-q4k")
    for name, make, rel in [("clip_l", clip_l, "text_encoders/clip_l.safetensors"),
                            ("t5xxl", t5xxl, "text_encoders/t5xxl_bf16.safetensors"),
                            ("vae", vae, "vae/ae.safetensors")]:
        t = time.perf_counter()
        m = make()
        config = (json.dumps(dict(m.config)) if name == "vae" else m.config.to_json_string())
        save_single(m, os.path.join(q8, rel), config)
        print(f"made {name} in {time.perf_counter() - t:.1f} s", flush=True)
        del m
        torch.cuda.empty_cache()
    os.makedirs(q4k, exist_ok=True)
    for folder in ("text_encoders", "vae"):
        link = os.path.join(q4k, folder)
        if not os.path.lexists(link):
            os.symlink(os.path.join("..", "flux-q8", folder), link)
    for folder, qtype, file in [(q8, rg.T.Q8_0, "flux1-dev-Q8_0.gguf"),
                                (q4k, rg.T.Q4_K, "flux1-dev-Q4_K_S.gguf")]:
        t = time.perf_counter()
        path = os.path.join(folder, "unet", file)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        rg.write(path, qtype, rg.DEV, seed=0)
        print(f"made {path}: {os.path.getsize(path) / 2**30:.2f} GiB in "
              f"{time.perf_counter() - t:.1f} s", flush=True)


def make_family(out, family):
    """A random full-size SD3.5-large, SDXL, FLUX.2 [klein] or Z-Image pipeline folder at
    `out`."""
    if family in ("klein4b", "klein9b", "zimage"):
        return make_qwen_pipeline(out, family)
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
    if "--family" in args and args[args.index("--family") + 1] == "flux-gguf":
        make_gguf_flux(out)
        return
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
