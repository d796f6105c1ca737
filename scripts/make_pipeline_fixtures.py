#!/usr/bin/env python3
"""Fixtures for tests/pipeline.rs: what diffusers' own pipelines make of captions (the
model's text inputs), for tiny random text encoders that read the tiny tokenizers of
tests/fixtures/encoders (made by scripts/make_encoder_fixtures.py, run that first).

The encoders of tests/fixtures/encoders have 100-token vocabularies and widths that do not
fit SD3's layout (CLIP-L + bigG wider than T5), so this script makes its own, sized for the
tokenizers (742 CLIP ids, 220 T5 ids):
  clip_l/       CLIPTextModel, width 8, quick GELU, the legacy eos_token_id 2 (pooled at the
                largest id); Flux's and SDXL's text_encoder
  clip_l_proj/  the same weights as CLIPTextModelWithProjection (projection 8 -> 12): SD3's
                text_encoder
  clip_g/       CLIPTextModelWithProjection, width 16, GELU, eos_token_id 741 (pooled at the
                first EOS), projection 16 -> 20: SDXL's and SD3's text_encoder_2
  t5/           T5EncoderModel (v1.1: gated GELU), width 32, so SD3 pads the CLIPs' 24
                features with 8 zeros

Each case builds the real pipeline class (FluxPipeline, StableDiffusion3Pipeline,
StableDiffusionXLPipeline) around these encoders and the fixture tokenizers, with no
transformer/unet, VAE or scheduler (the constructors accept None), and calls its
`encode_prompt` in float64 (no pipeline forces another dtype here). SDXL takes the
non-negative path (`do_classifier_free_guidance=False`): `force_zeros_for_empty_prompt` only
zeroes negative prompts, so the empty caption is encoded like any other.

The SD3 case `sd3_clip_l_identity` is SD3.5's single files, whose CLIP-L has no
text_projection: FLAME reads clip_l/ (no projection) and pools through the identity;
diffusers' conversion gives such a CLIP-L an identity projection, which is what its pipeline
is given here.

Writes tests/fixtures/pipeline/:
  clip_l/ clip_l_proj/ clip_g/ t5/   config.json + model.safetensors (f32 weights)
  cases.json         per case: family, FLAME's arguments (guided, t5_tokens), the diffusers
                     pipeline and arguments, encoders and tokenizers (slot order), captions
  outputs.safetensors  "<case>.context" (prompt_embeds) and "<case>.pooled"
                     (pooled_prompt_embeds), computed in f64, stored in f32

Deterministic (fixed seeds, one thread). Run: python3 scripts/make_pipeline_fixtures.py
Made with torch 2.15.0, transformers 5.24.0, diffusers 0.42.1.
"""

import json
import os
import shutil

import diffusers
import torch
import transformers
from diffusers import FluxPipeline, StableDiffusion3Pipeline, StableDiffusionXLPipeline
from safetensors.numpy import save_file
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

torch.set_num_threads(1)
# The pipelines warn of every truncated caption (the long one is truncated on purpose).
diffusers.utils.logging.set_verbosity_error()
transformers.utils.logging.set_verbosity_error()
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
OUT = os.path.join(ROOT, "tests", "fixtures", "pipeline")
TOK = os.path.join(ROOT, "tests", "fixtures", "encoders")

LONG = " ".join(["a very detailed painting of a small orange cat sitting on a red mat"] * 24)
# Empty, short, punctuation and prompt syntax, accents/CJK/emoji, longer than 77 CLIP tokens
# and than 512 T5 tokens (checked below).
CAPTIONS = [
    "",
    "a photo of a cat",
    "Hello, world!!! (cat:1.2) [dog] {bird} <lora:style:0.8> a|b \"quoted\" 3.14 #tag",
    "café crème à l'école, 日本語のキャプション 🐱 ｆｕｌｌｗｉｄｔｈ ①",
    LONG,
]
# The default T5 lengths (256, 512) on two captions only, to keep the fixtures small.
DEFAULT_LEN_CAPTIONS = [CAPTIONS[1], LONG]


def randomize(model, seed):
    """Every parameter redrawn (norms, biases, embeddings all matter), rounded to f32 (what
    the fixture stores), in f64."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if "norm" in name and name.endswith("weight"):
                v = 1.0 + 0.2 * r
            elif name.endswith("bias") and "relative_attention_bias" not in name:
                v = 0.2 * r
            elif "embed" in name or "relative_attention_bias" in name:
                v = r
            else:
                v = r / p.shape[-1] ** 0.5
            p.copy_(v.float().double())
    return model.double().eval()


def save_model(name, model):
    folder = os.path.join(OUT, name)
    os.makedirs(folder, exist_ok=True)
    model.config.to_json_file(os.path.join(folder, "config.json"))
    sd = {k: v.detach().float().contiguous().numpy() for k, v in model.state_dict().items()
          if k != "encoder.embed_tokens.weight"}
    save_file(sd, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def make_models():
    clip_tok = CLIPTokenizer.from_pretrained(os.path.join(TOK, "clip_tokenizer"))
    v_clip = len(clip_tok)
    bos, eos = clip_tok.bos_token_id, clip_tok.eos_token_id
    assert eos == v_clip - 1 and bos == v_clip - 2
    common = dict(vocab_size=v_clip, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, max_position_embeddings=77, layer_norm_eps=1e-5,
                  bos_token_id=bos, pad_token_id=1, attn_implementation="eager")
    cfg_l = CLIPTextConfig(hidden_size=8, hidden_act="quick_gelu", eos_token_id=2, **common)
    clip_l = randomize(CLIPTextModel(cfg_l), 11)
    cfg_lp = CLIPTextConfig(hidden_size=8, hidden_act="quick_gelu", eos_token_id=2,
                            projection_dim=12, **common)
    clip_l_proj = CLIPTextModelWithProjection(cfg_lp).double().eval()
    # (transformers 5's CLIPTextModel is the text transformer itself, keys without
    # "text_model.")
    missing = clip_l_proj.text_model.load_state_dict(clip_l.state_dict())
    assert not missing.missing_keys and not missing.unexpected_keys
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        w = torch.randn(clip_l_proj.text_projection.weight.shape, generator=g, dtype=torch.float64)
        clip_l_proj.text_projection.weight.copy_((w / 8 ** 0.5).float().double())
    # SD3.5 single files' CLIP-L: diffusers' conversion gives it an identity projection.
    cfg_li = CLIPTextConfig(hidden_size=8, hidden_act="quick_gelu", eos_token_id=2,
                            projection_dim=8, **common)
    clip_l_identity = CLIPTextModelWithProjection(cfg_li).double().eval()
    clip_l_identity.text_model.load_state_dict(clip_l.state_dict())
    with torch.no_grad():
        clip_l_identity.text_projection.weight.copy_(torch.eye(8, dtype=torch.float64))

    cfg_g = CLIPTextConfig(hidden_size=16, hidden_act="gelu", eos_token_id=eos,
                           projection_dim=20, **common)
    clip_g = randomize(CLIPTextModelWithProjection(cfg_g), 13)

    t5_tok = T5Tokenizer(tokenizer_file=os.path.join(TOK, "t5_tokenizer", "tokenizer.json"))
    cfg_t5 = T5Config(vocab_size=len(t5_tok) + 4, d_model=32, d_kv=8, d_ff=40, num_layers=2,
                      num_heads=4, relative_attention_num_buckets=32,
                      relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
                      layer_norm_epsilon=1e-6, is_encoder_decoder=False, use_cache=False,
                      attn_implementation="eager")
    t5 = randomize(T5EncoderModel(cfg_t5), 14)

    for name, m in [("clip_l", clip_l), ("clip_l_proj", clip_l_proj), ("clip_g", clip_g),
                    ("t5", t5)]:
        save_model(name, m)
    return dict(clip_l=clip_l, clip_l_proj=clip_l_proj, clip_l_identity=clip_l_identity,
                clip_g=clip_g, t5=t5)


def tokenizers():
    return dict(
        clip_tokenizer=CLIPTokenizer.from_pretrained(os.path.join(TOK, "clip_tokenizer")),
        clip_tokenizer_2=CLIPTokenizer.from_pretrained(os.path.join(TOK, "clip_tokenizer_2")),
        t5_tokenizer=T5Tokenizer(
            tokenizer_file=os.path.join(TOK, "t5_tokenizer", "tokenizer.json")),
    )


def run_case(case, models, toks):
    """diffusers' encode_prompt for one case: (prompt_embeds, pooled_prompt_embeds)."""
    enc = [models[e] for e in case["diffusers_encoders"]]
    tok = [toks[t] for t in case["tokenizers"]]
    caps = case["captions"]
    cpu = torch.device("cpu")
    with torch.no_grad():
        if case["family"] == "flux":
            pipe = FluxPipeline(scheduler=None, vae=None, text_encoder=enc[0], tokenizer=tok[0],
                                text_encoder_2=enc[1], tokenizer_2=tok[1], transformer=None)
            ctx, pooled, _ = pipe.encode_prompt(
                caps, prompt_2=None, device=cpu,
                max_sequence_length=case["max_sequence_length"])
        elif case["family"] == "sd3":
            pipe = StableDiffusion3Pipeline(
                transformer=None, scheduler=None, vae=None, text_encoder=enc[0],
                tokenizer=tok[0], text_encoder_2=enc[1], tokenizer_2=tok[1],
                text_encoder_3=enc[2], tokenizer_3=tok[2])
            ctx, _, pooled, _ = pipe.encode_prompt(
                caps, prompt_2=None, prompt_3=None, device=cpu,
                do_classifier_free_guidance=False,
                max_sequence_length=case["max_sequence_length"])
        else:
            pipe = StableDiffusionXLPipeline(
                vae=None, text_encoder=enc[0], text_encoder_2=enc[1], tokenizer=tok[0],
                tokenizer_2=tok[1], unet=None, scheduler=None, add_watermarker=False)
            ctx, _, pooled, _ = pipe.encode_prompt(caps, device=cpu,
                                                   do_classifier_free_guidance=False)
    assert ctx.dtype == torch.float64 and pooled.dtype == torch.float64, (ctx.dtype, pooled.dtype)
    return ctx, pooled


def cases():
    flux = dict(family="flux", flame_encoders=["clip_l", "t5"],
                diffusers_encoders=["clip_l", "t5"],
                tokenizers=["clip_tokenizer", "t5_tokenizer"], pipeline="FluxPipeline")
    sd3 = dict(family="sd3", flame_encoders=["clip_l_proj", "clip_g", "t5"],
               diffusers_encoders=["clip_l_proj", "clip_g", "t5"],
               tokenizers=["clip_tokenizer", "clip_tokenizer_2", "t5_tokenizer"],
               pipeline="StableDiffusion3Pipeline")
    sdxl = dict(family="sdxl", flame_encoders=["clip_l", "clip_g"],
                diffusers_encoders=["clip_l", "clip_g"],
                tokenizers=["clip_tokenizer", "clip_tokenizer_2"],
                pipeline="StableDiffusionXLPipeline", do_classifier_free_guidance=False)
    return {
        # FLUX.1 dev's default max_sequence_length (512), schnell's (256), and a short one.
        "flux_dev": dict(flux, guided=True, t5_tokens=0, max_sequence_length=512,
                         captions=DEFAULT_LEN_CAPTIONS),
        "flux_schnell": dict(flux, guided=False, t5_tokens=0, max_sequence_length=256,
                             captions=DEFAULT_LEN_CAPTIONS),
        "flux_t5_32": dict(flux, guided=True, t5_tokens=32, max_sequence_length=32,
                           captions=CAPTIONS),
        # SD3's default (256) and a short one.
        "sd3": dict(sd3, guided=True, t5_tokens=0, max_sequence_length=256,
                    do_classifier_free_guidance=False, captions=DEFAULT_LEN_CAPTIONS),
        "sd3_t5_32": dict(sd3, guided=True, t5_tokens=32, max_sequence_length=32,
                          do_classifier_free_guidance=False, captions=CAPTIONS),
        "sd3_clip_l_identity": dict(
            sd3, flame_encoders=["clip_l", "clip_g", "t5"],
            diffusers_encoders=["clip_l_identity", "clip_g", "t5"], guided=True, t5_tokens=32,
            max_sequence_length=32, do_classifier_free_guidance=False, captions=CAPTIONS),
        "sdxl": dict(sdxl, guided=True, t5_tokens=0, captions=CAPTIONS),
    }


if __name__ == "__main__":
    print("torch", torch.__version__, "transformers", transformers.__version__,
          "diffusers", diffusers.__version__)
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    models = make_models()
    toks = tokenizers()
    n_clip = len(toks["clip_tokenizer"](LONG)["input_ids"])
    n_t5 = len(toks["t5_tokenizer"](LONG)["input_ids"])
    assert n_clip > 77 and n_t5 > 512, (n_clip, n_t5)
    all_cases = cases()
    arrays = {}
    for name, case in all_cases.items():
        ctx, pooled = run_case(case, models, toks)
        arrays[f"{name}.context"] = ctx.float().contiguous().numpy()
        arrays[f"{name}.pooled"] = pooled.float().contiguous().numpy()
        print(f"{name}: context {tuple(ctx.shape)} pooled {tuple(pooled.shape)}")
    save_file(arrays, os.path.join(OUT, "outputs.safetensors"))
    meta = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "diffusers": diffusers.__version__},
        "compute_dtype": "float64 (stored float32)",
        "long_caption_tokens": {"clip": n_clip, "t5": n_t5},
        "cases": all_cases,
    }
    with open(os.path.join(OUT, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False, indent=1)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(OUT) for f in fs)
    print(f"wrote {OUT}: {total / 1024:.0f} KiB")
