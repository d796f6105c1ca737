//! `train init`: a config written from a model path and a folder of images alone, for the
//! layouts of tests/common/layouts.rs (a ComfyUI `models/` folder, the same with a GGUF
//! Flux, with the random city96-typed GGUF Flux of scripts/random_flux_gguf.py, a Hugging
//! Face cache folder), read back with every key a config key, checked by
//! `train --plan` and trained for two steps by `train` with no other path given. Refused,
//! naming what: an image folder without images, a folder without a model, an existing
//! config without --force. And the `sample` binary without `--arch`, the family found from
//! the model's keys, the candidates named where a folder holds two families.
#![cfg(feature = "cpu-ref")]

#[path = "common/layouts.rs"]
mod layouts;
use layouts::{comfy, gguf_flux, hub, qwen_family_folder, sd35_folder, temp};

use flame::train::TrainConfig;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn train(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_train"))
        .args(args)
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `train init --model model --images images --steps 2 --out out` (and `extra`).
fn init(model: &Path, images: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut a: Vec<&std::ffi::OsStr> = vec![
        "init".as_ref(),
        "--model".as_ref(),
        model.as_os_str(),
        "--images".as_ref(),
        images.as_os_str(),
        "--steps".as_ref(),
        "2".as_ref(),
        "--out".as_ref(),
        out.as_os_str(),
    ];
    a.extend(extra.iter().map(|s| s.as_ref() as &std::ffi::OsStr));
    train(&a)
}

/// Every `section.key` of the TOML text (array tables' keys as `section.key` too).
fn keys_of(text: &str) -> Vec<String> {
    let t: toml::Table = toml::from_str(text).unwrap();
    let mut out = vec![];
    for (section, v) in &t {
        let tables: Vec<&toml::Table> = match v {
            toml::Value::Table(t) => vec![t],
            toml::Value::Array(a) => a.iter().filter_map(|x| x.as_table()).collect(),
            other => panic!("top-level key {section} = {other}"),
        };
        for tab in tables {
            out.extend(tab.keys().map(|k| format!("{section}.{k}")));
        }
    }
    out
}

/// Writes the config for `model`, checks it (every key known, it parses, `train --plan`
/// runs clean), trains it for its two steps and returns its text and run folder.
fn init_plan_train(d: &Path, model: &Path, images: &Path, arch: &str) -> (String, PathBuf) {
    let cfg = d.join("configs/train.toml");
    let o = init(model, images, &cfg, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&cfg).unwrap();
    let known: Vec<String> = TrainConfig::reference()
        .iter()
        .map(|k| k.key.to_string())
        .collect();
    for k in keys_of(&text) {
        // `[[data.dirs]]` entries' keys are the table's own.
        let k = k
            .replace("data.dirs.path", "data.dirs")
            .replace("data.dirs.repeats", "data.dirs");
        assert!(known.contains(&k), "{k} is no config key:\n{text}");
    }
    assert!(text.contains(&format!("arch = \"{arch}\"")), "{text}");
    assert!(text.contains("# memory: "), "no memory plan:\n{text}");
    assert!(
        text.contains("prompts = [\"a "),
        "no prompts from the captions:\n{text}"
    );
    // No GPU here: the budget key is left commented.
    assert!(text.contains("# budget_gb"), "{text}");
    let config = TrainConfig::from_file(&cfg).unwrap();
    assert_eq!(config.train.steps, 2);
    let plan = train(&["--plan".as_ref(), cfg.as_os_str()]);
    assert!(plan.status.success(), "{}", stderr(&plan));
    let run = train(&[cfg.as_os_str()]);
    assert!(run.status.success(), "{}", stderr(&run));
    let out = config.train.output_dir;
    assert_eq!(out, d.join("configs/runs").join(format!("{arch}-lora")));
    assert!(out.join("lora.safetensors").is_file(), "{}", stderr(&run));
    let log = flame::train::rundir::read_log(&out.join("loss.jsonl")).unwrap();
    assert_eq!(log.len(), 2);
    (text, out)
}

#[test]
fn a_comfyui_folder_gets_a_config_that_trains_and_samples_without_arch() {
    let d = temp("init-comfy");
    let m = comfy(&d);
    let (text, out) = init_plan_train(&d, &m, &d.join("tiny/images"), "flux");
    // The files picked, each named with where it came from; the built-in vocabularies.
    for want in [
        "flux1-tiny.safetensors",
        "clip_l.safetensors",
        "t5xxl_fp16.safetensors",
        "ae.safetensors",
        "found by the model's keys",
        "built into FLAME",
    ] {
        assert!(text.contains(want), "{want}:\n{text}");
    }
    // Buckets from the pictures' sizes (64x64, 96x64, 64x96: typical side 64).
    assert!(text.contains("resolution = 64"), "{text}");
    assert!(text.contains("bucket_step = 16"), "{text}");

    // `sample` finds the family itself, with the trained LoRA merged.
    let s_out = d.join("samples");
    let o = Command::new(env!("CARGO_BIN_EXE_sample"))
        .args([
            "--device", "cpu", "--dtype", "f32", "--width", "32", "--height", "32",
        ])
        .args([
            "--steps",
            "2",
            "--t5-tokens",
            "16",
            "--prompt",
            "a red circle",
        ])
        .arg("--model")
        .arg(&m)
        .arg("--lora")
        .arg(out.join("lora.safetensors"))
        .arg("--out")
        .arg(&s_out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(s_out.join("0-0.png").is_file());
    assert!(
        stderr(&o).contains("diffusion model (flux)"),
        "{}",
        stderr(&o)
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_gguf_flux_gets_a_config_that_trains() {
    let d = temp("init-gguf");
    let m = comfy(&d);
    gguf_flux(&m);
    let (text, _) = init_plan_train(&d, &m, &d.join("tiny/images"), "flux");
    assert!(
        text.contains("flux1-tiny-F32.gguf") && text.contains("GGUF"),
        "{text}"
    );
    std::fs::remove_dir_all(&d).ok();
}

/// The random GGUF Flux of scripts/random_flux_gguf.py (the maker of the full-size Q8_0 /
/// Q4_K files of the memory rows) at its `--tiny` widths, committed as
/// tests/fixtures/gguf/flux-random-tiny-Q4_K_S.gguf: city96's types and no config in its
/// metadata (the shapes give it, as for the released files). In a ComfyUI folder's `unet/`
/// it is found, planned, trained for two steps, and `sample` takes it with the LoRA.
#[test]
fn a_random_city96_gguf_flux_gets_a_config_that_trains_and_samples() {
    use flame::backend::ggml::GgmlType;
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf/flux-random-tiny-Q4_K_S.gguf");
    let f = flame::gguf::GgufFile::open(&fixture).unwrap();
    assert!(!f.metadata().contains_key("config"));
    // city96's types (ComfyUI-GGUF tools/lcpp.patch): the input and output Linears of the
    // embedders in F32, the rest of them in F16, the blocks' Linears packed, 1-D in F32.
    for (name, ty) in [
        ("img_in.weight", GgmlType::F32),
        ("time_in.in_layer.weight", GgmlType::F32),
        ("time_in.out_layer.weight", GgmlType::F16),
        ("txt_in.weight", GgmlType::F16),
        ("final_layer.linear.weight", GgmlType::F32),
        ("final_layer.adaLN_modulation.1.weight", GgmlType::F16),
        ("double_blocks.0.img_attn.qkv.weight", GgmlType::Q4_K),
        ("double_blocks.0.txt_mlp.2.weight", GgmlType::Q4_K),
        ("single_blocks.0.linear2.weight", GgmlType::Q4_K),
        ("single_blocks.0.linear2.bias", GgmlType::F32),
        ("single_blocks.0.norm.key_norm.scale", GgmlType::F32),
    ] {
        assert_eq!(f.info(name).map(|i| i.ty), Some(ty), "{name}");
    }
    // The random blocks' scales give weights of spread about 0.02.
    let w = f.dequantize("double_blocks.0.img_attn.qkv.weight").unwrap();
    let std = (w.iter().map(|x| x * x).sum::<f32>() / w.len() as f32).sqrt();
    assert!((0.01..0.05).contains(&std), "{std}");
    let d = temp("init-random-gguf");
    let m = comfy(&d);
    std::fs::remove_file(m.join("diffusion_models/flux1-tiny.safetensors")).unwrap();
    std::fs::create_dir_all(m.join("unet")).unwrap();
    std::fs::copy(&fixture, m.join("unet/flux1-tiny-Q4_K_S.gguf")).unwrap();
    let (text, out) = init_plan_train(&d, &m, &d.join("tiny/images"), "flux");
    assert!(
        text.contains("flux1-tiny-Q4_K_S.gguf") && text.contains("Q4_K"),
        "{text}"
    );
    let s_out = d.join("samples");
    let o = Command::new(env!("CARGO_BIN_EXE_sample"))
        .args([
            "--device", "cpu", "--dtype", "f32", "--width", "32", "--height", "32",
        ])
        .args([
            "--steps",
            "1",
            "--t5-tokens",
            "16",
            "--prompt",
            "a red circle",
        ])
        .arg("--model")
        .arg(&m)
        .arg("--lora")
        .arg(out.join("lora.safetensors"))
        .arg("--out")
        .arg(&s_out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(s_out.join("0-0.png").is_file());
    assert!(stderr(&o).contains("GGUF"), "{}", stderr(&o));
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_hugging_face_cache_folder_gets_a_config_that_trains() {
    let d = temp("init-hub");
    let hub = hub(&d);
    let images = d.join("images");
    flame::train::demo::make_tiny_images(&images).unwrap();
    let (text, _) = init_plan_train(&d, &hub, &images, "flux2");
    assert!(text.contains("snapshots/abc"), "{text}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn refusals_name_what_and_nothing_is_overwritten_without_force() {
    let d = temp("init-refuse");
    let m = comfy(&d);
    let images = d.join("tiny/images");
    let cfg = d.join("train.toml");
    // An image folder with no image (a caption alone is none).
    let empty = d.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::write(empty.join("notes.txt"), "a caption without a picture").unwrap();
    let o = init(&m, &empty, &cfg, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&empty.display().to_string()) && stderr(&o).contains("no images"),
        "{}",
        stderr(&o)
    );
    assert!(!cfg.exists());
    // A folder with no diffusion model (a LoRA alone).
    let o = init(&m.join("loras"), &images, &cfg, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("--model") && stderr(&o).contains("no known diffusion model"),
        "{}",
        stderr(&o)
    );
    assert!(!cfg.exists());
    // An existing file: kept without --force, replaced with it.
    std::fs::write(&cfg, "# mine\n").unwrap();
    let o = init(&m, &images, &cfg, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&cfg).unwrap(), "# mine\n");
    let o = init(&m, &images, &cfg, &["--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    TrainConfig::from_file(&cfg).unwrap();
    // No flags: a usage error.
    let o = train(&["init".as_ref()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn sample_names_the_families_a_folder_holds_and_takes_arch_as_override() {
    let d = temp("init-sample-arch");
    let m = comfy(&d);
    let zimage = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/zimage");
    std::fs::copy(
        zimage.join("single_file.safetensors"),
        m.join("diffusion_models/z-image-tiny.safetensors"),
    )
    .unwrap();
    let sample = |extra: &[&str], out: &Path| {
        Command::new(env!("CARGO_BIN_EXE_sample"))
            .args([
                "--device", "cpu", "--dtype", "f32", "--width", "32", "--height", "32",
            ])
            .args([
                "--steps",
                "1",
                "--t5-tokens",
                "16",
                "--prompt",
                "a red circle",
            ])
            .args(extra)
            .arg("--model")
            .arg(&m)
            .arg("--out")
            .arg(out)
            .output()
            .unwrap()
    };
    let o = sample(&[], &d.join("a"));
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    for want in [
        "flux1-tiny.safetensors",
        "z-image-tiny.safetensors",
        "(flux, zimage)",
        "--arch",
    ] {
        assert!(e.contains(want), "{want}: {e}");
    }
    let o = sample(&["--arch", "flux"], &d.join("b"));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(d.join("b/0-0.png").is_file());
    std::fs::remove_dir_all(&d).ok();
}

/// The starting recipes of `train init` are the examples' templates' values.
#[test]
fn the_recipes_are_the_templates() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    assert_eq!(
        flame::train::init::RECIPES.len(),
        flame::models::FAMILIES.len()
    );
    for r in flame::train::init::RECIPES {
        flame::models::family(r.arch).unwrap();
        let text = std::fs::read_to_string(root.join("examples").join(r.template)).unwrap();
        let t: toml::Table = toml::from_str(&text).unwrap();
        assert_eq!(t["model"]["arch"].as_str(), Some(r.arch), "{}", r.template);
        let targets: Vec<&str> = t["adapter"]["targets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(targets, r.targets, "{}", r.template);
        assert_eq!(
            t["train"].get("timesteps").and_then(|v| v.as_str()),
            r.timesteps,
            "{}",
            r.template
        );
        let snr = t["train"].get("min_snr_gamma").and_then(|v| v.as_float());
        assert_eq!(snr.unwrap_or(0.0), r.min_snr_gamma, "{}", r.template);
        assert_eq!(
            t["sample"]["steps"].as_integer(),
            Some(r.sample_steps as i64)
        );
        assert_eq!(t["sample"]["guidance"].as_float(), Some(r.sample_guidance));
        assert_eq!(
            t["data"]["resolution"].as_integer(),
            Some(r.resolution as i64)
        );
    }
}

/// `sample` of the model folder `m` with the LoRA `lora` (one step at 32x32 in f32 on the
/// CPU); returns its log.
fn sample_with(m: &Path, lora: &Path, out: &Path) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_sample"))
        .args([
            "--device", "cpu", "--dtype", "f32", "--width", "32", "--height", "32",
        ])
        .args([
            "--steps",
            "1",
            "--t5-tokens",
            "16",
            "--prompt",
            "a red circle",
        ])
        .arg("--model")
        .arg(m)
        .arg("--lora")
        .arg(lora)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.join("0-0.png").is_file());
    stderr(&o)
}

/// A ComfyUI folder of `arch` under `d` (built by `make`) goes through `train init` (only its
/// path given) → `train --plan` → `train` → `sample --lora`; the config and the logs name
/// each file picked (`want`).
fn folder_trains_and_samples(d: &Path, m: &Path, arch: &str, want: &[&str]) {
    let images = d.join("images");
    flame::train::demo::make_tiny_images(&images).unwrap();
    let (text, out) = init_plan_train(d, m, &images, arch);
    for w in want {
        assert!(text.contains(w), "{w}:\n{text}");
    }
    let log = sample_with(m, &out.join("lora.safetensors"), &d.join("samples"));
    assert!(log.contains(&format!("diffusion model ({arch})")), "{log}");
    for w in want {
        assert!(log.contains(w), "{w}:\n{log}");
    }
}

#[test]
fn a_gguf_flux2_klein_in_a_comfyui_folder_trains_and_samples() {
    let d = temp("init-gguf-flux2");
    let m = qwen_family_folder(&d, "flux2");
    folder_trains_and_samples(
        &d,
        &m,
        "flux2",
        &[
            "flux2-tiny-Q8_0.gguf",
            "GGUF",
            "Q8_0",
            "qwen_3.safetensors",
            "flux2_vae.safetensors",
        ],
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_gguf_z_image_in_a_comfyui_folder_trains_and_samples() {
    let d = temp("init-gguf-zimage");
    let m = qwen_family_folder(&d, "zimage");
    folder_trains_and_samples(
        &d,
        &m,
        "zimage",
        &[
            "zimage-tiny-Q4_0.gguf",
            "Q4_0",
            "qwen_3.safetensors",
            "zimage_vae.safetensors",
        ],
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_gguf_sd35_in_a_comfyui_folder_trains_and_samples() {
    let d = temp("init-gguf-sd35");
    let m = sd35_folder(&d, true);
    folder_trains_and_samples(
        &d,
        &m,
        "sd3",
        &[
            "sd3.5_medium-Q5_0.gguf",
            "Q5_0",
            "clip_l.safetensors",
            "clip_g.safetensors",
            "t5xxl_fp16.safetensors",
            "sd35_vae.safetensors",
        ],
    );
    std::fs::remove_dir_all(&d).ok();
}

/// Stability's SD3.5 all-in-one in `checkpoints/` (MMDiT and autoencoder, no text encoders)
/// beside ComfyUI's lone `text_encoders/` files: the encoders come from those.
#[test]
fn an_sd35_checkpoint_without_encoders_takes_the_lone_ones_and_trains() {
    let d = temp("init-sd35-aio");
    let m = sd35_folder(&d, false);
    folder_trains_and_samples(
        &d,
        &m,
        "sd3",
        &[
            "sd3.5_medium.safetensors",
            "clip_l.safetensors",
            "clip_g.safetensors",
            "t5xxl_fp16.safetensors",
        ],
    );
    std::fs::remove_dir_all(&d).ok();
}
