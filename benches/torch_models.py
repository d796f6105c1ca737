"""diffusers on the shapes of benches/models.rs, timed the same way in the same call: full-size
Flux-dev, SD3.5-large and the SDXL UNet at 1024^2, batch 1, bf16, random weights built on the
GPU, frozen, backward to the input latents. Eager, default SDPA backend. ITERS 3 after 1
warm-up, as the Rust side. Usage: python3 torch_models.py [flux|sd35|sdxl]..."""
import sys

import torch

from torch_timing import timed as timed_n


def timed(f):
    return timed_n(f, warmup=1, iters=3)


def build(cls, **cfg):
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = cls(**cfg)
        torch.set_default_dtype(torch.float32)
    model.requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.02)
    return model


def report(name, model, latents, call):
    weights = sum(p.numel() * p.element_size() for p in model.parameters())

    def fwd():
        with torch.no_grad():
            call()

    def both():
        latents.grad = None
        out = call()
        out.backward(torch.ones_like(out))

    try:
        f = timed(fwd)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        b = timed(both)
        peak = torch.cuda.max_memory_allocated()
        gib = 1 << 30
        print(f"torch {name:<6} fwd {f * 1e3:8.1f} ms | fwd+bwd {b * 1e3:8.1f} ms | "
              f"weights {weights / gib:6.2f} GiB | peak {peak / gib:6.2f} GiB")
    except torch.OutOfMemoryError as e:
        print(f"torch {name:<6} out of memory: {str(e).splitlines()[0]}")


def main():
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel

    torch.backends.cuda.matmul.allow_tf32 = True
    want = sys.argv[1:] or ["flux", "sd35", "sdxl"]
    bf = dict(device="cuda", dtype=torch.bfloat16)
    if "flux" in want:
        m = build(FluxTransformer2DModel, patch_size=1, in_channels=64, num_layers=19,
                  num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                  joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                  axes_dims_rope=(16, 56, 56))
        img = torch.randn(1, 4096, 64, **bf).requires_grad_()
        txt = torch.randn(1, 512, 4096, **bf)
        y = torch.randn(1, 768, **bf)
        ids = torch.zeros(64, 64, 3)
        ids[..., 1] = torch.arange(64)[:, None]
        ids[..., 2] = torch.arange(64)[None, :]
        img_ids = ids.reshape(4096, 3).cuda()
        txt_ids = torch.zeros(512, 3, device="cuda")
        t = torch.tensor([0.7], **bf)
        g = torch.tensor([3.5], **bf)
        report("flux", m, img, lambda: m(hidden_states=img, encoder_hidden_states=txt,
                                         pooled_projections=y, timestep=t, img_ids=img_ids,
                                         txt_ids=txt_ids, guidance=g).sample)
        del m
        torch.cuda.empty_cache()
    if "sd35" in want:
        m = build(SD3Transformer2DModel, sample_size=128, patch_size=2, in_channels=16,
                  num_layers=38, attention_head_dim=64, num_attention_heads=38,
                  joint_attention_dim=4096, caption_projection_dim=2432,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192,
                  qk_norm="rms_norm")
        x = torch.randn(1, 16, 128, 128, **bf).requires_grad_()
        ctx = torch.randn(1, 333, 4096, **bf)
        y = torch.randn(1, 2048, **bf)
        t = torch.tensor([700.0], **bf)
        report("sd35", m, x, lambda: m(hidden_states=x, encoder_hidden_states=ctx,
                                       pooled_projections=y, timestep=t).sample)
        del m
        torch.cuda.empty_cache()
    if "sdxl" in want:
        m = build(UNet2DConditionModel, sample_size=128, in_channels=4, out_channels=4,
                  down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                  block_out_channels=(320, 640, 1280), layers_per_block=2,
                  transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
                  cross_attention_dim=2048, use_linear_projection=True,
                  addition_embed_type="text_time", addition_time_embed_dim=256,
                  projection_class_embeddings_input_dim=2816)
        x = torch.randn(1, 4, 128, 128, **bf).requires_grad_()
        ctx = torch.randn(1, 77, 2048, **bf)
        text = torch.randn(1, 1280, **bf)
        time_ids = torch.tensor([[1024.0, 1024, 0, 0, 1024, 1024]], **bf)
        t = torch.tensor([700.0], **bf)
        report("sdxl", m, x, lambda: m(x, t, encoder_hidden_states=ctx, added_cond_kwargs={
            "text_embeds": text, "time_ids": time_ids}).sample)


if __name__ == "__main__":
    main()
