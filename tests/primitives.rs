//! Every primitive on every device (`common::devices`), forward and backward: unary and binary
//! ops, comparisons, reductions, casts, copies and joins, indexing, matmul, softmax, the
//! sliding windows and convolution, the norms and the activations' backwards, random numbers,
//! and a small network's gradients. Random inputs (never zeros) with odd sizes, views and
//! broadcasting, made once on the CPU and copied, so the device and the reference see
//! identical values. The reference is the CPU backend (`oracle`): on the CPU in f64, so the
//! CPU's own rounding and dtype handling are what is checked; on a GPU at the same dtype.
#![cfg(feature = "cpu-ref")]

mod common;

use common::devices::{close_mag, normal_pair, on_every_device, oracle};
use flame::{CmpOp, DType, Device, Error, Result, Tensor};

const CPU: Device = Device::Cpu;
const FLOATS: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];
const SIZES: [usize; 3] = [1, 7, 1_000_003];

on_every_device!(
    unary_every_op_dtype_and_view,
    binary_every_op_with_broadcasting_and_views,
    comparisons_and_where,
    reductions_over_every_dim_set,
    casts_between_all_dtypes,
    copies_views_and_joins,
    views_of_whole_packs_match_the_reference,
    index_select_gather_scatter_add,
    matmul_shapes_views_and_dtypes,
    random_numbers_match_the_reference_stream,
    backward_of_a_network_matches,
    fused_softmax_matches_the_reference,
    unfold_fold_and_conv2d_match_the_reference,
    fused_norms_forward_and_backward_match_the_reference,
    fused_activation_backward_matches_the_reference,
);

fn close(what: &str, dev: &Device, got: &Tensor, want: &Tensor, dt: DType) {
    close_mag(what, dev, got, want, dt, 0.0)
}

/// The rtol `close_mag` holds a result in `dt` on `dev` to.
fn rtol(dev: &Device, dt: DType) -> f64 {
    oracle(dev, dt).1 .1
}

/// `x` (on the CPU) as the reference holds it: in the dtype `oracle` says (the same handle
/// where that is x's own).
fn reference(dev: &Device, x: &Tensor) -> Tensor {
    x.to_dtype(oracle(dev, x.dtype()).0).unwrap()
}

/// A result of the reference's (`want`, from inputs in `dt`) rounded to `dt`, as the device's
/// result of the same op is, and held as the reference holds values: a reference in f64 then
/// starts the next op from the device's values. (On a GPU it is `want`.)
fn rounded_like(dev: &Device, dt: DType, want: &Tensor) -> Tensor {
    reference(dev, &want.to_dtype(dt).unwrap())
}

/// Uniform values in [lo, hi) rounded to `dt`: (the reference's copy, the same values in `dt`
/// on `dev`), as `normal_pair`.
fn uniform_pair(
    dev: &Device,
    shape: &[usize],
    dt: DType,
    seed: u64,
    lo: f64,
    hi: f64,
) -> (Tensor, Tensor) {
    let x = Tensor::rand_uniform(lo, hi, shape.to_vec(), DType::F64, &CPU, seed)
        .unwrap()
        .to_dtype(dt)
        .unwrap();
    (reference(dev, &x), x.to_device(dev).unwrap())
}

/// The values of `t` as f64 bit patterns, for comparisons bit for bit.
fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
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

fn unary_every_op_dtype_and_view(dev: &Device) {
    for dt in FLOATS {
        for (i, (name, f, lo, hi)) in UNARY.iter().enumerate() {
            let mut shapes: Vec<Vec<usize>> = SIZES.iter().map(|&n| vec![n]).collect();
            shapes.push(vec![33, 65]);
            for (k, shape) in shapes.iter().enumerate() {
                let (c, g) = uniform_pair(dev, shape, dt, (i * 10 + k) as u64, *lo, *hi);
                for ((vn, cv), (_, gv)) in views(&c).into_iter().zip(views(&g)) {
                    close(
                        &format!("{name} {shape:?} {vn}"),
                        dev,
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

fn binary_every_op_with_broadcasting_and_views(dev: &Device) {
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
                let (ca, ga) = uniform_pair(dev, sa, dt, s + 2 * k as u64, 0.5, 2.0);
                let (cb, gb) = uniform_pair(dev, sb, dt, s + 2 * k as u64 + 1, -2.0, -0.5);
                close(
                    &format!("{name} {sa:?} {sb:?}"),
                    dev,
                    &f(&ga, &gb).unwrap(),
                    &f(&ca, &cb).unwrap(),
                    dt,
                );
            }
            // A transposed operand against a contiguous one.
            let (ca, ga) = uniform_pair(dev, &[9, 11], dt, s + 50, 0.5, 2.0);
            let (cb, gb) = uniform_pair(dev, &[11, 9], dt, s + 51, 0.5, 2.0);
            let (gt, ct) = (gb.t().unwrap(), cb.t().unwrap());
            close(
                &format!("{name} transposed"),
                dev,
                &f(&ga, &gt).unwrap(),
                &f(&ca, &ct).unwrap(),
                dt,
            );
        }
    }
}

/// Comparisons and `where_cond` exactly: on whole numbers every dtype holds, so the CPU's u32
/// and float paths must give the f64 reference's answers.
fn comparisons_and_where(dev: &Device) {
    // Whole numbers in [0, 5), so ties occur; the rhs is a transposed view.
    let whole = |seed: u64| -> Vec<f64> {
        let v = Tensor::rand_uniform(0.0, 5.0, 37 * 29, DType::F64, &CPU, seed).unwrap();
        v.to_vec_f64().unwrap().iter().map(|x| x.floor()).collect()
    };
    for dt in [DType::F32, DType::BF16, DType::F16, DType::F64, DType::U32] {
        let a = Tensor::from_vec(whole(7), (37, 29), &CPU)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let b = Tensor::from_vec(whole(8), (29, 37), &CPU)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
            .t()
            .unwrap();
        let (ca, cb) = (reference(dev, &a), reference(dev, &b));
        let (ga, gb) = (
            a.to_device(dev).unwrap(),
            b.to_device(dev).unwrap().t().unwrap().t().unwrap(),
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
                "{op:?} {dt} on {dev}"
            );
            if dt.is_float() {
                let gw = gm.where_cond(&ga, &gb.narrow(0, 0, 1).unwrap()).unwrap();
                let cw = cm.where_cond(&ca, &cb.narrow(0, 0, 1).unwrap()).unwrap();
                assert_eq!(
                    gw.to_vec_f64().unwrap(),
                    cw.to_vec_f64().unwrap(),
                    "where {op:?} {dt} on {dev}"
                );
            }
        }
    }
}

fn reductions_over_every_dim_set(dev: &Device) {
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
            let (c, g) = normal_pair(dev, shape, dt, 1000 + s as u64);
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
                        dev,
                        &gv.sum_keepdim(dims).unwrap(),
                        &cv.sum_keepdim(dims).unwrap(),
                        dt,
                        mag * 1e-9,
                    );
                    if dims.len() == 1 {
                        let d = dims[0];
                        close(
                            &format!("max {what}"),
                            dev,
                            &gv.max_keepdim(d).unwrap(),
                            &cv.max_keepdim(d).unwrap(),
                            dt,
                        );
                        close(
                            &format!("min {what}"),
                            dev,
                            &gv.min_keepdim(d).unwrap(),
                            &cv.min_keepdim(d).unwrap(),
                            dt,
                        );
                        assert_eq!(
                            gv.argmax(d).unwrap().to_vec::<u32>().unwrap(),
                            cv.argmax(d).unwrap().to_vec::<u32>().unwrap(),
                            "argmax {what} {dt} on {dev}"
                        );
                        assert_eq!(
                            gv.argmin(d).unwrap().to_vec::<u32>().unwrap(),
                            cv.argmin(d).unwrap().to_vec::<u32>().unwrap(),
                            "argmin {what} {dt} on {dev}"
                        );
                    }
                }
            }
        }
    }
    // NaN propagates and the first NaN wins argmax, as on the CPU.
    let v = vec![1.0f32, f32::NAN, 3.0, f32::NAN, 0.5, 9.0, 2.0];
    let c = Tensor::from_vec(v, (1, 7), &CPU).unwrap();
    let g = c.to_device(dev).unwrap();
    assert!(g.max(1).unwrap().to_vec::<f32>().unwrap()[0].is_nan());
    assert_eq!(
        g.argmax(1).unwrap().to_vec::<u32>().unwrap(),
        c.argmax(1).unwrap().to_vec::<u32>().unwrap()
    );
    assert_eq!(c.argmax(1).unwrap().to_vec::<u32>().unwrap(), [1]);
}

/// `x` rounded to `to` by hand, as a cast rounds it: to nearest (ties to even) for the floats,
/// toward zero and saturating at 0 and `u32::MAX` for u32.
fn round_to(x: f64, to: DType) -> f64 {
    match to {
        DType::F64 => x,
        DType::F32 => x as f32 as f64,
        DType::BF16 => flame::bf16_nearest(x).to_f64(),
        DType::F16 => flame::f16_nearest(x).to_f64(),
        DType::U32 => x as u32 as f64,
    }
}

/// Every cast bit for bit, plain and strided: on a GPU against the CPU's cast of the same
/// tensor, on the CPU against each value rounded by hand (`round_to`).
fn casts_between_all_dtypes(dev: &Device) {
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
        let g = c.to_device(dev).unwrap();
        for to in all {
            for (vn, cv, gv) in [
                ("plain", c.clone(), g.clone()),
                (
                    "strided",
                    c.narrow(0, 1, 999).unwrap(),
                    g.narrow(0, 1, 999).unwrap(),
                ),
            ] {
                // Both round once from double: bit-identical.
                let want = if dev.is_cuda() {
                    bits(&cv.to_dtype(to).unwrap())
                } else {
                    let vals = cv.to_vec_f64().unwrap();
                    vals.iter().map(|&x| round_to(x, to).to_bits()).collect()
                };
                assert_eq!(
                    bits(&gv.to_dtype(to).unwrap()),
                    want,
                    "{from} -> {to} {vn} on {dev}"
                );
            }
        }
    }
}

fn copies_views_and_joins(dev: &Device) {
    for dt in FLOATS {
        let (c, g) = normal_pair(dev, &[3, 4, 5, 7], dt, 77);
        let p = [2, 0, 3, 1];
        close(
            "permute+contiguous",
            dev,
            &g.permute(&p).unwrap().contiguous().unwrap(),
            &c.permute(&p).unwrap().contiguous().unwrap(),
            dt,
        );
        let (gn, cn) = (g.narrow(2, 1, 3).unwrap(), c.narrow(2, 1, 3).unwrap());
        for d in 0..4 {
            // A concatenation's output is written by its parts alone: a freed buffer of NaN
            // of its size, which a GPU's pool hands out again, leaves no trace.
            let mut dims = vec![3, 4, 5, 7];
            dims[d] *= 2;
            drop(Tensor::full(f64::NAN, dims, dt, &g.device().clone()).unwrap());
            close(
                &format!("cat dim {d}"),
                dev,
                &Tensor::cat(&[&g, &g.permute(&[0, 1, 2, 3]).unwrap()], d).unwrap(),
                &Tensor::cat(&[&c, &c], d).unwrap(),
                dt,
            );
        }
        close(
            "cat of views",
            dev,
            &Tensor::cat(&[&gn, &g], 2).unwrap(),
            &Tensor::cat(&[&cn, &c], 2).unwrap(),
            dt,
        );
        close(
            "stack",
            dev,
            &Tensor::stack(&[&gn, &gn], 1).unwrap(),
            &Tensor::stack(&[&cn, &cn], 1).unwrap(),
            dt,
        );
        // assign writes through a strided view of a device tensor.
        let (gz, cz) = (
            Tensor::zeros((7, 5), dt, dev).unwrap(),
            Tensor::zeros((7, 5), c.dtype(), &CPU).unwrap(),
        );
        let (cs, gs) = normal_pair(dev, &[5, 3], dt, 78);
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
        close("assign into a view", dev, &gz, &cz, dt);
    }
}

/// The kernels' path for views whose rows are whole packs of 8 (cuda/common.cuh `packs8`):
/// narrowed rows at offsets that keep the packs 16-byte aligned for every dtype, for f32 only,
/// or for none; a row broadcast over a matrix; heads permuted with the head dim innermost.
/// Unary, binary, cast and copy (contiguous(), concatenation into slices, assign) against
/// the reference; copies and casts bit for bit.
fn views_of_whole_packs_match_the_reference(dev: &Device) {
    for dt in FLOATS {
        let (c, g) = normal_pair(dev, &[37, 56], dt, 91);
        let (ch, gh) = normal_pair(dev, &[2, 7, 3, 16], dt, 92);
        let views = |x: &Tensor, h: &Tensor| -> Vec<(&'static str, Tensor)> {
            vec![
                ("rows of 24 from column 8", x.narrow(1, 8, 24).unwrap()),
                ("rows of 16 from column 4", x.narrow(1, 4, 16).unwrap()),
                ("rows of 8 from column 3", x.narrow(1, 3, 8).unwrap()),
                ("permuted heads", h.permute(&[0, 2, 1, 3]).unwrap()),
            ]
        };
        let (crow, grow) = normal_pair(dev, &[1, 24], dt, 93);
        for ((name, cv), (_, gv)) in views(&c, &ch).into_iter().zip(views(&g, &gh)) {
            close(
                &format!("gelu_tanh of {name}"),
                dev,
                &gv.gelu_tanh().unwrap(),
                &cv.gelu_tanh().unwrap(),
                dt,
            );
            close(
                &format!("exp of {name}"),
                dev,
                &gv.exp().unwrap(),
                &cv.exp().unwrap(),
                dt,
            );
            close(
                &format!("{name} times itself"),
                dev,
                &gv.mul(&gv).unwrap(),
                &cv.mul(&cv).unwrap(),
                dt,
            );
            // The reference holds the same values (in f64 on the CPU): the same bits.
            assert_eq!(
                bits(&gv.contiguous().unwrap()),
                bits(&cv.contiguous().unwrap()),
                "contiguous() of {name} [{dt} on {dev}]"
            );
            let to = if dt == DType::F32 {
                DType::BF16
            } else {
                DType::F32
            };
            assert_eq!(
                bits(&gv.to_dtype(to).unwrap()),
                bits(&cv.to_dtype(to).unwrap()),
                "cast of {name} [{dt} on {dev}]"
            );
        }
        // A row broadcast over a narrowed matrix (a gate times a projection's output), and
        // two narrowed operands.
        let (gn, cn) = (g.narrow(1, 16, 24).unwrap(), c.narrow(1, 16, 24).unwrap());
        close(
            "row times rows",
            dev,
            &grow.mul(&gn).unwrap(),
            &crow.mul(&cn).unwrap(),
            dt,
        );
        close(
            "rows plus rows",
            dev,
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
                "cat of widths {a} and {b} [{dt} on {dev}]"
            );
        }
        let (gz, cz) = (
            Tensor::zeros((37, 56), dt, dev).unwrap(),
            Tensor::zeros((37, 56), c.dtype(), &CPU).unwrap(),
        );
        gz.narrow(1, 24, 16)
            .unwrap()
            .assign(&g.narrow(1, 0, 16).unwrap())
            .unwrap();
        cz.narrow(1, 24, 16)
            .unwrap()
            .assign(&c.narrow(1, 0, 16).unwrap())
            .unwrap();
        assert_eq!(bits(&gz), bits(&cz), "assign into rows [{dt} on {dev}]");
    }
}

fn index_select_gather_scatter_add(dev: &Device) {
    for dt in FLOATS {
        let (c, g) = normal_pair(dev, &[11, 6, 5], dt, 90);
        let idc = Tensor::from_vec(vec![3u32, 0, 10, 3, 7], 5, &CPU).unwrap();
        let idg = idc.to_device(dev).unwrap();
        for d in 0..3 {
            let ok: Vec<u32> = idc
                .to_vec::<u32>()
                .unwrap()
                .iter()
                .map(|&i| i % c.dims()[d] as u32)
                .collect();
            let (ic, ig) = (
                Tensor::from_vec(ok.clone(), 5, &CPU).unwrap(),
                Tensor::from_vec(ok, 5, dev).unwrap(),
            );
            close(
                &format!("index_select dim {d}"),
                dev,
                &g.index_select(&ig, d).unwrap(),
                &c.index_select(&ic, d).unwrap(),
                dt,
            );
            close(
                &format!("index_select dim {d} of a view"),
                dev,
                &g.t().unwrap().index_select(&ig, d.min(1)).unwrap(),
                &c.t().unwrap().index_select(&ic, d.min(1)).unwrap(),
                dt,
            );
        }
        // gather / scatter_add along the middle dim, ids with repeats.
        let ids: Vec<u32> = (0..11 * 4 * 5).map(|i| ((i * 7 + 3) % 6) as u32).collect();
        let (gc, gg) = (
            Tensor::from_vec(ids.clone(), (11, 4, 5), &CPU).unwrap(),
            Tensor::from_vec(ids, (11, 4, 5), dev).unwrap(),
        );
        close(
            "gather",
            dev,
            &g.gather(&gg, 1).unwrap(),
            &c.gather(&gc, 1).unwrap(),
            dt,
        );
        let (sc, sg) = normal_pair(dev, &[11, 4, 5], dt, 91);
        close(
            "scatter_add",
            dev,
            &g.scatter_add(&gg, &sg, 1).unwrap(),
            &c.scatter_add(&gc, &sc, 1).unwrap(),
            dt,
        );
        // An index past its dim is an error on every backend.
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

/// `a` @ `b` on `dev` against the reference; each operand is (the reference's, the device's).
fn matmul_check(what: &str, dev: &Device, a: (&Tensor, &Tensor), b: (&Tensor, &Tensor), dt: DType) {
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
    // Two backends (or gemm in f32 and in f64) sum in different orders: allow a few f32
    // roundings of the magnitude.
    let extra = match dt {
        DType::F64 => 1e-13,
        _ => 1e-6,
    };
    close_mag(
        what,
        dev,
        &gc,
        &cc,
        dt,
        mag * extra / rtol(dev, dt).max(1e-300),
    );
}

fn matmul_shapes_views_and_dtypes(dev: &Device) {
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
            let (ca, ga) = normal_pair(dev, sa, dt, 200 + i as u64);
            let (cb, gb) = normal_pair(dev, sb, dt, 300 + i as u64);
            matmul_check(&format!("{sa:?}@{sb:?}"), dev, (&ca, &ga), (&cb, &gb), dt);
        }
        // Transposed operands are passed as flags; a doubly strided one is copied.
        let (ca, ga) = normal_pair(dev, &[4, 19, 23], dt, 400);
        let (cb, gb) = normal_pair(dev, &[4, 31, 19], dt, 401);
        let (cat, gat) = (ca.transpose(1, 2).unwrap(), ga.transpose(1, 2).unwrap());
        let (cbt, gbt) = (cb.transpose(1, 2).unwrap(), gb.transpose(1, 2).unwrap());
        matmul_check("a^T b^T", dev, (&cat, &gat), (&cbt, &gbt), dt);
        let (cs, gs) = (ca.narrow(2, 1, 19).unwrap(), ga.narrow(2, 1, 19).unwrap());
        matmul_check(
            "narrowed a",
            dev,
            (&cs, &gs),
            (
                &cb.transpose(1, 2).unwrap().narrow(1, 0, 19).unwrap(),
                &gb.transpose(1, 2).unwrap().narrow(1, 0, 19).unwrap(),
            ),
            dt,
        );
    }
}

/// The seeded streams: a GPU generates the CPU's numbers in every dtype; on the CPU each
/// dtype's stream is the f64 stream rounded once.
fn random_numbers_match_the_reference_stream(dev: &Device) {
    for dt in FLOATS {
        let (rdt, _) = oracle(dev, dt);
        for n in SIZES {
            let (c, g) = (
                Tensor::randn(n, rdt, &CPU, 42).unwrap(),
                Tensor::randn(n, dt, dev, 42).unwrap(),
            );
            close(&format!("randn {n}"), dev, &g, &c, dt);
            let (c, g) = (
                Tensor::rand_uniform(-2.0, 3.0, n, rdt, &CPU, 43).unwrap(),
                Tensor::rand_uniform(-2.0, 3.0, n, dt, dev, 43).unwrap(),
            );
            close(&format!("rand {n}"), dev, &g, &c, dt);
        }
    }
}

/// A small network of composites (embedding, matmul, layer_norm, gelu, softmax, cross
/// entropy, max) whose loss and every gradient must agree with the reference's.
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

fn backward_of_a_network_matches(dev: &Device) {
    let shapes: [&[usize]; 5] = [&[10, 8], &[8, 16], &[16], &[16], &[16, 5]];
    for dt in [DType::F32, DType::F64] {
        let params: Vec<Tensor> = shapes
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
        let cpu_params: Vec<Tensor> = params.iter().map(|p| reference(dev, p)).collect();
        let dev_params: Vec<Tensor> = params.iter().map(|p| p.to_device(dev).unwrap()).collect();
        for p in cpu_params.iter().chain(&dev_params) {
            p.set_requires_grad(true).unwrap();
        }
        let ids: Vec<u32> = (0..12).map(|i| (i * 7 % 10) as u32).collect();
        let tg = vec![1u32, 4, 0, 2];
        let (ic, ig) = (
            Tensor::from_vec(ids.clone(), 12, &CPU).unwrap(),
            Tensor::from_vec(ids, 12, dev).unwrap(),
        );
        let (tc, tgg) = (
            Tensor::from_vec(tg.clone(), 4, &CPU).unwrap(),
            Tensor::from_vec(tg, 4, dev).unwrap(),
        );
        let lc = network(&CPU, &cpu_params, &ic, &tc).unwrap();
        let lg = network(dev, &dev_params, &ig, &tgg).unwrap();
        let (rel, abs) = if dt == DType::F64 {
            (1e-10, 1e-12)
        } else {
            (1e-4, 1e-6)
        };
        let (a, b) = (lg.to_scalar_f64().unwrap(), lc.to_scalar_f64().unwrap());
        assert!(
            (a - b).abs() <= abs + rel * b.abs(),
            "loss {dt} on {dev}: {a} vs {b}"
        );
        let (gc, gg) = (lc.backward().unwrap(), lg.backward().unwrap());
        for (i, (pc, pg)) in cpu_params.iter().zip(&dev_params).enumerate() {
            let (x, y) = (
                gg.get(pg).expect("device grad").to_vec_f64().unwrap(),
                gc.get(pc).expect("reference grad").to_vec_f64().unwrap(),
            );
            let scale = y.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (j, (u, v)) in x.iter().zip(&y).enumerate() {
                assert!(
                    (u - v).abs() <= abs + rel * scale,
                    "param {i} grad {j} {dt}: {dev} {u} vs reference {v}"
                );
            }
        }
    }
}

fn fused_softmax_matches_the_reference(dev: &Device) {
    for dt in FLOATS {
        let (rdt, _) = oracle(dev, dt);
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
            let (c, g) = normal_pair(dev, &shape, dt, 600);
            let (c, g) = (c.affine(4.0, 0.0).unwrap(), g.affine(4.0, 0.0).unwrap());
            close(
                &format!("softmax {shape:?} dim {dim}"),
                dev,
                &g.softmax(dim).unwrap(),
                &c.softmax(dim).unwrap(),
                dt,
            );
            // The composite computed in f32 and rounded once (in a half type it would round
            // at every step); in f64 where the reference is.
            let wide = if rdt == DType::F64 {
                DType::F64
            } else {
                DType::F32
            };
            let reference = c
                .to_dtype(wide)
                .unwrap()
                .softmax_composite(dim)
                .unwrap()
                .to_dtype(rdt)
                .unwrap();
            close(
                &format!("softmax vs composite {shape:?}"),
                dev,
                &g.softmax(dim).unwrap(),
                &reference,
                dt,
            );
        }
    }
}

fn unfold_fold_and_conv2d_match_the_reference(dev: &Device) {
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
            let (c, g) = normal_pair(dev, &xd, dt, 800 + k as u64);
            let (cu, gu) = (c.unfold2d(win).unwrap(), g.unfold2d(win).unwrap());
            close(&format!("unfold2d {k}"), dev, &gu, &cu, dt);
            let (ccols, gcols) = normal_pair(dev, cu.dims(), dt, 900 + k as u64);
            close(
                &format!("fold2d {k}"),
                dev,
                &gcols.fold2d(win, (xd[2], xd[3])).unwrap(),
                &ccols.fold2d(win, (xd[2], xd[3])).unwrap(),
                dt,
            );
            let (cw, gw) = normal_pair(dev, &[8, xd[1], kernel.0, kernel.1], dt, 950 + k as u64);
            let want = conv2d(&c, &cw, None, stride, padding, dilation, 1).unwrap();
            let mag = (xd[1] * kernel.0 * kernel.1) as f64;
            close_mag(
                &format!("conv2d {k}"),
                dev,
                &conv2d(&g, &gw, None, stride, padding, dilation, 1).unwrap(),
                &want,
                dt,
                mag * 1e-6 / rtol(dev, dt).max(1e-300),
            );
        }
    }
}

fn fused_norms_forward_and_backward_match_the_reference(dev: &Device) {
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
        // packs a lane (5000), fewer rows than blocks (5, 33, 300). The two that wrap
        // around the ring (5.1 M and 3.7 M elements) are for those kernels alone: on the CPU
        // they would take most of the suite's time and take no path the others do not.
        let ring = [vec![20000, 256], vec![1200, 3072]];
        let ring = ring.into_iter().filter(|_| dev.is_cuda());
        for shape in ring.chain([
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
        ]) {
            let cols = *shape.last().unwrap_or(&1);
            let (c, g) = normal_pair(dev, &shape, dt, 1200);
            let (c, g) = (
                rounded_like(dev, dt, &c.affine(3.0, 1.0).unwrap()),
                g.affine(3.0, 1.0).unwrap(),
            );
            let (cdy, gdy) = normal_pair(dev, &shape, dt, 1201);
            let (cw, gw) = normal_pair(dev, &[cols], dt, 1202);
            let (cb, gb) = normal_pair(dev, &[cols], dt, 1203);
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
                close(&format!("{what} y"), dev, &og[0], &oc[0], dt);
                // dx sums row-long terms in f64 on both sides, then rounds once.
                close_mag(&format!("{what} dx"), dev, &og[1], &oc[1], dt, 3.0 * 3.0);
                // dw, db sum over rows in f32: allow for the summation order.
                let rows = (c.elem_count() / cols) as f64;
                for (k, name) in ["dw", "db"]
                    .iter()
                    .enumerate()
                    .take(og.len().saturating_sub(2))
                {
                    close_mag(
                        &format!("{what} {name}"),
                        dev,
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

fn fused_activation_backward_matches_the_reference(dev: &Device) {
    type Act = fn(&Tensor) -> Result<Tensor>;
    let acts: [(&str, Act); 3] = [
        ("gelu", |x| x.gelu()),
        ("gelu_tanh", |x| x.gelu_tanh()),
        ("silu", |x| x.silu()),
    ];
    for dt in FLOATS {
        for n in SIZES {
            let (c, g) = uniform_pair(dev, &[n], dt, 1300, -6.0, 6.0);
            let (cdy, gdy) = normal_pair(dev, &[n], dt, 1301);
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
                    dev,
                    &grad(&g, &gdy),
                    &grad(&c, &cdy),
                    dt,
                    5.0,
                );
            }
        }
    }
}

/// Casts to f16 round to nearest, ties to even, whatever lies past the rounding bit: f64 values
/// a hair above and below the midpoint of two neighbouring f16s (closer to the midpoint than
/// an f32 step, so only the f64's low bits decide) and the midpoints themselves, on the CPU's
/// cast and `f16_nearest`, against the neighbour each must give.
#[test]
fn casts_to_f16_round_to_nearest_past_the_rounding_bit() {
    use half::f16;
    let mut x: u32 = 777;
    let (mut vals, mut want) = (vec![], vec![]);
    for _ in 0..5_000 {
        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        // A finite f16 below the largest, and the next one away from zero.
        let a = ((x >> 8) % 0x7bff) as u16;
        let sign = ((x & 1) as u16) << 15;
        let (lo, hi) = (f16::from_bits(a | sign), f16::from_bits((a + 1) | sign));
        let (l, h) = (lo.to_f64(), hi.to_f64());
        let mid = (l + h) / 2.0;
        let hair = (h - l).abs() * 2f64.powi(-30);
        let toward_hi = if h > l { hair } else { -hair };
        vals.extend([mid + toward_hi, mid - toward_hi, mid]);
        // The tie goes to the even code.
        let even = if a % 2 == 0 { l } else { h };
        want.extend([h, l, even]);
    }
    let t = Tensor::from_vec(vals.clone(), vals.len(), &CPU).unwrap();
    let got = t.to_dtype(DType::F16).unwrap().to_vec_f64().unwrap();
    for ((v, g), w) in vals.iter().zip(&got).zip(&want) {
        assert_eq!(g.to_bits(), w.to_bits(), "{v:e}: {g:e} against {w:e}");
        assert_eq!(
            flame::f16_nearest(*v).to_f64().to_bits(),
            w.to_bits(),
            "{v:e}"
        );
    }
}

/// Casts to bf16 round to nearest, ties to even, whatever lies past the rounding bit: f32
/// values just above and below a tie (where `half::bf16::from_f64` rounded 0x66ee8004 down),
/// exact ties of both parities, and f64 values between two f32s, on the CPU against the
/// correctly rounded f32 conversion and the nearer of the two bf16 neighbours.
#[test]
fn casts_to_bf16_round_to_nearest_past_the_rounding_bit() {
    let mut bits32: Vec<u32> = vec![
        0x66ee_8004,
        0x8210_8005,
        0x6378_8006,
        0x0896_8002,
        0x3f80_8000,
        0x3f81_8000,
        0x3f80_8001,
        0x3f80_7fff,
        0x7f7f_ffff,
        0x0000_8001,
    ];
    let mut x: u32 = 12345;
    for i in 0..20_000u32 {
        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let low = [0x8000, 0x8001, 0x8004, 0x7fff, x & 0xffff][(i % 5) as usize];
        bits32.push(((x & 0x7fff_0000) | low) ^ (x & 0x8000_0000));
    }
    let vals: Vec<f32> = bits32
        .iter()
        .map(|&b| f32::from_bits(b))
        .filter(|v| v.is_finite())
        .collect();
    let t = Tensor::from_vec(vals.clone(), vals.len(), &CPU).unwrap();
    let got = t.to_dtype(DType::BF16).unwrap().to_vec_f64().unwrap();
    for (v, g) in vals.iter().zip(&got) {
        let want = half::bf16::from_f32(*v).to_f64();
        assert!(
            want.to_bits() == g.to_bits() || (want.is_nan() && g.is_nan()),
            "{:08x}: {g} against {want}",
            v.to_bits()
        );
    }
    // f64 values a fraction of an f32 step past f32 values: not ties once the f64 bits count.
    let wide: Vec<f64> = vals
        .iter()
        .filter(|v| v.abs() > 1e-30 && v.abs() < 1e30)
        .map(|&v| f64::from(v) * (1.0 + 1e-9))
        .collect();
    let t = Tensor::from_vec(wide.clone(), wide.len(), &CPU).unwrap();
    let got = t.to_dtype(DType::BF16).unwrap().to_vec_f64().unwrap();
    for (v, g) in wide.iter().zip(&got) {
        // The bf16 values around v, from v's f32 truncated to bf16 and the next one out.
        let trunc = f32::from_bits((*v as f32).to_bits() & 0xffff_0000);
        let lo = f64::from(trunc);
        let step = f64::from(f32::from_bits(trunc.to_bits() + 0x1_0000)) - lo;
        let hi = lo + step;
        let (dlo, dhi) = ((v - lo).abs(), (hi - v).abs());
        let want = if dlo < dhi { lo } else { hi };
        assert!(dlo != dhi, "{v} is a tie");
        assert_eq!(*g, want, "{v}: {g} against {want}");
    }
}
