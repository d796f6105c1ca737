#!/usr/bin/env python3
"""Key lists for tests/keylists.rs: every tensor (key, shape, storage dtype) of the full-size
encoder files users download, built on the meta device at the real configurations (no weights,
no download).

Writes tests/fixtures/keylists/<name>.json, each a sorted JSON list of [key, [shape...], dtype]
(dtype as safetensors names it: the storage of the released files as far as known, half precision
but BFL's f32 ae.safetensors and int64 buffers; FLAME converts every float dtype on read, so the
test does not depend on it):

  clip_l.json                CLIP ViT-L/14 text tower, transformers layout `text_model.*`:
                             Flux's text_encoder/, ComfyUI's clip_l.safetensors
  clip_l_projection.json     the same with `text_projection.weight` (CLIPTextModelWithProjection:
                             SD3 / SD3.5's text_encoder/)
  clip_l_bare.json           CLIPTextModel as transformers 5 saves it (no `text_model.`)
  clip_g.json                OpenCLIP ViT-bigG/14 text tower in transformers layout with its
                             projection: SDXL / SD3.5's text_encoder_2/, ComfyUI's clip_g
  sdxl_clip_l.json           CLIP-L inside SDXL's single file
                             (`conditioner.embedders.0.transformer.`), with the position_ids
                             buffer those files carry
  sdxl_clip_g_openclip.json  bigG inside SDXL's single file in OpenCLIP's layout
                             (`conditioner.embedders.1.model.`), with its logit_scale
  sd35_clip_l.json, sd35_clip_g.json, sd35_t5xxl.json
                             the encoders inside SD3 / SD3.5 single files that include them
                             (`text_encoders.{clip_l,clip_g,t5xxl}.transformer.`)
  t5xxl.json                 T5 v1.1 XXL encoder (`shared.weight` + `encoder.*`): ComfyUI's
                             t5xxl_fp16.safetensors, Flux's text_encoder_2/, SD3.5's text_encoder_3/
  flux_ae.json               BFL's ae.safetensors (LDM names, no prefix, no quant convs)
  sdxl_vae.json              SDXL's vae/ (diffusers layout, quant convs)
  sdxl_vae_ldm.json          SDXL's single file VAE (`first_stage_model.`, LDM names)
  sd35_vae.json              SD3.5's vae/ (diffusers layout; Flux's vae/ has the same keys)
  sd35_vae_ldm.json          SD3.5's single file VAE (`first_stage_model.`, LDM names)

Where a layout is not a model's own state dict (OpenCLIP, LDM, the single-file prefixes) the
list is written from the original architecture here and then proven: a dict of meta tensors with
exactly those keys and shapes goes through diffusers' own single-file converter
(`convert_open_clip_checkpoint`, `convert_ldm_vae_checkpoint`, `convert_ldm_clip_checkpoint`,
`convert_sd3_t5_checkpoint_to_diffusers`), and the result must equal the transformers /
diffusers model's state dict key for key and shape for shape.

Run: python3 scripts/make_keylists.py   (torch 2.15.0, transformers 5.24.0, diffusers 0.42.1)
"""

import json
import os

import torch
from diffusers import AutoencoderKL
from diffusers.loaders.single_file_utils import (
    convert_ldm_clip_checkpoint,
    convert_ldm_vae_checkpoint,
    convert_open_clip_checkpoint,
    convert_sd3_t5_checkpoint_to_diffusers,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    T5Config,
    T5EncoderModel,
)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "keylists")
META = torch.device("meta")

# --- configurations --------------------------------------------------------------------------

# openai/clip-vit-large-patch14 config.json, text_config (the text_encoder/config.json of SDXL,
# SD3.5 and Flux carries the same sizes): width 768, 12 layers of 12 heads, MLP 3072, quick GELU,
# 77 positions, 49408 tokens, projection 768.
CLIP_L = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    projection_dim=768,
)
# laion/CLIP-ViT-bigG-14-laion2B-39B-b160k text tower as stabilityai/stable-diffusion-xl-base-1.0
# text_encoder_2/config.json gives it (SD3.5's text_encoder_2/ is the same): width 1280,
# 32 layers of 20 heads, MLP 5120, GELU, projection 1280.
CLIP_G = dict(
    CLIP_L,
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    hidden_act="gelu",
    projection_dim=1280,
)
# google/t5-v1_1-xxl config.json (Flux's text_encoder_2/, SD3.5's text_encoder_3/): d_model 4096,
# 64 heads of 64, d_ff 10240, 24 layers, 32 buckets up to distance 128, gated GELU.
T5_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
)
# The vae/config.json of stabilityai/stable-diffusion-xl-base-1.0: four levels of
# (128, 256, 512, 512), 2 ResNets per encoder level, 4 latent channels, quant convs.
VAE_SDXL = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    act_fn="silu",
    latent_channels=4,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=0.13025,
)
# stabilityai/stable-diffusion-3.5-large vae/config.json: the same levels, 16 latent channels,
# no quant convs (black-forest-labs/FLUX.1-dev vae/config.json has the same sizes; only its
# scaling_factor 0.3611 / shift_factor 0.1159 differ, which are not in the weights).
VAE_16 = dict(
    VAE_SDXL,
    latent_channels=16,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=1.5305,
    shift_factor=0.0609,
)

# Prefixes inside single files (diffusers single_file_utils CHECKPOINT_KEY_NAMES / LDM_VAE_KEYS).
SDXL_CLIP_L = "conditioner.embedders.0.transformer."
SDXL_CLIP_G = "conditioner.embedders.1.model."
SD3_CLIP_L = "text_encoders.clip_l.transformer."
SD3_CLIP_G = "text_encoders.clip_g.transformer."
SD3_T5 = "text_encoders.t5xxl.transformer."
LDM_VAE = "first_stage_model."

# --- helpers ---------------------------------------------------------------------------------

DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}


def shapes(state):
    """{key: shape tuple} of a state dict."""
    return {k: tuple(v.shape) for k, v in state.items()}


def meta_dict(entries):
    """{key: meta tensor} for {key: shape}."""
    return {k: torch.empty(s, device=META) for k, s in entries.items()}


def prefixed(prefix, entries):
    return {prefix + k: s for k, s in entries.items()}


def assert_same(what, got, want, source=None, dropped=(), fanout=lambda key: 1):
    """Key sets and shapes equal, else an error naming the differences. With `source` (the list
    a converter was given), also every source key but those in `dropped` must have become
    `fanout(key)` keys of `got`: converters skip keys they do not know, so an extra key would
    otherwise pass unseen."""
    if source is not None:
        n = sum(fanout(k) for k in source if k not in dropped)
        if len(got) != n:
            raise AssertionError(f"{what}: {len(source)} keys should become {n}, became {len(got)}")
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    bad = sorted(k for k in set(got) & set(want) if tuple(got[k]) != tuple(want[k]))
    if missing or extra or bad:
        raise AssertionError(
            f"{what}: missing {missing[:5]}, extra {extra[:5]}, "
            f"misshapen {[(k, got[k], want[k]) for k in bad[:5]]}"
        )


def write(name, entries, dtype, overrides=None):
    """tests/fixtures/keylists/<name>.json: [key, shape, dtype] sorted by key, every tensor in
    `dtype` except those named in `overrides`."""
    overrides = overrides or {}
    rows = [[k, list(entries[k]), overrides.get(k, dtype)] for k in sorted(entries)]
    path = os.path.join(OUT, name + ".json")
    with open(path, "w") as f:
        f.write("[\n")
        f.write(",\n".join(json.dumps(r, separators=(",", ":")) for r in rows))
        f.write("\n]\n")
    print(f"{name}.json: {len(rows)} tensors, {os.path.getsize(path)} bytes")


# --- CLIP ------------------------------------------------------------------------------------


def clip_model(cfg, projection):
    config = CLIPTextConfig(**cfg)
    with META:
        model = (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)
    return shapes(model.state_dict())


def open_clip_keys(cfg):
    """OpenCLIP's text tower as its `CLIP` module names it (open_clip/model.py and
    transformer.py: `token_embedding`, `positional_embedding`, `transformer.resblocks.N` of
    `ln_1, attn (nn.MultiheadAttention: in_proj_weight/bias, out_proj), ln_2, mlp.c_fc,
    mlp.c_proj`, `ln_final`, `text_projection` (D, P) applied as x @ P, and `logit_scale`)."""
    d, f, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    keys = {
        "token_embedding.weight": (cfg["vocab_size"], d),
        "positional_embedding": (cfg["max_position_embeddings"], d),
        "ln_final.weight": (d,),
        "ln_final.bias": (d,),
        "text_projection": (d, cfg["projection_dim"]),
        "logit_scale": (),
    }
    for i in range(n):
        b = f"transformer.resblocks.{i}."
        keys.update(
            {
                b + "ln_1.weight": (d,),
                b + "ln_1.bias": (d,),
                b + "attn.in_proj_weight": (3 * d, d),
                b + "attn.in_proj_bias": (3 * d,),
                b + "attn.out_proj.weight": (d, d),
                b + "attn.out_proj.bias": (d,),
                b + "ln_2.weight": (d,),
                b + "ln_2.bias": (d,),
                b + "mlp.c_fc.weight": (f, d),
                b + "mlp.c_fc.bias": (f,),
                b + "mlp.c_proj.weight": (d, f),
                b + "mlp.c_proj.bias": (d,),
            }
        )
    return keys


def make_clip():
    l_proj = clip_model(CLIP_L, projection=True)
    l_plain = {k: s for k, s in l_proj.items() if k != "text_projection.weight"}
    bare = clip_model(CLIP_L, projection=False)
    # transformers >= 5.6 saves CLIPTextModel without the `text_model.` level.
    unwrapped = {k[len("text_model.") :]: s for k, s in l_plain.items()}
    assert_same("CLIPTextModel (bare)", bare, unwrapped)
    g = clip_model(CLIP_G, projection=True)

    write("clip_l", l_plain, "F16")
    write("clip_l_projection", l_proj, "F16")
    write("clip_l_bare", bare, "F16")
    write("clip_g", g, "F16")

    # SDXL's single file: sgm's FrozenCLIPEmbedder holds a transformers 4.2x CLIPTextModel,
    # whose persistent `position_ids` buffer (1, 77) int64 was saved with it.
    pos = "text_model.embeddings.position_ids"
    sdxl_l = prefixed(SDXL_CLIP_L, dict(l_plain, **{pos: (1, CLIP_L["max_position_embeddings"])}))
    conv = convert_ldm_clip_checkpoint(meta_dict(sdxl_l))
    assert_same("SDXL CLIP-L via convert_ldm_clip_checkpoint", shapes(conv),
                dict(l_plain, **{pos: (1, 77)}), sdxl_l)
    write("sdxl_clip_l", sdxl_l, "F16", {SDXL_CLIP_L + pos: "I64"})

    # SDXL's bigG in OpenCLIP names (sgm FrozenOpenCLIPEmbedder2 keeps open_clip's CLIP less its
    # visual tower: logit_scale stays). Proven by diffusers' converter, which must give exactly
    # the transformers model's state dict (logit_scale is not part of it and is dropped).
    sdxl_g = prefixed(SDXL_CLIP_G, open_clip_keys(CLIP_G))
    config = CLIPTextConfig(**CLIP_G)
    with META:
        target = CLIPTextModelWithProjection(config)
    conv = convert_open_clip_checkpoint(target, meta_dict(sdxl_g), prefix=SDXL_CLIP_G)
    assert_same("SDXL bigG via convert_open_clip_checkpoint", shapes(conv), g, sdxl_g,
                dropped=[SDXL_CLIP_G + "logit_scale"],
                fanout=lambda k: 3 if ".attn.in_proj_" in k else 1)  # q, k, v
    write("sdxl_clip_g_openclip", sdxl_g, "F16", {SDXL_CLIP_G + "logit_scale": "F16"})

    # SD3 / SD3.5 single files: the transformers layout under the prefix. CLIP-L has no
    # text_projection there (diffusers' create_diffusers_clip_model_from_ldm puts an identity in
    # its place, as SD3's reference code does); bigG keeps its (P, D) projection.
    sd3_l = prefixed(SD3_CLIP_L, l_plain)
    conv = convert_ldm_clip_checkpoint(meta_dict(sd3_l), SD3_CLIP_L)
    assert_same("SD3 CLIP-L via convert_ldm_clip_checkpoint", shapes(conv), l_plain, sd3_l)
    write("sd35_clip_l", sd3_l, "F16")
    sd3_g = prefixed(SD3_CLIP_G, g)
    conv = convert_ldm_clip_checkpoint(meta_dict(sd3_g), SD3_CLIP_G)
    assert_same("SD3 bigG via convert_ldm_clip_checkpoint", shapes(conv), g, sd3_g)
    write("sd35_clip_g", sd3_g, "F16")


# --- T5 --------------------------------------------------------------------------------------


def make_t5():
    with META:
        model = T5EncoderModel(T5Config(**T5_XXL))
    state = shapes(model.state_dict())
    # `encoder.embed_tokens.weight` is tied to `shared.weight` (T5EncoderModel
    # _tied_weights_keys); a saved file keeps only `shared.weight`.
    tied = getattr(model, "_tied_weights_keys", None) or {}
    assert "encoder.embed_tokens.weight" in tied, tied
    del state["encoder.embed_tokens.weight"]
    write("t5xxl", state, "F16")
    sd3 = prefixed(SD3_T5, state)
    conv = convert_sd3_t5_checkpoint_to_diffusers(meta_dict(sd3))
    assert_same("SD3 T5 via convert_sd3_t5_checkpoint_to_diffusers", shapes(conv), state, sd3)
    write("sd35_t5xxl", sd3, "F16")


# --- VAE -------------------------------------------------------------------------------------


def ldm_vae_keys(cfg, quant):
    """The original LDM autoencoder's names (ldm / sgm `modules/diffusionmodules/model.py`,
    BFL's `flux/modules/autoencoder.py`): Encoder `conv_in`, `down.N.block.M` ResNets (`norm1,
    conv1, norm2, conv2`, `nin_shortcut` where the width changes), `down.N.downsample.conv` but
    on the last level, `mid.block_1, mid.attn_1 (norm, q, k, v, proj_out as 1x1 convs),
    mid.block_2`, `norm_out`, `conv_out` (2 x latent); Decoder `conv_in`, the same mid, `up.N`
    from the latent side's index: up.N holds level N's width with layers + 1 ResNets and an
    upsample but on level 0; then `quant_conv` / `post_quant_conv` when present."""
    ch, n, z = cfg["block_out_channels"], cfg["layers_per_block"], cfg["latent_channels"]
    keys = {}

    def conv(name, cout, cin, k):
        keys[name + ".weight"] = (cout, cin, k, k)
        keys[name + ".bias"] = (cout,)

    def norm(name, c):
        keys[name + ".weight"] = (c,)
        keys[name + ".bias"] = (c,)

    def resnet(name, cin, cout):
        norm(name + ".norm1", cin)
        conv(name + ".conv1", cout, cin, 3)
        norm(name + ".norm2", cout)
        conv(name + ".conv2", cout, cout, 3)
        if cin != cout:
            conv(name + ".nin_shortcut", cout, cin, 1)

    def mid(side, c):
        resnet(f"{side}.mid.block_1", c, c)
        norm(f"{side}.mid.attn_1.norm", c)
        for p in ("q", "k", "v", "proj_out"):
            conv(f"{side}.mid.attn_1.{p}", c, c, 1)
        resnet(f"{side}.mid.block_2", c, c)

    conv("encoder.conv_in", ch[0], cfg["in_channels"], 3)
    cin = ch[0]
    for i, c in enumerate(ch):
        for m in range(n):
            resnet(f"encoder.down.{i}.block.{m}", cin, c)
            cin = c
        if i + 1 < len(ch):
            conv(f"encoder.down.{i}.downsample.conv", c, c, 3)
    mid("encoder", ch[-1])
    norm("encoder.norm_out", ch[-1])
    conv("encoder.conv_out", 2 * z, ch[-1], 3)

    conv("decoder.conv_in", ch[-1], z, 3)
    mid("decoder", ch[-1])
    cin = ch[-1]
    for i in reversed(range(len(ch))):
        for m in range(n + 1):
            resnet(f"decoder.up.{i}.block.{m}", cin, ch[i])
            cin = ch[i]
        if i > 0:
            conv(f"decoder.up.{i}.upsample.conv", ch[i], ch[i], 3)
    norm("decoder.norm_out", ch[0])
    conv("decoder.conv_out", cfg["out_channels"], ch[0], 3)
    if quant:
        conv("quant_conv", 2 * z, 2 * z, 1)
        conv("post_quant_conv", z, z, 1)
    return keys


def make_vae():
    for name, cfg, quant in [("sdxl", VAE_SDXL, True), ("sd35", VAE_16, False)]:
        with META:
            model = AutoencoderKL(**cfg)
        state = shapes(model.state_dict())
        write(f"{name}_vae", state, "F16")
        ldm = prefixed(LDM_VAE, ldm_vae_keys(cfg, quant))
        conv = convert_ldm_vae_checkpoint(meta_dict(ldm), cfg)
        assert_same(f"{name} LDM VAE via convert_ldm_vae_checkpoint", shapes(conv), state, ldm)
        write(f"{name}_vae_ldm", ldm, "F16")
        if name == "sd35":
            # BFL's ae.safetensors: the same LDM names with no prefix, stored in f32.
            bare = ldm_vae_keys(cfg, quant)
            conv = convert_ldm_vae_checkpoint(meta_dict(bare), cfg)
            assert_same("Flux ae via convert_ldm_vae_checkpoint", shapes(conv), state, bare)
            write("flux_ae", bare, "F32")


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    make_clip()
    make_t5()
    make_vae()
