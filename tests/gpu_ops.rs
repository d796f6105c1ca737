//! Every primitive on CUDA against the CPU reference, forward and backward, on random inputs
//! (never zeros) with odd sizes, views and broadcasting. Inputs are made once on the CPU and
//! copied, so both backends see identical values. Needs a GPU: ignored elsewhere; run with
//! --include-ignored on the GPU machine.
#![cfg(all(feature = "cuda", feature = "cpu-ref"))]

use flame::{CmpOp, DType, Device, Error, Result, Tensor};

#[path = "gpu_ops/attention.rs"]
mod attention;
#[path = "common/tolerance.rs"]
mod tolerance;

const CPU: Device = Device::Cpu;
const FLOATS: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];
const SIZES: [usize; 3] = [1, 7, 1_000_003];

/// Tests share one device and its memory counters: they run one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());
    GPU.lock().unwrap_or_else(|e| e.into_inner())
}

fn gpu() -> Device {
    Device::cuda(0).expect("a CUDA GPU")
}

/// CUDA against the CPU (atol, rtol), from the one tolerance table
/// (`tolerance::Against::Cpu`).
fn tol(dt: DType) -> (f64, f64) {
    tolerance::tolerance(tolerance::Against::Cpu, dt)
}

/// |gpu - cpu| <= atol + rtol * max(|cpu|, mag) elementwise; NaN must match NaN.
fn close_mag(what: &str, g: &Tensor, c: &Tensor, dt: DType, mag: f64) {
    assert_eq!(g.dims(), c.dims(), "{what}: shapes");
    assert_eq!(g.dtype(), c.dtype(), "{what}: dtypes");
    assert!(
        g.device().is_cuda() && !c.device().is_cuda(),
        "{what}: devices"
    );
    let (gv, cv) = (g.to_vec_f64().unwrap(), c.to_vec_f64().unwrap());
    let (atol, rtol) = tol(dt);
    for (i, (a, b)) in gv.iter().zip(&cv).enumerate() {
        let ok =
            (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= atol + rtol * b.abs().max(mag);
        assert!(ok, "{what} [{dt}] element {i}: cuda {a} vs cpu {b}");
    }
}

fn close(what: &str, g: &Tensor, c: &Tensor, dt: DType) {
    close_mag(what, g, c, dt, 0.0)
}

/// Random values of `dt` on the CPU and the same values on the GPU.
fn pair(shape: &[usize], dt: DType, seed: u64, lo: f64, hi: f64) -> (Tensor, Tensor) {
    let c = Tensor::rand_uniform(lo, hi, shape.to_vec(), DType::F64, &CPU, seed)
        .unwrap()
        .to_dtype(dt)
        .unwrap();
    let g = c.to_device(&gpu()).unwrap();
    (c, g)
}

/// The values of `t` as f64 bit patterns, for comparisons bit for bit.
fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn normal_pair(shape: &[usize], dt: DType, seed: u64) -> (Tensor, Tensor) {
    let c = Tensor::randn(shape.to_vec(), DType::F64, &CPU, seed)
        .unwrap()
        .to_dtype(dt)
        .unwrap();
    let g = c.to_device(&gpu()).unwrap();
    (c, g)
}

type Unary = (&'static str, fn(&Tensor) -> Result<Tensor>, f64, f64);

/// Each unary op with an input range inside its domain.
const UNARY: [Unary; 16] = [
    ("neg", |x| x.neg(), -3.0, 3.0),
    ("recip", |x| x.recip(), 0.25, 4.0),
    ("exp", |x| x.exp(), -4.0, 4.0),
    ("log", |x| x.log(), 0.01, 10.0),
    ("sqrt", |x| x.sqrt(), 0.01, 10.0),
    ("sin", |x| x.sin(), -6.0, 6.0),
    ("cos", |x| x.cos(), -6.0, 6.0),
    ("tanh", |x| x.tanh(), -5.0, 5.0),
    ("erf", |x| x.erf(), -3.0, 3.0),
    ("abs", |x| x.abs(), -3.0, 3.0),
    ("sign", |x| x.sign(), -3.0, 3.0),
    ("affine", |x| x.affine(-1.5, 0.25), -3.0, 3.0),
    ("powf", |x| x.powf(2.5), 0.1, 3.0),
    ("gelu", |x| x.gelu(), -6.0, 6.0),
    ("gelu_tanh", |x| x.gelu_tanh(), -6.0, 6.0),
    ("silu", |x| x.silu(), -8.0, 8.0),
];

/// The views an op is checked on: the tensor itself, transposed, narrowed, and broadcast.
fn views(x: &Tensor) -> Vec<(&'static str, Tensor)> {
    let mut v = vec![("contiguous", x.clone())];
    if x.rank() == 2 {
        v.push(("transposed", x.t().unwrap()));
        v.push(("narrowed", x.narrow(1, 1, x.dims()[1] - 2).unwrap()));
        v.push((
            "broadcast",
            x.narrow(0, 0, 1)
                .unwrap()
                .broadcast_as((5, x.dims()[1]))
                .unwrap(),
        ));
    }
    v
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn unary_every_op_dtype_and_view() {
    let _one = serial();
    for dt in FLOATS {
        for (i, (name, f, lo, hi)) in UNARY.iter().enumerate() {
            let mut shapes: Vec<Vec<usize>> = SIZES.iter().map(|&n| vec![n]).collect();
            shapes.push(vec![33, 65]);
            for (k, shape) in shapes.iter().enumerate() {
                let (c, g) = pair(shape, dt, (i * 10 + k) as u64, *lo, *hi);
                for ((vn, cv), (_, gv)) in views(&c).into_iter().zip(views(&g)) {
                    close(
                        &format!("{name} {shape:?} {vn}"),
                        &f(&gv).unwrap(),
                        &f(&cv).unwrap(),
                        dt,
                    );
                }
            }
        }
    }
}

type Binary = (&'static str, fn(&Tensor, &Tensor) -> Result<Tensor>);
const BINARY: [Binary; 6] = [
    ("add", |a, b| a.add(b)),
    ("sub", |a, b| a.sub(b)),
    ("mul", |a, b| a.mul(b)),
    ("div", |a, b| a.div(b)),
    ("maximum", |a, b| a.maximum(b)),
    ("minimum", |a, b| a.minimum(b)),
];

#[test]
#[ignore = "needs a CUDA GPU"]
fn binary_every_op_with_broadcasting_and_views() {
    let _one = serial();
    for dt in FLOATS {
        for (i, (name, f)) in BINARY.iter().enumerate() {
            let s = i as u64 * 100;
            let cases: Vec<(Vec<usize>, Vec<usize>)> = vec![
                (vec![1], vec![1]),
                (vec![7], vec![7]),
                (vec![1_000_003], vec![1_000_003]),
                (vec![3, 1, 5], vec![4, 1]),
                (vec![6, 7], vec![1]),
                (vec![2, 1_000], vec![3, 1, 1_000]),
            ];
            for (k, (sa, sb)) in cases.iter().enumerate() {
                let (ca, ga) = pair(sa, dt, s + 2 * k as u64, 0.5, 2.0);
                let (cb, gb) = pair(sb, dt, s + 2 * k as u64 + 1, -2.0, -0.5);
                close(
                    &format!("{name} {sa:?} {sb:?}"),
                    &f(&ga, &gb).unwrap(),
                    &f(&ca, &cb).unwrap(),
                    dt,
                );
            }
            // A transposed operand against a contiguous one.
            let (ca, ga) = pair(&[9, 11], dt, s + 50, 0.5, 2.0);
            let (cb, gb) = pair(&[11, 9], dt, s + 51, 0.5, 2.0);
            let (gt, ct) = (gb.t().unwrap(), cb.t().unwrap());
            close(
                &format!("{name} transposed"),
                &f(&ga, &gt).unwrap(),
                &f(&ca, &ct).unwrap(),
                dt,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn comparisons_and_where() {
    let _one = serial();
    // Whole numbers in [0, 5), so ties occur; the rhs is a transposed view.
    let whole = |seed: u64| -> Vec<f64> {
        let v = Tensor::rand_uniform(0.0, 5.0, 37 * 29, DType::F64, &CPU, seed).unwrap();
        v.to_vec_f64().unwrap().iter().map(|x| x.floor()).collect()
    };
    for dt in [DType::F32, DType::BF16, DType::F16, DType::F64, DType::U32] {
        let ca = Tensor::from_vec(whole(7), (37, 29), &CPU)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let cb = Tensor::from_vec(whole(8), (29, 37), &CPU)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
            .t()
            .unwrap();
        let (ga, gb) = (
            ca.to_device(&gpu()).unwrap(),
            cb.to_device(&gpu()).unwrap().t().unwrap().t().unwrap(),
        );
        for op in [
            CmpOp::Eq,
            CmpOp::Ne,
            CmpOp::Lt,
            CmpOp::Le,
            CmpOp::Gt,
            CmpOp::Ge,
        ] {
            let (gm, cm) = (ga.cmp(&gb, op).unwrap(), ca.cmp(&cb, op).unwrap());
            assert_eq!(
                gm.to_vec_f64().unwrap(),
                cm.to_vec_f64().unwrap(),
                "{op:?} {dt}"
            );
            if dt.is_float() {
                let gw = gm.where_cond(&ga, &gb.narrow(0, 0, 1).unwrap()).unwrap();
                let cw = cm.where_cond(&ca, &cb.narrow(0, 0, 1).unwrap()).unwrap();
                assert_eq!(
                    gw.to_vec_f64().unwrap(),
                    cw.to_vec_f64().unwrap(),
                    "where {op:?} {dt}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn reductions_over_every_dim_set() {
    let _one = serial();
    let shapes: Vec<Vec<usize>> = vec![
        vec![1],
        vec![7],
        vec![1_000_003],
        vec![3, 5, 7],
        vec![64, 300],
        vec![2, 100_000],
        vec![300, 3, 70],
    ];
    for dt in FLOATS {
        for (s, shape) in shapes.iter().enumerate() {
            let (c, g) = normal_pair(shape, dt, 1000 + s as u64);
            let rank = shape.len();
            let mut dim_sets: Vec<Vec<usize>> = (0..rank).map(|d| vec![d]).collect();
            if rank > 1 {
                dim_sets.push((0..rank).collect());
                dim_sets.push(vec![0, rank - 1]);
            }
            for (vn, (cv, gv)) in [
                ("plain", (c.clone(), g.clone())),
                (
                    "permuted",
                    (c.t().unwrap_or(c.clone()), g.t().unwrap_or(g.clone())),
                ),
            ] {
                for dims in &dim_sets {
                    let what = format!("{shape:?} {vn} dims {dims:?}");
                    // Sums are exact in double on both sides, then rounded once.
                    let mag = cv
                        .abs()
                        .unwrap()
                        .sum_keepdim(dims)
                        .unwrap()
                        .to_dtype(DType::F64)
                        .unwrap()
                        .max_all()
                        .unwrap()
                        .to_scalar_f64()
                        .unwrap();
                    close_mag(
                        &format!("sum {what}"),
                        &gv.sum_keepdim(dims).unwrap(),
                        &cv.sum_keepdim(dims).unwrap(),
                        dt,
                        mag * 1e-9,
                    );
                    if dims.len() == 1 {
                        let d = dims[0];
                        close(
                            &format!("max {what}"),
                            &gv.max_keepdim(d).unwrap(),
                            &cv.max_keepdim(d).unwrap(),
                            dt,
                        );
                        close(
                            &format!("min {what}"),
                            &gv.min_keepdim(d).unwrap(),
                            &cv.min_keepdim(d).unwrap(),
                            dt,
                        );
                        assert_eq!(
                            gv.argmax(d).unwrap().to_vec::<u32>().unwrap(),
                            cv.argmax(d).unwrap().to_vec::<u32>().unwrap(),
                            "argmax {what} {dt}"
                        );
                        assert_eq!(
                            gv.argmin(d).unwrap().to_vec::<u32>().unwrap(),
                            cv.argmin(d).unwrap().to_vec::<u32>().unwrap(),
                            "argmin {what} {dt}"
                        );
                    }
                }
            }
        }
    }
    // NaN propagates and the first NaN wins argmax, as on the CPU.
    let v = vec![1.0f32, f32::NAN, 3.0, f32::NAN, 0.5, 9.0, 2.0];
    let c = Tensor::from_vec(v, (1, 7), &CPU).unwrap();
    let g = c.to_device(&gpu()).unwrap();
    assert!(g.max(1).unwrap().to_vec::<f32>().unwrap()[0].is_nan());
    assert_eq!(
        g.argmax(1).unwrap().to_vec::<u32>().unwrap(),
        c.argmax(1).unwrap().to_vec::<u32>().unwrap()
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn casts_between_all_dtypes() {
    let _one = serial();
    let all = [DType::F32, DType::F64, DType::BF16, DType::F16, DType::U32];
    // Values past every dtype's range, negatives (u32 saturates to 0), and ordinary ones.
    let mut v: Vec<f64> = vec![-1e6, -3.7, -0.0, 0.3, 1.5, 70_000.0, 5e9, 1e40];
    v.extend(
        Tensor::randn(1_000, DType::F64, &CPU, 5)
            .unwrap()
            .affine(100.0, 0.0)
            .unwrap()
            .to_vec_f64()
            .unwrap(),
    );
    let base = Tensor::from_vec(v.clone(), v.len(), &CPU).unwrap();
    for from in all {
        let c = base.to_dtype(from).unwrap();
        let g = c.to_device(&gpu()).unwrap();
        for to in all {
            for (vn, cv, gv) in [
                ("plain", c.clone(), g.clone()),
                (
                    "strided",
                    c.narrow(0, 1, 999).unwrap(),
                    g.narrow(0, 1, 999).unwrap(),
                ),
            ] {
                let (cc, gc) = (cv.to_dtype(to).unwrap(), gv.to_dtype(to).unwrap());
                // Both round once from double: bit-identical.
                assert_eq!(
                    gc.to_vec_f64()
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>(),
                    cc.to_vec_f64()
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>(),
                    "{from} -> {to} {vn}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn copies_views_and_joins() {
    let _one = serial();
    for dt in FLOATS {
        let (c, g) = normal_pair(&[3, 4, 5, 7], dt, 77);
        let p = [2, 0, 3, 1];
        close(
            "permute+contiguous",
            &g.permute(&p).unwrap().contiguous().unwrap(),
            &c.permute(&p).unwrap().contiguous().unwrap(),
            dt,
        );
        let (gn, cn) = (g.narrow(2, 1, 3).unwrap(), c.narrow(2, 1, 3).unwrap());
        for d in 0..4 {
            // A concatenation's output is written by its parts alone: a freed buffer of NaN
            // of its size, which the pool hands out again, leaves no trace.
            let mut dims = vec![3, 4, 5, 7];
            dims[d] *= 2;
            drop(Tensor::full(f64::NAN, dims, dt, &g.device().clone()).unwrap());
            close(
                &format!("cat dim {d}"),
                &Tensor::cat(&[&g, &g.permute(&[0, 1, 2, 3]).unwrap()], d).unwrap(),
                &Tensor::cat(&[&c, &c], d).unwrap(),
                dt,
            );
        }
        close(
            "cat of views",
            &Tensor::cat(&[&gn, &g], 2).unwrap(),
            &Tensor::cat(&[&cn, &c], 2).unwrap(),
            dt,
        );
        close(
            "stack",
            &Tensor::stack(&[&gn, &gn], 1).unwrap(),
            &Tensor::stack(&[&cn, &cn], 1).unwrap(),
            dt,
        );
        // assign writes through a strided view of a GPU tensor.
        let (gz, cz) = (
            Tensor::zeros((7, 5), dt, &gpu()).unwrap(),
            Tensor::zeros((7, 5), dt, &CPU).unwrap(),
        );
        let (cs, gs) = normal_pair(&[5, 3], dt, 78);
        gz.t()
            .unwrap()
            .narrow(1, 2, 3)
            .unwrap()
            .assign(&gs)
            .unwrap();
        cz.t()
            .unwrap()
            .narrow(1, 2, 3)
            .unwrap()
            .assign(&cs)
            .unwrap();
        close("assign into a view", &gz, &cz, dt);
    }
}

/// The kernels' path for views whose rows are whole packs of 8 (cuda/common.cuh `packs8`):
/// narrowed rows at offsets that keep the packs 16-byte aligned for every dtype, for f32 only,
/// or for none; a row broadcast over a matrix; heads permuted with the head dim innermost.
/// Unary, binary, cast and copy (contiguous(), concatenation into slices, assign) against
/// the CPU; copies and casts bit for bit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn views_of_whole_packs_match_the_cpu() {
    let _one = serial();
    for dt in FLOATS {
        let (c, g) = normal_pair(&[37, 56], dt, 91);
        let (ch, gh) = normal_pair(&[2, 7, 3, 16], dt, 92);
        let views = |x: &Tensor, h: &Tensor| -> Vec<(&'static str, Tensor)> {
            vec![
                ("rows of 24 from column 8", x.narrow(1, 8, 24).unwrap()),
                ("rows of 16 from column 4", x.narrow(1, 4, 16).unwrap()),
                ("rows of 8 from column 3", x.narrow(1, 3, 8).unwrap()),
                ("permuted heads", h.permute(&[0, 2, 1, 3]).unwrap()),
            ]
        };
        let (crow, grow) = normal_pair(&[1, 24], dt, 93);
        for ((name, cv), (_, gv)) in views(&c, &ch).into_iter().zip(views(&g, &gh)) {
            close(
                &format!("gelu_tanh of {name}"),
                &gv.gelu_tanh().unwrap(),
                &cv.gelu_tanh().unwrap(),
                dt,
            );
            close(
                &format!("exp of {name}"),
                &gv.exp().unwrap(),
                &cv.exp().unwrap(),
                dt,
            );
            close(
                &format!("{name} times itself"),
                &gv.mul(&gv).unwrap(),
                &cv.mul(&cv).unwrap(),
                dt,
            );
            assert_eq!(
                bits(&gv.contiguous().unwrap()),
                bits(&cv.contiguous().unwrap()),
                "contiguous() of {name} [{dt}]"
            );
            let to = if dt == DType::F32 {
                DType::BF16
            } else {
                DType::F32
            };
            assert_eq!(
                bits(&gv.to_dtype(to).unwrap()),
                bits(&cv.to_dtype(to).unwrap()),
                "cast of {name} [{dt}]"
            );
        }
        // A row broadcast over a narrowed matrix (a gate times a projection's output), and
        // two narrowed operands.
        let (gn, cn) = (g.narrow(1, 16, 24).unwrap(), c.narrow(1, 16, 24).unwrap());
        close(
            "row times rows",
            &grow.mul(&gn).unwrap(),
            &crow.mul(&cn).unwrap(),
            dt,
        );
        close(
            "rows plus rows",
            &gn.add(&g.narrow(1, 32, 24).unwrap()).unwrap(),
            &cn.add(&c.narrow(1, 32, 24).unwrap()).unwrap(),
            dt,
        );
        // Concatenations write slices of whole packs, aligned and not.
        for (a, b) in [(16, 24), (8, 40), (5, 16)] {
            assert_eq!(
                bits(
                    &Tensor::cat(
                        &[&g.narrow(1, 0, a).unwrap(), &g.narrow(1, 8, b).unwrap()],
                        1
                    )
                    .unwrap()
                ),
                bits(
                    &Tensor::cat(
                        &[&c.narrow(1, 0, a).unwrap(), &c.narrow(1, 8, b).unwrap()],
                        1
                    )
                    .unwrap()
                ),
                "cat of widths {a} and {b} [{dt}]"
            );
        }
        let (gz, cz) = (
            Tensor::zeros((37, 56), dt, &gpu()).unwrap(),
            Tensor::zeros((37, 56), dt, &CPU).unwrap(),
        );
        gz.narrow(1, 24, 16)
            .unwrap()
            .assign(&g.narrow(1, 0, 16).unwrap())
            .unwrap();
        cz.narrow(1, 24, 16)
            .unwrap()
            .assign(&c.narrow(1, 0, 16).unwrap())
            .unwrap();
        assert_eq!(bits(&gz), bits(&cz), "assign into rows [{dt}]");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn index_select_gather_scatter_add() {
    let _one = serial();
    for dt in FLOATS {
        let (c, g) = normal_pair(&[11, 6, 5], dt, 90);
        let idc = Tensor::from_vec(vec![3u32, 0, 10, 3, 7], 5, &CPU).unwrap();
        let idg = idc.to_device(&gpu()).unwrap();
        for d in 0..3 {
            let ok: Vec<u32> = idc
                .to_vec::<u32>()
                .unwrap()
                .iter()
                .map(|&i| i % c.dims()[d] as u32)
                .collect();
            let (ic, ig) = (
                Tensor::from_vec(ok.clone(), 5, &CPU).unwrap(),
                Tensor::from_vec(ok, 5, &gpu()).unwrap(),
            );
            close(
                &format!("index_select dim {d}"),
                &g.index_select(&ig, d).unwrap(),
                &c.index_select(&ic, d).unwrap(),
                dt,
            );
            close(
                &format!("index_select dim {d} of a view"),
                &g.t().unwrap().index_select(&ig, d.min(1)).unwrap(),
                &c.t().unwrap().index_select(&ic, d.min(1)).unwrap(),
                dt,
            );
        }
        // gather / scatter_add along the middle dim, ids with repeats.
        let ids: Vec<u32> = (0..11 * 4 * 5).map(|i| ((i * 7 + 3) % 6) as u32).collect();
        let (gc, gg) = (
            Tensor::from_vec(ids.clone(), (11, 4, 5), &CPU).unwrap(),
            Tensor::from_vec(ids, (11, 4, 5), &gpu()).unwrap(),
        );
        close(
            "gather",
            &g.gather(&gg, 1).unwrap(),
            &c.gather(&gc, 1).unwrap(),
            dt,
        );
        let (sc, sg) = normal_pair(&[11, 4, 5], dt, 91);
        close(
            "scatter_add",
            &g.scatter_add(&gg, &sg, 1).unwrap(),
            &c.scatter_add(&gc, &sc, 1).unwrap(),
            dt,
        );
        // An index past its dim is an error on both backends.
        let bad = g.index_select(&idg, 1).unwrap_err();
        assert!(
            matches!(
                bad,
                Error::IndexOutOfRange {
                    index: 10,
                    size: 6,
                    ..
                }
            ),
            "{bad}"
        );
    }
}

fn matmul_check(what: &str, a: (&Tensor, &Tensor), b: (&Tensor, &Tensor), dt: DType) {
    let (gc, cc) = (a.1.matmul(b.1).unwrap(), a.0.matmul(b.0).unwrap());
    // The rounding error of a dot product scales with sum |a_i b_i|.
    let mag =
        a.0.to_dtype(DType::F64)
            .unwrap()
            .abs()
            .unwrap()
            .matmul(&b.0.to_dtype(DType::F64).unwrap().abs().unwrap())
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar_f64()
            .unwrap();
    // cuBLAS and gemm sum in different orders: allow a few f32 roundings of the magnitude.
    let extra = match dt {
        DType::F64 => 1e-13,
        _ => 1e-6,
    };
    close_mag(what, &gc, &cc, dt, mag * extra / tol(dt).1.max(1e-300));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_shapes_views_and_dtypes() {
    let _one = serial();
    let shapes: Vec<(Vec<usize>, Vec<usize>)> = vec![
        (vec![1, 1], vec![1, 1]),
        (vec![7, 13], vec![13, 5]),
        (vec![3, 33, 17], vec![3, 17, 9]),
        (vec![2, 3, 4, 64], vec![64, 65]),
        (vec![2, 1, 5, 8], vec![3, 8, 6]),
        (vec![128, 256], vec![256, 96]),
    ];
    for dt in FLOATS {
        for (i, (sa, sb)) in shapes.iter().enumerate() {
            let (ca, ga) = normal_pair(sa, dt, 200 + i as u64);
            let (cb, gb) = normal_pair(sb, dt, 300 + i as u64);
            matmul_check(&format!("{sa:?}@{sb:?}"), (&ca, &ga), (&cb, &gb), dt);
        }
        // Transposed operands are passed as flags; a doubly strided one is copied.
        let (ca, ga) = normal_pair(&[4, 19, 23], dt, 400);
        let (cb, gb) = normal_pair(&[4, 31, 19], dt, 401);
        let (cat, gat) = (ca.transpose(1, 2).unwrap(), ga.transpose(1, 2).unwrap());
        let (cbt, gbt) = (cb.transpose(1, 2).unwrap(), gb.transpose(1, 2).unwrap());
        matmul_check("a^T b^T", (&cat, &gat), (&cbt, &gbt), dt);
        let (cs, gs) = (ca.narrow(2, 1, 19).unwrap(), ga.narrow(2, 1, 19).unwrap());
        matmul_check(
            "narrowed a",
            (&cs, &gs),
            (
                &cb.transpose(1, 2).unwrap().narrow(1, 0, 19).unwrap(),
                &gb.transpose(1, 2).unwrap().narrow(1, 0, 19).unwrap(),
            ),
            dt,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn random_numbers_match_the_cpu_stream() {
    let _one = serial();
    for dt in FLOATS {
        for n in SIZES {
            let (c, g) = (
                Tensor::randn(n, dt, &CPU, 42).unwrap(),
                Tensor::randn(n, dt, &gpu(), 42).unwrap(),
            );
            close(&format!("randn {n}"), &g, &c, dt);
            let (c, g) = (
                Tensor::rand_uniform(-2.0, 3.0, n, dt, &CPU, 43).unwrap(),
                Tensor::rand_uniform(-2.0, 3.0, n, dt, &gpu(), 43).unwrap(),
            );
            close(&format!("rand {n}"), &g, &c, dt);
        }
    }
}

/// A small network of composites (embedding, matmul, layer_norm, gelu, softmax, cross
/// entropy, max) whose loss and every gradient must agree across backends.
fn network(dev: &Device, params: &[Tensor], ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (emb, w1, b1, g, w2) = (&params[0], &params[1], &params[2], &params[3], &params[4]);
    let x = emb.index_select(ids, 0)?.reshape((4, 3, 8))?;
    let h = x
        .matmul(w1)?
        .add(b1)?
        .layer_norm(Some(g), None, 1e-5)?
        .gelu()?;
    let logits = h.matmul(w2)?.max(1)?;
    let attn = h.matmul(&h.transpose(1, 2)?)?.softmax(-1)?.sum_all()?;
    let _ = dev;
    logits.cross_entropy(targets)?.add(&attn.mul_scalar(1e-3)?)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn backward_of_a_network_matches() {
    let _one = serial();
    let shapes: [&[usize]; 5] = [&[10, 8], &[8, 16], &[16], &[16], &[16, 5]];
    for dt in [DType::F32, DType::F64] {
        let cpu_params: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                Tensor::randn(s.to_vec(), DType::F64, &CPU, 500 + i as u64)
                    .unwrap()
                    .affine(0.5, 0.0)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap()
            })
            .collect();
        let gpu_params: Vec<Tensor> = cpu_params
            .iter()
            .map(|p| p.to_device(&gpu()).unwrap())
            .collect();
        for p in cpu_params.iter().chain(&gpu_params) {
            p.set_requires_grad(true).unwrap();
        }
        let ids: Vec<u32> = (0..12).map(|i| (i * 7 % 10) as u32).collect();
        let tg = vec![1u32, 4, 0, 2];
        let (ic, ig) = (
            Tensor::from_vec(ids.clone(), 12, &CPU).unwrap(),
            Tensor::from_vec(ids, 12, &gpu()).unwrap(),
        );
        let (tc, tgg) = (
            Tensor::from_vec(tg.clone(), 4, &CPU).unwrap(),
            Tensor::from_vec(tg, 4, &gpu()).unwrap(),
        );
        let lc = network(&CPU, &cpu_params, &ic, &tc).unwrap();
        let lg = network(&gpu(), &gpu_params, &ig, &tgg).unwrap();
        let (rel, abs) = if dt == DType::F64 {
            (1e-10, 1e-12)
        } else {
            (1e-4, 1e-6)
        };
        let (a, b) = (lg.to_scalar_f64().unwrap(), lc.to_scalar_f64().unwrap());
        assert!(
            (a - b).abs() <= abs + rel * b.abs(),
            "loss {dt}: {a} vs {b}"
        );
        let (gc, gg) = (lc.backward().unwrap(), lg.backward().unwrap());
        for (i, (pc, pg)) in cpu_params.iter().zip(&gpu_params).enumerate() {
            let (x, y) = (
                gg.get(pg).expect("gpu grad").to_vec_f64().unwrap(),
                gc.get(pc).expect("cpu grad").to_vec_f64().unwrap(),
            );
            let scale = y.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (j, (u, v)) in x.iter().zip(&y).enumerate() {
                assert!(
                    (u - v).abs() <= abs + rel * scale,
                    "param {i} grad {j} {dt}: cuda {u} vs cpu {v}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gradients_flow_across_devices() {
    let _one = serial();
    let x = Tensor::randn(37, DType::F32, &CPU, 9)
        .unwrap()
        .requires_grad_()
        .unwrap();
    let y = x
        .to_device(&gpu())
        .unwrap()
        .exp()
        .unwrap()
        .sum_all()
        .unwrap();
    let g = y.backward().unwrap();
    let gx = g.get(&x).expect("grad on the cpu leaf");
    assert!(!gx.device().is_cuda());
    let want = x.exp().unwrap().to_vec::<f32>().unwrap();
    for (a, b) in gx.to_vec::<f32>().unwrap().iter().zip(&want) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "{a} vs {b}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tensors_over_2_gib() {
    let _one = serial();
    // 600M f32 = 2.4 GB: offsets past 2^31 bytes and 2^29 elements. rand is counter-based, so
    // both backends generate the same numbers without copying 2.4 GB.
    let n = 600_000_000usize;
    let g = Tensor::rand(n, DType::F32, &gpu(), 3)
        .unwrap()
        .affine(2.0, -1.0)
        .unwrap();
    let c = Tensor::rand(n, DType::F32, &CPU, 3)
        .unwrap()
        .affine(2.0, -1.0)
        .unwrap();
    let tail = n - 1_000;
    close(
        "tail of a 2.4 GB tensor",
        &g.narrow(0, tail, 1_000).unwrap(),
        &c.narrow(0, tail, 1_000).unwrap(),
        DType::F32,
    );
    let (sg, sc) = (g.sum_all().unwrap(), c.sum_all().unwrap());
    close_mag("sum of 600M", &sg, &sc, DType::F32, 1.0);
    let mg = g.max_all().unwrap().to_scalar_f64().unwrap();
    assert_eq!(mg, c.max_all().unwrap().to_scalar_f64().unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn training_steps_reuse_pool_memory() {
    let _one = serial();
    use flame::optim::{AdamConfig, AdamW, Optimizer};
    let dev = gpu();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    let w = Tensor::randn((256, 256), DType::F32, &dev, 1)
        .unwrap()
        .requires_grad_()
        .unwrap();
    let x = Tensor::randn((64, 256), DType::F32, &dev, 2).unwrap();
    let mut opt = AdamW::new(vec![("w".into(), w.clone())], AdamConfig::default()).unwrap();
    let mut reserved = vec![];
    for _ in 0..6 {
        let loss = x
            .matmul(&w)
            .unwrap()
            .gelu()
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        opt.step(&grads).unwrap();
        cuda.synchronize().unwrap();
        reserved.push((cuda.pool_reserved_bytes().unwrap(), cuda.memory().in_use));
    }
    // After the first steps warm the pool, the driver is asked for nothing more.
    assert_eq!(
        reserved[2], reserved[5],
        "pool (reserved, in use) per step: {reserved:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn freed_buffers_are_cached_and_handed_out_again() {
    let _one = serial();
    let dev = gpu();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    // 1000 x 1000 f32: 4,000,000 bytes, counted as 4,000,256 (a multiple of 512).
    let rounded = 4_000_256u64;
    let a = Tensor::ones((1000, 1000), DType::F32, &dev).unwrap();
    cuda.synchronize().unwrap();
    let held = cuda.memory();
    drop(a);
    let freed = cuda.memory();
    assert_eq!(held.in_use - freed.in_use, rounded, "in use falls on drop");
    assert_eq!(freed.cached - held.cached, rounded, "the buffer is cached");
    let reserved = cuda.pool_reserved_bytes().unwrap();

    // The same size comes from the cache: no new driver memory, the cache shrinks back.
    let b = Tensor::full(2.5, (1000, 1000), DType::F32, &dev).unwrap();
    let again = cuda.memory();
    assert_eq!(again.cached, held.cached, "taken from the cache");
    assert_eq!(again.in_use, held.in_use);
    assert_eq!(again.allocations, freed.allocations + 1);
    assert_eq!(cuda.pool_reserved_bytes().unwrap(), reserved);
    // The reused memory holds what the new tensor wrote, not the old ones.
    let v = b.to_vec::<f32>().unwrap();
    assert!(v.iter().all(|&x| x == 2.5), "reused buffer rewritten");
    drop(b);

    // A near size (within the 512-byte rounding) shares the list; emptying returns it all.
    let c = Tensor::zeros(999_990, DType::F32, &dev).unwrap();
    assert_eq!(cuda.memory().cached, held.cached, "near size reused");
    drop(c);
    cuda.empty_cache();
    assert_eq!(
        cuda.memory().cached,
        0,
        "empty_cache returns every cached buffer"
    );
    assert_eq!(
        Tensor::ones(5, DType::BF16, &dev)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        vec![1.0; 5],
        "the device works after emptying"
    );
}

/// Under a cap, buffers are cut from one arena of the cap's size (made at the first request):
/// small ones from the bottom by best fit (below the large ones first), large ones (32 MiB
/// and up) from the top, freed neighbours merged; a request no free range holds although the cap does goes to the driver,
/// counted as an overflow.
#[test]
#[ignore = "needs a CUDA GPU"]
fn under_a_cap_buffers_come_from_one_arena_small_below_large_above() {
    let _one = serial();
    let dev = gpu();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    cuda.synchronize().unwrap();
    cuda.empty_cache();
    let mib = |n: usize| Tensor::full(n as f64, n << 18, DType::F32, &dev); // n MiB
    let before = cuda.memory();
    cuda.set_memory_limit(Some(before.in_use + (160 << 20)));
    // Small 16 MiB buffers from the bottom: [0, 16) [16, 32) [32, 48); a large 64 MiB one
    // from the top: [96, 160). Free: [48, 96).
    let (a, b, c) = (mib(16).unwrap(), mib(16).unwrap(), mib(16).unwrap());
    let big = mib(64).unwrap();
    drop(b);
    // Free: [16, 32) and [48, 96). 40 MiB (large) fits only the upper range, from its top.
    let d = mib(40).unwrap();
    // Free: [16, 32) and [48, 56). A small 8 MiB buffer takes the smallest range that holds
    // it, [48, 56), leaving [16, 32) whole for 16.
    let e = mib(8).unwrap();
    let f = mib(16).unwrap();
    assert_eq!(cuda.memory().overflows, before.overflows);
    // Nothing is free now; freeing a and c leaves two 16 MiB pieces: 24 MiB fits the cap but
    // no piece, so the driver serves it, counted.
    drop(a);
    drop(c);
    let g = mib(24).unwrap();
    assert_eq!(cuda.memory().overflows, before.overflows + 1);
    assert_eq!(
        cuda.memory().in_use,
        before.in_use + ((64 + 40 + 8 + 16 + 24) << 20)
    );
    // Freed neighbours merge: with g gone and f freed, [0, 48) is whole again.
    drop(g);
    drop(f);
    let h = mib(48).unwrap();
    assert_eq!(cuda.memory().overflows, before.overflows + 1);
    for (t, v) in [(&big, 64.0), (&d, 40.0), (&e, 8.0), (&h, 48.0)] {
        assert!(t.to_vec::<f32>().unwrap().iter().all(|&x| x == v));
    }
    drop((big, d, e, h));
    // A range a large buffer frees among large ones (a streamed block's, which the next one
    // takes) stays whole: small buffers take the smallest range below every live large one
    // first. Large [120, 160) and [56, 120), small [0, 8); free [8, 56).
    let l1 = mib(40).unwrap();
    let l2 = mib(64).unwrap();
    let a = mib(8).unwrap();
    // Freed: [120, 160), smaller than [8, 56) but above the large [56, 120). 16 MiB goes
    // below, [8, 24), so two large ones fit after it: [120, 160) and [24, 56).
    drop(l1);
    let b = mib(16).unwrap();
    let l3 = mib(40).unwrap();
    let l4 = mib(32).unwrap();
    assert_eq!(cuda.memory().overflows, before.overflows + 1);
    cuda.set_memory_limit(None);
    for (t, v) in [(&l2, 64.0), (&a, 8.0), (&b, 16.0), (&l3, 40.0), (&l4, 32.0)] {
        assert!(t.to_vec::<f32>().unwrap().iter().all(|&x| x == v));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_softmax_matches_the_cpu() {
    let _one = serial();
    for dt in FLOATS {
        for (shape, dim) in [
            (vec![1], 0usize),
            (vec![7], 0),
            (vec![1_000_003], 0),
            (vec![300, 1027], 1),
            (vec![64, 4608], 1),
            (vec![5, 4, 3], 0),
            // The register-resident rows: 4, 12 and 16 packs a lane, whole and partly filled.
            (vec![29, 1024], 1),
            (vec![37, 3072], 1),
            (vec![13, 2056], 1),
            (vec![5, 4096], 1),
        ] {
            let (c, g) = normal_pair(&shape, dt, 600);
            let (c, g) = (c.affine(4.0, 0.0).unwrap(), g.affine(4.0, 0.0).unwrap());
            close(
                &format!("softmax {shape:?} dim {dim}"),
                &g.softmax(dim).unwrap(),
                &c.softmax(dim).unwrap(),
                dt,
            );
            // The composite computed in f32 and rounded once (in a half type it would round
            // at every step).
            let wide = if dt == DType::F64 {
                DType::F64
            } else {
                DType::F32
            };
            let reference = c
                .to_dtype(wide)
                .unwrap()
                .softmax_composite(dim)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            close(
                &format!("softmax vs composite {shape:?}"),
                &g.softmax(dim).unwrap(),
                &reference,
                dt,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tf32_matmul_is_opt_in() {
    let _one = serial();
    let dev = gpu();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    let (ca, ga) = normal_pair(&[256, 512], DType::F32, 700);
    let (cb, gb) = normal_pair(&[512, 256], DType::F32, 701);
    let want = ca
        .to_dtype(DType::F64)
        .unwrap()
        .matmul(&cb.to_dtype(DType::F64).unwrap())
        .unwrap();
    let err = |t: &Tensor| {
        let d = t
            .to_device(&CPU)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .sub(&want)
            .unwrap();
        d.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar_f64()
            .unwrap()
            .sqrt()
            / want
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar_f64()
                .unwrap()
                .sqrt()
    };
    let exact = err(&ga.matmul(&gb).unwrap());
    cuda.set_allow_tf32(true).unwrap();
    let tf32 = err(&ga.matmul(&gb).unwrap());
    cuda.set_allow_tf32(false).unwrap();
    let again = err(&ga.matmul(&gb).unwrap());
    // f32: ~1e-7 relative; TF32 (10-bit mantissa inputs): ~1e-4 to 1e-3.
    assert!(
        exact < 1e-6 && again < 1e-6,
        "f32 error {exact}, after switching back {again}"
    );
    assert!(tf32 > 1e-5 && tf32 < 3e-3, "tf32 error {tf32}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn unfold_fold_and_conv2d_match_the_cpu() {
    let _one = serial();
    use flame::nn::conv2d;
    use flame::Window2d;
    for dt in FLOATS {
        for (k, (xd, kernel, stride, padding, dilation)) in [
            ([2usize, 3, 9, 7], (3, 3), (1, 1), (1, 1), (1, 1)),
            ([1, 4, 16, 15], (2, 3), (2, 1), (0, 2), (1, 2)),
            ([2, 320, 32, 32], (3, 3), (1, 1), (1, 1), (1, 1)),
            // col2im's fixed 3x3 unit-stride path, dilated and unpadded.
            ([1, 5, 11, 13], (3, 3), (1, 1), (2, 2), (2, 2)),
            ([1, 2, 8, 9], (3, 3), (1, 1), (0, 0), (1, 1)),
        ]
        .into_iter()
        .enumerate()
        {
            let win = Window2d {
                kernel,
                stride,
                padding,
                dilation,
            };
            let (c, g) = normal_pair(&xd, dt, 800 + k as u64);
            let (cu, gu) = (c.unfold2d(win).unwrap(), g.unfold2d(win).unwrap());
            close(&format!("unfold2d {k}"), &gu, &cu, dt);
            let (ccols, gcols) = normal_pair(cu.dims(), dt, 900 + k as u64);
            close(
                &format!("fold2d {k}"),
                &gcols.fold2d(win, (xd[2], xd[3])).unwrap(),
                &ccols.fold2d(win, (xd[2], xd[3])).unwrap(),
                dt,
            );
            let (cw, gw) = normal_pair(&[8, xd[1], kernel.0, kernel.1], dt, 950 + k as u64);
            let want = conv2d(&c, &cw, None, stride, padding, dilation, 1).unwrap();
            let mag = (xd[1] * kernel.0 * kernel.1) as f64;
            close_mag(
                &format!("conv2d {k}"),
                &conv2d(&g, &gw, None, stride, padding, dilation, 1).unwrap(),
                &want,
                dt,
                mag * 1e-6 / tol(dt).1.max(1e-300),
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_norms_forward_and_backward_match_the_cpu() {
    let _one = serial();
    for dt in FLOATS {
        // Streaming rows (7, 1001 columns) and every register-resident shape of
        // cuda/norm.cu: 4 to 32 lanes a row with 4 rows at once (32, 64, 128, 256 columns;
        // row counts that leave a partial last step), 2 packs a lane (512), 4 (1024), 8 (1544:
        // the last lanes hold fewer) and 12 (2056, partly filled; 3072, whole). With dw and
        // db the same shapes keep column sums in shared memory (norm_bwd_sums; 64 columns
        // over many blocks, whose partial rows meet in slices), longer rows take the row
        // blocks of cuda/rows.cuh (f32 past 1024 columns; two packs a lane at 5000), and
        // past 6144 columns the row kernel and the sweep (8200, and 1001 and f64 always).
        // On Hopper every shape of whole packs up to 6144 columns with dw and db takes
        // cuda/norm_bulk.cu instead: stages of rows that wrap around its ring of buffers
        // (20000 x 256, 1200 x 3072), blocks of many row groups (24, 64), a group of two
        // packs a lane (5000), fewer rows than blocks (5, 33, 300).
        for shape in [
            vec![20000, 256],
            vec![1200, 3072],
            vec![700, 24],
            vec![8192, 64],
            vec![5, 5000],
            vec![3, 8200],
            vec![7],
            vec![3, 1001],
            vec![33, 32],
            vec![5, 63, 64],
            vec![5, 63, 128],
            vec![37, 256],
            vec![37, 512],
            vec![9, 1024],
            vec![11, 1544],
            vec![6, 2056],
            vec![300, 3072],
        ] {
            let cols = *shape.last().unwrap_or(&1);
            let (c, g) = normal_pair(&shape, dt, 1200);
            let (c, g) = (c.affine(3.0, 1.0).unwrap(), g.affine(3.0, 1.0).unwrap());
            let (cdy, gdy) = normal_pair(&shape, dt, 1201);
            let (cw, gw) = normal_pair(&[cols], dt, 1202);
            let (cb, gb) = normal_pair(&[cols], dt, 1203);
            for (rms, affine) in [(false, false), (true, false), (false, true), (true, true)] {
                // Returns y and the gradients of x (and of w, b when affine).
                let run = |x: &Tensor, dy: &Tensor, w: &Tensor, b: &Tensor| {
                    let leaf = |t: &Tensor| t.detach().requires_grad_().unwrap();
                    let (xv, wv, bv) = (leaf(x), leaf(w), leaf(b));
                    let y = match (rms, affine) {
                        (true, true) => xv.rms_norm(Some(&wv), 1e-6),
                        (true, false) => xv.rms_norm(None, 1e-6),
                        (false, true) => xv.layer_norm(Some(&wv), Some(&bv), 1e-5),
                        (false, false) => xv.layer_norm(None, None, 1e-5),
                    }
                    .unwrap();
                    let mut grads = flame::Grads::new();
                    y.backward_with_grad(dy, &mut grads, false).unwrap();
                    let mut out = vec![y, grads.get(&xv).expect("dx").clone()];
                    if affine {
                        out.push(grads.get(&wv).expect("dw").clone());
                        if !rms {
                            out.push(grads.get(&bv).expect("db").clone());
                        }
                    }
                    out
                };
                let (oc, og) = (run(&c, &cdy, &cw, &cb), run(&g, &gdy, &gw, &gb));
                let what = format!("norm rms={rms} affine={affine} {shape:?}");
                close(&format!("{what} y"), &og[0], &oc[0], dt);
                // dx sums row-long terms in f64 on both sides, then rounds once.
                close_mag(&format!("{what} dx"), &og[1], &oc[1], dt, 3.0 * 3.0);
                // dw, db sum over rows in f32: allow for the summation order.
                let rows = (c.elem_count() / cols) as f64;
                for (k, name) in ["dw", "db"]
                    .iter()
                    .enumerate()
                    .take(og.len().saturating_sub(2))
                {
                    close_mag(
                        &format!("{what} {name}"),
                        &og[2 + k],
                        &oc[2 + k],
                        dt,
                        3.0 * rows.sqrt(),
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_activation_backward_matches_the_cpu() {
    let _one = serial();
    type Act = fn(&Tensor) -> Result<Tensor>;
    let acts: [(&str, Act); 3] = [
        ("gelu", |x| x.gelu()),
        ("gelu_tanh", |x| x.gelu_tanh()),
        ("silu", |x| x.silu()),
    ];
    for dt in FLOATS {
        for n in SIZES {
            let (c, g) = pair(&[n], dt, 1300, -6.0, 6.0);
            let (cdy, gdy) = normal_pair(&[n], dt, 1301);
            for (name, f) in acts {
                let grad = |x: &Tensor, dy: &Tensor| {
                    let xv = x.detach().requires_grad_().unwrap();
                    let mut grads = flame::Grads::new();
                    f(&xv)
                        .unwrap()
                        .backward_with_grad(dy, &mut grads, false)
                        .unwrap();
                    grads.get(&xv).expect("grad").clone()
                };
                // f'(x) sums terms of size ~1 that cancel (gelu_tanh near x = -2.4): the
                // error scales with |dy|, not with the result.
                close_mag(
                    &format!("d{name} n={n}"),
                    &grad(&g, &gdy),
                    &grad(&c, &cdy),
                    dt,
                    5.0,
                );
            }
        }
    }
}
