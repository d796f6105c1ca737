#!/usr/bin/env python3
"""Write the adapter key maps ComfyUI builds for FLUX.2 [klein] and Z-Image, as JSON fixtures.

What it writes (under tests/fixtures/comfy/, in the format make_comfy_keymaps.py
describes):

  flux2_tiny.json   the tiny FLUX.2 transformer of tests/fixtures/flux2/flux2/
                    single_file.safetensors (BFL layout, the layout ComfyUI loads)
  zimage_tiny.json  the tiny Z-Image transformer of tests/fixtures/zimage/
                    single_file.safetensors (original layout, as ComfyUI loads it)

ComfyUI code used, exactly as published (no ComfyUI tree is needed, nor importable
here: these two families need a ComfyUI newer than the 0.3.64 tree the other maps
came from). The caller writes these source excerpts, copied verbatim from the
ComfyUI repository, to a folder passed as --sources:

  lora_keys_unet.py  comfy/lora.py's model_lora_keys_unet, whole, at
                     Comfy-Org/ComfyUI commit 17358c8f73b581a0d22facc3c385822f09b8bfb1
  utils_maps.py      comfy/utils.py's swap_scale_shift, flux_to_diffusers and
                     z_image_to_diffusers, whole, at Comfy-Org/ComfyUI commit
                     09708eae709a992a5684bed3595ce4d07e705b4e, and the first lines of
                     its unet_to_diffusers (which returns {} for a config without
                     "num_res_blocks", as both configs here are; the rest of it is
                     replaced by a raise)

The functions are executed in a namespace whose `comfy` has two stand-ins:

  comfy.utils       a module holding the functions of utils_maps.py (the other
                    *_to_diffusers maps model_lora_keys_unet names are only reached
                    for other model classes and are left out)
  comfy.model_base  empty classes with the names model_lora_keys_unet tests with
                    isinstance, in ComfyUI's hierarchy for the two used here:
                    Flux2 subclasses Flux (comfy/model_base.py: `class Flux2(Flux)`),
                    and Z-Image's supported model (comfy/supported_models.py
                    `class ZImage(Lumina2)`) builds a model_base.Lumina2; every
                    other class is unrelated to both

The model handed to model_lora_keys_unet is an instance of the stand-in Flux2 or
Lumina2 class whose state_dict() returns the tiny file's tensors under
"diffusion_model." and whose model_config.unet_config holds the fields the maps
read, set from the file as comfy/model_detection.py's detect_unet_config sets them:
  flux2:  depth = number of double_blocks, depth_single_blocks = number of
          single_blocks, hidden_size = rows of img_in.weight
  zimage: n_layers = number of layers, n_refiner_layers = number of noise_refiner
          blocks, dim = rows of x_embedder.weight
ComfyUI renames FLUX.2's RMSNorm ".scale" keys to ".weight" when it loads a
checkpoint; the stand-in keeps the file's names, which only concerns the norms, and
no adapter targets a norm.

How to run (CPU; torch only, for swap_scale_shift; no network):

  python3 scripts/make_comfy_keymaps_flux2_zimage.py --sources /tmp/comfy-keys

The output is deterministic.
"""

import argparse
import json
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_comfy_keymaps import REPO, key_map_of, write_json  # noqa: E402

COMMITS = ("Comfy-Org/ComfyUI comfy/lora.py@17358c8f73b581a0d22facc3c385822f09b8bfb1 "
           "comfy/utils.py@09708eae709a992a5684bed3595ce4d07e705b4e")

# The class names model_lora_keys_unet tests with isinstance at the commit above.
MODEL_BASE = ["StableCascade_C", "SD3", "AuraFlow", "PixArt", "HunyuanDiT", "Flux",
              "GenmoMochi", "HunyuanVideo", "HiDream", "HiDreamO1", "ACEStep", "Omnigen2",
              "QwenImage", "Krea2", "Lumina2", "TwinFlow_Z_Image", "Kandinsky5",
              "ACEStep15", "ErnieImage", "LTXV", "LTXAV", "MiniMaxH3"]


def comfy_namespace(sources):
    utils = types.ModuleType("comfy.utils")
    with open(os.path.join(sources, "utils_maps.py")) as f:
        exec(compile(f.read(), "comfy/utils.py", "exec"), utils.__dict__)
    base = types.ModuleType("comfy.model_base")
    for name in MODEL_BASE:
        setattr(base, name, type(name, (), {}))
    base.Flux2 = type("Flux2", (base.Flux,), {})
    comfy = types.SimpleNamespace(utils=utils, model_base=base)
    ns = {"comfy": comfy}
    with open(os.path.join(sources, "lora_keys_unet.py")) as f:
        exec(compile(f.read(), "comfy/lora.py", "exec"), ns)
    comfy.lora = types.SimpleNamespace(model_lora_keys_unet=ns["model_lora_keys_unet"])
    return comfy


def count(keys, prefix):
    return len({k[len(prefix):].split(".")[0] for k in keys if k.startswith(prefix)})


def stand_in(comfy, cls_name, unet_config, weights):
    cls = getattr(comfy.model_base, cls_name)

    class StandIn(cls):
        def __init__(self):
            self.model_config = types.SimpleNamespace(unet_config=unet_config)

        def state_dict(self):
            return weights

    return StandIn()


def tiny(comfy, name, path, cls_name):
    from safetensors.torch import load_file

    sd = load_file(os.path.join(REPO, path))
    keys = list(sd)
    if cls_name == "Flux2":
        unet_config = {"image_model": "flux2", "depth": count(keys, "double_blocks."),
                       "depth_single_blocks": count(keys, "single_blocks."),
                       "hidden_size": int(sd["img_in.weight"].shape[0])}
    else:
        unet_config = {"image_model": "lumina2", "n_layers": count(keys, "layers."),
                       "n_refiner_layers": count(keys, "noise_refiner."),
                       "dim": int(sd["x_embedder.weight"].shape[0])}
    print("{} ({}): unet_config {}".format(name, path, json.dumps(unet_config, sort_keys=True)))
    weights = {"diffusion_model." + k: v for k, v in sd.items()}
    return stand_in(comfy, cls_name, unet_config, weights)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", required=True,
                    help="folder with lora_keys_unet.py and utils_maps.py (see above)")
    args = ap.parse_args()
    comfy = comfy_namespace(os.path.abspath(args.sources))
    for name, path, cls_name in [
        ("flux2_tiny", "tests/fixtures/flux2/flux2/single_file.safetensors", "Flux2"),
        ("zimage_tiny", "tests/fixtures/zimage/single_file.safetensors", "Lumina2"),
    ]:
        model = tiny(comfy, name, path, cls_name)
        key_map, dropped = key_map_of(comfy, model)
        out = write_json(name, {"comfyui": COMMITS, "model": name, "map": key_map})
        print("{}: {} keys -> {}; {} dropped as their target is not in the model".format(
            name, len(key_map), os.path.relpath(out, REPO), len(dropped)))


if __name__ == "__main__":
    main()
