"""The PyTorch twin of benches/train_step.rs: one full-size LoRA training step at 1024^2,
batch 1, bf16 random base built on the GPU, peft LoRA rank 16 alpha 16 on every Linear of the
blocks FLAME's bench targets, f32 adapters, MSE against a flow-matching (Flux, SD3.5) or
noise (SDXL) target, fused torch AdamW, timed after one warm-up over 3 steps, with peak
memory. Models (the shapes of benches/train_step.rs):
  flux  Flux-dev, 4096 image + 512 text tokens, LoRA on transformer_blocks/single_transformer_blocks
  sd35  SD3.5-large, 4096 image + 333 text tokens, LoRA on transformer_blocks
  sdxl  the SDXL UNet, 128x128 latents, 77 text tokens, LoRA on down/mid/up blocks
  klein4b, klein9b  FLUX.2 [klein] 4B / 9B (Flux2Transformer2DModel without guidance), 4096
        image + 512 text tokens, LoRA on transformer_blocks/single_transformer_blocks
  zimage  Z-Image 6B (ZImageTransformer2DModel's defaults), 128x128 latents, 512 caption
        tokens, LoRA on noise_refiner/context_refiner/layers
Modes: eager, eager with diffusers' gradient checkpointing, and compile (torch.compile applied
to each transformer block / UNet block, after the LoRA injection; its first steps compile,
so it warms up over two steps before timing). Needs diffusers and peft and
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (diffusers' Flux backward fails without it
on the GPU machine). Usage: python3 torch_train_step.py [--model flux|sd35|sdxl|klein4b|klein9b|zimage] [eager]
[checkpoint] [compile]"""
import sys

import torch

from torch_timing import timed
from torch_models import build


def flux():
    from diffusers import FluxTransformer2DModel

    bf = dict(device="cuda", dtype=torch.bfloat16)
    m = build(FluxTransformer2DModel, patch_size=1, in_channels=64, num_layers=19,
              num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
              joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
              axes_dims_rope=(16, 56, 56))
    x0 = torch.randn(1, 4096, 64, **bf)
    txt = torch.randn(1, 512, 4096, **bf)
    y = torch.randn(1, 768, **bf)
    ids = torch.zeros(64, 64, 3)
    ids[..., 1] = torch.arange(64)[:, None]
    ids[..., 2] = torch.arange(64)[None, :]
    img_ids = ids.reshape(4096, 3).cuda()
    txt_ids = torch.zeros(512, 3, device="cuda")
    g = torch.tensor([1.0], **bf)

    def loss():
        noise = torch.randn_like(x0)
        t = torch.sigmoid(torch.randn(1, device="cuda")).to(torch.bfloat16)
        xt = (1 - t) * x0 + t * noise
        out = m(hidden_states=xt, encoder_hidden_states=txt, pooled_projections=y,
                timestep=t, img_ids=img_ids, txt_ids=txt_ids, guidance=g).sample
        return torch.nn.functional.mse_loss(out.float(), (noise - x0).float())

    return m, ("transformer_blocks.",), loss


def klein(layers, single, heads, context):
    from diffusers import Flux2Transformer2DModel

    bf = dict(device="cuda", dtype=torch.bfloat16)
    # The FLUX.2 [klein] sizes of FLAME's `Flux2Config::klein_4b` / `klein_9b`.
    m = build(Flux2Transformer2DModel, patch_size=1, in_channels=128, num_layers=layers,
              num_single_layers=single, attention_head_dim=128, num_attention_heads=heads,
              joint_attention_dim=context, guidance_embeds=False, axes_dims_rope=(32, 32, 32, 32))
    x0 = torch.randn(1, 4096, 128, **bf)
    txt = torch.randn(1, 512, context, **bf)
    ids = torch.zeros(64, 64, 4)
    ids[..., 1] = torch.arange(64)[:, None]
    ids[..., 2] = torch.arange(64)[None, :]
    img_ids = ids.reshape(1, 4096, 4).cuda()
    txt_ids = torch.zeros(1, 512, 4, device="cuda")
    txt_ids[..., 3] = torch.arange(512, device="cuda")

    def loss():
        noise = torch.randn_like(x0)
        t = torch.sigmoid(torch.randn(1, device="cuda")).to(torch.bfloat16)
        xt = (1 - t) * x0 + t * noise
        out = m(hidden_states=xt, encoder_hidden_states=txt, timestep=t, img_ids=img_ids,
                txt_ids=txt_ids).sample
        return torch.nn.functional.mse_loss(out.float(), (noise - x0).float())

    return m, ("transformer_blocks.",), loss


def zimage():
    from diffusers import ZImageTransformer2DModel

    bf = dict(device="cuda", dtype=torch.bfloat16)
    m = build(ZImageTransformer2DModel)
    x0 = torch.randn(16, 1, 128, 128, **bf)
    cap = torch.randn(512, 2560, **bf)

    def loss():
        noise = torch.randn_like(x0)
        t = torch.sigmoid(torch.randn(1, device="cuda")).to(torch.bfloat16)
        xt = (1 - t) * x0 + t * noise
        out = m([xt], 1 - t, [cap]).sample[0]
        return torch.nn.functional.mse_loss(out.float(), (x0 - noise).float())

    return m, ("layers.", "noise_refiner.", "context_refiner."), loss


def sd35():
    from diffusers import SD3Transformer2DModel

    bf = dict(device="cuda", dtype=torch.bfloat16)
    m = build(SD3Transformer2DModel, sample_size=128, patch_size=2, in_channels=16,
              num_layers=38, attention_head_dim=64, num_attention_heads=38,
              joint_attention_dim=4096, caption_projection_dim=2432,
              pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192,
              qk_norm="rms_norm")
    x0 = torch.randn(1, 16, 128, 128, **bf)
    ctx = torch.randn(1, 333, 4096, **bf)
    y = torch.randn(1, 2048, **bf)

    def loss():
        noise = torch.randn_like(x0)
        t = torch.sigmoid(torch.randn(1, device="cuda")).to(torch.bfloat16)
        xt = (1 - t) * x0 + t * noise
        out = m(hidden_states=xt, encoder_hidden_states=ctx, pooled_projections=y,
                timestep=t * 1000).sample
        return torch.nn.functional.mse_loss(out.float(), (noise - x0).float())

    return m, ("transformer_blocks.",), loss


def sdxl():
    from diffusers import UNet2DConditionModel

    bf = dict(device="cuda", dtype=torch.bfloat16)
    m = build(UNet2DConditionModel, sample_size=128, in_channels=4, out_channels=4,
              down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
              up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
              block_out_channels=(320, 640, 1280), layers_per_block=2,
              transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
              cross_attention_dim=2048, use_linear_projection=True,
              addition_embed_type="text_time", addition_time_embed_dim=256,
              projection_class_embeddings_input_dim=2816)
    x0 = torch.randn(1, 4, 128, 128, **bf)
    ctx = torch.randn(1, 77, 2048, **bf)
    text = torch.randn(1, 1280, **bf)
    time_ids = torch.tensor([[1024.0, 1024, 0, 0, 1024, 1024]], **bf)

    def loss():
        noise = torch.randn_like(x0)
        t = torch.randint(0, 1000, (1,), device="cuda")
        # The scaled-linear schedule's alpha-bar at t (a fixed mix is enough for timing).
        a = 0.5
        xt = a ** 0.5 * x0 + (1 - a) ** 0.5 * noise
        out = m(xt, t, encoder_hidden_states=ctx, added_cond_kwargs={
            "text_embeds": text, "time_ids": time_ids}).sample
        return torch.nn.functional.mse_loss(out.float(), noise.float())

    return m, ("down_blocks.", "mid_block.", "up_blocks."), loss


def main():
    from peft import LoraConfig, inject_adapter_in_model

    args = sys.argv[1:]
    name = "flux"
    if "--model" in args:
        i = args.index("--model")
        name = args[i + 1]
        del args[i:i + 2]
    modes = args or ["eager", "checkpoint"]
    m, prefixes, loss = {
        "flux": flux, "sd35": sd35, "sdxl": sdxl,
        "klein4b": lambda: klein(5, 20, 24, 7680),
        "klein9b": lambda: klein(8, 24, 32, 12288),
        "zimage": zimage,
    }[name]()
    targets = [n for n, mod in m.named_modules()
               if isinstance(mod, torch.nn.Linear) and any(p in n for p in prefixes)]
    m = inject_adapter_in_model(LoraConfig(r=16, lora_alpha=16, target_modules=targets), m)
    lora = [p for n, p in m.named_parameters() if "lora_" in n]
    for p in lora:
        p.data = p.data.float()
        p.requires_grad_(True)
    n_params = sum(p.numel() for p in lora)
    opt = torch.optim.AdamW(lora, lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            value = loss()
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    gib = 1 << 30
    label = {"flux": "flux-dev", "sd35": "sd3.5-large", "sdxl": "sdxl",
             "klein4b": "flux2-klein-4b", "klein9b": "flux2-klein-9b",
             "zimage": "zimage-6b"}[name]
    # Compile last: it replaces the blocks' forward for good.
    modes = sorted(modes, key=lambda x: x == "compile")
    for mode in modes:
        m.enable_gradient_checkpointing() if mode == "checkpoint" else m.disable_gradient_checkpointing()
        if mode == "compile":
            def is_block(n):  # transformer_blocks.3, single_transformer_blocks.7, mid_block
                parts = n.split(".")
                return (len(parts) == 2 and parts[1].isdigit() and any(p in n + "." for p in prefixes)
                        or n + "." in prefixes)
            blocks = [mod for n, mod in m.named_modules() if is_block(n)]
            for b in blocks:
                b.compile()
        try:
            step()
            if mode == "compile":
                step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            s = timed(step, warmup=0, iters=3)
            peak = torch.cuda.max_memory_allocated()
            print(f"torch {label} LoRA step ({mode}, rank 16, {n_params / 1e6:.1f} M adapter "
                  f"params): {s * 1e3:.1f} ms | peak {peak / gib:.2f} GiB")
        except torch.OutOfMemoryError as e:
            print(f"torch {label} LoRA step ({mode}) out of memory: {str(e).splitlines()[0]}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
