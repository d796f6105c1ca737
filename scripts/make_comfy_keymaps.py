#!/usr/bin/env python3
"""Write the adapter key maps that ComfyUI itself builds, as JSON fixtures.

What it writes (under tests/fixtures/comfy/):

  flux_dev.json, sd35_large.json, sdxl_base.json
      Full-size Flux-dev, SD3.5-large and SDXL-base. ComfyUI's own model classes
      (comfy.supported_models.* -> comfy.model_base.*) are instantiated on the
      torch "meta" device from the config ComfyUI's model detection produces for
      the released checkpoints. The meta state dict is then run back through
      comfy.model_detection.model_config_from_unet (the path ComfyUI takes when it
      loads a checkpoint); the script checks that detection picks the same
      supported-model class and config, and rebuilds the model from the detected
      config before mapping keys.

  flux_tiny.json, sd35_tiny.json, sdxl_tiny.json
      The tiny test models in tests/fixtures/models/{flux,sd35_large,sdxl}/
      single_file.safetensors. ComfyUI's supported-model list does not accept
      these shapes (its Flux detection hard-codes hidden_size 3072, its MMDiT
      derives hidden_size as 64 * depth, its SDXL entry needs model_channels 320),
      so the model is a minimal stand-in: a subclass of the right
      comfy.model_base class (so ComfyUI's isinstance checks take the same
      branches) whose state_dict() returns the tiny file's tensors under
      "diffusion_model." and whose model_config is the supported-model config
      built from comfy.model_detection.detect_unet_config on that file.
      Two fields ComfyUI derives under full-size assumptions are set from the
      file instead (printed when the script runs):
        flux:  hidden_size = rows of img_in.weight (ComfyUI hard-codes 3072)
        sd3:   depth = number of joint_blocks (ComfyUI uses hidden_size // 64,
               which is 0 for the tiny model). ComfyUI's diffusers map for MMDiT
               then slices fused qkv at 64 * depth, so the slice start/size in
               sd35_tiny.json are in units of 64 * depth (128), not the tiny
               model's width (16); only the slice ordinal (start / size:
               q = 0, k = 1, v = 2) carries over to the tiny shapes.
        sdxl:  nothing; every field unet_to_diffusers reads comes from the file.

  kinds.json
      The tensor-name suffixes comfy.lora.load_lora and each weight adapter in
      comfy.weight_adapter look for after a mapped prefix. They are read off the
      code by calling load_lora / Adapter.load with a recording state dict that
      answers "present" for chosen names and notes every name asked for.

Key map file format (compact JSON, sorted keys):

  {"comfyui": "<version> <commit>", "model": "<name>", "map": {lora_key: target}}

  lora_key is the adapter tensor prefix (what comes before ".lora_up.weight",
  ".lora_A.weight", ".hada_w1_a", ...). target is one of
    "diffusion_model.<weight key>"                  the whole weight
    ["diffusion_model.<weight key>", dim, start, size]
                                                     a narrow() of the weight
                                                     (fused qkv / linear1)
    ["diffusion_model.<weight key>", "swap_scale_shift"]
                                                     whole weight, with ComfyUI's
                                                     comfy.utils.swap_scale_shift
                                                     applied to the delta
                                                     (diffusers norm_out.linear)
  The map is exactly what comfy.lora.model_lora_keys_unet returns, less the
  entries whose target weight is not in the model's state dict (ComfyUI's
  ModelPatcher.add_patches drops those patches, so such a key is never applied;
  the count dropped is printed).

ComfyUI version used: 0.3.64, commit a125cd84b054a57729b5eecab930ca9408719832
(the version/commit of the tree passed with --comfyui is what the files record).

How to run (CPU only; no GPU, network or model weights needed):

  1. A ComfyUI source tree, e.g. a clone of github.com/comfyanonymous/ComfyUI
     checked out at the commit above, at /tmp/comfy.
  2. Python 3.10+ with a CPU build of torch and numpy, plus safetensors, einops,
     psutil, pillow, tqdm, pyyaml and transformers (what importing comfy.lora,
     comfy.model_detection and comfy.supported_models needs; transformers only
     for the tokenizer classes those modules import). torchvision is only
     imported by model families irrelevant here (comfy.ldm.cosmos); if it is not
     importable, an empty placeholder module is registered in sys.modules.
  3. From the repository root:
       python3 scripts/make_comfy_keymaps.py --comfyui /tmp/comfy \\
           [--commit <sha if /tmp/comfy is not a git checkout>]

The output is deterministic for a given ComfyUI tree.
"""

import argparse
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS_DIR = os.path.join(REPO, "tests", "fixtures", "models")
OUT_DIR = os.path.join(REPO, "tests", "fixtures", "comfy")


# --------------------------------------------------------------------------
# importing ComfyUI


def import_comfy(comfy_dir):
    """Import the ComfyUI modules used here, forced onto the CPU."""
    sys.path.insert(0, comfy_dir)
    if importlib.util.find_spec("torchvision") is None:
        # Only comfy.ldm.cosmos (and a few other model families) import it at
        # module level; nothing on the LoRA key-mapping path uses it.
        for name in ("torchvision", "torchvision.transforms"):
            stub = types.ModuleType(name)
            stub.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            stub.__path__ = []
            sys.modules[name] = stub
        sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
    import comfy.options

    comfy.options.enable_args_parsing(False)  # cli_args parses [] instead of sys.argv
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # model_management must not probe for a GPU
    import comfy.lora
    import comfy.model_base
    import comfy.model_detection
    import comfy.supported_models
    import comfy.utils
    import comfy.weight_adapter

    return comfy


def comfy_version(comfy_dir, commit):
    ns = {}
    with open(os.path.join(comfy_dir, "comfyui_version.py")) as f:
        exec(f.read(), ns)
    if commit is None:
        try:
            top, commit = subprocess.run(
                ["git", "-C", comfy_dir, "rev-parse", "--show-toplevel", "HEAD"],
                check=True, capture_output=True, text=True,
            ).stdout.split()
        except (OSError, subprocess.CalledProcessError, ValueError):
            top = None
        if top is None or os.path.realpath(top) != os.path.realpath(comfy_dir):
            sys.exit("--comfyui is not the root of a git checkout: pass --commit <sha>")
    return "{} {}".format(ns["__version__"], commit)


# --------------------------------------------------------------------------
# key maps


def encode_target(target):
    """ComfyUI key-map value -> JSON value (see the module docstring)."""
    if isinstance(target, str):
        return target
    key, offset = target[0], target[1]
    if offset is not None:
        assert len(target) == 2, target
        dim, start, size = offset
        return [key, int(dim), int(start), int(size)]
    function = target[2]
    assert function.__name__ == "swap_scale_shift", target
    return [key, function.__name__]


def target_key(target):
    return target if isinstance(target, str) else target[0]


def key_map_of(comfy, model):
    # model_lora_keys_unet has a mutable default for key_map: always pass a fresh one.
    key_map = comfy.lora.model_lora_keys_unet(model, {})
    weights = model.state_dict()
    out, dropped = {}, []
    for lora_key, target in key_map.items():
        if target_key(target) in weights:
            out[lora_key] = encode_target(target)
        else:
            dropped.append(lora_key)
    return out, sorted(dropped)


def write_json(name, obj):
    path = os.path.join(OUT_DIR, name + ".json")
    with open(path, "w") as f:
        json.dump(obj, f, sort_keys=True, separators=(",", ":"))
        f.write("\n")
    return path


def write_map(comfy, version, name, model):
    key_map, dropped = key_map_of(comfy, model)
    path = write_json(name, {"comfyui": version, "model": name, "map": key_map})
    print("{}: {} keys -> {} ({} bytes); {} dropped as their target is not in the model{}".format(
        name, len(key_map), os.path.relpath(path, REPO), os.path.getsize(path), len(dropped),
        " (e.g. {})".format(", ".join(dropped[:3])) if dropped else ""))


# Full-size models: the config ComfyUI's detect_unet_config yields for the
# released checkpoints (checked by the round trip in full_size_model).
FULL_SIZE = {
    "flux_dev": ("Flux", {
        "image_model": "flux", "in_channels": 16, "patch_size": 2, "out_channels": 16,
        "vec_in_dim": 768, "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0,
        "num_heads": 24, "depth": 19, "depth_single_blocks": 38, "axes_dim": [16, 56, 56],
        "theta": 10000, "qkv_bias": True, "guidance_embed": True,
    }),
    "sd35_large": ("SD3", {
        "in_channels": 16, "patch_size": 2, "out_channels": 16, "depth": 38,
        "input_size": None, "adm_in_channels": 2048,
        "context_embedder_config": {"target": "torch.nn.Linear",
                                    "params": {"in_features": 4096, "out_features": 2432}},
        "num_patches": 192 * 192, "pos_embed_max_size": 192, "qk_norm": "rms",
        "pos_embed_scaling_factor": None, "x_block_self_attn_layers": [],
    }),
    "sdxl_base": ("SDXL", {
        "use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True,
        "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816,
        "in_channels": 4, "out_channels": 4, "model_channels": 320,
        "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
        "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
        "channel_mult": [1, 2, 4], "transformer_depth_middle": 10,
        "use_linear_in_transformer": True, "context_dim": 2048,
        "use_temporal_resblock": False, "use_temporal_attention": False,
    }),
}


def full_size_model(comfy, config_name, unet_config):
    import torch

    config_cls = getattr(comfy.supported_models, config_name)
    first = config_cls(unet_config).get_model({}, "diffusion_model.", device="meta")
    sd = first.state_dict()
    # What ComfyUI does with a checkpoint holding exactly these tensors:
    detected = comfy.model_detection.model_config_from_unet(sd, "diffusion_model.")
    assert type(detected) is config_cls, (config_name, type(detected))
    again = comfy.model_detection.detect_unet_config(sd, "diffusion_model.")
    assert again == unet_config, (config_name, again)
    model = detected.get_model(sd, "diffusion_model.", device="meta")
    sd2 = model.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: tuple(v.shape) for k, v in sd2.items()}
    assert all(v.device == torch.device("meta") for k, v in sd2.items() if k.startswith("diffusion_model."))
    return model


# Tiny test models: (fixture dir, supported-model config, model_base class).
TINY = {
    "flux_tiny": ("flux", "Flux", "Flux"),
    "sd35_tiny": ("sd35_large", "SD3", "SD3"),
    "sdxl_tiny": ("sdxl", "SDXL", "SDXL"),
}


def stand_in(comfy, base_name, model_config, state_dict):
    """The smallest object model_lora_keys_unet accepts: an instance of the real
    comfy.model_base class (for its isinstance checks) that has model_config and
    state_dict() but never builds the network."""
    import torch

    base = getattr(comfy.model_base, base_name)

    class StandIn(base):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.model_config = model_config
            self._weights = state_dict

        def state_dict(self, *args, **kwargs):
            return self._weights

    StandIn.__name__ = "StandIn" + base_name
    return StandIn()


def tiny_model(comfy, fixture, config_name, base_name):
    with open(os.path.join(MODELS_DIR, "manifest.json")) as f:
        prefix = json.load(f)["models"][fixture]["single_file_prefix"]
    path = os.path.join(MODELS_DIR, fixture, "single_file.safetensors")
    sd = comfy.utils.load_torch_file(path, safe_load=True)
    unet_config = comfy.model_detection.detect_unet_config(sd, prefix)
    assert unet_config is not None, fixture
    if config_name == "Flux":
        unet_config["hidden_size"] = sd[prefix + "img_in.weight"].shape[0]
    elif config_name == "SD3":
        unet_config["depth"] = comfy.model_detection.count_blocks(sd.keys(), prefix + "joint_blocks.{}.")
    print("{} ({}): unet_config {}".format(
        fixture, os.path.relpath(path, REPO), json.dumps(unet_config, sort_keys=True, default=str)))
    model_config = getattr(comfy.supported_models, config_name)(unet_config)
    weights = {"diffusion_model." + k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    return stand_in(comfy, base_name, model_config, weights)


# --------------------------------------------------------------------------
# adapter kinds


PROBE = "P"  # the mapped prefix handed to load_lora / Adapter.load


class RecordingStateDict:
    """Answers "present" for the names in `present` and records every name asked for."""

    def __init__(self, present, ndim):
        import torch

        self.torch = torch
        self.present = set(present)
        self.ndim = ndim
        self.checked = []  # asked with `in` / .get()
        self.read_absent = []  # read with [] although not present

    @staticmethod
    def _note(names, key):
        if key not in names:
            names.append(key)

    def keys(self):
        return self

    def __contains__(self, key):
        self._note(self.checked, key)
        return key in self.present

    def __iter__(self):
        return iter(sorted(self.present))

    def get(self, key, default=None):
        self._note(self.checked, key)
        return self._tensor(key) if key in self.present else default

    def __getitem__(self, key):
        if key not in self.present:
            self._note(self.read_absent, key)
        return self._tensor(key)

    def _tensor(self, key):
        if key.endswith(".alpha"):
            return self.torch.tensor(4.0)
        return self.torch.zeros([2] * self.ndim)


def suffix(name):
    assert name.startswith(PROBE), name
    return name[len(PROBE):]


def run_adapter(cls, present, ndim):
    """Adapter.load with `present`, adding every name it reads unconditionally.
    Returns (adapter or None, names present, names checked)."""
    present = set(present)
    while True:
        sd = RecordingStateDict(present, ndim)
        adapter = cls.load(PROBE, sd, None, None, set())
        if not sd.read_absent:
            return adapter, present, sd.checked
        present |= set(sd.read_absent)


def probe_adapter(cls):
    base = RecordingStateDict((), 2)
    assert cls.load(PROBE, base, None, None, set()) is None
    variants = []
    for trigger in base.checked:
        ndims = [n for n in (2, 3, 4) if run_adapter(cls, {trigger}, n)[0] is not None]
        if not ndims:
            continue  # not enough on its own to make this adapter
        ndim = ndims[0]
        adapter, present, checked = run_adapter(cls, {trigger}, ndim)
        required = sorted(present - {trigger})
        assert present <= adapter.loaded_keys
        optional, overridden_by = {}, []
        for other in checked:
            if other in present:
                continue
            a2, p2, _ = run_adapter(cls, present | {other}, ndim)
            if a2 is None:
                continue
            if trigger not in a2.loaded_keys:
                overridden_by.append(suffix(other))
            elif other in a2.loaded_keys:
                optional[suffix(other)] = sorted(suffix(k) for k in p2 - present - {other})
        variant = {"trigger": suffix(trigger), "requires": [suffix(k) for k in required],
                   "optional": optional}
        if overridden_by:
            variant["overridden_by"] = overridden_by
        if ndims != [2, 3, 4]:
            variant["trigger_ndim"] = ndims
        variants.append(variant)
    return {"class": cls.__name__, "variants": variants}


def probe_load_lora(comfy):
    """Names load_lora reads itself (not through an adapter) and what each patches."""
    target = "diffusion_model.block.weight"
    adapter_names = set()
    for cls in comfy.weight_adapter.adapters:
        for n in (2, 3, 4):
            sd = RecordingStateDict((), n)
            cls.load(PROBE, sd, None, None, set())
            adapter_names |= set(sd.checked)

    def run(present):
        sd = RecordingStateDict(present, 2)
        patches = comfy.lora.load_lora(sd, {PROBE: target}, log_missing=False)
        described = {}
        for key, value in patches.items():
            where = {target: "weight", target[:-len(".weight")] + ".bias": "bias"}[key]
            described[where] = value[0] if isinstance(value, tuple) else value.name
        return sd, described

    base, _ = run(())
    own = [k for k in base.checked if k not in adapter_names]
    out = {}
    for name in own:
        sd, patches = run({name})
        entry = {"patches": patches}
        if not patches:
            needs = []
            for other in own:
                if other != name:
                    _, with_other = run({name, other})
                    _, other_alone = run({other})
                    if with_other != other_alone:
                        needs.append(suffix(other))
                        entry["patches_with_" + suffix(other)] = {
                            k: v for k, v in with_other.items() if other_alone.get(k) != v}
            if needs:
                entry["needs"] = needs
            elif name in sd.checked and name not in sd.read_absent:
                # read (with .item() / as a tensor) and handed to every adapter's load()
                entry["passed_to_adapters"] = True
        out[suffix(name)] = entry
    return out


def write_kinds(comfy, version):
    kinds = {}
    for cls in comfy.weight_adapter.adapters:
        kinds[cls.name] = probe_adapter(cls)
    obj = {
        "comfyui": version,
        "adapter_order": [cls.name for cls in comfy.weight_adapter.adapters],
        "adapters": kinds,
        "load_lora": probe_load_lora(comfy),
    }
    path = write_json("kinds", obj)
    print("kinds: {} ({} bytes)".format(os.path.relpath(path, REPO), os.path.getsize(path)))


# --------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfyui", required=True, help="ComfyUI source tree (holds comfy/ and comfyui_version.py)")
    ap.add_argument("--commit", help="ComfyUI commit, when --comfyui is not a git checkout")
    args = ap.parse_args()
    comfy_dir = os.path.abspath(args.comfyui)
    version = comfy_version(comfy_dir, args.commit)
    comfy = import_comfy(comfy_dir)
    import logging

    logging.getLogger().setLevel(logging.ERROR)
    os.makedirs(OUT_DIR, exist_ok=True)
    print("ComfyUI", version)

    for name, (config_name, unet_config) in FULL_SIZE.items():
        write_map(comfy, version, name, full_size_model(comfy, config_name, unet_config))
    for name, (fixture, config_name, base_name) in TINY.items():
        write_map(comfy, version, name, tiny_model(comfy, fixture, config_name, base_name))
    write_kinds(comfy, version)


if __name__ == "__main__":
    main()
