//! Forward values of the ops on the CPU backend, against references computed by hand (stated
//! in comments) or by plain Rust loops over f64, for every dtype: elementwise, comparisons,
//! reductions, matmul, large tensors and views. Casts, indexing, construction, joins and
//! composites are in ops_more.rs.
#![cfg(feature = "cpu-ref")]

mod common;

use common::*;
use flame::{CmpOp, DType, Error, Result, Tensor};
use std::f64::consts::SQRT_2;

// ----- elementwise ----------------------------------------------------------------------------

type UnaryCase = (&'static str, UnaryFn, fn(f64) -> f64);

fn un(name: &'static str, t: UnaryFn, r: fn(f64) -> f64) -> UnaryCase {
    (name, t, r)
}

#[test]
fn unary_every_dtype() -> R {
    let ops = [
        un("neg", |x| x.neg(), |x| -x),
        un("recip", |x| x.recip(), |x| 1.0 / x),
        un("exp", |x| x.exp(), f64::exp),
        un("log", |x| x.log(), f64::ln),
        un("sqrt", |x| x.sqrt(), f64::sqrt),
        un("sin", |x| x.sin(), f64::sin),
        un("cos", |x| x.cos(), f64::cos),
        un("tanh", |x| x.tanh(), f64::tanh),
        un("erf", |x| x.erf(), erf_ref),
        un("abs", |x| x.abs(), f64::abs),
        un("affine", |x| x.affine(2.5, -0.75), |x| 2.5 * x - 0.75),
        un("powf", |x| x.powf(1.7), |x| x.powf(1.7)),
        un("cube", |x| x.powf(3.0), |x| x * x * x),
        un("sqr", |x| x.sqr(), |x| x * x),
        un("sigmoid", |x| x.sigmoid(), |x| 1.0 / (1.0 + (-x).exp())),
        un("relu", |x| x.relu(), |x| x.max(0.0)),
        un(
            "gelu",
            |x| x.gelu(),
            |x| x * (1.0 + erf_ref(x / SQRT_2)) / 2.0,
        ),
        un("silu", |x| x.silu(), |x| x / (1.0 + (-x).exp())),
        un("clamp", |x| x.clamp(-0.5, 0.25), |x| x.clamp(-0.5, 0.25)),
    ];
    // Hand-picked values; shapes (7,), (1,) and ().
    let signed = [-1.75, -0.9, -0.3, 0.2, 0.65, 1.1, 1.9];
    let positive = [0.3, 0.55, 0.8, 1.0, 1.45, 2.2, 3.1];
    for dt in FLOATS {
        for (name, f, r) in ops {
            let pos = ["recip", "log", "sqrt", "powf"].contains(&name);
            let vals: &[f64] = if pos { &positive } else { &signed };
            let sized = [
                (vec![7], vals),
                (vec![1], &vals[2..3]),
                (vec![], &vals[4..5]),
            ];
            for (shape, vals) in sized {
                let x = tt(vals, shape.clone(), dt);
                let y = f(&x)?;
                assert_eq!(y.dims(), &shape[..]);
                let want: Vec<f64> = v(&x).into_iter().map(r).collect();
                check(&format!("{name} {shape:?}"), &y, &want, dt);
            }
        }
    }
    Ok(())
}

#[test]
fn sign_and_unsupported_dtypes() -> R {
    // sign: -1, 0 or 1; 0 for +-0 and NaN.
    let x = Tensor::from_vec(vec![-2.5f32, -0.0, 0.0, 3.0, f32::NAN], 5, &CPU)?;
    eq(&x.sign()?, &[-1.0, 0.0, 0.0, 1.0, 0.0]);
    let u = ids(&[1, 2, 3], 3);
    let mm = u.reshape((1, 3))?.matmul(&u.reshape((3, 1))?);
    for r in [u.exp(), u.add(&u), u.sum_all(), mm] {
        assert!(matches!(r, Err(Error::UnsupportedDType { .. })), "{r:?}");
    }
    let f = Tensor::ones(3, DType::F32, &CPU)?;
    let r = f.add(&f.to_dtype(DType::F64)?);
    assert!(matches!(r, Err(Error::DTypeMismatch { op: "add", .. })));
    Ok(())
}

#[test]
fn binary_every_dtype_with_broadcasting() -> R {
    let ops: [BinaryCase; 6] = [
        ("add", |a, b| a.add(b), |a, b| a + b),
        ("sub", |a, b| a.sub(b), |a, b| a - b),
        ("mul", |a, b| a.mul(b), |a, b| a * b),
        ("div", |a, b| a.div(b), |a, b| a / b),
        ("maximum", |a, b| a.maximum(b), f64::max),
        ("minimum", |a, b| a.minimum(b), f64::min),
    ];
    let shapes: [(&[usize], &[usize], &[usize]); 7] = [
        (&[7], &[7], &[7]),
        (&[1], &[1], &[1]),
        (&[3, 1, 5], &[4, 1], &[3, 4, 5]),
        (&[4, 1], &[3, 1, 5], &[3, 4, 5]),
        (&[2, 7], &[1], &[2, 7]),
        (&[], &[3, 5], &[3, 5]),
        (&[3, 1], &[1, 7], &[3, 7]),
    ];
    let mut seed = 0;
    for dt in FLOATS {
        for (name, f, r) in ops {
            for (sa, sb, out) in shapes {
                seed += 2;
                let a = randn(sa, dt, seed);
                // The rhs in [0.5, 2): denominators away from 0.
                let b = Tensor::rand_uniform(0.5, 2.0, sb, dt, &CPU, seed + 1)?;
                let y = f(&a, &b)?;
                assert_eq!(y.dims(), out, "{name} {sa:?} {sb:?}");
                let want = broadcast_ref(&v(&a), sa, &v(&b), sb, r);
                check(&format!("{name} {sa:?} {sb:?}"), &y, &want, dt);
                // Swapped operands, and the rhs made of both signs.
                let b = b.sub(&randn(sb, dt, seed + 1000))?;
                let want = broadcast_ref(&v(&b), sb, &v(&a), sa, r);
                if name != "div" {
                    check(&format!("{name} {sb:?} {sa:?}"), &f(&b, &a)?, &want, dt);
                }
            }
        }
    }
    // By hand: [[1], [2]] + [10, 20, 30] = [[11, 21, 31], [12, 22, 32]]; [1, 2] * () 3 = [3, 6].
    let a = tt(&[1.0, 2.0], (2, 1), DType::F32);
    let c = a.add(&tt(&[10.0, 20.0, 30.0], 3, DType::F32))?;
    assert_eq!(c.dims(), &[2, 3]);
    eq(&c, &[11.0, 21.0, 31.0, 12.0, 22.0, 32.0]);
    eq(
        &a.mul(&Tensor::full(3.0, (), DType::F32, &CPU)?)?,
        &[3.0, 6.0],
    );
    // (2, 1) against (3, 2): 2 vs 3 cannot broadcast.
    let r = a.add(&Tensor::ones((3, 2), DType::F32, &CPU)?);
    assert!(matches!(
        r,
        Err(Error::BroadcastIncompatible { op: "add", .. })
    ));
    Ok(())
}

#[test]
fn shape_errors_name_the_op_and_both_shapes() -> R {
    let a = Tensor::zeros((2, 3), DType::F32, &CPU)?;
    let b = Tensor::zeros((4, 5), DType::F32, &CPU)?;
    let cat = Tensor::cat(&[&a, &b], 0);
    for (op, r) in [("add", a.add(&b)), ("matmul", a.matmul(&b)), ("cat", cat)] {
        let msg = r.unwrap_err().to_string();
        for part in [op, "[2, 3]", "[4, 5]"] {
            assert!(msg.contains(part), "{msg:?} lacks {part:?}");
        }
    }
    Ok(())
}

// ----- comparisons, where, NaN ----------------------------------------------------------------

#[test]
fn comparisons_and_where() -> R {
    for dt in FLOATS {
        let a = tt(&[1.0, 2.0, 3.0, 4.0, 5.0], 5, dt);
        let b = tt(&[5.0, 2.0, 1.0, 4.0, 6.0], 5, dt);
        let cases: [(CmpOp, [f64; 5]); 6] = [
            (CmpOp::Eq, [0., 1., 0., 1., 0.]),
            (CmpOp::Ne, [1., 0., 1., 0., 1.]),
            (CmpOp::Lt, [1., 0., 0., 0., 1.]),
            (CmpOp::Le, [1., 1., 0., 1., 1.]),
            (CmpOp::Gt, [0., 0., 1., 0., 0.]),
            (CmpOp::Ge, [0., 1., 1., 1., 0.]),
        ];
        for (op, want) in cases {
            let m = a.cmp(&b, op)?;
            assert_eq!((m.dtype(), v(&m)), (dt, want.to_vec()), "{op:?}");
        }
        assert_eq!(v(&a.gt(&b)?), v(&b.lt(&a)?));
        // a >= 3: [0, 0, 1, 1, 1]; a < [[2], [4]] broadcast to (2, 5).
        eq(&a.cmp_scalar(3.0, CmpOp::Ge)?, &[0., 0., 1., 1., 1.]);
        let c = a.lt(&tt(&[2.0, 4.0], (2, 1), dt))?;
        eq(&c, &[1., 0., 0., 0., 0., 1., 1., 1., 0., 0.]);
        // where(a > b, a, b) = elementwise max = [5, 2, 3, 4, 6]
        eq(&a.gt(&b)?.where_cond(&a, &b)?, &[5., 2., 3., 4., 6.]);
        // mask (2,1) = [[1], [0]] over branches (3,) and (): [[1, 2, 3], [-1, -1, -1]]
        let m = tt(&[1.0, 0.0], (2, 1), dt);
        let f = Tensor::full(-1.0, (), dt, &CPU)?;
        let w = m.where_cond(&tt(&[1.0, 2.0, 3.0], 3, dt), &f)?;
        assert_eq!(w.dims(), &[2, 3]);
        eq(&w, &[1., 2., 3., -1., -1., -1.]);
    }
    // u32 comparisons and a u32 mask: [3, 1] < [3, 2] = [0, 1].
    let (p, q) = (ids(&[3, 1], 2), ids(&[3, 2], 2));
    eq(&p.eq(&q)?, &[1.0, 0.0]);
    let t = tt(&[7.0, 8.0], 2, DType::F64);
    eq(&p.lt(&q)?.where_cond(&t, &t.neg()?)?, &[-7.0, 8.0]);
    Ok(())
}

#[test]
fn nan_propagates_in_max_and_min() -> R {
    let n = f64::NAN;
    for dt in FLOATS {
        // Rows [1, NaN, 3] and [4, 5, 6].
        let x = tt(&[1.0, n, 3.0, 4.0, 5.0, 6.0], (2, 3), dt);
        let m = v(&x.max(1)?);
        assert!(m[0].is_nan() && m[1] == 6.0, "{m:?}");
        let m = v(&x.min(1)?);
        assert!(m[0].is_nan() && m[1] == 4.0, "{m:?}");
        // Over dim 0: [4, NaN, 6]
        let m = v(&x.max(0)?);
        assert!(m[0] == 4.0 && m[1].is_nan() && m[2] == 6.0, "{m:?}");
        assert!(x.max_all()?.to_scalar_f64()?.is_nan());
        // argmax points at the NaN, as in PyTorch.
        eq(&x.argmax(1)?, &[1.0, 2.0]);
        // maximum/minimum propagate a NaN from either side.
        let y = tt(&[n, 0.0, 9.0, 0.0, 9.0, n], (2, 3), dt);
        let nan_at = |t: Tensor| v(&t).iter().map(|x| x.is_nan()).collect::<Vec<_>>();
        let want = [true, true, false, false, false, true];
        assert_eq!(nan_at(x.maximum(&y)?), want);
        assert_eq!(nan_at(y.minimum(&x)?), want);
        assert_eq!(v(&x.maximum(&y)?)[2..5], [9.0, 4.0, 9.0]);
    }
    Ok(())
}

// ----- reductions -----------------------------------------------------------------------------

#[test]
fn reductions_over_each_dim_and_several_dims() -> R {
    let dims = [3usize, 4, 5];
    for dt in FLOATS {
        let x = randn(dims, dt, 77);
        let xv = v(&x);
        let refr = |red: &[usize], op| reduce_ref(&xv, &dims, red, op);
        for d in 0..3usize {
            let (want, mag) = refr(&[d], Red::Sum);
            let s = x.sum_keepdim(&[d])?;
            assert_eq!(s.dims()[d], 1);
            check_mag(&format!("sum {d}"), &s, &want, Some(&mag), dt);
            assert_eq!(x.sum(&[d])?.rank(), 2);
            // Max and min pick an element: exact.
            let exact = [
                (Red::Max, x.max(d)?),
                (Red::Min, x.min(d)?),
                (Red::Max, x.max_keepdim(d)?),
                (Red::Min, x.min_keepdim(d)?),
                (Red::ArgMax, x.argmax(d)?),
                (Red::ArgMin, x.argmin(d)?),
                (Red::ArgMax, x.argmax_keepdim(d)?),
            ];
            for (op, t) in exact {
                assert_eq!(v(&t), refr(&[d], op).0, "{op:?} over {d} ({dt})");
                let arg = matches!(op, Red::ArgMax | Red::ArgMin);
                assert_eq!(t.dtype(), if arg { DType::U32 } else { dt });
            }
            // Negative dims count from the end.
            assert_eq!(v(&x.max(d as i32 - 3)?), v(&x.max(d)?));
        }
        for red in [vec![0usize, 2], vec![1, 2], vec![0, 1, 2]] {
            let (want, mag) = refr(&red, Red::Sum);
            let s = x.sum_keepdim(&red)?;
            check_mag(&format!("sum {red:?}"), &s, &want, Some(&mag), dt);
            // mean divides by the number of reduced elements.
            let n = red.iter().map(|&d| dims[d]).product::<usize>() as f64;
            let div = |v: Vec<f64>| v.into_iter().map(|x| x / n).collect::<Vec<_>>();
            let (want, mag) = (div(want), div(mag));
            check_mag("mean", &x.mean_keepdim(&red)?, &want, Some(&mag), dt);
        }
        let (want, mag) = refr(&[0, 1, 2], Red::Sum);
        let all = x.sum_all()?;
        assert_eq!(all.rank(), 0);
        check_mag("sum_all", &all, &want, Some(&mag), dt);
        let mx = xv.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(x.max_all()?.to_scalar_f64()?, mx);
    }
    Ok(())
}

#[test]
fn reductions_by_hand() -> R {
    // [[1, 3, 3, 2], [0, -1, -1, 5]]: the first extreme wins ties.
    let x = tt(&[1., 3., 3., 2., 0., -1., -1., 5.], (2, 4), DType::F32);
    eq(&x.argmax(1)?, &[1.0, 3.0]);
    eq(&x.argmin(1)?, &[0.0, 1.0]);
    eq(&x.argmax(0)?, &[0.0, 0.0, 0.0, 1.0]);
    // Row sums 9 and 3, column sums [1, 2, 2, 7], total 12; var of row 0 = 0.6875.
    eq(&x.sum(&[1])?, &[9.0, 3.0]);
    eq(&x.sum(&[0])?, &[1.0, 2.0, 2.0, 7.0]);
    assert_eq!(x.sum_all()?.to_scalar_f64()?, 12.0);
    assert_eq!(v(&x.var_keepdim(&[1])?)[0], 0.6875);
    // A size-1 dim reduces to itself.
    let c = x.narrow(1, 3, 1)?;
    eq(&c.sum(&[1])?, &[2.0, 5.0]);
    eq(&c.max(1)?, &[2.0, 5.0]);
    assert!(x.sum(&[0, 0]).is_err(), "a dim listed twice");
    assert!(matches!(x.sum(&[2]), Err(Error::DimOutOfRange { .. })));
    Ok(())
}

// ----- matmul ---------------------------------------------------------------------------------

/// a @ b for views a (.., M, K) and b (.., K, N), against loops over their values.
fn check_matmul(what: &str, a: &Tensor, b: &Tensor, dt: DType) -> R {
    let y = a.matmul(b)?;
    let (ra, rb) = (a.rank(), b.rank());
    let (m, k, n) = (a.dims()[ra - 2], a.dims()[ra - 1], b.dims()[rb - 1]);
    let batch = y.dims()[..y.rank() - 2].to_vec();
    let ab = a.broadcast_as([batch.clone(), vec![m, k]].concat())?;
    let bb = b.broadcast_as([batch.clone(), vec![k, n]].concat())?;
    let bs = batch.iter().product();
    let (want, mag) = matmul_ref(&v(&ab), &v(&bb), [bs, m, k, n]);
    check_mag(what, &y, &want, Some(&mag), dt);
    Ok(())
}

#[test]
fn matmul_against_naive_loops() -> R {
    let mut rng = Lcg(5);
    let mut seed = 100;
    for dt in FLOATS {
        for round in 0..12 {
            let mut d = || [1, 2, 3, 5, 7, 16, 33][rng.next(7)];
            let (bs, m, k, n) = (1 + round % 3, d(), d(), d());
            let what = format!("{bs}x{m}x{k}x{n}");
            seed += 4;
            let (a, b) = (randn((bs, m, k), dt, seed), randn((bs, k, n), dt, seed + 1));
            check_matmul(&what, &a, &b, dt)?;
            // Transposed views: stored (B, K, M) and (N, K).
            let at = randn((bs, k, m), dt, seed + 2).transpose(1, 2)?;
            let bt = randn((n, k), dt, seed + 3).t()?;
            check_matmul(&format!("transposed {what}"), &at, &bt, dt)?;
        }
        // Odd and degenerate sizes, 2D, broadcast batch, narrowed and broadcast operands.
        check_matmul("1x1x1", &randn((1, 1), dt, 1), &randn((1, 1), dt, 2), dt)?;
        check_matmul("2D", &randn((7, 5), dt, 3), &randn((5, 3), dt, 4), dt)?;
        let (a, b) = (randn((2, 1, 3, 4), dt, 5), randn((3, 4, 2), dt, 6));
        check_matmul("(2,1,3,4)@(3,4,2)", &a, &b, dt)?;
        assert_eq!(a.matmul(&b)?.dims(), &[2, 3, 3, 2]);
        let narrow = randn((5, 9), dt, 7).narrow(1, 2, 4)?;
        check_matmul("narrowed", &narrow, &randn((4, 3), dt, 8), dt)?;
        let rows = randn((1, 4), dt, 9).broadcast_as((3, 4))?;
        check_matmul("broadcast rows", &rows, &randn((4, 2), dt, 10), dt)?;
        let cols = randn((4, 1), dt, 12).broadcast_as((4, 5))?;
        check_matmul("broadcast columns", &randn((3, 4), dt, 13), &cols, dt)?;
        // K = 0: a sum of nothing.
        let y = randn((2, 0), dt, 14).matmul(&randn((0, 3), dt, 15))?;
        assert_eq!((y.dims(), v(&y)), (&[2, 3][..], vec![0.0; 6]));
    }
    // Large enough for gemm's own threads (M N K past 2^18 per batch entry).
    let (a, b) = (
        randn((2, 70, 70), DType::F32, 11),
        randn((70, 70), DType::F32, 12),
    );
    check_matmul("2x70x70x70", &a, &b, DType::F32)?;
    // A dot product of 1_000_003 terms.
    let (a, b) = (
        randn((1, BIG), DType::F64, 3),
        randn((BIG, 1), DType::F64, 4),
    );
    check_matmul("dot", &a, &b, DType::F64)
}

// ----- large tensors (the rayon paths) --------------------------------------------------------

const BIG: usize = 1_000_003;

#[test]
fn large_sums_and_extremes() -> R {
    for dt in [DType::F64, DType::F32, DType::BF16] {
        let x = Tensor::rand(BIG, dt, &CPU, 42)?;
        let (want, mag) = reduce_ref(&v(&x), &[BIG], &[0], Red::Sum);
        check_mag("sum of 1_000_003", &x.sum_all()?, &want, Some(&mag), dt);
    }
    // 0 + 1 + ... + (n - 1) = n (n - 1) / 2, exact in f64.
    let n = BIG as f64;
    assert_eq!(
        arange(0.0, n, DType::F64).sum_all()?.to_scalar_f64()?,
        n * (n - 1.0) / 2.0
    );
    // A unique minimum, a maximum tied across chunks (the first wins), then a NaN.
    let mut vals: Vec<f32> = (0..BIG).map(|i| (i % 1000) as f32 / 1000.0).collect();
    (vals[777_777], vals[999_999], vals[123_457]) = (5.0, 5.0, -5.0);
    let x = Tensor::from_vec(vals.clone(), BIG, &CPU)?;
    eq(&x.argmax(0)?, &[777_777.0]);
    eq(&x.argmin(0)?, &[123_457.0]);
    assert_eq!(x.max_all()?.to_scalar_f64()?, 5.0);
    eq(&x.min(0)?, &[-5.0]);
    vals[600_001] = f32::NAN;
    let x = Tensor::from_vec(vals, BIG, &CPU)?;
    assert!(x.max_all()?.to_scalar_f64()?.is_nan());
    eq(&x.argmax(0)?, &[600_001.0]);
    Ok(())
}

#[test]
fn large_elementwise_on_views() -> R {
    let (r, c) = (1001, 999);
    let a = Tensor::rand((r, c), DType::F32, &CPU, 1)?;
    let b = Tensor::rand((c, r), DType::F32, &CPU, 2)?;
    let (av, bv) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);
    // (a^T + b)[i][j] = a[j][i] + b[i][j], in f32.
    let s = a.t()?.add(&b)?;
    assert_eq!(s.dims(), &[c, r]);
    let sv = s.to_vec::<f32>()?;
    for i in 0..c {
        for j in (i % 3..r).step_by(3) {
            assert_eq!(sv[i * r + j], av[j * c + i] + bv[i * r + j]);
        }
    }
    // A materialised transposed copy, and a product of views of it.
    let ct = a.t()?.contiguous()?;
    assert_eq!(v(&ct), v(&a.t()?));
    assert_eq!(v(&ct.t()?.mul(&a)?), v(&a.mul(&a)?));
    // Column sums of the transposed view are the row sums of a.
    let rows = v(&a.sum(&[1])?);
    check("sum of t()", &a.t()?.sum(&[0])?, &rows, DType::F32);
    // A unary op on a large narrowed view.
    let ev = a.narrow(1, 1, c - 2)?.exp()?.to_vec::<f32>()?;
    for i in (0..r).step_by(13) {
        for j in 0..c - 2 {
            assert_eq!(ev[i * (c - 2) + j], av[i * c + j + 1].exp());
        }
    }
    // 1 + 0.5 broadcast over 1_000_003 elements.
    let y = Tensor::ones(BIG, DType::F32, &CPU)?.add(&Tensor::full(0.5, 1, DType::F32, &CPU)?)?;
    assert_eq!(y.to_vec::<f32>()?, vec![1.5f32; BIG]);
    Ok(())
}

#[test]
fn large_reductions_with_few_outputs_over_strided_rows() -> R {
    // Three outputs over 400_001 strided elements each: the reducer's split-range path.
    let n = 400_001;
    let x = randn((n, 3), DType::F32, 17);
    let xv = v(&x);
    let t = x.t()?;
    let (want, mag) = reduce_ref(&xv, &[n, 3], &[0], Red::Sum);
    check_mag("strided sum", &t.sum(&[1])?, &want, Some(&mag), DType::F32);
    let got = [t.argmax(1)?, t.argmin(1)?, t.max(1)?];
    for (op, got) in [Red::ArgMax, Red::ArgMin, Red::Max].into_iter().zip(got) {
        assert_eq!(v(&got), reduce_ref(&xv, &[n, 3], &[0], op).0, "{op:?}");
    }
    // where over large operands: x > 0 ? x : 0, elementwise.
    let zero = Tensor::zeros((), DType::F32, &CPU)?;
    let w = v(&t.gt(&zero)?.where_cond(&t, &zero)?);
    for i in 0..3 {
        for j in (0..n).step_by(11) {
            assert_eq!(w[i * n + j], xv[j * 3 + i].max(0.0));
        }
    }
    Ok(())
}

// ----- non-contiguous views ------------------------------------------------------------------

#[test]
fn views_compute_like_their_contiguous_copies() -> R {
    for dt in FLOATS {
        let (base, col) = (randn((4, 6), dt, 9), randn((4, 1), dt, 10));
        let (bv, cv) = (v(&base), v(&col));
        // Each view with its elements [i][j] read from the base's row-major values.
        let pick = |n: usize, src: &[f64], at: fn(usize) -> usize| -> Vec<f64> {
            (0..n).map(|k| src[at(k)]).collect()
        };
        let t = pick(24, &bv, |k| (k % 4) * 6 + k / 4);
        let narrow = pick(16, &bv, |k| (k / 4) * 6 + 1 + k % 4);
        let narrow_t = pick(12, &bv, |k| (1 + k % 2) * 6 + k / 2);
        let bcast = pick(24, &cv, |k| k / 6);
        let views = [
            ("t", base.t()?, t),
            ("narrow", base.narrow(1, 1, 4)?, narrow),
            ("narrow t", base.narrow(0, 1, 2)?.t()?, narrow_t),
            ("broadcast", col.broadcast_as((4, 6))?, bcast),
        ];
        for (name, x, want) in views {
            assert!(!x.is_contiguous(), "{name}");
            assert_eq!(v(&x), want, "{name} values");
            let c = x.contiguous()?;
            assert!(c.is_contiguous());
            let same = |p: Result<Tensor>, q: Result<Tensor>, op: &str| {
                assert_eq!(v(&p.unwrap()), v(&q.unwrap()), "{name} {op} {dt}")
            };
            same(x.exp(), c.exp(), "exp");
            same(x.affine(3.0, 1.0), c.affine(3.0, 1.0), "affine");
            same(x.mul(&x.sin()?), c.mul(&c.sin()?), "mul");
            same(x.sub(&c), c.zeros_like(), "sub");
            same(x.sum(&[0]), c.sum(&[0]), "sum 0");
            same(x.sum(&[1]), c.sum(&[1]), "sum 1");
            same(x.max(1), c.max(1), "max");
            same(x.argmin(0), c.argmin(0), "argmin");
            same(x.softmax(1), c.softmax(1), "softmax");
            same(x.to_dtype(DType::F64), c.to_dtype(DType::F64), "cast");
            same(x.flatten_all(), c.flatten_all(), "reshape");
            let w = randn((x.dims()[1], 3), dt, 11);
            let (want, mag) = matmul_ref(&v(&c), &v(&w), [1, x.dims()[0], x.dims()[1], 3]);
            let y = x.matmul(&w)?;
            check_mag(&format!("matmul of {name}"), &y, &want, Some(&mag), dt);
        }
    }
    Ok(())
}

#[test]
fn reshape_of_non_contiguous_views() -> R {
    let x = arange(0.0, 60.0, DType::F64).reshape((3, 4, 5))?;
    let perms = [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ];
    for p in perms {
        for (d, start, len) in [(0, 0, 3), (0, 1, 2), (1, 1, 3), (2, 2, 2), (2, 0, 1)] {
            let x = x.narrow(d, start, len)?.permute(&p)?;
            let c = v(&x.contiguous()?);
            let [a, b, e] = [x.dims()[0], x.dims()[1], x.dims()[2]];
            let n = a * b * e;
            let shapes = [
                vec![n],
                vec![1, n, 1],
                vec![a, b * e],
                vec![a * b, e],
                vec![a, 1, b, e],
            ];
            for shape in shapes {
                let r = x.reshape(shape.clone())?;
                let what = format!("{p:?} narrow({d},{start},{len}) -> {shape:?}");
                assert_eq!((r.dims(), v(&r)), (&shape[..], c.clone()), "{what}");
                assert_eq!(v(&r.reshape((a, b, e))?), c, "{what} and back");
            }
        }
    }
    // By hand: arange(6) as (2, 3) = [[0,1,2],[3,4,5]]; its transpose is [[0,3],[1,4],[2,5]].
    let x = arange(0.0, 6.0, DType::F32).reshape((2, 3))?;
    let t = x.t()?;
    let flat = t.reshape(6)?;
    eq(&flat, &[0., 3., 1., 4., 2., 5.]);
    assert!(!flat.same_storage(&x), "merging transposed dims must copy");
    eq(&t.reshape((2, 3))?, &[0., 3., 1., 4., 2., 5.]);
    // Splitting a dim of a view needs no copy: (3, 2) -> (3, 1, 2).
    let s = t.reshape((3, 1, 2))?;
    assert!(s.same_storage(&x));
    eq(&s, &[0., 3., 1., 4., 2., 5.]);
    let r = x.reshape(7);
    assert!(matches!(r, Err(Error::ElementCount { count: 6, .. })));
    Ok(())
}
