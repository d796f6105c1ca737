"""The PyTorch twin of benches/train_step.rs: one full-size Flux-dev LoRA training step at
1024^2 (4096 image + 512 text tokens, batch 1, bf16 random base built on the GPU, peft LoRA
rank 16 alpha 16 on every Linear of the 57 blocks, f32 adapters, flow-matching MSE, fused
torch AdamW), timed after one warm-up over 3 steps, with peak memory. Modes: eager, and
eager with diffusers' gradient checkpointing. Needs diffusers and peft and
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (diffusers' Flux backward fails without it
on the GPU machine). Usage: python3 torch_train_step.py [eager] [checkpoint]"""
import sys

import torch

from torch_timing import timed
from torch_models import build


def main():
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig, inject_adapter_in_model

    modes = sys.argv[1:] or ["eager", "checkpoint"]
    bf = dict(device="cuda", dtype=torch.bfloat16)
    m = build(FluxTransformer2DModel, patch_size=1, in_channels=64, num_layers=19,
              num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
              joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
              axes_dims_rope=(16, 56, 56))
    targets = [n for n, mod in m.named_modules()
               if isinstance(mod, torch.nn.Linear) and "transformer_blocks." in n]
    m = inject_adapter_in_model(LoraConfig(r=16, lora_alpha=16, target_modules=targets), m)
    lora = [p for n, p in m.named_parameters() if "lora_" in n]
    for p in lora:
        p.data = p.data.float()
        p.requires_grad_(True)
    n_params = sum(p.numel() for p in lora)
    opt = torch.optim.AdamW(lora, lr=1e-4, fused=True)
    x0 = torch.randn(1, 4096, 64, **bf)
    txt = torch.randn(1, 512, 4096, **bf)
    y = torch.randn(1, 768, **bf)
    ids = torch.zeros(64, 64, 3)
    ids[..., 1] = torch.arange(64)[:, None]
    ids[..., 2] = torch.arange(64)[None, :]
    img_ids = ids.reshape(4096, 3).cuda()
    txt_ids = torch.zeros(512, 3, device="cuda")
    g = torch.tensor([1.0], **bf)

    def step():
        noise = torch.randn_like(x0)
        t = torch.sigmoid(torch.randn(1, device="cuda")).to(torch.bfloat16)
        xt = (1 - t) * x0 + t * noise
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(hidden_states=xt, encoder_hidden_states=txt, pooled_projections=y,
                    timestep=t, img_ids=img_ids, txt_ids=txt_ids, guidance=g).sample
        loss = torch.nn.functional.mse_loss(out.float(), (noise - x0).float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    gib = 1 << 30
    for mode in modes:
        m.enable_gradient_checkpointing() if mode == "checkpoint" else m.disable_gradient_checkpointing()
        try:
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            s = timed(step, warmup=0, iters=3)
            peak = torch.cuda.max_memory_allocated()
            print(f"torch flux-dev LoRA step ({mode}, rank 16, {n_params / 1e6:.1f} M adapter "
                  f"params): {s * 1e3:.1f} ms | peak {peak / gib:.2f} GiB")
        except torch.OutOfMemoryError as e:
            print(f"torch flux-dev LoRA step ({mode}) out of memory: {str(e).splitlines()[0]}")


if __name__ == "__main__":
    main()
