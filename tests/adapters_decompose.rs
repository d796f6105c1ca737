//! LyCORIS's weight decomposition of LoKr and LoHa trained in FLAME
//! (`AdapterConfig::weight_decompose`, LyCORIS's `weight_decompose` / `dora_wd`): the files
//! LyCORIS 4.1.3 wrote (`loha_dora`, `lokr_dora`, scripts/make_lycoris_fixtures.py) load as
//! trainable adapters and compute LyCORIS's change; an f64 gradcheck through the magnitude,
//! every factor and the norm (LyCORIS does not detach it), on a Linear and a 3x3 convolution,
//! in the Tucker form too; a fresh adapter leaves the layers as they were; kohya files round
//! trip bit for bit, and their merge (the `sample` binary's) and `delta_weight` give what the
//! trained layer computes; the PEFT layout and the kinds without the decomposition refuse it.
//! The layers are the LyCORIS fixtures' base: a Linear 12 -> 20, a 3x3 Conv2d 16 -> 32
//! (padding 1) and a 1x1 Conv2d 16 -> 32.
#![cfg(feature = "cpu-ref")]

mod common;

use common::tolerance::{tolerance, Against};
use flame::autograd::gradcheck::{gradcheck, GradcheckConfig};
use flame::nn::adapter::{Adapter, AdapterConfig, Adapters, BaseLayer};
use flame::nn::{
    Conv2d, Conv2dConfig, KeyMap, KeySource, Linear, LokrSplit, LoraMerge, VarBuilder,
};
use flame::{DType, Device, Error, Setting, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const CPU: Device = Device::Cpu;
const LAYERS: [&str; 3] = ["lin", "conv", "pw"];

fn lyco() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/adapters/lycoris")
}

fn load(path: &Path) -> HashMap<String, Tensor> {
    flame::safetensors::load(path, &CPU)
        .unwrap()
        .into_iter()
        .collect()
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-decompose-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `common::rel_err` over the elements (a magnitude (out, 1) against norms (out)).
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    common::rel_err(&a.flatten_all().unwrap(), &b.flatten_all().unwrap())
}

/// The bound of an f32 result against its f64 reference (the suites' one table), as the
/// relative error `rel` measures.
fn f32_rtol() -> f64 {
    tolerance(Against::F64, DType::F32).1
}

/// A decomposed `kind` ("lokr" or "loha") on the three layers, rank and alpha as the
/// LyCORIS fixtures were made (LoHa 4 and 2, LoKr 2 and 1 with factor 4), LyCORIS's split.
fn config(kind: &str) -> AdapterConfig {
    let (rank, alpha) = if kind == "lokr" { (2, 1.0) } else { (4, 2.0) };
    AdapterConfig {
        kind: kind.into(),
        rank,
        alpha,
        dropout: 0.0,
        module_dropout: 0.0,
        rank_dropout: 0.0,
        targets: LAYERS.iter().map(|s| s.to_string()).collect(),
        seed: 5,
        conv_rank: rank,
        conv_alpha: alpha,
        factor: 4,
        decompose_both: false,
        lokr_split: LokrSplit::Lycoris,
        tucker: false,
        weight_decompose: true,
        wd_on_out: true,
        per_projection: false,
    }
}

/// The fixtures' three layers from base.safetensors in `dtype`, adapted by `a`.
struct Layers {
    lin: Linear,
    conv: Conv2d,
    pw: Conv2d,
}

fn layers(a: &Arc<Adapters>, dtype: DType) -> Layers {
    let vb = VarBuilder::from_files(&[lyco().join("base.safetensors")], dtype, &CPU)
        .unwrap()
        .with_adapters(a.clone())
        .unwrap();
    Layers::of(&vb)
}

impl Layers {
    fn of(vb: &VarBuilder) -> Layers {
        let padded = Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        Layers {
            lin: Linear::new(&vb.pp("lin"), 12, 20, true).unwrap(),
            conv: Conv2d::new(&vb.pp("conv"), 16, 32, 3, padded).unwrap(),
            pw: Conv2d::new(&vb.pp("pw"), 16, 32, 1, Conv2dConfig::default()).unwrap(),
        }
    }

    fn forward(&self, name: &str, x: &Tensor) -> Tensor {
        match name {
            "lin" => self.lin.forward(x),
            "conv" => self.conv.forward(x),
            _ => self.pw.forward(x),
        }
        .unwrap()
    }
}

/// The plain layer `name` with weight `w` and bias `b` (any dtype), without adapters.
fn plain(name: &str, x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    match name {
        "lin" => x.matmul(&w.t().unwrap()).unwrap().add(b).unwrap(),
        "conv" => flame::nn::conv2d(x, w, Some(b), (1, 1), (1, 1), (1, 1), 1).unwrap(),
        _ => flame::nn::conv2d(x, w, Some(b), (1, 1), (0, 0), (1, 1), 1).unwrap(),
    }
}

/// An input of layer `name` in `dtype`.
fn input(name: &str, dtype: DType, seed: u64) -> Tensor {
    let dims = match name {
        "lin" => vec![3, 12],
        _ => vec![2, 16, 5, 6],
    };
    Tensor::randn(dims, DType::F64, &CPU, seed)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn by_path(a: &Adapters, path: &str) -> Arc<dyn Adapter> {
    a.layers()
        .unwrap()
        .into_iter()
        .find(|l| l.path() == path)
        .unwrap()
}

/// Every adapter tensor of `a` moved by 0.3 N(0, 1), so no factor stays at its zero start.
fn perturb(a: &Adapters, seed: u64) {
    for (i, (_, t)) in a.params().unwrap().iter().enumerate() {
        let r = Tensor::randn(t.dims().to_vec(), DType::F32, &CPU, seed + i as u64).unwrap();
        t.assign(&t.add(&r.affine(0.3, 0.0).unwrap()).unwrap())
            .unwrap();
    }
}

/// `delta_weight` of the adapter at `path` over the fixture's base weight (f32).
fn delta(a: &Adapters, base: &HashMap<String, Tensor>, path: &str) -> Tensor {
    let l = by_path(a, path);
    let w = base[&format!("{path}.weight")].clone();
    let weight = |dt: DType| w.to_dtype(dt);
    l.delta_weight(&BaseLayer::new(l.shape(), &weight)).unwrap()
}

/// LyCORIS's own files of LoHa and LoKr with `weight_decompose=True` load into decomposed
/// adapters as trainable parameters (the magnitude `dora_scale` among them, read as written),
/// with the magnitudes per output channel and per input channel (`wd_on_out=False`):
/// the change they stand for is the one LyCORIS's forward made (`<case>_delta`), each layer
/// computes its base layer on W + that change, and a loss reaches every tensor.
#[test]
fn lycoris_decomposed_files_load_as_trainable_adapters() {
    let base = load(&lyco().join("base.safetensors"));
    // (case, kind, LyCORIS's wd_on_out)
    for (case, kind, on_out) in [
        ("loha_dora", "loha", true),
        ("lokr_dora", "lokr", true),
        ("loha_dora_in", "loha", false),
        ("lokr_dora_in", "lokr", false),
    ] {
        let file = load(&lyco().join(format!("{case}.safetensors")));
        let want = load(&lyco().join(format!("{case}_delta.safetensors")));
        let a = Adapters::new(AdapterConfig {
            wd_on_out: on_out,
            per_projection: false,
            ..config(kind)
        })
        .unwrap();
        let m = layers(&a, DType::F64);
        a.load_kohya(lyco().join(format!("{case}.safetensors")))
            .unwrap();
        let mut loss: Option<Tensor> = None;
        for name in LAYERS {
            let l = by_path(&a, name);
            let (names, _): (Vec<&str>, Vec<Tensor>) = l.params().into_iter().unzip();
            assert_eq!(
                names.last(),
                Some(&"dora_scale"),
                "{case} {name}: {names:?}"
            );
            let m_read = &l.params().last().unwrap().1.clone();
            let m_file = &file[&format!("{}.dora_scale", flame::nn::kohya_name(name))];
            assert_eq!(
                m_read.to_vec_f64().unwrap(),
                m_file
                    .to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec_f64()
                    .unwrap(),
                "{case} {name}: dora_scale read"
            );
            let got = delta(&a, &base, name);
            let e = rel(&got, &want[&format!("{name}.weight")]);
            assert!(
                e < f32_rtol(),
                "{case} {name}: LyCORIS's change off by {e:e}"
            );
            let x = input(name, DType::F64, 11);
            let w = base[&format!("{name}.weight")]
                .add(&want[&format!("{name}.weight")])
                .unwrap();
            let reference = plain(name, &x, &w, &base[&format!("{name}.bias")]);
            let y = m.forward(name, &x);
            let e = rel(&y, &reference);
            assert!(e < f32_rtol(), "{case} {name}: output off by {e:e}");
            let term = y.sqr().unwrap().sum_all().unwrap();
            loss = Some(match loss {
                Some(l) => l.add(&term).unwrap(),
                None => term,
            });
        }
        let grads = loss.unwrap().backward().unwrap();
        for (n, t) in a.params().unwrap() {
            let g = grads
                .get(&t)
                .unwrap_or_else(|| panic!("{case}: no gradient of {n}"));
            assert!(
                g.to_vec_f64().unwrap().iter().any(|v| *v != 0.0),
                "{case}: zero gradient of {n}"
            );
        }
    }
}

/// f64 gradcheck of the decomposed forward (`Adapter::forward_with`) over the input, every
/// factor (Tucker cores included) and the magnitude, on a Linear and a 3x3 convolution, the
/// magnitudes per output channel and per input channel: LyCORIS differentiates through the
/// norm, so a detached norm fails it.
#[test]
fn decomposed_lokr_and_loha_pass_an_f64_gradcheck() {
    let base = load(&lyco().join("base.safetensors"));
    // (kind, Tucker form on the 3x3 convolution, magnitudes per output channel, layers)
    for (kind, tucker, on_out, names) in [
        ("lokr", false, true, &["lin", "conv"][..]),
        ("loha", false, true, &["lin", "conv"][..]),
        ("lokr", true, true, &["conv"][..]),
        ("loha", true, true, &["conv"][..]),
        ("lokr", false, false, &["lin", "conv"][..]),
        ("loha", true, false, &["conv"][..]),
    ] {
        let mut c = config(kind);
        c.tucker = tucker;
        c.wd_on_out = on_out;
        if kind == "loha" {
            // Fewer values to check; rank 2 is as good a decomposition as rank 4.
            (c.rank, c.conv_rank) = (2, 2);
        }
        let a = Adapters::new(c).unwrap();
        let _m = layers(&a, DType::F64);
        for &name in names {
            let l = by_path(&a, name);
            let n = l.params().len();
            assert_eq!(l.params()[n - 1].0, "dora_scale");
            if tucker {
                assert!(
                    l.params()
                        .iter()
                        .any(|(p, _)| *p == "lokr_t2" || *p == "hada_t1"),
                    "{kind}: no Tucker core"
                );
            }
            let w = base[&format!("{name}.weight")].clone();
            let weight = |dt: DType| w.to_dtype(dt);
            let params: Vec<Tensor> = l
                .params()
                .iter()
                .enumerate()
                .map(|(i, (_, t))| {
                    let r =
                        Tensor::randn(t.dims().to_vec(), DType::F64, &CPU, 90 + i as u64).unwrap();
                    // The magnitude near ‖W‖'s size, the factors around zero.
                    let shift = if i == n - 1 { 1.0 } else { 0.0 };
                    r.affine(0.3, shift).unwrap()
                })
                .collect();
            let x = match name {
                "lin" => input(name, DType::F64, 3).narrow(0, 0, 2).unwrap(),
                _ => Tensor::randn((1, 16, 3, 3), DType::F64, &CPU, 3).unwrap(),
            };
            let f = |t: &[Tensor]| {
                let bl = BaseLayer::new(l.shape(), &weight);
                let y = match name {
                    "lin" => t[0].matmul(&w.t()?)?,
                    _ => flame::nn::conv2d(&t[0], &w, None, (1, 1), (1, 1), (1, 1), 1)?,
                };
                l.forward_with(&bl, &t[0], y, &t[1..])
            };
            let mut leaves = vec![x];
            leaves.extend(params);
            let r = gradcheck(f, &leaves, GradcheckConfig::default()).unwrap_or_else(|e| {
                panic!("{kind} (Tucker {tucker}, on out {on_out}) {name}: {e}")
            });
            assert!(r.checked > 0);
        }
    }
}

/// A fresh decomposed adapter (the factor that starts at zero, the magnitude at ‖W‖ of each
/// output row) leaves every layer as it was: its change is W (‖W‖ / (‖W‖ + ε) - 1), ε
/// float32's epsilon, below the f32 bound; the magnitude it took is the rows' norm (the input
/// channels' columns' with `wd_on_out = false`).
#[test]
fn a_fresh_decomposed_adapter_leaves_the_layers_unchanged() {
    let base = load(&lyco().join("base.safetensors"));
    let plain_layers = Layers::of(
        &VarBuilder::from_files(&[lyco().join("base.safetensors")], DType::F32, &CPU).unwrap(),
    );
    for (kind, tucker, on_out) in [
        ("lokr", false, true),
        ("loha", false, true),
        ("lokr", true, true),
        ("loha", true, true),
        ("lokr", false, false),
        ("loha", true, false),
    ] {
        let mut c = config(kind);
        c.tucker = tucker;
        c.wd_on_out = on_out;
        let a = Adapters::new(c).unwrap();
        let m = layers(&a, DType::F32);
        for name in LAYERS {
            let x = input(name, DType::F32, 21);
            let (y, y0) = (m.forward(name, &x), plain_layers.forward(name, &x));
            let e = rel(&y, &y0);
            assert!(
                e < 1e-6,
                "{kind} (Tucker {tucker}) {name}: changed by {e:e}"
            );
            let l = by_path(&a, name);
            let mag = l.params().last().unwrap().1.clone();
            let w = &base[&format!("{name}.weight")];
            // Of each output row, or of each input channel's column (W transposed).
            let w_by = if on_out {
                w.clone()
            } else {
                w.transpose(0, 1).unwrap().contiguous().unwrap()
            };
            let rows = w_by.dims()[0];
            let norms = w_by
                .reshape((rows, w.elem_count() / rows))
                .unwrap()
                .sqr()
                .unwrap()
                .sum(&[1])
                .unwrap()
                .sqrt()
                .unwrap();
            let e = rel(&mag, &norms);
            assert!(e < 1e-6, "{kind} {name}: the magnitude is not ‖W‖ ({e:e})");
            let (d, w) = (delta(&a, &base, name), w.to_dtype(DType::F32).unwrap());
            let e = rel(&w.add(&d).unwrap(), &w);
            assert!(e < 1e-6, "{kind} {name}: a fresh change of {e:e} of W");
        }
    }
}

/// Module dropout skips a decomposed adapter whole (LyCORIS's: the layer's own forward), the
/// magnitude's rescaling included, for some micro-batches while training; the others compute
/// the adapter as without it.
#[test]
fn module_dropout_skips_the_whole_decomposed_adapter() {
    for kind in ["lokr", "loha"] {
        let mut c = config(kind);
        c.module_dropout = 0.5;
        let a = Adapters::new(c).unwrap();
        let m = layers(&a, DType::F32);
        let x = input("lin", DType::F32, 5);
        a.set_train(false);
        let base = {
            let vb = VarBuilder::from_files(&[lyco().join("base.safetensors")], DType::F32, &CPU)
                .unwrap();
            Layers::of(&vb).forward("lin", &x)
        };
        m.forward("lin", &x);
        perturb(&a, 40);
        let whole = m.forward("lin", &x);
        assert!(rel(&whole, &base) > 1e-3, "{kind}: no change");
        let (mut skipped, mut kept) = (0, 0);
        for step in 0..16 {
            a.set_step(step).unwrap();
            a.set_train(true);
            let y = m.forward("lin", &x);
            a.set_train(false);
            let (to_base, to_whole) = (rel(&y, &base), rel(&y, &whole));
            assert!(
                to_base < 1e-7 || to_whole < 1e-6,
                "{kind} step {step}: neither skipped nor whole ({to_base:e}, {to_whole:e})"
            );
            if to_base < 1e-7 {
                skipped += 1;
            } else {
                kept += 1;
            }
        }
        assert!(
            skipped > 0 && kept > 0,
            "{kind}: {skipped} skipped, {kept} kept"
        );
    }
}

/// Rank dropout on a decomposed adapter (LyCORIS's order: the kind's change has its rows
/// dropped, then the whole is decomposed): while training, each output row is either the
/// trained layer's or the frozen row rescaled by its magnitude alone, m W / ‖W‖; about half
/// of each at p = 0.5, the same rows again for the same step, none outside training.
#[test]
fn rank_dropout_drops_rows_of_the_change_before_the_decomposition() {
    let base = load(&lyco().join("base.safetensors"));
    for kind in ["lokr", "loha"] {
        let mut c = config(kind);
        c.rank_dropout = 0.5;
        let a = Adapters::new(c).unwrap();
        let m = layers(&a, DType::F32);
        let x = input("lin", DType::F32, 8);
        a.set_train(false);
        m.forward("lin", &x);
        perturb(&a, 90);
        let whole = m.forward("lin", &x).to_vec_f64().unwrap();
        // Every row's change dropped: x (m W / ‖W‖)^T + b.
        let w = &base["lin.weight"];
        let mag = by_path(&a, "lin").params().last().unwrap().1.clone();
        let norms = w.sqr().unwrap().sum_keepdim(&[1]).unwrap().sqrt().unwrap();
        let scale = mag
            .to_dtype(DType::F64)
            .unwrap()
            .reshape((20, 1))
            .unwrap()
            .div(&norms)
            .unwrap();
        let dropped = plain(
            "lin",
            &x.to_dtype(DType::F64).unwrap(),
            &w.mul(&scale).unwrap(),
            &base["lin.bias"],
        )
        .to_vec_f64()
        .unwrap();
        let col = |v: &[f64], j: usize| (0..3).map(|i| v[i * 20 + j]).collect::<Vec<_>>();
        let near = |a: &[f64], b: &[f64]| {
            let s = b.iter().fold(1e-6f64, |s, v| s.max(v.abs()));
            a.iter().zip(b).all(|(p, q)| (p - q).abs() < 1e-5 * s)
        };
        let (mut kept, mut rows) = (0, 0);
        for step in 0..6 {
            a.set_step(step).unwrap();
            a.set_train(true);
            let t = m.forward("lin", &x).to_vec_f64().unwrap();
            a.set_step(step).unwrap();
            let again = m.forward("lin", &x).to_vec_f64().unwrap();
            a.set_train(false);
            assert_eq!(t, again, "{kind} step {step}: another mask");
            for j in 0..20 {
                let got = col(&t, j);
                let is_whole = near(&got, &col(&whole, j));
                let is_dropped = near(&got, &col(&dropped, j));
                assert!(
                    is_whole ^ is_dropped,
                    "{kind} step {step} row {j}: {got:?}, whole {:?}, dropped {:?}",
                    col(&whole, j),
                    col(&dropped, j)
                );
                kept += is_whole as usize;
                rows += 1;
            }
        }
        assert!(
            (30..=90).contains(&kept),
            "{kind}: {kept} of {rows} rows kept at p = 0.5"
        );
        assert_eq!(
            m.forward("lin", &x).to_vec_f64().unwrap(),
            whole,
            "{kind}: eval"
        );
    }
}

/// A few gradient steps on a decomposed LoKr and LoHa (every factor and the magnitude
/// moving), then: `delta_weight` (what the `sample` binary merges) is the change the forward
/// makes, the base layer on W + delta computing the trained layer; the kohya file records
/// `dora_wd` and holds `dora_scale` (out, 1) or (out, 1, 1, 1) (with `wd_on_out = false`:
/// `wd_on_output` False, (1, in) or (1, cin, 1, 1)), reads back bit for bit, and
/// merged as the weights load (`LoraMerge`) gives the trained layers; so does the "comfyui"
/// file, whose magnitudes are written for ComfyUI's norm of the frozen weight and read back
/// through it (refused for magnitudes per input channel). A plain adapter refuses the file's magnitudes, and a decomposed one a file
/// without them, naming the tensor.
#[test]
fn trained_decomposed_adapters_round_trip_and_merge_to_their_forward_s_change() {
    let base = load(&lyco().join("base.safetensors"));
    let d = temp("trained");
    for (kind, tucker, on_out) in [
        ("lokr", false, true),
        ("loha", false, true),
        ("lokr", true, true),
        ("lokr", false, false),
        ("loha", true, false),
    ] {
        let mut c = config(kind);
        c.tucker = tucker;
        c.wd_on_out = on_out;
        let a = Adapters::new(c.clone()).unwrap();
        let m = layers(&a, DType::F32);
        let xs: Vec<(&str, Tensor)> = LAYERS
            .iter()
            .map(|n| (*n, input(n, DType::F32, 60)))
            .collect();
        for (n, x) in &xs {
            m.forward(n, x);
        }
        perturb(&a, 50);
        // Plain gradient steps on a fixed target: every tensor moves by its gradient.
        let start: Vec<Vec<f64>> = a
            .params()
            .unwrap()
            .iter()
            .map(|(_, t)| t.to_vec_f64().unwrap())
            .collect();
        for step in 0..3 {
            let mut loss: Option<Tensor> = None;
            for (i, (n, x)) in xs.iter().enumerate() {
                let y = m.forward(n, x);
                let g = Tensor::randn(y.dims().to_vec(), DType::F32, &CPU, 70 + i as u64).unwrap();
                let term = y.mul(&g).unwrap().sum_all().unwrap();
                loss = Some(match loss {
                    Some(l) => l.add(&term).unwrap(),
                    None => term,
                });
            }
            let grads = loss.unwrap().backward().unwrap();
            let _g = flame::no_grad();
            for (name, t) in a.params().unwrap() {
                let g = grads
                    .get(&t)
                    .unwrap_or_else(|| panic!("{kind} step {step}: no gradient of {name}"));
                t.assign(&t.sub(&g.affine(1e-3, 0.0).unwrap()).unwrap())
                    .unwrap();
            }
        }
        for ((name, t), s) in a.params().unwrap().iter().zip(&start) {
            assert!(&t.to_vec_f64().unwrap() != s, "{kind}: {name} did not move");
        }
        let trained: Vec<Tensor> = xs.iter().map(|(n, x)| m.forward(n, x)).collect();
        // delta_weight: the change the forward makes.
        for ((n, x), y) in xs.iter().zip(&trained) {
            let w = base[&format!("{n}.weight")].to_dtype(DType::F32).unwrap();
            let b = base[&format!("{n}.bias")].to_dtype(DType::F32).unwrap();
            let merged = w.add(&delta(&a, &base, n)).unwrap();
            let e = rel(&plain(n, x, &merged, &b), y);
            assert!(
                e < 2e-6,
                "{kind} {n}: delta_weight off the forward by {e:e}"
            );
        }

        // The kohya file: the kind's tensors and dora_scale, the network args, exact reload.
        let file = d.join(format!("{kind}-{tucker}-{on_out}.safetensors"));
        a.save_kohya(&file, DType::F32).unwrap();
        let t = load(&file);
        let shapes = if on_out {
            [
                ("lin", vec![20, 1]),
                ("conv", vec![32, 1, 1, 1]),
                ("pw", vec![32, 1, 1, 1]),
            ]
        } else {
            [
                ("lin", vec![1, 12]),
                ("conv", vec![1, 16, 1, 1]),
                ("pw", vec![1, 16, 1, 1]),
            ]
        };
        for (n, dims) in shapes {
            let key = format!("{}.dora_scale", flame::nn::kohya_name(n));
            assert_eq!(t[&key].dims(), dims.as_slice(), "{kind} {key}");
        }
        let meta = flame::safetensors::SafeTensorsFile::open(&file)
            .unwrap()
            .metadata()
            .clone();
        let args = &meta["ss_network_args"];
        assert!(
            args.contains("\"dora_wd\": \"True\"")
                && args.contains(&format!("\"algo\": \"{kind}\""))
                && args.contains("wd_on_output") != on_out,
            "{kind}: {args}"
        );
        if !on_out {
            assert!(
                args.contains("\"wd_on_output\": \"False\""),
                "{kind}: {args}"
            );
        }
        let fresh = Adapters::new(c.clone()).unwrap();
        let fm = layers(&fresh, DType::F32);
        fresh.load_kohya(&file).unwrap();
        for ((n0, t0), (n1, t1)) in a.params().unwrap().iter().zip(fresh.params().unwrap()) {
            assert_eq!(n0, &n1);
            assert_eq!(
                t0.to_vec_f64().unwrap(),
                t1.to_vec_f64().unwrap(),
                "{kind} {n0}: kohya round trip"
            );
        }
        for ((n, x), y) in xs.iter().zip(&trained) {
            assert_eq!(
                fm.forward(n, x).to_vec_f64().unwrap(),
                y.to_vec_f64().unwrap(),
                "{kind} {n}: reloaded output"
            );
        }

        // Merged as the weights load: the trained layers, every tensor taken.
        let merged_layers = |file: &Path| {
            let merge = Arc::new(LoraMerge::open(file, 1.0, "unet").unwrap());
            let vb = VarBuilder::from_files(&[lyco().join("base.safetensors")], DType::F32, &CPU)
                .unwrap()
                .with_merge(merge.clone())
                .unwrap();
            let l = Layers::of(&vb);
            (l, merge)
        };
        let (ml, merge) = merged_layers(&file);
        for ((n, x), y) in xs.iter().zip(&trained) {
            let e = rel(&ml.forward(n, x), y);
            assert!(e < 2e-6, "{kind} {n}: the merged kohya file off by {e:e}");
        }
        merge.check_all_used().unwrap();

        // The "comfyui" file: merged, and read back through the same weights.
        let weight_of = |p: &str| Ok::<Tensor, Error>(base[&format!("{p}.weight")].clone());
        let cfile = d.join(format!("{kind}-{tucker}-{on_out}-comfyui.safetensors"));
        if !on_out {
            // Its rescaling for ComfyUI is of magnitudes per output row.
            let e = a
                .save_comfyui(&cfile, DType::F32, &weight_of)
                .unwrap_err()
                .to_string();
            assert!(e.contains("wd_on_out") && e.contains("kohya"), "{e}");
        } else {
            a.save_comfyui(&cfile, DType::F32, &weight_of).unwrap();
            let (ml, merge) = merged_layers(&cfile);
            for ((n, x), y) in xs.iter().zip(&trained) {
                let e = rel(&ml.forward(n, x), y);
                assert!(e < 1e-5, "{kind} {n}: the merged comfyui file off by {e:e}");
            }
            merge.check_all_used().unwrap();
            let back = Adapters::new(c.clone()).unwrap();
            let _bm = layers(&back, DType::F32);
            back.load_comfyui(&cfile, &weight_of).unwrap();
            for ((n0, t0), (_, t1)) in a.params().unwrap().iter().zip(back.params().unwrap()) {
                let e = rel(&t1, t0);
                assert!(e < 1e-6, "{kind} {n0}: comfyui round trip off by {e:e}");
            }
        }

        // Without the decomposition the magnitudes are left over; with it, a plain file
        // lacks them.
        let plain_cfg = AdapterConfig {
            weight_decompose: false,
            wd_on_out: true,
            per_projection: false,
            ..c.clone()
        };
        let p = Adapters::new(plain_cfg.clone()).unwrap();
        let _pm = layers(&p, DType::F32);
        let e = p.load_kohya(&file).unwrap_err().to_string();
        assert!(e.contains("dora_scale") && e.contains("no planned"), "{e}");
        let plain_file = d.join(format!("{kind}-{tucker}-{on_out}-plain.safetensors"));
        perturb(&p, 80);
        p.save_kohya(&plain_file, DType::F32).unwrap();
        let e = fresh.load_kohya(&plain_file).unwrap_err().to_string();
        assert!(e.contains("dora_scale") && e.contains("missing"), "{e}");
    }
    std::fs::remove_dir_all(&d).ok();
}

fn identity() -> KeyMap {
    Arc::new(|k: &str| Some(KeySource::Key(k.to_string())))
}

/// The PEFT layout has no weight decomposition of LoKr or LoHa: checked before training
/// (`Adapters::check_peft`), written or read, it is refused with the layout's setting, naming
/// the layer and the fix. LoRA, DoRA and full refuse the setting itself (a LoRA with
/// magnitudes is the kind "dora").
#[test]
fn the_peft_layout_and_other_kinds_refuse_the_decomposition() {
    let d = temp("peft");
    for kind in ["lokr", "loha"] {
        let a = Adapters::new(config(kind)).unwrap();
        let _m = layers(&a, DType::F32);
        let layout = |r: flame::Result<()>| match r {
            Err(Error::Setting {
                setting: Setting::AdapterLayout,
                msg,
            }) => msg,
            other => panic!("{kind}: {other:?}"),
        };
        let msg = layout(a.check_peft(&identity()));
        assert!(
            msg.contains("layer conv") || msg.contains("layer lin") || msg.contains("layer pw"),
            "{msg}"
        );
        assert!(
            msg.contains("weight_decompose") && msg.contains("kohya"),
            "{msg}"
        );
        let file = d.join(format!("{kind}.safetensors"));
        layout(a.save_peft(&file, &identity(), "unet", DType::F32));
        assert!(!file.exists(), "{kind}: a PEFT file was written");
    }
    for kind in ["lora", "dora", "full"] {
        let e = Adapters::new(AdapterConfig {
            kind: kind.into(),
            ..config("lokr")
        })
        .map(|_| ())
        .unwrap_err();
        match &e {
            Error::Setting {
                setting: Setting::AdapterWeightDecompose,
                msg,
            } => assert!(
                msg.contains("lokr and loha") && msg.contains("\"dora\""),
                "{kind}: {msg}"
            ),
            other => panic!("{kind}: {other:?}"),
        }
        assert!(e.to_string().contains("AdapterConfig::weight_decompose"));
    }
    std::fs::remove_dir_all(&d).ok();
}
