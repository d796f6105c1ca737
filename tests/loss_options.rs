//! The loss and noise options (kohya sd-scripts' Huber schedules and losses, masked loss
//! and its reduction, L1, noise offset and its random strength, pyramid noise, input
//! perturbation, timestep ranges, the regularisation
//! repeats) against tests/fixtures/lossdata/reference.json, made by
//! scripts/make_lossdata_fixtures.py with PyTorch from kohya's formulas (float64), and the
//! masks against pictures written here.
#![cfg(feature = "cpu-ref")]

use flame::data::mask::{area_pool, mask_file, mask_tensor, MaskSource};
use flame::data::{reg_repeats, Bucket, CropMode, Geometry, Resample};
use flame::diffusion::loss::{
    elementwise, huber_threshold, noise_offset, perturbed_noise, pyramid_levels, pyramid_noise,
    reduce, strength, HuberSchedule, LossType, TimestepRange,
};
use flame::train::Ddpm;
use flame::train::{flow_matching, Prediction};
use flame::{DType, Device, Tensor};
use serde_json::Value;
use std::path::PathBuf;

const CPU: Device = Device::Cpu;

fn reference() -> Value {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lossdata/reference.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    floats(v).iter().map(|&x| x as f32).collect()
}

fn dims(v: &Value) -> Vec<usize> {
    floats(v).iter().map(|&x| x as usize).collect()
}

fn close(what: &str, got: &[f64], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= atol + rtol * w.abs(),
            "{what}: element {i} is {g}, want {w}"
        );
    }
}

#[test]
fn huber_thresholds_follow_kohyas_schedules() {
    let r = reference();
    let ddpm = Ddpm::scaled_linear();
    let mut seen = 0;
    for case in r["huber_threshold"].as_array().unwrap() {
        let schedule = match case["schedule"].as_str().unwrap() {
            "constant" => HuberSchedule::Constant,
            "exponential" => HuberSchedule::Exponential,
            _ => HuberSchedule::Snr,
        };
        let t = floats(&case["timesteps"]);
        let got = huber_threshold(
            schedule,
            case["huber_c"].as_f64().unwrap(),
            case["huber_scale"].as_f64().unwrap(),
            &t,
            Some(&ddpm.alphas_cumprod),
        )
        .unwrap();
        // diffusers' ᾱ is float32: 1e-6 relative.
        close(&format!("{case}"), &got, &floats(&case["c"]), 1e-9, 1e-6);
        seen += 1;
    }
    assert_eq!(seen, 10);
    // "snr" needs a DDPM schedule; flow matching has none: an error naming the key.
    let e = huber_threshold(HuberSchedule::Snr, 0.1, 1.0, &[500.0], None).unwrap_err();
    assert!(e.to_string().contains("train.huber_schedule"), "{e}");
}

#[test]
fn losses_masks_and_the_reduction_equal_kohyas() {
    let r = reference();
    let l = &r["loss"];
    let d = dims(&l["dims"]);
    let (b, h, w, f) = (d[0], d[2], d[3], l["factor"].as_u64().unwrap() as usize);
    let t = |k: &str, shape: Vec<usize>| Tensor::from_vec(f32s(&l[k]), shape, &CPU).unwrap();
    let pred = t("pred", d.clone());
    let target = t("target", d.clone());
    let c = t("c", vec![b]);
    let weights = t("weights", vec![b]);
    // kohya's area interpolation to the latent grid is the mean of each factor² cell.
    let pixels = f32s(&l["pixel_mask"]);
    let plane = h * f * w * f;
    let pooled: Vec<f64> = (0..b)
        .flat_map(|i| area_pool(&pixels[i * plane..(i + 1) * plane], h * f, w * f, f))
        .map(f64::from)
        .collect();
    close("area pool", &pooled, &floats(&l["mask"]), 1e-7, 1e-6);
    let mask = t("mask", vec![b, 1, h, w]);
    for case in l["cases"].as_array().unwrap() {
        let kind = match case["loss_type"].as_str().unwrap() {
            "l2" => LossType::L2,
            "l1" => LossType::L1,
            "huber" => LossType::Huber,
            _ => LossType::SmoothL1,
        };
        let el = elementwise(kind, &pred, &target, Some(&c)).unwrap();
        let what = format!("{kind:?}");
        close(
            &what,
            &el.to_vec_f64().unwrap(),
            &floats(&case["elementwise"]),
            1e-6,
            1e-5,
        );
        let masked = reduce(&el, Some(&mask), Some(&weights)).unwrap();
        let want = case["reduced"].as_f64().unwrap();
        close(
            &what,
            &[masked.to_scalar_f64().unwrap()],
            &[want],
            1e-7,
            1e-5,
        );
        let plain = reduce(&el, None, Some(&weights)).unwrap();
        let want = case["reduced_unmasked"].as_f64().unwrap();
        close(
            &what,
            &[plain.to_scalar_f64().unwrap()],
            &[want],
            1e-7,
            1e-5,
        );
    }
    // A zero mask: zero loss and zero gradient.
    let p = Tensor::from_vec(f32s(&l["pred"]), d.clone(), &CPU)
        .unwrap()
        .requires_grad_()
        .unwrap();
    let zero = Tensor::zeros((b, 1, h, w), DType::F32, &CPU).unwrap();
    let el = elementwise(LossType::Huber, &p, &target, Some(&c)).unwrap();
    let loss = reduce(&el, Some(&zero), None).unwrap();
    assert_eq!(loss.to_scalar_f64().unwrap(), 0.0);
    let g = loss.backward().unwrap();
    assert!(g
        .get(&p)
        .unwrap()
        .to_vec_f64()
        .unwrap()
        .iter()
        .all(|&x| x == 0.0));
    // Huber without its threshold, and a mask of the wrong grid, are errors.
    assert!(elementwise(LossType::Huber, &pred, &target, None).is_err());
    let wrong = Tensor::zeros((b, 1, h + 1, w), DType::F32, &CPU).unwrap();
    assert!(reduce(&el, Some(&wrong), None).is_err());
}

#[test]
fn noise_offset_and_its_adaptive_scale_equal_kohyas() {
    let r = reference();
    let n = &r["noise_offset"];
    let d = dims(&n["dims"]);
    let dims = [d[0], d[1], d[2], d[3]];
    for case in n["cases"].as_array().unwrap() {
        let mut noise = f32s(&n["noise"]);
        // noise_offset_random_strength: the offset is u times noise_offset.
        let offset = case["offset"].as_f64().unwrap();
        let u = case["random_u"].as_f64();
        noise_offset(
            &mut noise,
            &f32s(&n["latents"]),
            dims,
            strength(offset, u.is_some(), u.unwrap_or(0.0)),
            case["adaptive"].as_f64(),
            &f32s(&n["draws"]),
        )
        .unwrap();
        let got: Vec<f64> = noise.iter().map(|&x| x as f64).collect();
        close(&format!("{case}"), &got, &floats(&case["out"]), 1e-6, 1e-6);
    }
}

#[test]
fn pyramid_noise_equals_kohyas() {
    let r = reference();
    let p = &r["pyramid"];
    let d = dims(&p["dims"]);
    let levels = pyramid_levels(d[2], d[3], &floats(&p["r"]));
    let want: Vec<(usize, usize)> = p["levels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l[0].as_u64().unwrap() as usize,
                l[1].as_u64().unwrap() as usize,
            )
        })
        .collect();
    assert_eq!(
        levels, want,
        "the levels stop after the first with a side of 1"
    );
    let draws: Vec<Vec<f32>> = p["draws"].as_array().unwrap().iter().map(f32s).collect();
    let out = pyramid_noise(
        &f32s(&p["noise"]),
        [d[0], d[1], d[2], d[3]],
        p["discount"].as_f64().unwrap(),
        &levels,
        &draws,
    )
    .unwrap();
    let got: Vec<f64> = out.iter().map(|&x| x as f64).collect();
    close("pyramid", &got, &floats(&p["out"]), 1e-5, 1e-5);
}

#[test]
fn timestep_ranges_follow_kohyas_randint_and_map_flow_matching() {
    // DDPM: randint(min, max), max excluded; equal ends give that timestep.
    let r = TimestepRange { min: 200, max: 300 };
    assert_eq!(r.ddpm(0.0), 200);
    assert_eq!(r.ddpm(0.5), 250);
    assert_eq!(r.ddpm(0.999_999), 299);
    assert_eq!(TimestepRange { min: 400, max: 400 }.ddpm(0.7), 400);
    // The full range is the sampler's own: floor(u · 1000).
    assert_eq!(TimestepRange::FULL.ddpm(0.1234), 123);
    // Flow matching: t mapped into [min, max] / 1000.
    assert!((r.flow(0.0) - 0.2).abs() < 1e-15);
    assert!((r.flow(0.5) - 0.25).abs() < 1e-15);
    assert!((r.flow(1.0) - 0.3).abs() < 1e-15);
    // Ddpm draws inside the range, from the uniform draws of its own sampler.
    let ddpm = Ddpm::scaled_linear();
    let t = ddpm
        .sample_timesteps_in(64, r, 9, &CPU)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    let u = Tensor::rand(64, DType::F32, &CPU, 9)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    for (t, u) in t.iter().zip(&u) {
        assert_eq!(*t as usize, r.ddpm(*u));
        assert!((200.0..300.0).contains(t));
    }
    let full = ddpm
        .sample_timesteps(64, 9, &CPU)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    let same = ddpm
        .sample_timesteps_in(64, TimestepRange::FULL, 9, &CPU)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    assert_eq!(full, same);
    let over = TimestepRange { min: 0, max: 2000 };
    assert!(ddpm.sample_timesteps_in(4, over, 9, &CPU).is_err());
}

#[test]
fn regularisation_repeats_follow_kohyas_loop() {
    // The first pass takes each image with its repeats until the sum reaches the training
    // samples; later passes add one repeat each in turn.
    assert_eq!(reg_repeats(10, &[1, 1, 1]), vec![4, 3, 3]);
    assert_eq!(reg_repeats(7, &[2, 1]), vec![4, 3]);
    // Images the first pass does not reach are left out.
    assert_eq!(reg_repeats(5, &[3, 3, 3]), vec![3, 3, 0]);
    assert_eq!(reg_repeats(6, &[3, 3, 3]), vec![3, 3, 0]);
    // More reg images than training samples; no training samples; no reg images.
    assert_eq!(reg_repeats(2, &[1, 1, 1, 1]), vec![1, 1, 0, 0]);
    assert_eq!(reg_repeats(0, &[2]), vec![0]);
    assert!(reg_repeats(5, &[]).is_empty());
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-loss-options-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn masks_follow_their_image_through_resize_crop_and_flip() {
    let d = temp("masks");
    let image = d.join("a.png");
    // A 64x32 image into a 32x32 bucket: resized to 64x32 (no change), cropped at left 16.
    image::RgbImage::new(64, 32).save(&image).unwrap();
    // The mask: white where x >= 40, black elsewhere.
    let m = image::GrayImage::from_fn(64, 32, |x, _| image::Luma([if x >= 40 { 255 } else { 0 }]));
    m.save(mask_file(&image)).unwrap();
    assert_eq!(mask_file(&image), d.join("a-masklabel.png"));
    let bucket = Bucket {
        width: 32,
        height: 32,
    };
    let geo = Geometry::new(64, 32, bucket, CropMode::Center, 0, 0);
    assert_eq!((geo.left, geo.top), (16, 0));
    let at = |flip: bool| {
        mask_tensor(
            &image,
            MaskSource::File,
            &geo,
            Resample::Lanczos3,
            flip,
            8,
            &CPU,
        )
        .unwrap()
        .to_vec_f64()
        .unwrap()
    };
    // Crop columns 16..48 in cells of 8: 16..24, 24..32 black; 32..40 black; 40..48 white.
    let row = [0.0, 0.0, 0.0, 1.0];
    let want: Vec<f64> = (0..4).flat_map(|_| row).collect();
    assert_eq!(at(false), want);
    let flipped: Vec<f64> = (0..4).flat_map(|_| row.iter().rev().copied()).collect();
    assert_eq!(at(true), flipped);
    // No mask file: ones. An image without alpha under alpha_mask: ones.
    std::fs::remove_file(mask_file(&image)).unwrap();
    assert_eq!(at(false), vec![1.0; 16]);
    let alpha = mask_tensor(
        &image,
        MaskSource::Alpha,
        &geo,
        Resample::Lanczos3,
        false,
        8,
        &CPU,
    )
    .unwrap();
    assert_eq!(alpha.to_vec_f64().unwrap(), vec![1.0; 16]);
    // The alpha channel: half transparent everywhere.
    let rgba = image::RgbaImage::from_pixel(64, 32, image::Rgba([9, 9, 9, 0]));
    rgba.save(&image).unwrap();
    let alpha = mask_tensor(
        &image,
        MaskSource::Alpha,
        &geo,
        Resample::Lanczos3,
        false,
        8,
        &CPU,
    )
    .unwrap();
    assert_eq!(alpha.to_vec_f64().unwrap(), vec![0.0; 16]);
    // A mask of another size than its image is refused, naming the mask.
    image::GrayImage::new(10, 10)
        .save(mask_file(&image))
        .unwrap();
    let e = mask_tensor(
        &image,
        MaskSource::File,
        &geo,
        Resample::Lanczos3,
        false,
        8,
        &CPU,
    )
    .unwrap_err();
    assert!(e.contains("a-masklabel.png") && e.contains("10x10"), "{e}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn bad_option_values_are_refused_naming_their_key() {
    let example = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny.toml");
    let good = std::fs::read_to_string(example).unwrap();
    let d = temp("config");
    let train = |keys: &str| good.replace("[train]\n", &format!("[train]\n{keys}\n"));
    let data = |keys: &str| good.replace("[data]\n", &format!("[data]\n{keys}\n"));
    let adapter = |keys: &str| good.replace("[adapter]\n", &format!("[adapter]\n{keys}\n"));
    let cases = [
        (train("huber_c = 0.0"), "train.huber_c"),
        (train("huber_c = 1.5"), "train.huber_c"),
        (train("huber_scale = 0.0"), "train.huber_scale"),
        (train("loss_type = \"l3\""), "train.loss_type"),
        (
            train("noise_offset_random_strength = true"),
            "train.noise_offset_random_strength",
        ),
        (train("ip_noise_gamma = -0.1"), "train.ip_noise_gamma"),
        (
            train("ip_noise_gamma_random_strength = true"),
            "train.ip_noise_gamma_random_strength",
        ),
        (
            adapter("loraplus_lr_ratio = 0.0"),
            "adapter.loraplus_lr_ratio",
        ),
        (
            adapter("kind = \"full\"\nloraplus_lr_ratio = 16.0"),
            "adapter.loraplus_lr_ratio",
        ),
        (
            format!("{good}\n[[adapter.blocks]]\npattern = \"x.*\"\nalpha = 0.0\n"),
            "adapter.blocks",
        ),
        (train("huber_schedule = \"cosine\""), "train.huber_schedule"),
        (train("noise_offset = -0.1"), "train.noise_offset"),
        (
            train("adaptive_noise_scale = 0.05"),
            "train.adaptive_noise_scale",
        ),
        (
            train("multires_noise_discount = 0.0"),
            "train.multires_noise_discount",
        ),
        (
            train("multires_noise_iterations = 100"),
            "train.multires_noise_iterations",
        ),
        (train("min_timestep = 1000"), "train.min_timestep"),
        (train("max_timestep = 1001"), "train.max_timestep"),
        (
            train("min_timestep = 500\nmax_timestep = 400"),
            "train.max_timestep",
        ),
        (data("prior_loss_weight = -1.0"), "data.prior_loss_weight"),
        (
            data("masked_loss = true\nalpha_mask = true"),
            "data.alpha_mask",
        ),
        (
            format!("{}\n[[data.reg_dirs]]\npath = \"reg\"\nrepeats = 0\n", good),
            "data.reg_dirs",
        ),
    ];
    for (text, key) in cases {
        let p = d.join("bad.toml");
        std::fs::write(&p, &text).unwrap();
        let e = flame::train::TrainConfig::from_file(&p)
            .unwrap_err()
            .to_string();
        assert!(e.contains(key), "{key} not in: {e}");
    }
    // Good values pass.
    let fine = train(
        "loss_type = \"smooth_l1\"\nhuber_schedule = \"exponential\"\nnoise_offset = 0.1\n\
         adaptive_noise_scale = -0.2\nmultires_noise_iterations = 6\nmin_timestep = 10\n\
         max_timestep = 10\nnoise_offset_random_strength = true\nip_noise_gamma = 0.1\n\
         ip_noise_gamma_random_strength = true",
    );
    std::fs::write(d.join("good.toml"), fine).unwrap();
    flame::train::TrainConfig::from_file(d.join("good.toml")).unwrap();
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn input_perturbation_noises_the_input_and_not_the_target() {
    let r = reference();
    let ip = &r["ip_noise"];
    let d = dims(&ip["dims"]);
    let t = |k: &str| Tensor::from_vec(floats(&ip[k]), d.clone(), &CPU).unwrap();
    let (x0, noise, xi) = (t("latents"), t("noise"), t("xi"));
    let ddpm = Ddpm::scaled_linear();
    let v = |t: &Tensor| t.to_vec_f64().unwrap();
    for case in ip["cases"].as_array().unwrap() {
        let u = case["random_u"].as_f64();
        let gamma = strength(
            case["gamma"].as_f64().unwrap(),
            u.is_some(),
            u.unwrap_or(0.0),
        );
        let input = perturbed_noise(&noise, &xi, gamma).unwrap();
        let what = format!("{case}");
        // Flow matching: x_t from the perturbed noise, the target from the noise.
        let s = Tensor::from_vec(floats(&case["flow_sigmas"]), d[0], &CPU).unwrap();
        let xt = flow_matching(&x0, &input, &s).unwrap().0;
        let target = flow_matching(&x0, &noise, &s).unwrap().1;
        close(&what, &v(&xt), &floats(&case["flow_input"]), 1e-6, 1e-6);
        close(
            &what,
            &v(&target),
            &floats(&case["flow_target"]),
            1e-12,
            1e-12,
        );
        // DDPM: add_noise of the perturbed noise; ε and v targets from the noise.
        let ts: Vec<f32> = f32s(&case["ddpm_timesteps"]);
        let ts = Tensor::from_vec(ts, d[0], &CPU).unwrap();
        for (pred, key) in [
            (Prediction::Epsilon, "ddpm_target_eps"),
            (Prediction::V, "ddpm_target_v"),
        ] {
            let xt = ddpm.noisy_and_target(&x0, &input, &ts, pred).unwrap().0;
            let target = ddpm.noisy_and_target(&x0, &noise, &ts, pred).unwrap().1;
            close(&what, &v(&xt), &floats(&case["ddpm_input"]), 1e-6, 1e-6);
            close(&what, &v(&target), &floats(&case[key]), 1e-6, 1e-6);
        }
    }
    // Without its random strength the strength is the value; with it, u times it.
    assert_eq!(strength(0.1, false, 0.3), 0.1);
    assert_eq!(strength(0.5, true, 0.25), 0.125);
}
