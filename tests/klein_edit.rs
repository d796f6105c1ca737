//! FLUX.2 [klein] conditioned on reference images (edit training and sampling), against
//! diffusers 0.42.1's `Flux2KleinPipeline` on the tiny random pipeline of tests/klein.rs.
//! Fixtures (tests/fixtures/klein_edit) are made by scripts/make_klein_edit_fixtures.py:
//! the transformer's forward and backward in f64 with one and with two references of other
//! sizes than the image (reference tokens appended with `_prepare_image_ids`' positions), and
//! `__call__(image=[...])` trajectories with and without classifier-free guidance, with the
//! pipeline's preprocessed references and their packed latents.
//!
//! Tolerances, max |flame - diffusers| / max |diffusers| per tensor:
//! - [`FORWARD_TOL`] for the output, input and parameter gradients (FLAME in f32 against the
//!   f64 reference);
//! - [`TRAJECTORY_TOL`] for the latents after every step, the references' latents and the
//!   decoded image (as tests/klein.rs);
//! - the preprocessed references: equal to the pipeline's to f32 rounding, except where the
//!   pipeline's PIL resize rounds to 8 bits ([`RESIZE_TOL`]).
//!
//! Then the data side (ai-toolkit's reference folders, manifests in FLAME's and musubi-tuner's
//! fields, bad references), the config (keys refused for other families), the `train` binary
//! on an edit dataset (references cached, validation, samples with references, an exact
//! resume) and the `sample` binary's `--reference`.
#![cfg(feature = "cpu-ref")]

mod common;

use common::rel_err;
use flame::data::reference::{self, ReferenceOptions, PIPELINE_MAX_PIXELS};
use flame::data::{scan, OnBadFile, Source};
use flame::memory::{Checkpointing, Plan};
use flame::models::flux2::{self, Flux2};
use flame::models::{self, load_as, DiffusionModel, LoadOptions, Sources};
use flame::nn::{Adapters, LoraConfig};
use flame::sample::{denoise_with, Guidance, Schedule, StepInfo};
use flame::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const CPU: Device = Device::Cpu;
const FORWARD_TOL: f64 = 1e-5;
const TRAJECTORY_TOL: f64 = 1e-5;
/// PIL resizes 8-bit pictures to 8 bits, FLAME in f32: half a level of rounding, in [-1, 1]
/// two levels of 2/255 apart, plus the filters' own differences.
const RESIZE_TOL: f64 = 2.5 / 255.0;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/klein_edit")
}

fn pipeline() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/klein/pipeline")
}

fn tensors(name: &str) -> BTreeMap<String, Tensor> {
    flame::safetensors::load(root().join(name), &CPU)
        .unwrap()
        .into_iter()
        .collect()
}

fn cases() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(root().join("cases.json")).unwrap()).unwrap()
}

/// max |got - want| / max |want|, asserted within `tol`.
fn check(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> f64 {
    let e = rel_err(got, want);
    assert!(e <= tol, "{what}: error {e:e} > {tol:e}");
    e
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    a.iter()
        .zip(&b)
        .fold(0f64, |m, (x, y)| m.max((x - y).abs()))
}

// ---------------------------------------------------------------------------------------------
// The transformer.

/// The forward of `case` through `predict_with_references` (x, the references and the
/// context made trainable, every weight trainable), its loss's gradients against the
/// fixture. Returns the worst (output, input gradients, parameter gradients) errors.
fn forward_parity(case: &str) -> [f64; 3] {
    let io = tensors("forward.safetensors");
    let (model, vb) = Flux2::load(pipeline().join("transformer"), DType::F32, &CPU, None).unwrap();
    vb.set_trainable(|_| true).unwrap();
    let g = |k: &str| {
        io[&format!("{case}.{k}")]
            .detach()
            .requires_grad_()
            .unwrap()
    };
    let x = g("x");
    let ctx = g("context");
    let n = (0..)
        .take_while(|i| io.contains_key(&format!("{case}.ref.{i}")))
        .count();
    let refs: Vec<Tensor> = (0..n).map(|i| g(&format!("ref.{i}"))).collect();
    let t = &io[&format!("{case}.t")];
    let out = model
        .predict_with_references(&x, t, std::slice::from_ref(&ctx), &refs, 1.0)
        .unwrap();
    let mut worst = [
        check(
            &format!("{case} output"),
            &out,
            &io[&format!("{case}.output")],
            FORWARD_TOL,
        ),
        0.0,
        0.0,
    ];
    let grads = out
        .mul(&io[&format!("{case}.loss_weight")])
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let mut inputs = vec![("x".to_string(), &x), ("context".to_string(), &ctx)];
    inputs.extend(
        refs.iter()
            .enumerate()
            .map(|(i, r)| (format!("ref.{i}"), r)),
    );
    for (name, t) in inputs {
        let want = &io[&format!("{case}.grad.{name}")];
        worst[1] = worst[1].max(check(
            &format!("{case} grad.{name}"),
            grads.get(t).unwrap(),
            want,
            FORWARD_TOL,
        ));
    }
    let params: BTreeMap<String, Tensor> = vb.trainable_params().unwrap().into_iter().collect();
    let prefix = format!("{case}.param.");
    let want: Vec<(&str, &Tensor)> = io
        .iter()
        .filter_map(|(k, v)| k.strip_prefix(&prefix).map(|k| (k, v)))
        .collect();
    assert_eq!(
        params.keys().map(String::as_str).collect::<Vec<_>>(),
        want.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
        "{case}: parameters vs fixture gradients"
    );
    for (k, w) in want {
        let got = grads
            .get(&params[k])
            .unwrap_or_else(|| panic!("{case}: no gradient for {k}"));
        worst[2] = worst[2].max(check(&format!("{case} grad of {k}"), got, w, FORWARD_TOL));
    }
    println!(
        "klein edit forward {case} ({n} reference(s)): output {:.2e}, input grads {:.2e}, \
         param grads {:.2e}",
        worst[0], worst[1], worst[2]
    );
    worst
}

/// One reference of another size than the image: output, the gradients of the image, the
/// reference and the text, and every weight's gradient equal diffusers'.
#[test]
fn forward_with_one_reference_matches_diffusers() {
    forward_parity("one");
}

/// Two references of two sizes, a batch of two: the same.
#[test]
fn forward_with_two_references_matches_diffusers() {
    forward_parity("two");
}

/// The reference tokens and ids as `Flux2KleinPipeline.prepare_image_latents` makes them;
/// no references is the plain prediction; a family without references refuses them.
#[test]
fn reference_tokens_ids_and_refusals() {
    let ids = flux2::reference_ids(&[(2, 3), (1, 2)], &CPU).unwrap();
    assert_eq!(
        ids.to_vec_f64().unwrap(),
        [
            [10., 0., 0., 0.],
            [10., 0., 1., 0.],
            [10., 0., 2., 0.],
            [10., 1., 0., 0.],
            [10., 1., 1., 0.],
            [10., 1., 2., 0.],
            [20., 0., 0., 0.],
            [20., 0., 1., 0.],
        ]
        .concat()
    );
    assert!(flux2::reference_tokens(&[]).unwrap().is_none());
    let a = Tensor::randn((2, 4, 2, 3), DType::F32, &CPU, 1).unwrap();
    let b = Tensor::randn((2, 4, 1, 2), DType::F32, &CPU, 2).unwrap();
    let (tok, _) = flux2::reference_tokens(&[a.clone(), b.clone()])
        .unwrap()
        .unwrap();
    assert_eq!(tok.dims(), [2, 8, 4]);
    let want = Tensor::cat(
        &[
            &flux2::pack_latents(&a).unwrap(),
            &flux2::pack_latents(&b).unwrap(),
        ],
        1,
    )
    .unwrap();
    assert_eq!(tok.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    // Batches must agree.
    let c = Tensor::randn((1, 4, 1, 2), DType::F32, &CPU, 3).unwrap();
    assert!(flux2::reference_tokens(&[a, c]).is_err());

    let io = tensors("forward.safetensors");
    let m = models::load(
        "flux2",
        pipeline().join("transformer"),
        &LoadOptions::new(DType::F32, &CPU),
    )
    .unwrap()
    .model;
    assert!(m.family().references);
    let (x, t, ctx) = (&io["one.x"], &io["one.t"], &io["one.context"]);
    let plain = m.predict(x, t, std::slice::from_ref(ctx), 1.0).unwrap();
    let none = m
        .predict_with_references(x, t, std::slice::from_ref(ctx), &[], 1.0)
        .unwrap();
    assert_eq!(plain.to_vec_f64().unwrap(), none.to_vec_f64().unwrap());
    let with = m
        .predict_with_references(
            x,
            t,
            std::slice::from_ref(ctx),
            &[io["one.ref.0"].clone()],
            1.0,
        )
        .unwrap();
    assert!(
        rel_err(&with, &plain) > 1e-3,
        "the reference changes nothing"
    );
    // A reference of another batch is refused, naming the shapes.
    let bad = Tensor::zeros((2, 32, 6, 4), DType::F32, &CPU).unwrap();
    let e = m
        .predict_with_references(x, t, std::slice::from_ref(ctx), &[bad], 1.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("reference"), "{e}");
    for name in ["flux", "sd3", "sdxl", "zimage"] {
        assert!(!models::family(name).unwrap().references, "{name}");
    }
}

fn lora() -> std::sync::Arc<Adapters> {
    Adapters::new(LoraConfig {
        rank: 2,
        alpha: 2.0,
        dropout: 0.0,
        targets: vec!["double_blocks.*".into(), "single_blocks.*".into()],
        seed: 7,
    })
    .unwrap()
}

/// A LoRA's gradients reach it through the reference tokens' attention (they differ from
/// those without references), and checkpointed or streamed blocks give the resident run's
/// output and gradients bit for bit with references too.
#[test]
fn adapter_gradients_flow_through_references_under_every_block_plan() {
    let io = tensors("forward.safetensors");
    let path = pipeline().join("transformer");
    let run = |plan: Plan, with_refs: bool| {
        let a = lora();
        let mut opts = LoadOptions::new(DType::F32, &CPU).with_adapters(a.clone());
        opts.memory = plan;
        let l = load_as::<Flux2>(&path, &opts, None).unwrap();
        let refs: Vec<Tensor> = match with_refs {
            true => vec![io["two.ref.0"].clone(), io["two.ref.1"].clone()],
            false => vec![],
        };
        let out = l
            .model
            .predict_with_references(
                &io["two.x"],
                &io["two.t"],
                &[io["two.context"].clone()],
                &refs,
                1.0,
            )
            .unwrap();
        let grads = out
            .mul(&io["two.loss_weight"])
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let mut v = vec![("output".to_string(), out.to_vec_f64().unwrap())];
        for (n, p) in a.params().unwrap() {
            let g = grads
                .get(&p)
                .unwrap_or_else(|| panic!("no gradient reached {n}"));
            v.push((n, g.to_vec_f64().unwrap()));
        }
        v
    };
    let resident = run(Plan::default(), true);
    let without = run(Plan::default(), false);
    // The up-projections start at zero, so only their gradients (and the output) are not
    // zero: every one of them changes with the references.
    let moved: Vec<&String> = resident
        .iter()
        .filter(|(_, a)| a.iter().any(|v| *v != 0.0))
        .map(|(n, _)| n)
        .collect();
    assert_eq!(moved.len(), 1 + (resident.len() - 1) / 2, "{moved:?}");
    for ((n, a), (_, b)) in resident.iter().zip(&without) {
        if moved.contains(&n) {
            assert_ne!(a, b, "{n}: the references change nothing");
        }
    }
    let prefixes = flux2::Flux2Config::from_diffusers(
        &serde_json::from_str(&std::fs::read_to_string(path.join("config.json")).unwrap()).unwrap(),
    )
    .unwrap()
    .block_prefixes();
    for plan in [
        Plan {
            checkpointing: Checkpointing::All,
            ..Plan::default()
        },
        Plan {
            checkpointing: Checkpointing::All,
            streamed: prefixes.clone(),
            prefetch: 1,
            ..Plan::default()
        },
    ] {
        let what = format!("{:?} streaming {:?}", plan.checkpointing, plan.streamed);
        assert_eq!(run(plan, true), resident, "{what}");
    }
}

// ---------------------------------------------------------------------------------------------
// The pipeline: references sized, encoded and denoised with.

const KEYS: [&str; 3] = ["encoders.text", "encoders.tokenizers", "encoders.vae"];

fn vae() -> flame::encoders::AutoencoderKl {
    let family = models::family("flux2").unwrap();
    let (_, located) = Sources::default()
        .locate(family, &pipeline().join("transformer"), KEYS)
        .unwrap();
    models::load_vae(family, &located, DType::F32, &CPU, "encoders.vae").unwrap()
}

/// The size rules of `Flux2KleinPipeline.__call__` for references: the area cap's resize,
/// the floor to multiples of 16 (FLUX.2's autoencoder) and of 4 (the tiny one's), and the
/// pictures the pipeline refuses.
#[test]
fn reference_sizes_follow_the_pipeline() {
    let c = cases();
    for (wh, want) in c["sizes"].as_object().unwrap() {
        let (w, h) = wh.split_once('x').unwrap();
        let (w, h): (usize, usize) = (w.parse().unwrap(), h.parse().unwrap());
        for multiple in [16usize, 4] {
            let v: Vec<usize> = want[multiple.to_string()]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(
                reference::resized_size(w, h, PIPELINE_MAX_PIXELS),
                (v[0], v[1]),
                "{wh}"
            );
            let g = reference::geometry(
                w,
                h,
                &ReferenceOptions {
                    max_pixels: PIPELINE_MAX_PIXELS,
                    multiple,
                },
            )
            .unwrap();
            assert_eq!(
                (g.bucket.width, g.bucket.height),
                (v[2], v[3]),
                "{wh} /{multiple}"
            );
            assert_eq!(
                (g.left, g.top),
                ((v[0] - v[2]) / 2, (v[1] - v[3]) / 2),
                "{wh}"
            );
        }
    }
    // check_image_input: sides of at least 64, aspect ratios of at most 8.
    assert!(reference::unfit(63, 100).is_some());
    assert!(reference::unfit(64, 513).is_some());
    assert!(reference::unfit(64, 512).is_none());
}

/// The references as the pipeline preprocesses them: exact where it does not resize (a, b),
/// within 8-bit rounding where it does (big, over 1024x1024 pixels).
#[test]
fn preprocessed_references_match_the_pipeline() {
    let out = tensors("outputs.safetensors");
    let opts = ReferenceOptions {
        max_pixels: PIPELINE_MAX_PIXELS,
        multiple: 4,
    };
    for (i, name) in ["a", "b"].iter().enumerate() {
        let x =
            reference::load(&root().join(format!("refs/{name}.png")), &opts, false, &CPU).unwrap();
        let want = out[&format!("cfg.cond.{i}")].squeeze(0).unwrap();
        let d = max_abs_diff(&x, &want);
        assert!(d <= 1e-7, "{name}: {d:e}");
    }
    let big = reference::load(&root().join("refs/big.png"), &opts, false, &CPU).unwrap();
    let shape: Vec<usize> = cases()["big_shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(big.dims()[1..], shape[..]);
    let patch = big.narrow(1, 100, 32).unwrap().narrow(2, 200, 32).unwrap();
    let d = max_abs_diff(&patch, &out["big.cond"]);
    println!(
        "klein edit: big reference resized within {:.4} of PIL's 8-bit resize",
        d
    );
    assert!(d <= RESIZE_TOL, "big: {d}");
}

/// `case`'s trajectory: the references loaded, sized and encoded by FLAME (their packed
/// latents and ids against the pipeline's), then `denoise_with` from the pipeline's noise,
/// each step's latents, the final latents and the decoded image against the pipeline's.
fn trajectory(case: &str, batched: bool) -> f64 {
    let out = tensors("outputs.safetensors");
    let c = &cases()["cases"][case];
    let steps = c["steps"].as_u64().unwrap() as usize;
    let scale = c["guidance_scale"].as_f64().unwrap();
    let v = vae();
    let opts = ReferenceOptions {
        max_pixels: PIPELINE_MAX_PIXELS,
        multiple: v.config.diffusion_downscale(),
    };
    let refs: Vec<Tensor> = {
        let _g = flame::no_grad();
        c["refs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let p = root().join(format!("refs/{}.png", r.as_str().unwrap()));
                let x = reference::load(&p, &opts, false, &CPU).unwrap();
                v.encode_latents(&x.unsqueeze(0).unwrap()).unwrap()
            })
            .collect()
    };
    let (tok, ids) = flux2::reference_tokens(&refs).unwrap().unwrap();
    let e_refs = check(
        &format!("{case}: reference latents"),
        &tok,
        &out[&format!("{case}.image_latents")],
        TRAJECTORY_TOL,
    );
    assert_eq!(
        ids.unsqueeze(0).unwrap().to_vec_f64().unwrap(),
        out[&format!("{case}.image_ids")].to_vec_f64().unwrap(),
        "{case}: reference ids"
    );
    let m = models::load(
        "flux2",
        pipeline().join("transformer"),
        &LoadOptions::new(DType::F32, &CPU),
    )
    .unwrap()
    .model;
    let noise = &out[&format!("{case}.noise")];
    let d = noise.dims().to_vec();
    let schedule = flux2::schedule(steps, d[2] * d[3]).unwrap();
    let want_t = out[&format!("{case}.timesteps")].to_vec_f64().unwrap();
    for (a, b) in schedule.timesteps().iter().zip(&want_t) {
        assert!((*a as f64 - b).abs() <= 1e-6 * b.abs(), "timesteps {a} {b}");
    }
    // The pipeline repeats the references over the batch.
    let refs: Vec<Tensor> = refs
        .iter()
        .map(|r| Tensor::cat(&vec![r; d[0]], 0).unwrap())
        .collect();
    let cond = vec![out[&format!("{case}.context")].clone()];
    let guidance = match out.get(&format!("{case}.neg_context")) {
        Some(n) => Guidance::cfg(vec![n.clone()], scale).batched(batched),
        None => Guidance::none(),
    };
    let mut worst = 0f64;
    let mut seen = 0;
    let mut on_step = |s: &StepInfo<'_>| -> flame::Result<()> {
        worst = worst.max(check(
            &format!("{case}: latents after step {}", s.index),
            s.latents,
            &out[&format!("{case}.latents.{}", s.index)],
            TRAJECTORY_TOL,
        ));
        seen += 1;
        Ok(())
    };
    let z = denoise_with(
        &*m,
        &schedule,
        noise,
        &cond,
        &refs,
        &guidance,
        Some(&mut on_step),
    )
    .unwrap();
    assert_eq!(seen, steps);
    let _g = flame::no_grad();
    let e_lat = check(
        &format!("{case}: output_type=latent"),
        &v.unscale_latents(&z).unwrap(),
        &out[&format!("{case}.latent")],
        TRAJECTORY_TOL,
    );
    let e_img = check(
        &format!("{case}: decoded"),
        &v.decode_latents(&z).unwrap(),
        &out[&format!("{case}.decoded")],
        TRAJECTORY_TOL,
    );
    println!(
        "klein edit {case} (batched {batched}): reference latents {e_refs:.2e}, trajectory \
         {worst:.2e}, latents {e_lat:.2e}, decoded {e_img:.2e}"
    );
    worst.max(e_lat).max(e_img).max(e_refs)
}

/// Two references, classifier-free guidance at 4.0 (the base model's), its two predictions
/// batched and one after the other.
#[test]
fn cfg_trajectory_with_references_matches_the_pipeline() {
    trajectory("cfg", true);
    trajectory("cfg", false);
}

/// One reference, no guidance, the image the reference's size as the pipeline makes it.
#[test]
fn unguided_trajectory_with_a_reference_matches_the_pipeline() {
    trajectory("plain", false);
}

// ---------------------------------------------------------------------------------------------
// Data: reference folders and manifests.

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-klein-edit-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A `w` x `h` picture of one colour at `path`.
fn picture(path: &Path, w: u32, h: u32, rgb: [u8; 3]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    image::RgbImage::from_pixel(w, h, image::Rgb(rgb))
        .save(path)
        .unwrap();
}

fn folder(dir: &Path, references: &[PathBuf]) -> Source {
    Source::Folder {
        dir: dir.to_path_buf(),
        repeats: 1,
        references: references.to_vec(),
    }
}

/// ai-toolkit's convention: each reference folder holds an image of the same name (any
/// extension); several folders give several references in order; a `<repeats>_<name>`
/// subfolder's images look in the same subfolder of the reference folders. A missing
/// reference is a bad file naming the image and the missing path; a picture too small to be
/// a reference is one too; a missing reference folder is an error.
#[test]
fn reference_folders_pair_images_by_name() {
    let d = temp("folders");
    let (t, c1, c2) = (d.join("target"), d.join("control"), d.join("control2"));
    for (stem, ext) in [("a", "png"), ("b", "jpg")] {
        picture(&t.join(format!("{stem}.{ext}")), 64, 64, [200, 0, 0]);
        std::fs::write(t.join(format!("{stem}.txt")), format!("edit {stem}")).unwrap();
    }
    picture(&t.join("3_sub/c.png"), 64, 64, [0, 200, 0]);
    std::fs::write(t.join("3_sub/c.txt"), "edit c").unwrap();
    picture(&c1.join("a.webp"), 64, 80, [0, 0, 200]);
    picture(&c1.join("b.png"), 96, 64, [0, 0, 200]);
    picture(&c1.join("3_sub/c.jpg"), 70, 64, [0, 0, 200]);
    picture(&c2.join("a.PNG"), 64, 64, [9, 9, 9]);
    picture(&c2.join("b.jpeg"), 64, 64, [9, 9, 9]);
    picture(&c2.join("3_sub/c.png"), 64, 64, [9, 9, 9]);
    let s = scan(&[folder(&t, &[c1.clone(), c2.clone()])], OnBadFile::Stop).unwrap();
    let got: Vec<(String, Vec<PathBuf>)> = s
        .items
        .iter()
        .map(|it| {
            (
                it.name.clone(),
                it.references.iter().map(|r| r.path.clone()).collect(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (
                "a.png".to_string(),
                vec![c1.join("a.webp"), c2.join("a.PNG")]
            ),
            (
                "b.jpg".to_string(),
                vec![c1.join("b.png"), c2.join("b.jpeg")]
            ),
            (
                "3_sub/c.png".to_string(),
                vec![c1.join("3_sub/c.jpg"), c2.join("3_sub/c.png")]
            ),
        ]
    );
    assert_eq!(
        (
            s.items[0].references[0].width,
            s.items[0].references[0].height
        ),
        (64, 80)
    );
    assert_eq!(s.items[2].repeats, 3);

    // A missing reference: the error names the image and the missing path.
    std::fs::remove_file(c2.join("b.jpeg")).unwrap();
    let e = scan(&[folder(&t, &[c1.clone(), c2.clone()])], OnBadFile::Stop)
        .unwrap_err()
        .to_string();
    assert!(e.contains(&t.join("b.jpg").display().to_string()), "{e}");
    assert!(e.contains(&c2.join("b.*").display().to_string()), "{e}");
    let s = scan(&[folder(&t, &[c1.clone(), c2.clone()])], OnBadFile::Skip).unwrap();
    assert_eq!(s.items.len(), 2);
    assert_eq!(s.skipped.len(), 1);
    assert!(s.skipped[0].reason.contains("missing"), "{}", s.skipped[0]);
    // A reference the pipeline refuses (a side under 64 pixels).
    picture(&c2.join("b.png"), 32, 64, [9, 9, 9]);
    let e = scan(&[folder(&t, &[c1.clone(), c2.clone()])], OnBadFile::Stop)
        .unwrap_err()
        .to_string();
    assert!(e.contains("at least 64"), "{e}");
    // No such reference folder.
    let e = scan(&[folder(&t, &[d.join("nowhere")])], OnBadFile::Skip)
        .unwrap_err()
        .to_string();
    assert!(e.contains("nowhere"), "{e}");
    std::fs::remove_dir_all(&d).ok();
}

/// Manifest lines list references as FLAME's `references`, musubi-tuner's `control_path` (a
/// path or a list) or `control_path_<n>` (in the order of n), the image as `file` or
/// `image_path`; two forms on one line, or an unknown key, are refused naming the line.
#[test]
fn manifests_list_references_in_flame_and_musubi_fields() {
    let d = temp("manifest");
    for n in ["t1", "t2", "t3", "t4"] {
        picture(&d.join(format!("{n}.png")), 64, 64, [100, 100, 100]);
    }
    for n in 0..12 {
        picture(&d.join(format!("r{n}.png")), 64, 72, [10 * n as u8, 0, 0]);
    }
    let lines = [
        r#"{"file": "t1.png", "caption": "one", "references": ["r0.png", "r1.png"]}"#,
        r#"{"image_path": "t2.png", "caption": "two", "control_path": "r2.png"}"#,
        r#"{"image_path": "t3.png", "caption": "three", "control_path": ["r3.png", "r4.png"]}"#,
        r#"{"image_path": "t4.png", "caption": "four", "control_path_10": "r10.png", "control_path_2": "r2.png", "control_path_0": "r0.png"}"#,
    ];
    let m = d.join("edits.jsonl");
    std::fs::write(&m, lines.join("\n")).unwrap();
    let src = [Source::Manifest {
        path: m.clone(),
        repeats: 1,
    }];
    let s = scan(&src, OnBadFile::Stop).unwrap();
    let refs: Vec<Vec<String>> = s
        .items
        .iter()
        .map(|it| {
            it.references
                .iter()
                .map(|r| r.path.file_name().unwrap().to_string_lossy().into_owned())
                .collect()
        })
        .collect();
    assert_eq!(
        refs,
        [
            vec!["r0.png", "r1.png"],
            vec!["r2.png"],
            vec!["r3.png", "r4.png"],
            vec!["r0.png", "r2.png", "r10.png"],
        ]
    );
    assert_eq!(s.items[1].caption, "two");
    for (line, says) in [
        (
            r#"{"file": "t1.png", "caption": "x", "references": ["r0.png"], "control_path": "r1.png"}"#,
            "two forms",
        ),
        (
            r#"{"file": "t1.png", "caption": "x", "control": "r1.png"}"#,
            "unknown key",
        ),
        (
            r#"{"file": "t1.png", "image_path": "t2.png", "caption": "x"}"#,
            "use one",
        ),
        (
            r#"{"file": "t1.png", "caption": "x", "references": "r0.png"}"#,
            "list",
        ),
    ] {
        std::fs::write(&m, format!("{}\n{line}\n", lines[0])).unwrap();
        let e = scan(&src, OnBadFile::Stop).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains(says), "{line}: {e}");
    }
    // A missing reference names the image and the reference.
    std::fs::write(
        &m,
        r#"{"file": "t1.png", "caption": "x", "references": ["gone.png"]}"#,
    )
    .unwrap();
    let e = scan(&src, OnBadFile::Stop).unwrap_err().to_string();
    assert!(
        e.contains(&d.join("t1.png").display().to_string())
            && e.contains(&d.join("gone.png").display().to_string()),
        "{e}"
    );
    std::fs::remove_dir_all(&d).ok();
}

// ---------------------------------------------------------------------------------------------
// The config, the `train` binary and the `sample` binary.

/// The edit dataset of the runs below: the twelve tiny pictures (tests/klein.rs's) as
/// targets, and as their references the same pictures with the colours turned around, half
/// of them 80 pixels wide instead (two reference sizes: batches of each).
fn edit_images(dir: &Path) -> (PathBuf, PathBuf) {
    let (t, c) = (dir.join("target"), dir.join("control"));
    flame::train::demo::make_tiny_images(&t).unwrap();
    std::fs::create_dir_all(&c).unwrap();
    for e in std::fs::read_dir(&t).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "png") {
            let img = image::open(&p).unwrap().to_rgb8();
            let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
            let n: usize = stem.trim_start_matches("picture-").parse().unwrap();
            let (w, h) = match n % 2 {
                0 => (img.width(), img.height()),
                _ => (80, img.height()),
            };
            let img = image::imageops::resize(&img, w, h, image::imageops::FilterType::Triangle);
            let inverted = image::RgbImage::from_fn(w, h, |x, y| {
                let q = img.get_pixel(x, y).0;
                image::Rgb([255 - q[0], 255 - q[1], 255 - q[2]])
            });
            inverted.save(c.join(format!("{stem}.png"))).unwrap();
        }
    }
    (t, c)
}

/// An edit run on the fixture pipeline: `steps` steps, checkpoints and validation every 2,
/// samples every 2 (one prompt with a reference, one without) when `samples`.
fn edit_config(dir: &Path, target: &Path, control: &Path, steps: usize, samples: bool) -> PathBuf {
    let sample = match samples {
        true => format!(
            r#"
[sample]
every = 2
prompts = [{{ prompt = "make the circle red", references = ["{r}"] }}, "a small blue square"]
steps = 3
guidance = 4.0
seed = 1
"#,
            r = control.join("picture-00.png").display()
        ),
        false => String::new(),
    };
    let text = format!(
        r#"[model]
arch = "flux2"
path = "{model}"
dtype = "f32"

[adapter]
rank = 4
alpha = 4.0
targets = ["double_blocks.*_attn.qkv", "double_blocks.*_mlp.*", "single_blocks.*.linear*"]
format = "kohya"

[optimizer]
lr = 1e-3

[train]
steps = {steps}
batch_size = 2
seed = 7
save_every = 2
keep_last = 2
output_dir = "{out}"
device = "cpu"
timesteps = "flux_shift"
validate_every = 2

[data]
resolution = 32
bucket_step = 16
flip = true
caption_dropout = 0.1
validation_split = 0.2
reference_resolution = 64

[[data.dirs]]
path = "{target}"
references = ["{control}"]
{sample}"#,
        model = pipeline().display(),
        out = dir.join("out").display(),
        target = target.display(),
        control = control.display(),
    );
    let p = dir.join("train.toml");
    std::fs::write(&p, text).unwrap();
    p
}

/// The config: `references` and prompt tables parse (paths relative to the config), a
/// reference size under 64 is refused, and every way of naming reference images is refused
/// for a family without them, naming the key.
#[test]
fn the_config_reads_references_and_refuses_them_elsewhere() {
    let d = temp("config");
    let p = edit_config(&d, Path::new("target"), Path::new("control"), 4, true);
    let c = flame::train::TrainConfig::from_file(&p).unwrap();
    assert_eq!(c.data.dirs[0].references, [d.join("control")]);
    assert_eq!(c.data.reference_resolution, 64);
    assert_eq!(c.sample.prompts.len(), 2);
    assert_eq!(c.sample.prompts[0].text(), "make the circle red");
    assert_eq!(
        c.sample.prompts[0].references(),
        [d.join("control/picture-00.png")]
    );
    assert!(c.sample.prompts[1].references().is_empty());
    let text = std::fs::read_to_string(&p).unwrap();
    let refused = |edit: &dyn Fn(&str) -> String, key: &str| {
        let e = flame::train::TrainConfig::from_toml(&edit(&text))
            .unwrap_err()
            .to_string();
        assert!(e.contains(key), "{key}: {e}");
    };
    refused(
        &|t| t.replace("reference_resolution = 64", "reference_resolution = 32"),
        "data.reference_resolution",
    );
    let flux = |t: &str| t.replace("arch = \"flux2\"", "arch = \"flux\"");
    refused(&flux, "data.dirs");
    refused(
        &|t| flux(&t.replace("references = [\"control\"]\n", "")),
        "sample.prompts",
    );
    refused(
        &|t| {
            t.replace("arch = \"flux2\"", "arch = \"sdxl\"")
                .replace("references = [\"control\"]\n", "")
                .replace(
                    "validation_split = 0.2",
                    "validation_dir = \"val\"\nvalidation_references = [\"vref\"]",
                )
        },
        "data.validation_references",
    );
    refused(
        &|t| {
            t.replace(
                "validation_split = 0.2",
                "validation_references = [\"vref\"]",
            )
        },
        "data.validation_references",
    );
    std::fs::remove_dir_all(&d).ok();
}

/// examples/klein-edit.toml parses and passes every check that needs no files.
#[test]
fn the_edit_template_parses() {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/klein-edit.toml");
    let c = flame::train::TrainConfig::from_file(&p).unwrap();
    assert_eq!(c.model.arch, "flux2");
    assert!(!c.data.dirs[0].references.is_empty());
    assert!(c.sample.prompts.iter().any(|p| !p.references().is_empty()));
}

fn losses(out: &Path) -> Vec<String> {
    flame::train::rundir::read_log(&out.join("loss.jsonl"))
        .unwrap()
        .into_iter()
        .map(|(_, l)| l)
        .collect()
}

/// An edit run stopped after step 3 and resumed gives the uninterrupted run's log and
/// adapter bit for bit; its batches hold references of two sizes.
#[test]
fn an_edit_run_resumes_exactly() {
    use flame::train::{RunEnd, RunOptions, TrainConfig, Trainer};
    let d = temp("resume");
    let (t, c) = edit_images(&d.join("images"));
    let run = |name: &str, stop: Option<usize>, resume: bool| {
        let dir = d.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = TrainConfig::from_file(edit_config(&dir, &t, &c, 5, false)).unwrap();
        let mut notes = vec![];
        let mut note = |e: flame::train::Event| {
            if let flame::train::Event::Note(n) = e {
                notes.push(n)
            }
        };
        let end = Trainer::open(cfg.clone(), flame::train::Prepare::Encode, &mut note)
            .unwrap()
            .run(
                &RunOptions {
                    resume,
                    stop_at: stop,
                    ..Default::default()
                },
                &mut note,
            )
            .unwrap();
        (end, cfg.train.output_dir, notes)
    };
    let (end, full, notes) = run("full", None, false);
    assert!(matches!(end, RunEnd::Finished(_)), "{end:?}");
    // Ten training pictures, each with one reference, both mirrorings.
    assert!(
        notes.iter().any(|n| n.contains("caching latents: 40/40")),
        "{notes:?}"
    );
    assert!(
        notes.iter().any(|n| n.contains("caching latents")),
        "{notes:?}"
    );
    let (end, part, _) = run("part", Some(3), false);
    assert_eq!(end, RunEnd::Stopped(3));
    let (end, _, _) = run("part", None, true);
    assert!(matches!(end, RunEnd::Finished(_)), "{end:?}");
    let (a, b) = (losses(&full), losses(&part));
    assert_eq!(a.iter().filter(|l| l.contains("\"loss\"")).count(), 5);
    assert_eq!(a.iter().filter(|l| l.contains("val_loss")).count(), 3);
    assert_eq!(a, b);
    // Every tensor bit for bit (the metadata's times differ).
    let tensors = |p: &Path| -> Vec<(String, Vec<u64>)> {
        flame::safetensors::load(p.join("lora.safetensors"), &CPU)
            .unwrap()
            .into_iter()
            .map(|(k, t)| {
                let bits = t.to_vec_f64().unwrap().into_iter().map(f64::to_bits);
                (k, bits.collect())
            })
            .collect()
    };
    let (x, y) = (tensors(&full), tensors(&part));
    assert!(!x.is_empty());
    assert!(x == y, "the resumed adapter differs");
    std::fs::remove_dir_all(&d).ok();
}

fn train_bin(args: &[&std::ffi::OsStr]) -> std::process::Output {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(args)
        .env_remove("FLAME_FAULT")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "train {args:?}: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn sample_bin(extra: &[&std::ffi::OsStr], model: &Path) -> std::process::Output {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_sample"));
    c.args(["--device", "cpu", "--dtype", "f32"])
        .arg("--model")
        .arg(model)
        .args(["--steps", "3", "--seed", "1"])
        .args(extra);
    c.output().unwrap()
}

/// The `train` binary trains an edit LoRA from reference folders: references cached beside
/// the latents (a second run encodes nothing), validation lines, sample images of a prompt
/// with a reference and one without; the `sample` binary with that LoRA and `--reference`
/// gives the run's own image for the prompt with the reference, a plain prompt the other
/// one, and takes the reference's size when no size is given. A missing reference stops
/// the run naming the image and the path.
#[test]
fn train_and_sample_binaries_run_an_edit_dataset() {
    let d = temp("binaries");
    let (t, c) = edit_images(&d.join("images"));
    let cfg = edit_config(&d, &t, &c, 4, true);
    let out = d.join("out");
    let o = train_bin(&[cfg.as_os_str()]);
    let log = std::fs::read_to_string(out.join("loss.jsonl")).unwrap();
    assert_eq!(log.lines().filter(|l| l.contains("\"loss\"")).count(), 4);
    assert_eq!(log.lines().filter(|l| l.contains("val_loss")).count(), 2);
    for l in log.lines() {
        assert!(!l.contains("NaN") && !l.contains("inf"), "{l}");
    }
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        stderr.contains("sample prompts' reference images"),
        "{stderr}"
    );
    for i in 0..2 {
        let img = image::open(out.join(format!("samples/step-0000004-{i}.png"))).unwrap();
        assert_eq!((img.width(), img.height()), (32, 32));
    }
    let lora = out.join("lora.safetensors");

    // The sample binary: the prompt with its reference gives the run's own image.
    let run = |name: &str, prompt: &str, refs: &[&Path], size: bool| {
        let o_dir = d.join(name);
        let mut args: Vec<std::ffi::OsString> = vec![
            "--prompt".into(),
            prompt.into(),
            "--guidance".into(),
            "4.0".into(),
            "--lora".into(),
            lora.clone().into(),
            "--out".into(),
            o_dir.clone().into(),
        ];
        if size {
            args.extend([
                "--width".into(),
                "32".into(),
                "--height".into(),
                "32".into(),
            ]);
        }
        for r in refs {
            args.extend(["--reference".into(), r.as_os_str().to_owned()]);
        }
        let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        let o = sample_bin(&args, &pipeline());
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        image::open(o_dir.join("0-1.png")).unwrap().to_rgb8()
    };
    let worst = |a: &image::RgbImage, b: &image::RgbImage| {
        a.as_raw()
            .iter()
            .zip(b.as_raw())
            .map(|x| x.0.abs_diff(*x.1))
            .max()
            .unwrap()
    };
    let ref0 = c.join("picture-00.png");
    let with = run("with", "make the circle red", &[&ref0], true);
    let own = image::open(out.join("samples/step-0000004-0.png"))
        .unwrap()
        .to_rgb8();
    let without = run("without", "make the circle red", &[], true);
    let (same, other) = (worst(&with, &own), worst(&with, &without));
    println!("klein edit sample: --reference vs the run's own image {same}, vs none {other}");
    // Merged weights against attached adapters, through 8-bit PNGs: a level or so apart
    // (measured 1); the reference moves the tiny random model's image further (measured 10).
    assert!(same <= 3, "{same}");
    assert!(
        other >= 3 * same.max(2),
        "the reference changes little: {other}"
    );
    // No size given: the reference's (the tiny autoencoder's multiple of 4 of 64x64).
    let sized = run("sized", "make the circle red", &[&ref0], false);
    assert_eq!((sized.width(), sized.height()), (64, 64));

    // A second run on the same cache encodes nothing.
    let d2 = d.join("again");
    std::fs::create_dir_all(&d2).unwrap();
    let cfg2 = edit_config(&d2, &t, &c, 1, false);
    let text = std::fs::read_to_string(&cfg2).unwrap().replace(
        "[data]\n",
        &format!("[data]\ncache_dir = \"{}\"\n", out.join("cache").display()),
    );
    std::fs::write(&cfg2, text).unwrap();
    let o = train_bin(&[cfg2.as_os_str()]);
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    let fills: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("caching") && l.contains(" encoded)"))
        .collect();
    assert!(
        !fills.is_empty() && fills.iter().all(|l| l.ends_with(", 0 encoded)")),
        "{stderr}"
    );

    // A missing reference stops the run naming the image and the path.
    std::fs::remove_file(c.join("picture-03.png")).unwrap();
    let d3 = d.join("missing");
    std::fs::create_dir_all(&d3).unwrap();
    let cfg3 = edit_config(&d3, &t, &c, 1, false);
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .arg(&cfg3)
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains(&t.join("picture-03.png").display().to_string())
            && e.contains(&c.join("picture-03.*").display().to_string()),
        "{e}"
    );
    std::fs::remove_dir_all(&d).ok();
}

/// `sample --reference` is refused for a family without references, naming the flag.
#[test]
fn the_sample_binary_refuses_references_for_other_families() {
    let d = temp("refuse");
    // The tiny Flux of `train --make-tiny`.
    let example = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny.toml");
    let cfg = d.join("flux-tiny.toml");
    std::fs::copy(&example, &cfg).unwrap();
    let c = flame::train::TrainConfig::from_file(&cfg).unwrap();
    flame::train::demo::make_tiny(&c).unwrap();
    let r = root().join("refs/a.png");
    let o = sample_bin(
        &[
            "--arch".as_ref(),
            "flux".as_ref(),
            "--prompt".as_ref(),
            "x".as_ref(),
            "--reference".as_ref(),
            r.as_os_str(),
            "--out".as_ref(),
            d.join("o").as_os_str(),
        ],
        &c.model.path,
    );
    let e = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(e.contains("--reference") && e.contains("flux2"), "{e}");
    assert!(!d.join("o").exists());
    std::fs::remove_dir_all(&d).ok();
}
