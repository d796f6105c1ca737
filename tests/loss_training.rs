//! The loss and noise options through the trainer, on the tiny image example
//! (examples/flux-tiny.toml): zero masks give zero loss and gradient, alpha masks of
//! pictures without alpha change nothing, a changed mask recaches only its entries;
//! regularisation images are matched to the training samples, and their loss is weighted by
//! `prior_loss_weight` (0: zero loss and gradient from them, 3: three times the loss);
//! noise offset, pyramid noise, Huber and smooth L1 and timestep ranges each train and
//! change the loss, as do L1, input perturbation and the random strengths; a run with every
//! option on (LoRA+ and a block's rate and rank among them) resumes exactly; LoRA+ scales the
//! first AdamW update of the up matrices by its ratio and leaves the files' layout alone, and
//! a block's rank and rate reach its layers.
#![cfg(feature = "cpu-ref")]

use flame::nn::AdapterBlock;
use flame::train::data::Part;
use flame::train::rundir::read_log;
use flame::train::{Event, Prepare, RunOptions, StepReport, TrainConfig, Trainer};
use flame::{DType, Device};
use std::path::{Path, PathBuf};

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-loss-training-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The image example under `dir` for `steps` steps of `batch` samples on the CPU, without
/// sample images or validation, with `train` and `data` keys added; the tiny model,
/// encoders and pictures made once per folder.
fn config(dir: &Path, steps: usize, batch: usize, train: &str, data: &str) -> TrainConfig {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny.toml");
    // `[[...]]` tables go at the end, after the `[data]` keys.
    let (data, tables) = data.split_at(data.find("[[").unwrap_or(data.len()));
    let text = std::fs::read_to_string(example)
        .unwrap()
        .replace("steps = 200", &format!("steps = {steps}"))
        .replace("batch_size = 4", &format!("batch_size = {batch}"))
        .replace("save_every = 50", "save_every = 3")
        .replace("validate_every = 50", "validate_every = 0")
        .replace("validation_split = 0.2", "validation_split = 0.0")
        .replace("device = \"auto\"", "device = \"cpu\"")
        .replace("warmup_steps = 10", "warmup_steps = 1")
        .replace("[train]\n", &format!("[train]\n{train}\n"))
        .replace(
            "[data]\n",
            &format!("[data]\ncache_dir = \"tiny/cache\"\n{data}\n"),
        );
    let text = text
        .lines()
        .map(|l| match l.starts_with("prompts = ") {
            true => "prompts = []",
            false => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
        + tables;
    let p = dir.join("train.toml");
    std::fs::write(&p, text).unwrap();
    let cfg = TrainConfig::from_file(p).unwrap();
    if !dir.join("tiny/flux-tiny.safetensors").exists() {
        flame::train::demo::make_tiny(&cfg).unwrap();
    }
    cfg
}

/// `cfg` with its output in `out` (under the config's folder).
fn output(mut cfg: TrainConfig, dir: &Path, out: &str) -> TrainConfig {
    cfg.train.output_dir = dir.join(out);
    cfg
}

fn open(cfg: &TrainConfig) -> (Trainer, Vec<String>) {
    let mut notes = vec![];
    let t = Trainer::open(cfg.clone(), Prepare::Encode, &mut |e| {
        if let Event::Note(n) = e {
            notes.push(n)
        }
    })
    .unwrap();
    (t, notes)
}

/// Runs `cfg` from scratch: every step's report.
fn steps(cfg: &TrainConfig) -> Vec<StepReport> {
    let mut out = vec![];
    open(cfg)
        .0
        .run(&RunOptions::default(), &mut |e| {
            if let Event::Step(r) = e {
                out.push(r)
            }
        })
        .unwrap();
    out
}

fn images(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir.join("tiny/images"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "png"))
        .filter(|p| !p.to_string_lossy().contains("-masklabel"))
        .collect();
    v.sort();
    v
}

/// Writes a mask of grey `level` beside every picture.
fn masks(dir: &Path, level: u8) {
    for p in images(dir) {
        let (w, h) = image::image_dimensions(&p).unwrap();
        image::GrayImage::from_pixel(w, h, image::Luma([level]))
            .save(flame::data::mask::mask_file(&p))
            .unwrap();
    }
}

/// The "(N reused, M encoded)" of the last latent caching note.
fn cached(notes: &[String]) -> (usize, usize) {
    let n = notes
        .iter()
        .rev()
        .find(|n| n.starts_with("caching latents:"))
        .unwrap_or_else(|| panic!("no caching note: {notes:?}"));
    let nums: Vec<usize> = n
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    (nums[2], nums[3])
}

#[test]
fn masks_weight_the_loss_and_key_the_cache() {
    let d = temp("masks");
    let plain = steps(&output(config(&d, 3, 4, "", ""), &d, "plain"));
    // Alpha masks of pictures without alpha are ones: the same run, bit for bit.
    let alpha = steps(&output(
        config(&d, 3, 4, "", "alpha_mask = true"),
        &d,
        "alpha",
    ));
    let losses = |r: &[StepReport]| r.iter().map(|s| s.loss).collect::<Vec<_>>();
    assert_eq!(losses(&alpha), losses(&plain));

    // Black masks: no loss, no gradient, from every picture.
    masks(&d, 0);
    let cfg = output(config(&d, 3, 4, "", "masked_loss = true"), &d, "black");
    let black = steps(&cfg);
    assert_eq!(black.len(), 3);
    for s in &black {
        assert_eq!((s.loss, s.grad_norm), (0.0, 0.0), "step {}", s.step);
    }
    // White masks: the unmasked loss (a resized white mask is 1 within rounding).
    masks(&d, 255);
    let white = steps(&output(
        config(&d, 3, 4, "", "masked_loss = true"),
        &d,
        "white",
    ));
    let (a, b) = (white[0].loss, plain[0].loss);
    assert!((a - b).abs() <= 1e-5 * b.abs(), "white {a}, unmasked {b}");

    // The cache is keyed by the mask: one changed mask file recomputes its entries only.
    let (_, notes) = open(&output(
        config(&d, 3, 4, "", "masked_loss = true"),
        &d,
        "again",
    ));
    let (reused, encoded) = cached(&notes);
    assert_eq!(encoded, 0, "{notes:?}");
    let first = flame::data::mask::mask_file(&images(&d)[0]);
    let (w, h) = image::image_dimensions(&first).unwrap();
    image::GrayImage::from_pixel(w, h, image::Luma([128]))
        .save(&first)
        .unwrap();
    let (_, notes) = open(&output(
        config(&d, 3, 4, "", "masked_loss = true"),
        &d,
        "again",
    ));
    let (r2, e2) = cached(&notes);
    assert!(e2 > 0 && r2 > 0 && r2 + e2 == reused, "{notes:?}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn regularisation_images_are_matched_and_weighted() {
    let d = temp("reg");
    // Three of the pictures, with their captions, as regularisation images.
    let reg = d.join("reg");
    std::fs::create_dir_all(&reg).unwrap();
    config(&d, 1, 1, "", "");
    for p in images(&d).iter().take(3) {
        let name = p.file_name().unwrap();
        std::fs::copy(p, reg.join(name)).unwrap();
        std::fs::copy(
            p.with_extension("txt"),
            reg.join(name).with_extension("txt"),
        )
        .unwrap();
    }
    let with = |w: f64, out: &str| {
        let data = format!("prior_loss_weight = {w}\n[[data.reg_dirs]]\npath = \"reg\"\n");
        output(config(&d, 8, 1, "", &data), &d, out)
    };
    let cfg = with(0.0, "zero");
    let (t, notes) = open(&cfg);
    // kohya's rule: the reg samples an epoch match the training samples (12 images x 2).
    let ds = |t: &Trainer| t.data().describe();
    assert!(
        notes
            .iter()
            .any(|n| n.starts_with("3 of 3 regularisation images used, 24 regularisation samples")),
        "{notes:?} {}",
        ds(&t)
    );
    // Which steps draw a regularisation image (batch size 1).
    let reg_step: Vec<bool> = (0..8)
        .map(|m| {
            let b = t
                .data()
                .batch(m, 1, cfg.train.seed, Part::WHOLE, DType::F32, &Device::Cpu)
                .unwrap();
            b.loss_weight.unwrap().to_vec_f64().unwrap()[0] == 0.0
        })
        .collect();
    drop(t);
    assert!(
        reg_step.iter().any(|&r| r) && reg_step.iter().any(|&r| !r),
        "{reg_step:?}"
    );
    let zero = steps(&cfg);
    for (s, &r) in zero.iter().zip(&reg_step) {
        match r {
            true => assert_eq!((s.loss, s.grad_norm), (0.0, 0.0), "step {}", s.step),
            false => assert!(s.loss > 0.0 && s.grad_norm > 0.0, "step {}", s.step),
        }
    }
    // The first step's loss scales with the weight when it is a reg sample.
    let one = steps(&with(1.0, "one"));
    let three = steps(&with(3.0, "three"));
    let want = if reg_step[0] {
        3.0 * one[0].loss
    } else {
        one[0].loss
    };
    // (3x in f32, against 3x in f64: one rounding apart.)
    assert!(
        (three[0].loss - want).abs() <= 1e-6 * want.abs(),
        "{} {want}",
        three[0].loss
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn noise_and_loss_options_train_and_change_the_loss() {
    let d = temp("options");
    let plain = steps(&output(config(&d, 2, 4, "", ""), &d, "plain"));
    let options = [
        "noise_offset = 0.1",
        "noise_offset = 0.1\nadaptive_noise_scale = 0.05",
        "multires_noise_iterations = 4\nmultires_noise_discount = 0.3",
        "loss_type = \"huber\"\nhuber_schedule = \"exponential\"\nhuber_c = 0.2",
        "loss_type = \"smooth_l1\"\nhuber_schedule = \"constant\"\nhuber_scale = 2.0",
        "min_timestep = 100\nmax_timestep = 600",
        "loss_type = \"l1\"",
        "noise_offset = 0.1\nnoise_offset_random_strength = true",
        "ip_noise_gamma = 0.1",
        "ip_noise_gamma = 0.1\nip_noise_gamma_random_strength = true",
    ];
    for (i, o) in options.iter().enumerate() {
        let r = steps(&output(config(&d, 2, 4, o, ""), &d, &format!("o{i}")));
        assert_eq!(r.len(), 2, "{o}");
        assert!(r.iter().all(|s| s.loss.is_finite() && s.loss > 0.0), "{o}");
        assert_ne!(
            r[0].loss, plain[0].loss,
            "{o} changes the first step's loss"
        );
    }
    // The SNR Huber schedule (kohya's default) needs a DDPM model: refused, naming the key.
    let cfg = output(config(&d, 2, 4, "loss_type = \"huber\"", ""), &d, "snr");
    let e = Trainer::open(cfg, Prepare::Encode, &mut |_| {})
        .err()
        .unwrap();
    assert!(e.to_string().contains("train.huber_schedule"), "{e}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_run_with_every_option_resumes_exactly() {
    let train = "noise_offset = 0.1\nadaptive_noise_scale = 0.05\nmultires_noise_iterations = 3\n\
                 loss_type = \"huber\"\nhuber_schedule = \"exponential\"\nmin_timestep = 50\n\
                 max_timestep = 900\nnoise_offset_random_strength = true\nip_noise_gamma = 0.1\n\
                 ip_noise_gamma_random_strength = true";
    let data = "masked_loss = true\nprior_loss_weight = 0.5\n[[data.reg_dirs]]\npath = \"reg\"\n";
    let setup = |d: &Path| {
        let reg = d.join("reg");
        std::fs::create_dir_all(&reg).unwrap();
        config(d, 6, 2, train, data);
        for (i, p) in images(d).iter().enumerate().take(2) {
            let name = p.file_name().unwrap();
            std::fs::copy(p, reg.join(name)).unwrap();
            std::fs::copy(
                p.with_extension("txt"),
                reg.join(name).with_extension("txt"),
            )
            .unwrap();
            // One reg image and some pictures with a half-grey mask.
            let (w, h) = image::image_dimensions(p).unwrap();
            let grey = image::GrayImage::from_pixel(w, h, image::Luma([100 + 50 * i as u8]));
            grey.save(flame::data::mask::mask_file(p)).unwrap();
            grey.save(flame::data::mask::mask_file(&reg.join(name)))
                .unwrap();
        }
        // LoRA+ and a block of its own rate and rank: an optimizer of four parameter groups.
        let mut c = config(d, 6, 2, train, data);
        c.adapter.loraplus_lr_ratio = 4.0;
        c.adapter.blocks = vec![AdapterBlock {
            pattern: "double_blocks.0.*".into(),
            lr: Some(1e-3),
            rank: Some(4),
            alpha: Some(2.0),
        }];
        c
    };
    let a = temp("full");
    let cfg = setup(&a);
    open(&cfg)
        .0
        .run(&RunOptions::default(), &mut |_| {})
        .unwrap();
    let out = &cfg.train.output_dir;
    let full = read_log(&out.join("loss.jsonl")).unwrap();
    assert_eq!(full.len(), 6);
    let lora = flame::train::metadata::content(&out.join("lora.safetensors")).unwrap();

    let b = temp("resumed");
    let cfg = setup(&b);
    let stop = RunOptions {
        stop_at: Some(4),
        ..Default::default()
    };
    open(&cfg).0.run(&stop, &mut |_| {}).unwrap();
    let resume = RunOptions {
        resume: true,
        ..Default::default()
    };
    open(&cfg).0.run(&resume, &mut |_| {}).unwrap();
    let out = &cfg.train.output_dir;
    assert_eq!(read_log(&out.join("loss.jsonl")).unwrap(), full);
    assert_eq!(
        flame::train::metadata::content(&out.join("lora.safetensors")).unwrap(),
        lora
    );
    // The options are resume keys: a resume with another weight is refused, naming it.
    let mut other = cfg.clone();
    other.data.prior_loss_weight = 0.25;
    let e = Trainer::open(other, Prepare::Encode, &mut |_| {})
        .and_then(|mut t| t.run(&resume, &mut |_| {}).map(|_| ()))
        .unwrap_err();
    assert!(e.to_string().contains("data.prior_loss_weight"), "{e}");
    std::fs::remove_dir_all(&a).ok();
    std::fs::remove_dir_all(&b).ok();
}

/// The adapters' tensors of a trainer, by name, as f64.
fn adapter_values(t: &Trainer) -> Vec<(String, Vec<f64>)> {
    t.adapters()
        .params()
        .unwrap()
        .into_iter()
        .map(|(n, p)| (n, p.to_vec_f64().unwrap()))
        .collect()
}

#[test]
fn loraplus_scales_the_up_matrices_first_update_by_its_ratio() {
    let d = temp("loraplus");
    let run = |ratio: f64, out: &str| {
        let mut cfg = output(config(&d, 1, 4, "", ""), &d, out);
        cfg.adapter.loraplus_lr_ratio = ratio;
        let (mut t, _) = open(&cfg);
        t.run(&RunOptions::default(), &mut |_| {}).unwrap();
        let file = flame::safetensors::SafeTensorsFile::open(
            cfg.train.output_dir.join("lora.safetensors"),
        )
        .unwrap();
        let layout: Vec<(String, Vec<usize>)> = file
            .names()
            .map(|n| (n.to_string(), file.info(n).unwrap().shape.clone()))
            .collect();
        (adapter_values(&t), layout)
    };
    let (one, layout_one) = run(1.0, "r1");
    let (eight, layout_eight) = run(8.0, "r8");
    let mut ups = 0;
    for ((name, a), (_, b)) in one.iter().zip(&eight) {
        if name.ends_with("lora_up.weight") {
            // B starts at zero; Adam's first step moves it by lr · g / (|g| + eps): eight
            // times as far at eight times the rate.
            ups += 1;
            assert!(a.iter().any(|&x| x != 0.0), "{name} moved");
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (y - 8.0 * x).abs() <= 1e-5 * (8.0 * x).abs() + 1e-12,
                    "{name}: {y} vs 8 x {x}"
                );
            }
        } else {
            // A's gradient is zero while B is: only the decay moves it, alike.
            assert_eq!(a, b, "{name}");
        }
    }
    assert!(ups > 0);
    let mut l1 = layout_one;
    let mut l8 = layout_eight;
    l1.sort();
    l8.sort();
    assert_eq!(l1, l8, "the same tensors and shapes in the file");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn blocks_set_ranks_and_rates_and_are_reported() {
    let d = temp("blocks");
    let mut cfg = output(config(&d, 1, 4, "", ""), &d, "blocks");
    cfg.adapter.blocks = vec![
        AdapterBlock {
            pattern: "double_blocks.0.*".into(),
            lr: Some(0.0),
            rank: Some(2),
            alpha: Some(1.0),
        },
        AdapterBlock {
            pattern: "single_blocks.*".into(),
            lr: None,
            rank: Some(0),
            alpha: None,
        },
        AdapterBlock {
            pattern: "nothing.*".into(),
            lr: None,
            rank: Some(3),
            alpha: None,
        },
    ];
    let (mut t, notes) = open(&cfg);
    let before = adapter_values(&t);
    t.run(&RunOptions::default(), &mut |_| {}).unwrap();
    let after = adapter_values(&t);
    let report: Vec<&String> = notes
        .iter()
        .filter(|n| n.starts_with("adapter.blocks"))
        .collect();
    assert_eq!(report.len(), 3, "{notes:?}");
    assert!(
        report[0].contains("matched 4 targeted layers (lr 0, rank 2, alpha 1)"),
        "{report:?}"
    );
    assert!(report[1].contains("rank 0, left without"), "{report:?}");
    assert!(
        report[2].contains("matched no targeted layer"),
        "{report:?}"
    );
    for ((name, a), (_, b)) in before.iter().zip(&after) {
        assert!(!name.starts_with("single_blocks."), "{name} has no adapter");
        if name.starts_with("double_blocks.0.") {
            // Rank 2, at rate 0: unchanged (the decay is lr · weight_decay = 0).
            if name.ends_with("lora_down.weight") {
                assert_eq!(a.len() % 2, 0);
            }
            assert_eq!(a, b, "{name} trains at rate 0");
        }
    }
    assert!(before
        .iter()
        .zip(&after)
        .any(|((n, a), (_, b))| !n.starts_with("double_blocks.0.") && a != b));
    // Files with two ranks are written with each module's alpha and read back.
    let out = cfg.train.output_dir.join("lora.safetensors");
    let file = flame::safetensors::SafeTensorsFile::open(&out).unwrap();
    let down = file
        .names()
        .find(|n| n.starts_with("lora_unet_double_blocks_0_") && n.ends_with("lora_down.weight"))
        .unwrap()
        .to_string();
    assert_eq!(file.info(&down).unwrap().shape[0], 2);
    let other = file
        .names()
        .find(|n| n.starts_with("lora_unet_final_layer") && n.ends_with("lora_down.weight"))
        .unwrap()
        .to_string();
    assert_eq!(file.info(&other).unwrap().shape[0], 8);
    let alpha = down.replace("lora_down.weight", "alpha");
    assert_eq!(
        file.load(&alpha, &Device::Cpu)
            .unwrap()
            .to_vec_f64()
            .unwrap(),
        [1.0]
    );
    // The per-block settings ride in the file's metadata as written.
    let recorded: Vec<AdapterBlock> =
        serde_json::from_str(&file.metadata()["flame_blocks"]).unwrap();
    assert_eq!(recorded, cfg.adapter.blocks);
    t.adapters().load_kohya(&out).unwrap();
    std::fs::remove_dir_all(&d).ok();
}
