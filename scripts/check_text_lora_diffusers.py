#!/usr/bin/env python3
"""Loads a FLAME-written PEFT-layout LoRA holding text-encoder adapters (`text_encoder.*`,
`text_encoder_2.*`) into a tiny SDXL pipeline with diffusers'
`StableDiffusionXLLoraLoaderMixin.load_lora_weights` and checks that every tensor of the file
is taken (no unexpected or missing keys) and that both encoders then give the outputs of
transformers + peft with the same LoRA (tests/fixtures/text_lora/outputs.safetensors, made by
scripts/make_text_lora_fixtures.py).

The pipeline is built here from configs: the tiny random CLIP-L and bigG of
tests/fixtures/encoders with their tokenizers, a tiny random UNet and autoencoder (not run).

Usage: check_text_lora_diffusers.py [LORA.safetensors]
(default: tests/fixtures/text_lora/lora.safetensors). Runs in float64 on the CPU; exits 1 when
a key is left over or missing or max |diff| / max |peft| exceeds 1e-4. Called by the ignored
test diffusers_loads_the_text_encoder_lora in tests/text_lora.rs.
Checked with torch 2.15.0, transformers 5.24.0, diffusers 0.42.1, peft.
"""
import logging
import os
import sys
import types

import torch

if not hasattr(torch, "accelerator"):  # diffusers 0.42 probes it; torch < 2.6 lacks it
    torch.accelerator = types.SimpleNamespace(
        is_available=lambda: False, current_accelerator=lambda *a, **k: None, device_count=lambda: 0)

from diffusers import (AutoencoderKL, EulerDiscreteScheduler,  # noqa: E402
                       StableDiffusionXLPipeline, UNet2DConditionModel)
from diffusers.utils import logging as dlogging  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (CLIPTextModel, CLIPTextModelWithProjection,  # noqa: E402
                          CLIPTokenizer)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ENC = os.path.join(ROOT, "tests", "fixtures", "encoders")
FIX = os.path.join(ROOT, "tests", "fixtures", "text_lora")


def pipeline():
    torch.manual_seed(0)
    te = CLIPTextModel.from_pretrained(f"{ENC}/clip_l", torch_dtype=torch.float64)
    te2 = CLIPTextModelWithProjection.from_pretrained(f"{ENC}/clip_g", torch_dtype=torch.float64)
    # Context = both widths side by side (24 + 24); added embeddings = 6 time ids of 8 + the
    # 16-wide projection.
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(8, 16), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=48,
        attention_head_dim=2, norm_num_groups=4, addition_embed_type="text_time",
        addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + 16,
        transformer_layers_per_block=1, use_linear_projection=True).double()
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",)).double()
    return StableDiffusionXLPipeline(
        vae=vae, text_encoder=te, text_encoder_2=te2,
        tokenizer=CLIPTokenizer.from_pretrained(f"{ENC}/clip_tokenizer"),
        tokenizer_2=CLIPTokenizer.from_pretrained(f"{ENC}/clip_tokenizer_2"),
        unet=unet, scheduler=EulerDiscreteScheduler())


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = []

    def emit(self, record):
        self.seen.append(record.getMessage())


def main():
    lora = sys.argv[1] if len(sys.argv) > 1 else f"{FIX}/lora.safetensors"
    pipe = pipeline()
    caught = Warnings()
    dlogging.get_logger("diffusers").addHandler(caught)
    logging.getLogger("peft").addHandler(caught)
    sd = load_file(lora)
    pipe.load_lora_weights(sd, adapter_name="flame")
    # The file holds no UNet LoRA: diffusers says so, and that note is no key problem.
    bad = [w for w in caught.seen if not w.startswith("No LoRA keys associated")
           and ("unexpected" in w.lower() or "missing" in w.lower())]
    ok = not bad
    for w in bad:
        print("diffusers:", w)
    # Every tensor of the file is now a LoRA weight of one of the two encoders.
    for prefix, enc in [("text_encoder", pipe.text_encoder), ("text_encoder_2", pipe.text_encoder_2)]:
        have = {n for n, _ in enc.named_parameters() if ".lora_" in n}
        want = [k for k in sd if k.startswith(prefix + ".")]
        print(f"{prefix}: {len(want)} tensors in the file, {len(have)} LoRA weights loaded")
        ok &= len(want) == len(have) and len(want) > 0
    extra = [k for k in sd if not k.startswith(("text_encoder.", "text_encoder_2."))]
    if extra:
        print("tensors for neither encoder:", extra[:3])
        ok = False
    io = load_file(f"{FIX}/outputs.safetensors")
    worst = 0.0
    with torch.no_grad():
        for name, enc in [("clip_l", pipe.text_encoder), ("clip_g", pipe.text_encoder_2)]:
            ids = io[f"{name}.ids"].long()
            o = enc.double()(input_ids=ids, output_hidden_states=True)
            for what, got in [("last_hidden", o.last_hidden_state),
                              ("penultimate", o.hidden_states[-2])]:
                want = io[f"{name}.{what}"].double()
                e = ((got - want).abs().max() / want.abs().max()).item()
                print(f"{name} {what}: max rel err {e:.2e}")
                worst = max(worst, e)
    ok &= worst <= 1e-4
    print("ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
