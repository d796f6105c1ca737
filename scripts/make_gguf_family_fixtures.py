#!/usr/bin/env python3
"""Tiny GGUF models of FLUX.2 [klein], Z-Image, SD3.5 (medium: with a dual-attention block)
and SDXL in the layout of the files users download, made the way they are made: city96's
ComfyUI-GGUF `tools/convert.py` (an F16 / BF16 GGUF of the single file) then its patched
`llama-quantize` (`tools/lcpp.patch`), both at commit 795e45156ece99afbc3efef911e63fcb46e6a20d
(the other quantized releases, unsloth's and QuantStack's FLUX.2 [klein] and Z-Image files,
are made with the same two tools and hold the same key names).

Usage:  python scripts/make_gguf_family_fixtures.py [OUT_DIR]   (default tests/fixtures/gguf)

Writes OUT_DIR/{flux2,zimage,sd35_medium,sdxl}-tiny-<TYPE>.gguf and families.json (each
file's arch, quantization and tensor count by type). Sources, all tiny random models of the tests:
  flux2        tests/fixtures/klein/pipeline/transformer (its text encoder's width), BFL keys
  zimage       tests/fixtures/zimage_pipeline/pipeline/transformer, the original keys
  sd35_medium  a random SD3Transformer2DModel of hidden 32 (rows of whole 32-blocks) whose
               context and pooled widths are those of tests/fixtures/pipeline's clip_l_proj,
               clip_g and t5: Stability's keys
  sdxl         make_model_fixtures.py's tiny SDXL UNet, random, with the context and pooled
               widths of tests/fixtures/encoders' CLIPs: Stability's (LDM) keys

What the tools do, reproduced here (ComfyUI-GGUF at the commit above):
  convert.py: strips "model.diffusion_model." (keys without it are dropped); a bf16 source
    gives BF16, any other F16; for f32 / bf16 sources 1-D tensors and tensors of at most 1024
    values are F32. For sdxl (`shape_fix`) a tensor of 2+ dims, at least 512 values, a whole
    number of 256s and a last dim that is not, is reshaped to (n/256, 256) and its shape
    recorded as the INT32 array `comfy.gguf.orig_shape.<key>`. general.architecture is the
    detected arch: "flux" (FLUX.2 has `double_blocks.0.img_attn.proj.weight`), "lumina2"
    (Z-Image: `cap_embedder.1.weight`, `context_refiner.0.attention.qkv.weight`), "sd3", "sdxl".
  lcpp.patch: quantizes 2-D tensors named "...weight" except, per arch, the embedders and
    final layers (flux: txt_in. img_in. time_in. vector_in. guidance_in. final_layer.;
    sd3: final_layer. time_text_embed. context_embedder. t_embedder. y_embedder. x_embedder.
    proj_out.weight pos_embed; sdxl: class_embedding. time_embedding. add_embedding.
    time_embed. label_emb. conv_in. conv_out. input_blocks.0.0.weight out.2.weight; lumina2:
    t_embedder. x_embedder. final_layer. cap_embedder. context_refiner. noise_refiner.);
    in a Q4_0 / Q5_0 file the FFN down-projections (".feed_forward.w2.weight",
    ".ff.net.2.weight", ...) take Q4_1 / Q5_1; a K type whose rows are not whole 256-blocks
    falls back to F16. Tensors of at most 1024 values that convert.py kept in F32 stay F32,
    and rows that are not whole blocks of the type stay as they are (F16 / BF16). Writing the
    file through ggml drops the leading size-1 dims (ggml's trailing ones): Z-Image's pad
    tokens (1, dim) are stored as (dim); the patch keeps SD3's pos_embed 3-D.

Quantization is gguf-py's (0.19.0), from the models' values. Needs torch, diffusers 0.42.1,
safetensors, numpy, gguf.
"""
import json
import os
import sys

import numpy as np
import torch
import gguf
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import make_model_fixtures as mmf  # noqa: E402
import make_flux2_fixtures as mf2  # noqa: E402
import make_zimage_fixtures as mzi  # noqa: E402
from diffusers import SD3Transformer2DModel, UNet2DConditionModel  # noqa: E402

T = gguf.GGMLQuantizationType

# lcpp.patch: the tensors each arch keeps unquantized (substrings, and whole names).
KEEP = {
    "flux": (("txt_in.", "img_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer."), ()),
    "sd3": (("final_layer.", "time_text_embed.", "context_embedder.", "t_embedder.", "y_embedder.",
             "x_embedder."), ("proj_out.weight", "pos_embed")),
    "sdxl": (("class_embedding.", "time_embedding.", "add_embedding.", "time_embed.", "label_emb.",
              "conv_in.", "conv_out."), ("input_blocks.0.0.weight", "out.2.weight")),
    "lumina2": (("t_embedder.", "x_embedder.", "final_layer.", "cap_embedder.", "context_refiner.",
                 "noise_refiner."), ()),
}
# lcpp.patch `img_tensor_get_type`: the FFN down-projections' names.
FFN_DOWN = ("ffn_down", ".ffn.2.weight", ".ff.net.2.weight", ".mlp.layer2.weight",
            ".adaln_modulation_mlp.2.weight", ".feed_forward.w2.weight")
FFN_DOWN_TYPE = {T.Q4_0: T.Q4_1, T.Q5_0: T.Q5_1}

# The tiny SD3.5 medium: hidden 32 (2 heads of 16), context 32 (t5's d_model), pooled 32
# (clip_l_proj's 12 + clip_g's 20), a dual-attention first block, 16 latent channels (those of
# tests/fixtures/vae/flux_like_ae.safetensors, an autoencoder of SD3's kind), positions for 32x32
# patches (the buckets of 64-pixel pictures).
SD3_CONFIG = dict(sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                  pooled_projection_dim=32, out_channels=16, pos_embed_max_size=32,
                  qk_norm="rms_norm", dual_attention_layers=(0,))


# The tiny SDXL UNet of make_model_fixtures.py with the context (48) and pooled (16) widths of
# tests/fixtures/encoders' CLIPs (sdxl_te.safetensors, clip_l, clip_g): 16 + 6 x 8 time ids.
SDXL_CONFIG = dict(mmf.MODELS["sdxl"]["config"], cross_attention_dim=48,
                   projection_class_embeddings_input_dim=16 + 6 * 8)


def diffusers_state(folder):
    sd = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        return sd, json.load(f)


def flux2_source():
    sd, cfg = diffusers_state(os.path.join(ROOT, "tests/fixtures/klein/pipeline/transformer"))
    return mf2.flux2_to_original(sd, cfg), torch.bfloat16, None


def zimage_source():
    sd, cfg = diffusers_state(os.path.join(ROOT, "tests/fixtures/zimage_pipeline/pipeline/transformer"))
    return mzi.to_original(sd, cfg), torch.bfloat16, cfg


def sd3_source():
    torch.manual_seed(mmf.SEED)
    model = SD3Transformer2DModel(**SD3_CONFIG)
    mmf.init_params(model, np.random.default_rng(mmf.SEED + 7))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = dict(SD3_CONFIG, dual_attention_layers=list(SD3_CONFIG["dual_attention_layers"]))
    return mmf.sd3_to_original(sd, cfg), torch.float16, None


def sdxl_source():
    torch.manual_seed(mmf.SEED)
    model = UNet2DConditionModel(**SDXL_CONFIG)
    mmf.init_params(model, np.random.default_rng(mmf.SEED + 8))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    config = dict(json.loads(json.dumps(SDXL_CONFIG)), _class_name="UNet2DConditionModel")
    return mmf.sdxl_to_original(sd, SDXL_CONFIG), torch.float16, config


# name -> (arch, source, quantization, shape_fix)
FAMILIES = {
    "flux2": ("flux", flux2_source, T.Q8_0, False),
    "zimage": ("lumina2", zimage_source, T.Q4_0, False),
    "sd35_medium": ("sd3", sd3_source, T.Q5_0, False),
    "sdxl": ("sdxl", sdxl_source, T.Q8_0, True),
}


def quantized_type(arch, name, shape, qtype):
    """lcpp.patch's type for a 2-D tensor `name` of (stored) `shape`, or None to keep it."""
    subs, whole = KEEP[arch]
    if not name.endswith("weight") or any(s in name for s in subs) or name in whole:
        return None
    ty = FFN_DOWN_TYPE.get(qtype, qtype) if any(s in name for s in FFN_DOWN) else qtype
    block = gguf.GGML_QUANT_SIZES[ty][0]
    if shape[-1] % block != 0:
        # K types fall back to F16 (lcpp.patch); other rows of part blocks are kept.
        return T.F16 if block == 256 else None
    return ty


def write(name, out_dir):
    arch, source, qtype, shape_fix = FAMILIES[name]
    sd, release, config = source()
    path = os.path.join(out_dir, f"{name}-tiny-{qtype.name}.gguf")
    w = gguf.GGUFWriter(path, arch=arch)
    if config is not None:
        # The tiny Z-Image's head dim (16) has no known RoPE axes split, and the tiny SDXL's
        # widths no heads of 64: their diffusers configs ride along under FLAME's single-file
        # metadata key (the released files' shapes give theirs).
        w.add_string("config", json.dumps(config, sort_keys=True))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type({T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, T.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
                     T.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0}[qtype])
    types = {}
    for key, t in sd.items():
        # The release's dtype, then convert.py's type.
        data = t.to(release).to(torch.float32).numpy()
        ty = T.BF16 if release == torch.bfloat16 else T.F16
        n = data.size
        if release == torch.bfloat16 and (data.ndim == 1 or n <= 1024):
            ty = T.F32
        if shape_fix and data.ndim > 1 and n >= 512 and n % 256 == 0 and data.shape[-1] % 256 != 0:
            w.add_array(f"comfy.gguf.orig_shape.{key}", [int(d) for d in data.shape])
            data = data.reshape(n // 256, 256)
        # llama-quantize: ggml drops the leading size-1 dims (SD3's pos_embed is kept 3-D).
        if not (arch == "sd3" and key == "pos_embed"):
            while data.ndim > 1 and data.shape[0] == 1:
                data = data.reshape(data.shape[1:])
        if data.ndim == 2 and ty != T.F32:
            ty = quantized_type(arch, key, data.shape, qtype) or ty
        w.add_tensor(key, gguf.quants.quantize(data, ty), raw_dtype=ty)
        types[key] = ty.name
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    counts = {}
    for ty in types.values():
        counts[ty] = counts.get(ty, 0) + 1
    print(f"wrote {path}: {len(types)} tensors {counts}, {os.path.getsize(path) / 1024:.0f} KiB")
    return os.path.basename(path), dict(arch=arch, quantization=qtype.name, tensors=counts)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests/fixtures/gguf")
    os.makedirs(out_dir, exist_ok=True)
    manifest = {"generator": "scripts/make_gguf_family_fixtures.py", "gguf": "0.19.0",
                "comfyui_gguf_commit": "795e45156ece99afbc3efef911e63fcb46e6a20d",
                "sd35_medium_config": SD3_CONFIG, "sdxl_config": SDXL_CONFIG, "files": {}}
    for name in FAMILIES:
        f, info = write(name, out_dir)
        manifest["files"][f] = info
    with open(os.path.join(out_dir, "families.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
