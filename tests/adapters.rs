//! The adapter kinds (LoRA with LoCon, DoRA, LoKr, LoHa, full) against PEFT 0.17.0's own
//! implementations, from the fixtures `scripts/make_adapter_fixtures.py` made
//! (tests/fixtures/adapters: a Linear 12 -> 10, a 3x3 Conv2d 4 -> 6 and a 1x1 Conv2d 4 -> 6,
//! every adapter tensor random): outputs, weight changes and gradients; each kind's kohya file
//! checked by an independent formula (ComfyUI's reading of the names); file round trips and
//! their errors; an f64 gradcheck of each kind's forward; LoCon on SDXL's ResNets; LyCORIS's
//! Tucker LoCon trained, read and written.
#![cfg(feature = "cpu-ref")]

use flame::autograd::gradcheck::{gradcheck, GradcheckConfig};
use flame::nn::adapter::{factorization, Adapter, AdapterConfig, Adapters, BaseLayer};
use flame::nn::{Conv2d, Conv2dConfig, KeyMap, KeySource, Linear, VarBuilder};
use flame::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const CPU: Device = Device::Cpu;
const MODULES: [&str; 3] = ["lin", "conv", "pw"];
const KINDS: [&str; 5] = ["lora", "dora", "lokr", "lokr_full", "loha"];
/// PEFT's Tucker forms (`use_effective_conv2d`): the 3x3 convolution's LoKr w2 and LoHa halves.
const TUCKER_KINDS: [&str; 2] = ["lokr_tucker", "loha_tucker"];

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/adapters")
}

fn load(path: &Path) -> HashMap<String, Tensor> {
    flame::safetensors::load(path, &CPU)
        .unwrap()
        .into_iter()
        .collect()
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-adapters-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// max |a - b| / max(max |b|, 1e-30), over equal shapes (element counts).
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    assert_eq!(a.len(), b.len());
    let m = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(&b)
        .fold(0.0f64, |d, (x, y)| d.max((x - y).abs()))
        / m
}

/// FLAME's config for a fixture folder, from its PEFT config.
fn config(kind: &str) -> AdapterConfig {
    let text = std::fs::read_to_string(dir().join(kind).join("adapter_config.json")).unwrap();
    let c: serde_json::Value = serde_json::from_str(&text).unwrap();
    let r = c["r"].as_u64().unwrap() as usize;
    let alpha = c
        .get("lora_alpha")
        .or_else(|| c.get("alpha"))
        .and_then(|a| a.as_f64())
        .unwrap();
    let kind = match (kind, c["use_dora"].as_bool()) {
        ("lora", Some(true)) | ("dora", _) => "dora",
        ("lokr_full", _) | ("lokr_tucker", _) => "lokr",
        ("loha_tucker", _) => "loha",
        (k, _) => k,
    };
    AdapterConfig {
        kind: kind.into(),
        rank: r,
        alpha,
        dropout: 0.0,
        module_dropout: 0.0,
        rank_dropout: 0.0,
        targets: MODULES.iter().map(|s| s.to_string()).collect(),
        seed: 1,
        conv_rank: r,
        conv_alpha: alpha,
        factor: c["decompose_factor"].as_i64().unwrap_or(-1),
        decompose_both: c["decompose_both"].as_bool().unwrap_or(false),
        // The fixtures were made by PEFT.
        lokr_split: flame::nn::LokrSplit::Peft,
        tucker: c["use_effective_conv2d"].as_bool().unwrap_or(false),
        weight_decompose: false,
        wd_on_out: true,
        per_projection: false,
    }
}

/// The three layers of the fixture model, adapted by `a`, in `dtype`.
struct Model {
    lin: Linear,
    conv: Conv2d,
    pw: Conv2d,
}

fn model(a: &Arc<Adapters>, dtype: DType) -> Model {
    let vb = VarBuilder::from_files(&[dir().join("base.safetensors")], dtype, &CPU)
        .unwrap()
        .with_adapters(a.clone())
        .unwrap();
    let conv = |name: &str, k: usize, padding: usize| {
        let cfg = Conv2dConfig {
            padding,
            ..Default::default()
        };
        Conv2d::new(&vb.pp(name), 4, 6, k, cfg).unwrap()
    };
    Model {
        lin: Linear::new(&vb.pp("lin"), 12, 10, true).unwrap(),
        conv: conv("conv", 3, 1),
        pw: conv("pw", 1, 0),
    }
}

impl Model {
    fn forward(&self, m: &str, x: &Tensor) -> Tensor {
        match m {
            "lin" => self.lin.forward(x),
            "conv" => self.conv.forward(x),
            _ => self.pw.forward(x),
        }
        .unwrap()
    }
}

/// Every adapter tensor of `a` moved by 0.3 N(0, 1) (seeds from `seed`), so no kind's
/// tensor is left at its zero start.
fn perturb(a: &Adapters, seed: u64) {
    for (i, (_, t)) in a.params().unwrap().iter().enumerate() {
        let r = Tensor::randn(t.dims().to_vec(), DType::F32, &CPU, seed + i as u64).unwrap();
        t.assign(&t.add(&r.affine(0.3, 0.0).unwrap()).unwrap())
            .unwrap();
    }
}

/// The fixture's base weights with `merge` merged in as they load.
fn merged_base(merge: &Arc<flame::nn::LoraMerge>) -> VarBuilder {
    VarBuilder::from_files(&[dir().join("base.safetensors")], DType::F32, &CPU)
        .unwrap()
        .with_merge(merge.clone())
        .unwrap()
}

/// Keys map to themselves (the fixture model's modules are its own diffusers names).
fn identity() -> KeyMap {
    Arc::new(|k: &str| Some(KeySource::Key(k.to_string())))
}

/// A fixture kind's adapters, with the PEFT file read in.
fn from_peft(kind: &str) -> (Arc<Adapters>, Model) {
    let a = Adapters::new(config(kind)).unwrap();
    let m = model(&a, DType::F32);
    a.load_peft(
        dir().join(kind).join("peft.safetensors"),
        &identity(),
        "base_model.model",
    )
    .unwrap();
    (a, m)
}

/// PEFT's name of FLAME's tensor `name` (kohya names), and whether PEFT's shape differs.
fn peft_name(name: &str) -> &str {
    match name {
        "lora_down.weight" => "lora_A.weight",
        "lora_up.weight" => "lora_B.weight",
        "dora_scale" => "lora_magnitude_vector",
        n => n,
    }
}

fn inputs() -> HashMap<String, Tensor> {
    load(&dir().join("inputs.safetensors"))
        .into_iter()
        .map(|(k, v)| (k, v.to_dtype(DType::F32).unwrap()))
        .collect()
}

#[test]
fn every_kind_matches_peft_outputs_weight_changes_and_gradients() {
    let inp = inputs();
    for kind in KINDS.into_iter().chain(TUCKER_KINDS) {
        let io = load(&dir().join(kind).join("io.safetensors"));
        let (a, m) = from_peft(kind);
        let mut loss: Option<Tensor> = None;
        let mut xs = vec![];
        for name in MODULES {
            let x = inp[&format!("x.{name}")].clone().requires_grad_().unwrap();
            let y = m.forward(name, &x);
            let e = rel(&y, &io[&format!("y.{name}")]);
            assert!(e < 1e-6, "{kind} {name}: output off by {e:e}");
            let term = y
                .mul(&inp[&format!("g.{name}")])
                .unwrap()
                .sum_all()
                .unwrap();
            loss = Some(match loss {
                Some(l) => l.add(&term).unwrap(),
                None => term,
            });
            xs.push((name, x));
        }
        let grads = loss.unwrap().backward().unwrap();
        for (name, x) in &xs {
            let e = rel(grads.get(x).unwrap(), &io[&format!("grad.x.{name}")]);
            assert!(e < 1e-5, "{kind} {name}: input gradient off by {e:e}");
        }
        let base = load(&dir().join("base.safetensors"));
        for l in a.layers().unwrap() {
            let module = l.path().to_string();
            for (n, t) in l.params() {
                let key = format!("grad.base_model.model.{module}.{}", peft_name(n));
                let want = io.get(&key).unwrap_or_else(|| panic!("{kind}: no {key}"));
                let got = grads
                    .get(&t)
                    .unwrap_or_else(|| panic!("{kind}: no gradient of {n}"));
                let e = rel(got, want);
                assert!(e < 1e-5, "{kind} {module}.{n}: gradient off by {e:e}");
            }
            let w = base[&format!("{module}.weight")].clone();
            let weight = |dt| w.to_dtype(dt);
            let delta = l.delta_weight(&BaseLayer::new(l.shape(), &weight)).unwrap();
            let e = rel(&delta, &io[&format!("delta.{module}")]);
            assert!(e < 1e-6, "{kind} {module}: weight change off by {e:e}");
        }
    }
}

/// PEFT's and LyCORIS's factorisation (the table the fixture script read off PEFT).
#[test]
fn lokr_factorisation_is_peft_s() {
    for (dim, want) in [
        (10, (2, 5)),
        (12, (3, 4)),
        (4, (2, 2)),
        (6, (2, 3)),
        (36, (6, 6)),
        (3072, (48, 64)),
        (12288, (96, 128)),
        (7, (1, 7)),
    ] {
        assert_eq!(factorization(dim, -1), want, "{dim}");
    }
    assert_eq!(factorization(3072, 8), (8, 384));
}

/// LoKr's split where the factor divides a side: PEFT's (factor, dim / factor) as it comes,
/// LyCORIS's smaller side first. Adapters split by the rule they are built with; a file says
/// which it holds (`LokrSplit::of_file`); one read with the other rule is refused naming the
/// setting; read with its own, and merged by the `sample` binary's reader, it gives the layer
/// it was saved from.
#[test]
fn lokr_splits_follow_peft_or_lycoris_and_a_file_says_which() {
    use flame::nn::{LokrSplit, LoraMerge};
    for (dim, f, peft, lycoris) in [
        (12, 4, (4, 3), (3, 4)),
        (3072, 64, (64, 48), (48, 64)),
        (3072, -1, (48, 64), (48, 64)),
        (12, 5, (3, 4), (3, 4)),
        (128, 4, (4, 32), (4, 32)),
    ] {
        assert_eq!(LokrSplit::Peft.split(dim, f), peft, "{dim} by {f}");
        assert_eq!(LokrSplit::Lycoris.split(dim, f), lycoris, "{dim} by {f}");
    }
    let inp = inputs();
    let x = &inp["x.lin"];
    let d = temp("lokr_split");
    let other = |s: LokrSplit| match s {
        LokrSplit::Peft => LokrSplit::Lycoris,
        LokrSplit::Lycoris => LokrSplit::Peft,
    };
    for split in [LokrSplit::Peft, LokrSplit::Lycoris] {
        let mut c = config("lokr");
        c.targets = vec!["lin".into()];
        c.factor = 4;
        c.decompose_both = false;
        c.lokr_split = split;
        let a = Adapters::new(c.clone()).unwrap();
        let m = model(&a, DType::F32);
        perturb(&a, 700);
        let want = m.forward("lin", x);
        // lin is 12 -> 10: 10 splits (2, 5) by either rule, 12 by 4 as the rule says.
        let params = a.params().unwrap();
        let w1 = &params
            .iter()
            .find(|(n, _)| n.ends_with("lokr_w1"))
            .unwrap()
            .1;
        assert_eq!(w1.dims(), [2, split.split(12, 4).0], "{split:?}");
        let file = d.join(format!("{split:?}.safetensors"));
        a.save_kohya(&file, DType::F32).unwrap();
        assert_eq!(LokrSplit::of_file(&file, 4).unwrap(), Some(split));
        assert_eq!(LokrSplit::of_file(&file, -1).unwrap(), None);
        // Read with the other rule: refused, naming the split and the setting.
        let mut wrong = c.clone();
        wrong.lokr_split = other(split);
        let b = Adapters::new(wrong).unwrap();
        let _unused = model(&b, DType::F32);
        let e = b.load_kohya(&file).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{split:?}'s split")) && e.contains("lokr_split"),
            "{e}"
        );
        // Read with the rule the file shows: the layer it was saved from.
        let mut right = c.clone();
        right.lokr_split = LokrSplit::of_file(&file, 4).unwrap().unwrap();
        let b = Adapters::new(right).unwrap();
        let mb = model(&b, DType::F32);
        b.load_kohya(&file).unwrap();
        let e = rel(&mb.forward("lin", x), &want);
        assert!(e < 1e-6, "{split:?}: read back off by {e:e}");
        // The merge takes the split from the file's shapes.
        let merge = Arc::new(LoraMerge::open(&file, 1.0, "transformer").unwrap());
        let vb = merged_base(&merge);
        let plain = Linear::new(&vb.pp("lin"), 12, 10, true).unwrap();
        let e = rel(&plain.forward(x).unwrap(), &want);
        assert!(e < 2e-6, "{split:?}: merged off by {e:e}");
    }
}

/// Host math for the independent formulas below.
struct Mat {
    rows: usize,
    cols: usize,
    v: Vec<f64>,
}

fn mat(t: &Tensor, rows: usize) -> Mat {
    let v = t.to_vec_f64().unwrap();
    Mat {
        rows,
        cols: v.len() / rows,
        v,
    }
}

impl Mat {
    fn mm(&self, o: &Mat) -> Mat {
        assert_eq!(self.cols, o.rows);
        let mut v = vec![0.0; self.rows * o.cols];
        for i in 0..self.rows {
            for k in 0..self.cols {
                for j in 0..o.cols {
                    v[i * o.cols + j] += self.v[i * self.cols + k] * o.v[k * o.cols + j];
                }
            }
        }
        Mat {
            rows: self.rows,
            cols: o.cols,
            v,
        }
    }
}

/// ΔW (out, in·kh·kw) of one layer from the kohya file's tensors, written from the names'
/// meaning as LyCORIS and ComfyUI read them (comfy/weight_adapter), not from FLAME's code;
/// DoRA's `dora_scale` as LyCORIS reads it (ComfyUI divides by ‖W‖ instead: tests/comfy.rs).
#[allow(clippy::needless_range_loop)] // index math, written out
fn kohya_delta(t: &HashMap<String, Tensor>, k: &str, w: &Mat, in_ch: usize) -> Mat {
    let get = |n: &str| t.get(&format!("{k}.{n}"));
    let (out, cols) = (w.rows, w.cols);
    let alpha = get("alpha").map(|a| a.to_vec_f64().unwrap()[0]);
    if let Some(diff) = get("diff") {
        return mat(diff, out);
    }
    if let Some(down) = get("lora_down.weight") {
        let r = down.dims()[0];
        let s = alpha.map_or(1.0, |a| a / r as f64);
        let mut d = mat(get("lora_up.weight").unwrap(), out).mm(&mat(down, r));
        d.v.iter_mut().for_each(|x| *x *= s);
        if let Some(m) = get("dora_scale") {
            // W' = m · (W + ΔW) / ‖W + ΔW‖ per output row.
            let m = m.to_vec_f64().unwrap();
            for i in 0..out {
                let row: Vec<f64> = (0..cols)
                    .map(|j| w.v[i * cols + j] + d.v[i * cols + j])
                    .collect();
                let n = row.iter().map(|x| x * x).sum::<f64>().sqrt();
                for j in 0..cols {
                    d.v[i * cols + j] = m[i] * row[j] / n - w.v[i * cols + j];
                }
            }
        }
        return d;
    }
    if let Some(a1) = get("hada_w1_a") {
        let r = a1.dims()[1];
        let s = alpha.map_or(1.0, |a| a / r as f64);
        let p1 = mat(a1, out).mm(&mat(get("hada_w1_b").unwrap(), r));
        let p2 = mat(get("hada_w2_a").unwrap(), out).mm(&mat(get("hada_w2_b").unwrap(), r));
        let v = p1.v.iter().zip(&p2.v).map(|(x, y)| s * x * y).collect();
        return Mat { rows: out, cols, v };
    }
    // LoKr: w1 (out_l, in_m) ⊗ w2 (out_k, in_n·kh·kw); scale alpha / r with a low-rank
    // factor (r from its b matrix), else 1.
    let (w1, r1) = match get("lokr_w1") {
        Some(w1) => (mat(w1, w1.dims()[0]), None),
        None => {
            let (a, b) = (get("lokr_w1_a").unwrap(), get("lokr_w1_b").unwrap());
            (
                mat(a, a.dims()[0]).mm(&mat(b, b.dims()[0])),
                Some(b.dims()[0]),
            )
        }
    };
    let (w2, r2) = match get("lokr_w2") {
        Some(w2) => (mat(w2, w2.dims()[0]), None),
        None => {
            let (a, b) = (get("lokr_w2_a").unwrap(), get("lokr_w2_b").unwrap());
            (
                mat(a, a.dims()[0]).mm(&mat(b, b.dims()[0])),
                Some(b.dims()[0]),
            )
        }
    };
    let s = match (alpha, r2.or(r1)) {
        (Some(a), Some(r)) => a / r as f64,
        _ => 1.0,
    };
    let (out_l, in_m) = (w1.rows, w1.cols);
    let (out_k, in_n) = (w2.rows, in_ch / in_m);
    let kk = w2.cols / in_n;
    let mut v = vec![0.0; out * cols];
    for a in 0..out_l {
        for c in 0..in_m {
            for b in 0..out_k {
                for d in 0..in_n {
                    for h in 0..kk {
                        let row = a * out_k + b;
                        let col = (c * in_n + d) * kk + h;
                        v[row * cols + col] =
                            s * w1.v[a * in_m + c] * w2.v[b * w2.cols + d * kk + h];
                    }
                }
            }
        }
    }
    Mat { rows: out, cols, v }
}

/// Every kind's kohya file, read by the formulas ComfyUI applies to its names, gives the
/// weight whose plain layer computes what FLAME's adapted layer computes; reading the file
/// back into fresh adapters gives the same tensors.
#[test]
fn kohya_files_mean_what_comfyui_reads_and_load_back() {
    let inp = inputs();
    let base = load(&dir().join("base.safetensors"));
    let d = temp("kohya");
    for kind in KINDS.into_iter().chain(["full"]) {
        let (a, m) = if kind == "full" {
            let mut c = config("lora");
            c.kind = "full".into();
            let a = Adapters::new(c).unwrap();
            let m = model(&a, DType::F32);
            for (i, (_, t)) in a.params().unwrap().iter().enumerate() {
                let r = Tensor::randn(t.dims().to_vec(), DType::F32, &CPU, 70 + i as u64).unwrap();
                t.assign(&r.affine(0.3, 0.0).unwrap()).unwrap();
            }
            (a, m)
        } else {
            from_peft(kind)
        };
        let file = d.join(format!("{kind}.safetensors"));
        a.save_kohya(&file, DType::F32).unwrap();
        let t = load(&file);
        for name in MODULES {
            let w = &base[&format!("{name}.weight")];
            let wm = mat(w, w.dims()[0]);
            let in_ch = w.dims()[1];
            let delta = kohya_delta(&t, &flame::nn::kohya_name(name), &wm, in_ch);
            let merged: Vec<f64> = wm.v.iter().zip(&delta.v).map(|(x, y)| x + y).collect();
            let merged = Tensor::from_vec(merged, w.dims().to_vec(), &CPU)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            // The bias and its change where the file has one (full's `diff_b`).
            let mut b = base[&format!("{name}.bias")].to_dtype(DType::F32).unwrap();
            if let Some(db) = t.get(&format!("{}.diff_b", flame::nn::kohya_name(name))) {
                b = b.add(&db.to_dtype(DType::F32).unwrap()).unwrap();
            }
            let x = &inp[&format!("x.{name}")];
            let plain = match name {
                "lin" => x.matmul(&merged.t().unwrap()).unwrap().add(&b).unwrap(),
                "conv" => {
                    flame::nn::conv2d(x, &merged, Some(&b), (1, 1), (1, 1), (1, 1), 1).unwrap()
                }
                _ => flame::nn::conv2d(x, &merged, Some(&b), (1, 1), (0, 0), (1, 1), 1).unwrap(),
            };
            let e = rel(&m.forward(name, x), &plain);
            assert!(
                e < 2e-6,
                "{kind} {name}: the kohya file means something else ({e:e})"
            );
        }
        // Back into fresh adapters of the same config: the same tensors.
        let fresh = Adapters::new(a.config.clone()).unwrap();
        let _m2 = model(&fresh, DType::F32);
        fresh.load_kohya(&file).unwrap();
        for ((n0, t0), (n1, t1)) in a.params().unwrap().iter().zip(fresh.params().unwrap()) {
            assert_eq!(n0, &n1);
            assert_eq!(rel(&t1, t0), 0.0, "{kind} {n0}: kohya round trip");
        }
    }
}

/// The PEFT layout round-trips (the scale folded into a factor on the way out and taken out
/// on the way in), and files of the wrong kind or shape are errors naming the tensor.
#[test]
fn peft_files_round_trip_and_wrong_files_are_named() {
    let d = temp("peft");
    for kind in KINDS.into_iter().chain(TUCKER_KINDS) {
        let (a, _m) = from_peft(kind);
        let file = d.join(format!("{kind}.safetensors"));
        a.save_peft(&file, &identity(), "transformer", DType::F32)
            .unwrap();
        let fresh = Adapters::new(a.config.clone()).unwrap();
        let _m2 = model(&fresh, DType::F32);
        fresh.load_peft(&file, &identity(), "transformer").unwrap();
        for ((n0, t0), (_, t1)) in a.params().unwrap().iter().zip(fresh.params().unwrap()) {
            let e = rel(&t1, t0);
            assert!(e < 1e-6, "{kind} {n0}: PEFT round trip off by {e:e}");
        }
    }
    // A LoRA file read as LoHa: the first LoHa tensor is missing, by name.
    let mut c = config("loha");
    c.kind = "loha".into();
    let loha = Adapters::new(c).unwrap();
    let _m = model(&loha, DType::F32);
    let e = loha
        .load_peft(d.join("lora.safetensors"), &identity(), "transformer")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("transformer.") && e.contains("hada_w1_a") && e.contains("missing"),
        "{e}"
    );
    // The same kind at another rank: a shape error naming the tensor.
    let mut c = config("lora");
    c.rank = 2;
    c.conv_rank = 2;
    let small = Adapters::new(c).unwrap();
    let _m = model(&small, DType::F32);
    let e = small
        .load_peft(d.join("lora.safetensors"), &identity(), "transformer")
        .unwrap_err()
        .to_string();
    assert!(e.contains("lora_A.weight") && e.contains("shape"), "{e}");
    // A DoRA file read as a plain LoRA: the magnitude is left over, named.
    let lora = Adapters::new(config("lora")).unwrap();
    let _m = model(&lora, DType::F32);
    let e = lora
        .load_peft(d.join("dora.safetensors"), &identity(), "transformer")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("lora_magnitude_vector") && e.contains("no planned"),
        "{e}"
    );
}

/// f64 gradcheck of each kind's forward (the function `Adapter::forward` runs) on a Linear
/// and a 3x3 convolution, over the input and every parameter. DoRA's norm is detached by
/// design (PEFT's semantics), so its check holds A and B fixed and covers the input and the
/// magnitude.
#[test]
fn every_kind_passes_an_f64_gradcheck() {
    let base = load(&dir().join("base.safetensors"));
    let inp = load(&dir().join("inputs.safetensors"));
    for kind in ["lora", "dora", "lokr", "lokr_full", "loha", "full"] {
        let mut c = config(if kind == "full" { "lora" } else { kind });
        if kind == "full" {
            c.kind = "full".into();
        }
        let a = Adapters::new(c).unwrap();
        let m = model(&a, DType::F64);
        for name in ["lin", "conv"] {
            let l: Arc<dyn Adapter> = a
                .layers()
                .unwrap()
                .into_iter()
                .find(|l| l.path() == name)
                .unwrap();
            let w = base[&format!("{name}.weight")].clone();
            let params: Vec<Tensor> = l
                .params()
                .iter()
                .enumerate()
                .map(|(i, (_, t))| {
                    Tensor::randn(t.dims().to_vec(), DType::F64, &CPU, 90 + i as u64)
                        .unwrap()
                        .affine(0.3, 0.0)
                        .unwrap()
                })
                .collect();
            let x = inp[&format!("x.{name}")].narrow(0, 0, 1).unwrap();
            let frozen_op = |x: &Tensor| match name {
                "lin" => x.matmul(&w.t().unwrap()),
                _ => flame::nn::conv2d(x, &w, None, (1, 1), (1, 1), (1, 1), 1),
            };
            let weight = |dt| w.to_dtype(dt);
            let dora = kind == "dora";
            let f = |t: &[Tensor]| {
                let base = BaseLayer::new(l.shape(), &weight);
                let p: Vec<Tensor> = if dora {
                    vec![params[0].clone(), params[1].clone(), t[1].clone()]
                } else {
                    t[1..].to_vec()
                };
                l.forward_with(&base, &t[0], frozen_op(&t[0])?, &p)
            };
            let mut leaves = vec![x];
            if dora {
                leaves.push(params[2].affine(1.0, 2.0).unwrap());
            } else {
                leaves.extend(params.iter().cloned());
            }
            let r = gradcheck(f, &leaves, GradcheckConfig::default())
                .unwrap_or_else(|e| panic!("{kind} {name}: {e}"));
            assert!(r.checked > 0);
        }
        drop(m);
    }
}

/// LoCon on SDXL (LoRA, in the Tucker form too, and the other kinds): with `conv_rank` the
/// ResNet convolutions get adapters beside the Linear layers; a fresh adapter changes
/// nothing, trained ones act, and gradients reach them.
#[test]
fn conv_adapters_train_on_sdxl() {
    use flame::models::sdxl::{SdxlConfig, Unet};
    let cfg = SdxlConfig {
        in_channels: 4,
        out_channels: 4,
        model_channels: 8,
        block_out_channels: vec![8, 16],
        num_res_blocks: 1,
        transformer_depth: vec![0, 1],
        num_heads: vec![1, 2],
        transformer_depth_middle: 1,
        context_dim: 12,
        adm_in_channels: 10,
        addition_time_embed_dim: 4,
        num_groups: 4,
    };
    // "_tucker": in LyCORIS's Tucker form on the 3x3 convolutions.
    for kind in ["lora", "lora_tucker", "dora", "lokr", "loha", "loha_tucker"] {
        let tucker = kind.ends_with("_tucker");
        let a = Adapters::new(AdapterConfig {
            kind: kind.trim_end_matches("_tucker").into(),
            rank: 2,
            alpha: 2.0,
            dropout: 0.0,
            module_dropout: 0.0,
            rank_dropout: 0.0,
            targets: vec!["input_blocks.*".into(), "output_blocks.*".into()],
            seed: 3,
            conv_rank: 2,
            conv_alpha: 1.0,
            factor: -1,
            decompose_both: false,
            lokr_split: Default::default(),
            tucker,
            weight_decompose: false,
            wd_on_out: true,
            per_projection: false,
        })
        .unwrap();
        let vb = VarBuilder::random(5, 0.2, DType::F32, &CPU)
            .with_adapters(a.clone())
            .unwrap();
        let unet = Unet::new(&vb, &cfg).unwrap();
        let convs = a
            .layers()
            .unwrap()
            .iter()
            .filter(|l| l.shape().is_conv())
            .count();
        assert!(convs >= 4, "{kind}: {convs} convolutions adapted");
        let cores = a
            .params()
            .unwrap()
            .iter()
            .filter(|(n, _)| n.ends_with("lora_mid.weight") || n.ends_with("hada_t1"))
            .count();
        assert_eq!(cores > 0, tucker, "{kind}: {cores} Tucker cores");
        let x = Tensor::randn((1, 4, 8, 8), DType::F32, &CPU, 1).unwrap();
        let t = Tensor::full(500.0, 1, DType::F32, &CPU).unwrap();
        let ctx = Tensor::randn((1, 5, 12), DType::F32, &CPU, 2).unwrap();
        let y = Tensor::randn((1, 10), DType::F32, &CPU, 3).unwrap();
        let run = || unet.forward(&x, &t, &ctx, &y).unwrap();
        let out0 = run();
        // Every parameter random: the adapters act and every one gets a gradient.
        for (i, (_, p)) in a.params().unwrap().iter().enumerate() {
            let r = Tensor::randn(p.dims().to_vec(), DType::F32, &CPU, 30 + i as u64).unwrap();
            p.assign(&r.affine(0.1, 0.0).unwrap()).unwrap();
        }
        let out = run();
        assert!(rel(&out, &out0) > 1e-4, "{kind}: the adapters act");
        let grads = out.sqr().unwrap().mean_all().unwrap().backward().unwrap();
        for (n, p) in a.params().unwrap() {
            if n.contains("input_blocks") || n.contains("output_blocks") {
                let g = grads
                    .get(&p)
                    .unwrap_or_else(|| panic!("{kind}: no gradient of {n}"));
                assert!(
                    g.to_vec_f64().unwrap().iter().any(|v| *v != 0.0),
                    "{kind} {n}"
                );
            }
        }
    }
}

/// The `sample` binary's merge (`LoraMerge`) reads every kind's kohya file on Linear layers
/// the way ComfyUI does and gives the adapted layer's output (strength 1), the base at
/// strength 0; every tensor of the file is taken.
#[test]
fn merging_each_kind_s_file_gives_the_adapted_layer() {
    use flame::nn::LoraMerge;
    let inp = inputs();
    let d = temp("merge");
    for kind in ["lora", "dora", "lokr", "lokr_full", "loha", "full"] {
        let mut c = config(if kind == "full" { "lora" } else { kind });
        if kind == "full" {
            c.kind = "full".into();
        }
        c.targets = vec!["lin".into()];
        let a = Adapters::new(c).unwrap();
        let m = model(&a, DType::F32);
        let x = &inp["x.lin"];
        m.forward("lin", x); // DoRA's magnitude from the weight
        perturb(&a, 300);
        let want = m.forward("lin", x);
        let file = d.join(format!("{kind}.safetensors"));
        a.save_kohya(&file, DType::F32).unwrap();
        for strength in [1.0, 0.0] {
            let merge = Arc::new(LoraMerge::open(&file, strength, "transformer").unwrap());
            let vb = merged_base(&merge);
            let plain = Linear::new(&vb.pp("lin"), 12, 10, true).unwrap();
            assert!(plain.adapter.is_none());
            let got = plain.forward(x).unwrap();
            merge.check_all_used().unwrap();
            if strength == 0.0 {
                // The base: the adapted layer without its adapter.
                let base = {
                    let vb0 =
                        VarBuilder::from_files(&[dir().join("base.safetensors")], DType::F32, &CPU)
                            .unwrap();
                    Linear::new(&vb0.pp("lin"), 12, 10, true)
                        .unwrap()
                        .forward(x)
                        .unwrap()
                };
                assert!(rel(&got, &base) < 1e-6, "{kind}: strength 0");
            } else {
                let e = rel(&got, &want);
                assert!(e < 2e-6, "{kind}: merged output off by {e:e}");
            }
        }
    }
}

/// The merge on convolutions: each kind's kohya file on the fixture's 3x3 and 1x1 Conv2d
/// (LoCon, DoRA, LoKr, LoHa, full) gives the adapted layer's output, every tensor taken.
#[test]
fn merging_each_kind_s_file_on_convolutions_gives_the_adapted_layer() {
    use flame::nn::LoraMerge;
    let inp = inputs();
    let d = temp("merge_conv");
    for kind in ["lora", "dora", "lokr", "lokr_full", "loha", "full"] {
        let mut c = config(if kind == "full" { "lora" } else { kind });
        if kind == "full" {
            c.kind = "full".into();
        }
        c.targets = vec!["conv".into(), "pw".into()];
        let a = Adapters::new(c).unwrap();
        let m = model(&a, DType::F32);
        for layer in ["conv", "pw"] {
            m.forward(layer, &inp[&format!("x.{layer}")]); // DoRA's magnitude from the weight
        }
        perturb(&a, 900);
        let file = d.join(format!("{kind}.safetensors"));
        a.save_kohya(&file, DType::F32).unwrap();
        let merge = Arc::new(LoraMerge::open(&file, 1.0, "unet").unwrap());
        let vb = merged_base(&merge);
        for (layer, k, padding) in [("conv", 3, 1), ("pw", 1, 0)] {
            let cfg = Conv2dConfig {
                padding,
                ..Default::default()
            };
            let plain = Conv2d::new(&vb.pp(layer), 4, 6, k, cfg).unwrap();
            assert!(plain.adapter.is_none());
            let x = &inp[&format!("x.{layer}")];
            let e = rel(&plain.forward(x).unwrap(), &m.forward(layer, x));
            assert!(e < 2e-6, "{kind} on {layer}: merged output off by {e:e}");
        }
        merge.check_all_used().unwrap();
    }
}

/// The merge reads the PEFT-layout files FLAME writes for DoRA, LoKr and LoHa (and LoRA) on
/// a Linear and both convolutions: each gives the adapted layer's output, every tensor taken.
#[test]
fn merging_flame_s_peft_files_of_each_kind_gives_the_adapted_layer() {
    use flame::nn::LoraMerge;
    let inp = inputs();
    let d = temp("merge_peft");
    for kind in KINDS.into_iter().chain(TUCKER_KINDS) {
        let mut c = config(kind);
        c.targets = vec!["lin".into(), "conv".into(), "pw".into()];
        let a = Adapters::new(c).unwrap();
        let m = model(&a, DType::F32);
        for layer in ["lin", "conv", "pw"] {
            m.forward(layer, &inp[&format!("x.{layer}")]); // DoRA's magnitude from the weight
        }
        perturb(&a, 950);
        let file = d.join(format!("{kind}.safetensors"));
        a.save_peft(&file, &identity(), "unet", DType::F32).unwrap();
        let merge = Arc::new(LoraMerge::open(&file, 1.0, "unet").unwrap());
        let vb = merged_base(&merge);
        let lin = Linear::new(&vb.pp("lin"), 12, 10, true).unwrap();
        let x = &inp["x.lin"];
        let e = rel(&lin.forward(x).unwrap(), &m.forward("lin", x));
        assert!(e < 2e-6, "{kind} on lin: merged output off by {e:e}");
        for (layer, k, padding) in [("conv", 3, 1), ("pw", 1, 0)] {
            let cfg = Conv2dConfig {
                padding,
                ..Default::default()
            };
            let plain = Conv2d::new(&vb.pp(layer), 4, 6, k, cfg).unwrap();
            let x = &inp[&format!("x.{layer}")];
            let e = rel(&plain.forward(x).unwrap(), &m.forward(layer, x));
            assert!(e < 2e-6, "{kind} on {layer}: merged output off by {e:e}");
        }
        merge.check_all_used().unwrap();
    }
}

/// A LyCORIS file with a tensor of the wrong rank or shape is an error naming it, not a panic.
#[test]
fn a_malformed_lycoris_file_is_named_in_the_merge() {
    use flame::nn::LoraMerge;
    let d = temp("malformed");
    let t = |dims: &[usize]| Tensor::zeros(dims.to_vec(), DType::F32, &CPU).unwrap();
    for (bad, tensors) in [
        (
            "hada_w1_b",
            vec![
                ("hada_w1_a", t(&[10, 2])),
                ("hada_w1_b", t(&[])),
                ("hada_w2_a", t(&[10, 2])),
                ("hada_w2_b", t(&[2, 12])),
            ],
        ),
        (
            "lokr_w2",
            vec![("lokr_w1", t(&[2, 3])), ("lokr_w2", t(&[5, 5]))],
        ),
    ] {
        let file = d.join(format!("{bad}.safetensors"));
        let named: Vec<(String, Tensor)> = tensors
            .into_iter()
            .map(|(n, v)| (format!("lora_unet_lin.{n}"), v))
            .collect();
        flame::safetensors::save(named.iter().map(|(k, v)| (k.as_str(), v)), &file).unwrap();
        let merge = Arc::new(LoraMerge::open(&file, 1.0, "transformer").unwrap());
        let vb = merged_base(&merge);
        let e = Linear::new(&vb.pp("lin"), 12, 10, true)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("lora_unet_lin.{bad}")), "{e}");
    }
}

/// The weight change of every module of the fixture model after the PEFT-layout LoRA `file`
/// is read into adapters planned at rank `lin_rank` on the Linear and 4 on the convolutions.
fn peft_lora_deltas(file: &Path, lin_rank: usize) -> HashMap<String, Tensor> {
    let base = load(&dir().join("base.safetensors"));
    let a = Adapters::new(AdapterConfig {
        rank: lin_rank,
        conv_rank: 4,
        ..config("lora")
    })
    .unwrap();
    let _m = model(&a, DType::F64);
    a.load_peft(file, &identity(), "base_model.model").unwrap();
    a.layers()
        .unwrap()
        .into_iter()
        .map(|l| {
            let w = base[&format!("{}.weight", l.path())].clone();
            let weight = |dt| w.to_dtype(dt);
            let d = l.delta_weight(&BaseLayer::new(l.shape(), &weight)).unwrap();
            (l.path().to_string(), d)
        })
        .collect()
}

/// PEFT's per-module scales from `adapter_config.json`: `rank_pattern` and `alpha_pattern`
/// (regular expressions matching a module's name whole or a dot-separated suffix of it,
/// PEFT's `get_pattern_key`) override r and alpha for the modules they match, and
/// `use_rslora` makes the scale alpha / √r. Built from the LoRA fixture (r = 4, alpha = 8):
/// its `lin` adapter cut to rank 2 under `rank_pattern = {"lin": 2}` (scale 8 / 2), its
/// `conv` under `alpha_pattern = {"c.nv": 12}` (scale 12 / 4), `pw` as it was (8 / 4). Read
/// into planned adapters and merged by the `sample` binary's reader alike.
#[test]
fn peft_rank_and_alpha_patterns_and_rslora_scale_each_module() {
    let src = dir().join("lora");
    let t = load(&src.join("peft.safetensors"));
    let io = load(&src.join("io.safetensors"));
    let base = load(&dir().join("base.safetensors"));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("adapter_config.json")).unwrap())
            .unwrap();
    let key = |m: &str, ab: &str| format!("base_model.model.{m}.lora_{ab}.weight");
    let write = |name: &str, tensors: &HashMap<String, Tensor>, extra: serde_json::Value| {
        let d = temp(name);
        let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        flame::safetensors::save(named, d.join("adapter_model.safetensors")).unwrap();
        let mut c = cfg.clone();
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        std::fs::write(d.join("adapter_config.json"), c.to_string()).unwrap();
        d.join("adapter_model.safetensors")
    };
    // Patterns: lin at rank 2.
    let mut cut = t.clone();
    let a2 = t[&key("lin", "A")]
        .narrow(0, 0, 2)
        .unwrap()
        .contiguous()
        .unwrap();
    let b2 = t[&key("lin", "B")]
        .narrow(1, 0, 2)
        .unwrap()
        .contiguous()
        .unwrap();
    cut.insert(key("lin", "A"), a2.clone());
    cut.insert(key("lin", "B"), b2.clone());
    let file = write(
        "peft-patterns",
        &cut,
        serde_json::json!({"rank_pattern": {"lin": 2}, "alpha_pattern": {"c.nv": 12}}),
    );
    let got = peft_lora_deltas(&file, 2);
    let want_lin = b2.matmul(&a2).unwrap().affine(8.0 / 2.0, 0.0).unwrap();
    // The fixture's deltas are PEFT's at scale 8 / 4.
    let want_conv = io["delta.conv"].affine(3.0 / 2.0, 0.0).unwrap();
    for (m, want) in [
        ("lin", &want_lin),
        ("conv", &want_conv),
        ("pw", &io["delta.pw"]),
    ] {
        let e = rel(&got[m].reshape(want.shape().clone()).unwrap(), want);
        assert!(e < 1e-6, "patterns: {m} off by {e:e}");
    }
    // The sample binary's merge reads the same scale (Linear layers).
    let merge = flame::nn::LoraMerge::open(&file, 1.0, "base_model.model").unwrap();
    let w = base["lin.weight"].to_dtype(DType::F32).unwrap();
    let d = merge.delta_for("lin.weight", &w).unwrap().unwrap();
    let e = rel(&d.to_dtype(DType::F64).unwrap(), &want_lin);
    assert!(e < 1e-6, "merge with patterns: lin off by {e:e}");

    // rsLoRA: alpha / √r = 8 / 2, twice the fixture's scale.
    let file = write("peft-rslora", &t, serde_json::json!({"use_rslora": true}));
    let got = peft_lora_deltas(&file, 4);
    for m in MODULES {
        let want = io[&format!("delta.{m}")].affine(2.0, 0.0).unwrap();
        let e = rel(&got[m].reshape(want.shape().clone()).unwrap(), &want);
        assert!(e < 1e-6, "rslora: {m} off by {e:e}");
    }

    // A pattern that is not a regular expression is named.
    let file = write(
        "peft-bad-pattern",
        &t,
        serde_json::json!({"rank_pattern": {"lin(": 2}}),
    );
    let a = Adapters::new(config("lora")).unwrap();
    let _m = model(&a, DType::F64);
    let e = a
        .load_peft(&file, &identity(), "base_model.model")
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank_pattern") && e.contains("lin("), "{e}");
}

/// Files PEFT 0.21.0 wrote with `rank_pattern` / `alpha_pattern` and with `use_rslora`
/// (scripts/make_peft_pattern_fixtures.py: lin at rank 2 scaled 8 / 2, conv 12 / 4 through
/// the pattern "c.nv", pw 5 / 4 through "p."; rsLoRA 8 / √4 everywhere): read into adapters,
/// every module's weight change is the one PEFT's merge made, and the `sample` binary's merge
/// gives the Linear's too.
#[test]
fn peft_made_pattern_and_rslora_files_compute_what_peft_merged() {
    for (case, lin_rank) in [("lora_patterns", 2), ("lora_rslora", 4)] {
        let d = dir().join(case);
        let want = load(&d.join("delta.safetensors"));
        let base = load(&dir().join("base.safetensors"));
        let file = d.join("adapter_model.safetensors");
        for (m, got) in peft_lora_deltas(&file, lin_rank) {
            let want = &want[&format!("delta.{m}")];
            let e = rel(&got.reshape(want.shape().clone()).unwrap(), want);
            assert!(e < 1e-6, "{case} {m}: weight change off by {e:e}");
        }
        let merge = flame::nn::LoraMerge::open(&file, 1.0, "base_model.model").unwrap();
        let w = base["lin.weight"].to_dtype(DType::F32).unwrap();
        let got = merge.delta_for("lin.weight", &w).unwrap().unwrap();
        let e = rel(&got.to_dtype(DType::F64).unwrap(), &want["delta.lin"]);
        assert!(e < 1e-6, "{case}: the merge's lin off by {e:e}");
    }
}

/// Files LyCORIS 4.1.3 wrote (`scripts/make_lycoris_fixtures.py`): its Tucker forms
/// (`lora_mid`, `hada_t1`/`hada_t2`, `lokr_t2` on a 3x3 convolution), DoRA's per-column
/// `dora_scale` on a Linear, LoHa and LoKr with DoRA's magnitudes a row and per input channel
/// (its `weight_decompose` on them, `wd_on_out` True and False), and full fine-tuning's `diff` with `diff_b`, merged as the weights
/// load, give every weight and bias LyCORIS's own change (`get_diff_weight`, or the merged
/// weight for DoRA), every tensor of each file taken.
#[test]
fn lycoris_tucker_dora_and_bias_files_merge_as_lycoris_computes_them() {
    let lyco = dir().join("lycoris");
    let base = load(&lyco.join("base.safetensors"));
    for case in [
        "locon_tucker",
        "loha_tucker",
        "lokr_tucker",
        "dora_columns",
        "full",
        "loha_dora",
        "lokr_dora",
        "loha_dora_in",
        "lokr_dora_in",
    ] {
        let merge = Arc::new(
            flame::nn::LoraMerge::open(lyco.join(format!("{case}.safetensors")), 1.0, "unet")
                .unwrap(),
        );
        let want = load(&lyco.join(format!("{case}_delta.safetensors")));
        // The room a plan leaves the merge holds the largest change in f32 (Tucker cores
        // read from the file's shapes as the kinds rebuild them).
        let largest = want.values().map(|d| d.elem_count()).max().unwrap() as u64;
        assert!(
            merge.merge_bytes() >= largest * 4 + 4 * 4 * (4 << 20),
            "{case}: merge_bytes {} for a change of {largest} values",
            merge.merge_bytes()
        );
        let vb = VarBuilder::from_files(&[lyco.join("base.safetensors")], DType::F32, &CPU)
            .unwrap()
            .with_merge(merge.clone())
            .unwrap();
        for (key, b) in &base {
            let got = vb.get(b.dims().to_vec(), key).unwrap();
            let b32 = b.to_dtype(DType::F32).unwrap();
            let change = got.sub(&b32).unwrap();
            match want.get(key) {
                Some(d) => {
                    let e = rel(&change, &d.to_dtype(DType::F32).unwrap());
                    assert!(e < 1e-5, "{case} {key}: off by {e:e}");
                }
                None => assert_eq!(
                    got.to_vec_f64().unwrap(),
                    b32.to_vec_f64().unwrap(),
                    "{case} {key}: changed"
                ),
            }
        }
        merge.check_all_used().unwrap();
    }
}

/// The fixture's Linear without an adapter, on `x`.
fn base_lin(x: &Tensor) -> Tensor {
    let vb = VarBuilder::from_files(&[dir().join("base.safetensors")], DType::F32, &CPU).unwrap();
    Linear::new(&vb.pp("lin"), 12, 10, true)
        .unwrap()
        .forward(x)
        .unwrap()
}

/// Module dropout (`AdapterConfig::module_dropout`, kohya's and LyCORIS's) skips a layer's
/// whole adapter (LoRA, LoKr, LoHa) for some micro-batches while training, the same ones
/// again for the same step and micro-batch, and never outside training; the others compute
/// the adapter as without it. Full training refuses it and rank dropout.
#[test]
fn module_dropout_skips_whole_adapters_for_some_micro_batches_in_training_only() {
    for kind in ["lora", "lokr", "loha"] {
        let a = Adapters::new(AdapterConfig {
            module_dropout: 0.5,
            ..config(kind)
        })
        .unwrap();
        let m = model(&a, DType::F32);
        perturb(&a, 11);
        let x = Tensor::randn((3, 12), DType::F32, &CPU, 5).unwrap();
        let base = base_lin(&x);
        a.set_train(false);
        let adapted = m.lin.forward(&x).unwrap();
        assert!(
            rel(&adapted, &base) > 1e-3,
            "{kind}: the adapter changes nothing"
        );
        let dropped = |step: u64| -> bool {
            a.set_step(step).unwrap();
            a.set_train(true);
            let y = m.lin.forward(&x).unwrap();
            a.set_train(false);
            match (rel(&y, &base) < 1e-7, rel(&y, &adapted) < 1e-7) {
                (true, false) => true,
                (false, true) => false,
                _ => panic!("{kind} step {step}: neither the base nor the adapted output"),
            }
        };
        let first: Vec<bool> = (0..40).map(dropped).collect();
        let n = first.iter().filter(|d| **d).count();
        assert!(
            (8..=32).contains(&n),
            "{kind}: {n} of 40 micro-batches skipped at p = 0.5"
        );
        let again: Vec<bool> = (0..40).map(dropped).collect();
        assert_eq!(
            first, again,
            "{kind}: the same steps skip the same adapters"
        );
    }
    let e = Adapters::new(AdapterConfig {
        module_dropout: 0.1,
        kind: "full".into(),
        ..config("lora")
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("module_dropout"), "{e}");
    let e = Adapters::new(AdapterConfig {
        rank_dropout: 0.1,
        kind: "full".into(),
        ..config("lora")
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("rank_dropout"), "{e}");
}

/// Rank dropout (`AdapterConfig::rank_dropout`, kohya's): while training, each row of the
/// down-projection's output keeps each rank component with probability 1 - p, scaled by
/// 1 / (1 - p); the same step draws the same mask again, and outside training nothing is
/// dropped. Checked on every row by finding the mask in {0, 2}^r that gives its term.
#[test]
fn rank_dropout_keeps_each_rank_component_of_a_row_or_drops_it_in_training_only() {
    let a = Adapters::new(AdapterConfig {
        rank_dropout: 0.5,
        ..config("lora")
    })
    .unwrap();
    let m = model(&a, DType::F32);
    perturb(&a, 13);
    let rows = 3;
    let x = Tensor::randn((rows, 12), DType::F32, &CPU, 6).unwrap();
    let base = base_lin(&x);
    let lin = a
        .layers()
        .unwrap()
        .into_iter()
        .find(|l| l.path() == "lin")
        .unwrap();
    let p = lin.params();
    let (down, up) = (&p[0].1, &p[1].1);
    let r = down.dims()[0];
    let s = a.config.alpha / r as f64;
    // u = A x per row (rows, r), and each rank component's column s B[:, k].
    let u = x.matmul(&down.t().unwrap()).unwrap().to_vec_f64().unwrap();
    let b = up.to_vec_f64().unwrap();
    a.set_train(false);
    let adapted = m.lin.forward(&x).unwrap();
    let masks = |step: u64| -> Vec<Vec<bool>> {
        a.set_step(step).unwrap();
        a.set_train(true);
        let y = m.lin.forward(&x).unwrap();
        a.set_train(false);
        let term = y.sub(&base).unwrap().to_vec_f64().unwrap();
        (0..rows)
            .map(|i| {
                let fits = |mask: usize| {
                    (0..10).all(|j| {
                        let want: f64 = (0..r)
                            .filter(|k| mask >> k & 1 == 1)
                            .map(|k| 2.0 * u[i * r + k] * s * b[j * r + k])
                            .sum();
                        (term[i * 10 + j] - want).abs() < 1e-4
                    })
                };
                let mask = (0..1usize << r)
                    .find(|&mk| fits(mk))
                    .unwrap_or_else(|| panic!("step {step} row {i}: no mask gives its term"));
                (0..r).map(|k| mask >> k & 1 == 1).collect()
            })
            .collect()
    };
    let first: Vec<_> = (0..20).map(masks).collect();
    let kept = first.iter().flatten().flatten().filter(|k| **k).count();
    let all = 20 * rows * r;
    assert!(
        kept > all / 4 && kept < 3 * all / 4,
        "{kept} of {all} kept at p = 0.5"
    );
    let again: Vec<_> = (0..20).map(masks).collect();
    assert_eq!(first, again, "the same steps draw the same masks");
    assert!(rel(&m.lin.forward(&x).unwrap(), &adapted) < 1e-7);
}

/// FLAME's kohya files read by LyCORIS itself (`scripts/check_lycoris_load.py`, LyCORIS
/// 4.1.3): every kind on the fixture's Linear, 3x3 and 1x1 convolutions (LoKr with a
/// low-rank and with two full factors, DoRA with its magnitude a row, full with the biases'
/// changes), LoRA, LoKr and LoHa in their Tucker forms, LoKr and LoHa with LyCORIS's weight
/// decomposition (`dora_scale`, per output channel and per input channel), LyCORIS wraps
/// every layer and adds what FLAME's adapter adds,
/// in float64. Needs Python with torch and
/// lycoris-lora: `FLAME_LYCORIS_PYTHONPATH=/tmp/pysite2:/tmp/pysite cargo test --features
/// cpu-ref --test adapters -- --ignored lycoris`.
#[test]
#[ignore = "needs Python with torch and lycoris-lora (FLAME_LYCORIS_PYTHONPATH)"]
fn flame_kohya_files_load_into_lycoris() {
    let d = temp("lycoris-load");
    let base = load(&dir().join("base.safetensors"));
    let cases = [
        "lora",
        "dora",
        "lokr",
        "lokr_full",
        "loha",
        "full",
        "lora_tucker",
        "lokr_tucker",
        "loha_tucker",
        "lokr_wd",
        "loha_wd",
        "loha_tucker_wd",
        "lokr_wd_in",
        "loha_wd_in",
        "loha_tucker_wd_in",
    ];
    for case in cases {
        // `<kind>[_tucker][_wd[_in]]`: the Tucker forms on the 3x3 convolution, LyCORIS's
        // weight decomposition, its magnitudes per input channel (`wd_on_out = false`).
        let kind = case
            .split("_tucker")
            .next()
            .unwrap()
            .trim_end_matches("_in")
            .trim_end_matches("_wd");
        let on_out = !case.ends_with("_in");
        let cfg = match kind {
            "full" => AdapterConfig {
                kind: "full".into(),
                ..config("lora")
            },
            c => config(c),
        };
        let cfg = AdapterConfig {
            tucker: case.contains("_tucker"),
            weight_decompose: case.contains("_wd"),
            wd_on_out: on_out,
            per_projection: false,
            ..cfg
        };
        let settings = serde_json::json!({
            "algo": "lokr",
            "dim": cfg.rank,
            "alpha": cfg.alpha,
            "factor": cfg.factor,
            "decompose_both": cfg.decompose_both,
            "use_tucker": true,
        });
        let mut in_settings = serde_json::json!({
            "algo": kind,
            "dim": cfg.rank,
            "alpha": cfg.alpha,
            "use_tucker": case.contains("_tucker"),
            "weight_decompose": true,
            "wd_on_out": false,
        });
        if kind == "lokr" {
            in_settings["factor"] = cfg.factor.into();
            in_settings["decompose_both"] = cfg.decompose_both.into();
        }
        let a = Adapters::new(AdapterConfig {
            lokr_split: flame::nn::LokrSplit::Lycoris,
            ..cfg
        })
        .unwrap();
        let _m = model(&a, DType::F64);
        let delta = |l: &Arc<dyn Adapter>| {
            let w = base[&format!("{}.weight", l.path())].clone();
            let get = move |dt: DType| w.to_dtype(dt);
            l.delta_weight(&BaseLayer::new(l.shape(), &get)).unwrap()
        };
        // DoRA's magnitudes from the weights first, then every tensor moved.
        for l in a.layers().unwrap() {
            delta(&l);
        }
        perturb(&a, 31);
        a.save_kohya(d.join(format!("{case}.safetensors")), DType::F64)
            .unwrap();
        // LyCORIS 4.1.3's loader misreads LoKr's Tucker form, its own files too (the rank
        // from `lokr_w2_a.size(1)`, the output side there): the script builds LyCORIS's
        // modules with these settings and loads FLAME's tensors into them strictly.
        if case == "lokr_tucker" {
            std::fs::write(d.join(format!("{case}.json")), settings.to_string()).unwrap();
        }
        // Nor can it read magnitudes per input channel, its own neither: it builds the module
        // with `wd_on_out=True` and copies `dora_scale` (1, in) into (out, 1).
        if !on_out {
            std::fs::write(d.join(format!("{case}.json")), in_settings.to_string()).unwrap();
        }
        // The weights' changes, and the biases' where the kind trains them (full).
        let mut deltas: Vec<(String, Tensor)> = vec![];
        for l in a.layers().unwrap() {
            let t = delta(&l).to_dtype(DType::F64).unwrap();
            deltas.push((format!("{}.weight", l.path()), t));
            for (name, p) in l.params() {
                if name == "diff_b" {
                    let b = p.to_dtype(DType::F64).unwrap();
                    deltas.push((format!("{}.bias", l.path()), b));
                }
            }
        }
        if case == "full" {
            assert_eq!(deltas.len(), 6, "full trains every layer's bias");
        }
        flame::safetensors::save(
            deltas.iter().map(|(k, t)| (k.as_str(), t)),
            d.join(format!("{case}_delta.safetensors")),
        )
        .unwrap();
    }
    let python = std::env::var("FLAME_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/check_lycoris_load.py");
    let out = std::process::Command::new(python)
        .arg(&script)
        .arg(&d)
        .arg(dir().join("base.safetensors"))
        .env(
            "PYTHONPATH",
            std::env::var("FLAME_LYCORIS_PYTHONPATH").unwrap_or_default(),
        )
        .output()
        .expect("python3");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "LyCORIS:\n{text}");
    std::fs::remove_dir_all(&d).ok();
}

/// Rank dropout on LoKr and LoHa (`AdapterConfig::rank_dropout`, LyCORIS's for these kinds):
/// while training, each output row of the weight change is kept whole or zeroed, about half
/// of them at p = 0.5 and the kept ones unscaled; the same step drops the same rows again,
/// and outside training nothing is dropped.
#[test]
fn rank_dropout_on_lokr_and_loha_keeps_or_zeroes_each_row_of_the_change() {
    for kind in ["lokr", "loha"] {
        let a = Adapters::new(AdapterConfig {
            rank_dropout: 0.5,
            ..config(kind)
        })
        .unwrap();
        let m = model(&a, DType::F32);
        perturb(&a, 17);
        let x = Tensor::randn((3, 12), DType::F32, &CPU, 7).unwrap();
        let base = base_lin(&x);
        let term = |train: Option<u64>| -> Vec<f64> {
            if let Some(step) = train {
                a.set_step(step).unwrap();
            }
            a.set_train(train.is_some());
            let y = m.lin.forward(&x).unwrap().sub(&base).unwrap();
            a.set_train(false);
            y.to_vec_f64().unwrap()
        };
        let whole = term(None);
        assert!(whole.iter().any(|v| v.abs() > 1e-3), "{kind}: no change");
        let (mut kept, mut rows) = (0, 0);
        let mut first = vec![];
        for step in 0..8 {
            let t = term(Some(step));
            for j in 0..10 {
                let col = |v: &[f64]| (0..3).map(|i| v[i * 10 + j]).collect::<Vec<_>>();
                let (got, want) = (col(&t), col(&whole));
                let scale = want.iter().fold(1e-6f64, |s, v| s.max(v.abs()));
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(g, w)| (g - w).abs() < 1e-5 * scale);
                let zero = got.iter().all(|g| g.abs() < 1e-6 * scale);
                assert!(
                    same ^ zero,
                    "{kind} step {step} row {j}: {got:?} against {want:?}"
                );
                kept += same as usize;
                rows += 1;
            }
            first.push(t);
        }
        assert!(
            (20..=60).contains(&kept),
            "{kind}: {kept} of {rows} rows kept at p = 0.5"
        );
        for (step, t) in first.iter().enumerate() {
            assert_eq!(
                &term(Some(step as u64)),
                t,
                "{kind} step {step}: another mask"
            );
        }
        assert_eq!(term(None), whole, "{kind}: outside training");
    }
}

/// LyCORIS's Tucker forms train in FLAME (`AdapterConfig::tucker`): LoCon's (`lora_mid`),
/// LoHa's (`hada_t1`, `hada_t2`) and LoKr's (`lokr_t2`). The files LyCORIS 4.1.3 wrote
/// (`locon_tucker`, `loha_tucker`, `lokr_tucker`, `scripts/make_lycoris_fixtures.py`) load into such adapters, whose changes
/// are then LyCORIS's own and whose 3x3 convolution computes its base plus that change; the
/// 1x1 convolution and the Linear keep the plain form; the kohya file FLAME writes holds the
/// cores and loads back bit for bit; the f64 gradcheck passes through every factor and core;
/// the PEFT layout (FLAME writes the form in the kohya layout only) and the kinds without the
/// form refuse it, naming the setting.
#[test]
fn lycoris_tucker_forms_load_train_and_write() {
    let lyco = dir().join("lycoris");
    let base = load(&lyco.join("base.safetensors"));
    let d = temp("tucker");
    // (case, kind, the cores' names, rank, alpha), as the fixtures were made.
    for (case, kind, cores, rank, alpha) in [
        ("locon_tucker", "lora", &["lora_mid.weight"][..], 4, 2.0),
        ("loha_tucker", "loha", &["hada_t1", "hada_t2"][..], 4, 2.0),
        ("lokr_tucker", "lokr", &["lokr_t2"][..], 2, 1.0),
    ] {
        let want = load(&lyco.join(format!("{case}_delta.safetensors")));
        let cfg = AdapterConfig {
            kind: kind.into(),
            rank,
            alpha,
            conv_rank: rank,
            conv_alpha: alpha,
            factor: 4,
            lokr_split: flame::nn::LokrSplit::Lycoris,
            tucker: true,
            targets: MODULES.iter().map(|m| m.to_string()).collect(),
            ..config("lora")
        };
        let layers = |a: &Arc<Adapters>| {
            let vb = VarBuilder::from_files(&[lyco.join("base.safetensors")], DType::F64, &CPU)
                .unwrap()
                .with_adapters(a.clone())
                .unwrap();
            let cfg = Conv2dConfig {
                padding: 1,
                ..Default::default()
            };
            (
                Conv2d::new(&vb.pp("conv"), 16, 32, 3, cfg).unwrap(),
                Conv2d::new(&vb.pp("pw"), 16, 32, 1, Conv2dConfig::default()).unwrap(),
                Linear::new(&vb.pp("lin"), 12, 20, true).unwrap(),
            )
        };
        let a = Adapters::new(cfg.clone()).unwrap();
        let (conv, _pw, _lin) = layers(&a);
        a.load_kohya(lyco.join(format!("{case}.safetensors")))
            .unwrap();
        let by_path = |a: &Arc<Adapters>, p: &str| -> Arc<dyn Adapter> {
            a.layers()
                .unwrap()
                .into_iter()
                .find(|l| l.path() == p)
                .unwrap()
        };
        for name in MODULES {
            let l = by_path(&a, name);
            let names: Vec<&str> = l.params().iter().map(|(n, _)| *n).collect();
            for c in cores {
                assert_eq!(
                    names.contains(c),
                    name == "conv",
                    "{case} {name}: {names:?}"
                );
            }
            let w = base[&format!("{name}.weight")].clone();
            let weight = |dt| w.to_dtype(dt);
            let delta = l.delta_weight(&BaseLayer::new(l.shape(), &weight)).unwrap();
            let e = rel(
                &delta.to_dtype(DType::F64).unwrap(),
                &want[&format!("{name}.weight")],
            );
            assert!(e < 1e-6, "{case} {name}: LyCORIS's change off by {e:e}");
        }
        // The adapted 3x3 convolution: conv(x, W + ΔW) + b.
        let x = Tensor::randn((2, 16, 5, 7), DType::F64, &CPU, 3).unwrap();
        let merged = base["conv.weight"].add(&want["conv.weight"]).unwrap();
        let reference = flame::nn::conv2d(
            &x,
            &merged,
            Some(&base["conv.bias"]),
            (1, 1),
            (1, 1),
            (1, 1),
            1,
        )
        .unwrap();
        let e = rel(&conv.forward(&x).unwrap(), &reference);
        assert!(
            e < 1e-6,
            "{case}: the Tucker convolution's output off by {e:e}"
        );

        // Written as kohya with the cores, and read back exactly.
        let file = d.join(format!("{case}.safetensors"));
        a.save_kohya(&file, DType::F32).unwrap();
        let t = load(&file);
        // Kohya's scripts rebuild the network from its recorded arguments.
        let meta = flame::safetensors::SafeTensorsFile::open(&file)
            .unwrap()
            .metadata()
            .clone();
        assert!(
            meta["ss_network_args"].contains("use_tucker"),
            "{case}: {:?}",
            meta.get("ss_network_args")
        );
        for c in cores {
            assert_eq!(
                t[&format!("{}.{c}", flame::nn::kohya_name("conv"))].dims(),
                [rank, rank, 3, 3],
                "{case} {c}"
            );
        }
        let fresh = Adapters::new(cfg.clone()).unwrap();
        let _fresh_layers = layers(&fresh);
        fresh.load_kohya(&file).unwrap();
        for ((n0, t0), (n1, t1)) in a.params().unwrap().iter().zip(fresh.params().unwrap()) {
            assert_eq!(n0, &n1);
            let t0 = t0.to_dtype(DType::F32).unwrap();
            assert_eq!(rel(&t1, &t0), 0.0, "{case} {n0}: kohya round trip");
        }

        // The gradient through every factor and core.
        let l = by_path(&a, "conv");
        let w = base["conv.weight"].clone();
        let params: Vec<Tensor> = l
            .params()
            .iter()
            .enumerate()
            .map(|(i, (_, t))| {
                Tensor::randn(t.dims().to_vec(), DType::F64, &CPU, 40 + i as u64)
                    .unwrap()
                    .affine(0.3, 0.0)
                    .unwrap()
            })
            .collect();
        let weight = |dt| w.to_dtype(dt);
        let f = |t: &[Tensor]| {
            let base = BaseLayer::new(l.shape(), &weight);
            let y = flame::nn::conv2d(&t[0], &w, None, (1, 1), (1, 1), (1, 1), 1)?;
            l.forward_with(&base, &t[0], y, &t[1..])
        };
        let mut leaves = vec![x
            .narrow(0, 0, 1)
            .unwrap()
            .narrow(2, 0, 3)
            .unwrap()
            .contiguous()
            .unwrap()];
        leaves.extend(params);
        let r = gradcheck(f, &leaves, GradcheckConfig::default())
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        assert!(r.checked > 0);

        // PEFT has no Tucker form of LoRA; LoKr's and LoHa's are its use_effective_conv2d.
        let peft = a.save_peft(d.join("peft.safetensors"), &identity(), "unet", DType::F32);
        if kind == "lora" {
            let e = peft.map(|_| ()).unwrap_err().to_string();
            assert!(e.contains("Tucker") && e.contains("conv"), "{case}: {e}");
        } else {
            peft.unwrap_or_else(|e| panic!("{case}: {e}"));
        }
    }
    // The kinds without the form refuse the setting.
    for kind in ["dora", "full"] {
        let e = Adapters::new(AdapterConfig {
            kind: kind.into(),
            tucker: true,
            ..config("lora")
        })
        .map(|_| ())
        .unwrap_err()
        .to_string();
        assert!(e.contains("AdapterConfig::tucker"), "{kind}: {e}");
    }
}

/// The `adapter_config.json` FLAME writes beside a PEFT file says what PEFT must build: the
/// kind, alpha = r (the tensors carry the scale), the convolutions' own rank through
/// `rank_pattern` / `alpha_pattern`, the modules, and PEFT's Tucker form
/// (`use_effective_conv2d`); a file whose config says another form than the adapters' is an
/// error naming `AdapterConfig::tucker`.
#[test]
fn peft_configs_say_the_form_and_a_file_of_the_other_form_is_named() {
    let d = temp("peft-config");
    for kind in TUCKER_KINDS {
        let (a, _m) = from_peft(kind);
        let c = a.peft_config(&identity()).unwrap();
        let want: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir().join(kind).join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(c["peft_type"], want["peft_type"], "{kind}");
        assert_eq!(c["use_effective_conv2d"], true, "{kind}");
        assert_eq!(c["r"], want["r"], "{kind}");
        assert_eq!(
            c["alpha"], want["r"],
            "{kind}: alpha = r, the scale folded in"
        );
        let mut targets: Vec<&str> = c["target_modules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        targets.sort();
        assert_eq!(targets, ["conv", "lin", "pw"], "{kind}");
        if kind == "lokr_tucker" {
            assert_eq!(c["decompose_factor"], want["decompose_factor"]);
        }
        // The same file read by adapters without the Tucker form: named, not a shape error.
        let sub = d.join(kind);
        std::fs::create_dir_all(&sub).unwrap();
        a.save_peft(
            sub.join("adapter_model.safetensors"),
            &identity(),
            "base_model.model",
            DType::F32,
        )
        .unwrap();
        a.save_peft_config(sub.join("adapter_config.json"), &identity())
            .unwrap();
        let mut plain = config(kind);
        plain.tucker = false;
        let p = Adapters::new(plain).unwrap();
        let _m = model(&p, DType::F32);
        let e = p
            .load_peft(
                sub.join("adapter_model.safetensors"),
                &identity(),
                "base_model.model",
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("AdapterConfig::tucker") && e.contains("use_effective_conv2d = true"),
            "{kind}: {e}"
        );
        // Read back with its config: the values come back.
        let fresh = Adapters::new(a.config.clone()).unwrap();
        let _m2 = model(&fresh, DType::F32);
        fresh
            .load_peft(
                sub.join("adapter_model.safetensors"),
                &identity(),
                "base_model.model",
            )
            .unwrap();
        for ((n, t0), (_, t1)) in a.params().unwrap().iter().zip(fresh.params().unwrap()) {
            assert!(rel(&t1, t0) < 1e-6, "{kind} {n}");
        }
    }
    // A conv_rank other than rank: PEFT's patterns give the convolutions theirs.
    let mut c = config("loha");
    c.conv_rank = 2;
    c.conv_alpha = 3.0;
    let a = Adapters::new(c).unwrap();
    let _m = model(&a, DType::F32);
    let pc = a.peft_config(&identity()).unwrap();
    for m in ["conv", "pw"] {
        assert_eq!(pc["rank_pattern"][m], 2, "{pc}");
        assert_eq!(pc["alpha_pattern"][m], 2, "{pc}");
    }
    assert!(pc["rank_pattern"].get("lin").is_none(), "{pc}");
}

/// FLAME's PEFT files load into peft 0.21.2 (`set_peft_model_state_dict` with no missing or
/// unexpected key, and `PeftModel.from_pretrained`, with the `adapter_config.json` FLAME
/// writes) and peft computes FLAME's outputs, every kind and PEFT's Tucker forms
/// (`use_effective_conv2d`), by `scripts/check_peft_adapters.py`. Needs Python with torch
/// and peft: `FLAME_PYTHON=/work/pyenv/bin/python cargo test --features cpu-ref --test
/// adapters -- --ignored into_peft`.
#[test]
#[ignore = "needs Python with torch and peft (FLAME_PYTHON)"]
fn flame_peft_files_load_into_peft() {
    let d = temp("peft-load");
    let inp = inputs();
    for kind in KINDS.into_iter().chain(TUCKER_KINDS) {
        let (a, m) = from_peft(kind);
        perturb(&a, 1300);
        let sub = d.join(kind);
        std::fs::create_dir_all(&sub).unwrap();
        a.save_peft(
            sub.join("adapter_model.safetensors"),
            &identity(),
            "base_model.model",
            DType::F32,
        )
        .unwrap();
        a.save_peft_config(sub.join("adapter_config.json"), &identity())
            .unwrap();
        let ys: Vec<(String, Tensor)> = MODULES
            .iter()
            .map(|n| (format!("y.{n}"), m.forward(n, &inp[&format!("x.{n}")])))
            .collect();
        flame::safetensors::save(
            ys.iter().map(|(k, t)| (k.as_str(), t)),
            sub.join("flame.safetensors"),
        )
        .unwrap();
    }
    let python = std::env::var("FLAME_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/check_peft_adapters.py");
    let out = std::process::Command::new(python)
        .arg(&script)
        .arg("tiny")
        .arg(&d)
        .arg(dir())
        .output()
        .expect("python3");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "peft:\n{text}");
    std::fs::remove_dir_all(&d).ok();
}

/// A LoRA merged as the weights load changes each weight in its own storage a few rows at a
/// time: a bf16 weight larger than one pass (4 · 2^20 values) and a bias-free f32 one come
/// out as the change added whole would make them (W in f32 plus strength · (s · B A), in the
/// builder's dtype, s = 4 / 3), bit for bit; the tensors a builder over tensors in memory was
/// given are left as they were; and the device room the merge asks of a plan (`merge_bytes`)
/// is the largest change in f32 and four passes' rows.
#[test]
fn merges_change_weights_in_place_by_rows_and_leave_given_tensors_alone() {
    let d = temp("merge-in-place");
    let (out, cols, r) = (1031usize, 4099usize, 3usize);
    let big = Tensor::randn((out, cols), DType::F32, &CPU, 1)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let small = Tensor::randn((7, 5), DType::F32, &CPU, 2).unwrap();
    let factor = |dims: (usize, usize), seed: u64| {
        Tensor::randn(dims, DType::F32, &CPU, seed)
            .unwrap()
            .affine(0.1, 0.0)
            .unwrap()
    };
    let (down, up) = (factor((r, cols), 3), factor((out, r), 4));
    let (down_s, up_s) = (factor((2, 5), 5), factor((7, 2), 6));
    // alpha / r = 4 / 3: a scale whose products round (the change as the old merge made it:
    // B A, then scaled, then at strength).
    let alpha = Tensor::from_vec(vec![4.0f32], (), &CPU).unwrap();
    let file = d.join("lora.safetensors");
    let named = [
        ("lora_unet_big.lora_down.weight", &down),
        ("lora_unet_big.lora_up.weight", &up),
        ("lora_unet_big.alpha", &alpha),
        ("lora_unet_small.lora_down.weight", &down_s),
        ("lora_unet_small.lora_up.weight", &up_s),
    ];
    flame::safetensors::save(named.iter().map(|(k, v)| (*k, *v)), &file).unwrap();
    let strength = 0.7;
    let merge = Arc::new(flame::nn::LoraMerge::open(&file, strength, "transformer").unwrap());
    assert_eq!(
        merge.merge_bytes(),
        (out * cols * 4) as u64 + 4 * 4 * (4 << 20),
        "the merge's room"
    );
    let given: HashMap<String, Tensor> = [
        ("big.weight".to_string(), big.clone()),
        ("small.weight".to_string(), small.clone()),
    ]
    .into();
    let before: Vec<Vec<f64>> = [&big, &small]
        .iter()
        .map(|t| t.to_vec_f64().unwrap())
        .collect();
    for (dtype, key, w, down, up, scale) in [
        (DType::BF16, "big.weight", &big, &down, &up, 4.0 / r as f64),
        // No alpha stored: kohya's scale 1.
        (DType::F32, "small.weight", &small, &down_s, &up_s, 1.0),
    ] {
        let vb = VarBuilder::from_tensors(given.clone(), dtype, &CPU)
            .with_merge(merge.clone())
            .unwrap();
        let got = vb.get(w.dims().to_vec(), key).unwrap();
        let change = up
            .matmul(down)
            .unwrap()
            .affine(scale, 0.0)
            .unwrap()
            .affine(strength, 0.0)
            .unwrap();
        let want = w
            .to_dtype(DType::F32)
            .unwrap()
            .add(&change)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        assert_eq!(got.dtype(), dtype);
        assert_eq!(
            got.to_vec_f64().unwrap(),
            want.to_vec_f64().unwrap(),
            "{key}: the merged weight"
        );
        assert!(
            rel(
                &got.to_dtype(DType::F32).unwrap(),
                &w.to_dtype(DType::F32).unwrap()
            ) > 1e-3
        );
    }
    // The builder's own tensors and the caller's handles to them are unchanged.
    for (t, was) in [&big, &small].iter().zip(&before) {
        assert_eq!(&t.to_vec_f64().unwrap(), was, "a given tensor changed");
    }
    for (k, t) in &given {
        let was = if k == "big.weight" {
            &before[0]
        } else {
            &before[1]
        };
        assert_eq!(&t.to_vec_f64().unwrap(), was, "{k}: the given map changed");
    }
    merge.check_all_used().unwrap();
    let _ = std::fs::remove_dir_all(&d);
}
