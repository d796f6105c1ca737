//! Forward values on the CPU backend, continued from ops.rs: composites, casts, indexing,
//! construction, cat/stack/chunk.
#![cfg(feature = "cpu-ref")]

mod common;

use common::*;
use flame::{DType, Error, Result, Tensor};

// ----- composites -----------------------------------------------------------------------------

#[test]
fn norms_and_losses_forward() -> R {
    for dt in FLOATS {
        let x = randn((3, 5), dt, 61);
        // Per-feature weight 0.5 + j / 4 and bias j - 2.
        let w: Vec<f64> = (0..5).map(|j| 0.5 + j as f64 * 0.25).collect();
        let b: Vec<f64> = (0..5).map(|j| j as f64 - 2.0).collect();
        let (mut sm, mut lsm, mut ln) = (vec![], vec![], vec![]);
        for r in v(&x).chunks(5) {
            let mx = r.iter().copied().fold(f64::MIN, f64::max);
            let z: f64 = r.iter().map(|x| (x - mx).exp()).sum();
            let mean = r.iter().sum::<f64>() / 5.0;
            let var = r.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 5.0;
            for (j, x) in r.iter().enumerate() {
                sm.push((x - mx).exp() / z);
                lsm.push(x - mx - z.ln());
                ln.push((x - mean) / (var + 1e-5).sqrt() * w[j] + b[j]);
            }
        }
        let (wt, bt) = (tt(&w, 5, dt), tt(&b, 5, dt));
        check("softmax", &x.softmax(1)?, &sm, dt);
        check("log_softmax", &x.log_softmax(-1)?, &lsm, dt);
        let y = x.layer_norm(Some(&wt), Some(&bt), 1e-5)?;
        check("layer_norm", &y, &ln, dt);
        // cross entropy of targets [1, 4, 0]: the mean of -log_softmax[i][t_i].
        let ce = -(lsm[1] + lsm[5 + 4] + lsm[10]) / 3.0;
        let y = x.cross_entropy(&ids(&[1, 4, 0], 3))?;
        check("cross_entropy", &y, &[ce], dt);
    }
    // group_norm of (2, 4, 3), 2 groups: statistics over 2 channels x 3 positions; weight
    // c + 1 and bias 0.5 for channel c.
    let x = randn((2, 4, 3), DType::F64, 63);
    let mut want = vec![];
    for g in v(&x).chunks(6) {
        let mean = g.iter().sum::<f64>() / 6.0;
        let var = g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 6.0;
        for x in g {
            let c = want.len() / 3 % 4;
            want.push((x - mean) / (var + 1e-5).sqrt() * (c + 1) as f64 + 0.5);
        }
    }
    let w = arange(1.0, 5.0, DType::F64);
    let b = Tensor::full(0.5, 4, DType::F64, &CPU)?;
    let y = x.group_norm(2, Some(&w), Some(&b), 1e-5)?;
    check("group_norm", &y, &want, DType::F64);
    assert!(x.group_norm(3, None, None, 1e-5).is_err());
    Ok(())
}

// ----- casts ----------------------------------------------------------------------------------

/// A non-contiguous (stride 2) view holding the values of the vector `x`.
fn strided_view(x: &Tensor) -> Result<Tensor> {
    let col = x.unsqueeze(1)?;
    Tensor::cat(&[&col, &col], 1)?.narrow(1, 0, 1)?.squeeze(1)
}

#[test]
fn casts_between_all_dtypes() -> R {
    // Small integers are exact in every dtype: every pair keeps them, from any layout.
    let ints = [0.0, 1.0, 2.0, 7.0, 100.0, 255.0];
    for from in ALL {
        let x = tt(&ints, 6, from);
        let strided = strided_view(&x)?;
        assert!(!strided.is_contiguous());
        for to in ALL {
            let y = x.to_dtype(to)?;
            assert_eq!((y.dtype(), v(&y)), (to, ints.to_vec()), "{from} -> {to}");
            assert_eq!(v(&strided.to_dtype(to)?), ints, "{from} -> {to}, strided");
        }
    }
    let src = [
        -1.5, 0.49, 2.5, 4e9, 1e10, 65504., 65520., 2049., 1.01171875, 0.1,
    ];
    let x = tt(&src, src.len(), DType::F64);
    // To u32: truncation toward zero, negative -> 0, past u32::MAX -> u32::MAX.
    let u = x.to_dtype(DType::U32)?.to_vec::<u32>()?;
    let want = [0, 0, 2, 4_000_000_000, u32::MAX, 65504, 65520, 2049, 1, 0];
    assert_eq!(u, want);
    // To f16: 65504 is the largest finite, 65520 rounds to inf, 2049 ties to even 2048.
    let h = v(&x.to_dtype(DType::F16)?);
    assert_eq!(h[0], -1.5);
    assert_eq!(h[5..8], [65504.0, f64::INFINITY, 2048.0]);
    // To bf16 (8 significant bits): 1 + 3/256 ties to even 1 + 4/256; 2049 -> 2048.
    let b = v(&x.to_dtype(DType::BF16)?);
    assert_eq!((b[0], b[7], b[8]), (-1.5, 2048.0, 1.015625));
    // To f32: 0.1 becomes the nearest f32.
    assert_eq!(v(&x.to_dtype(DType::F32)?)[9], 0.1f32 as f64);
    // u32 -> f32 rounds 2^24 + 1 to 2^24 and u32::MAX to 2^32; u32 -> f64 is exact.
    let big = ids(&[16_777_217, u32::MAX], 2);
    eq(&big.to_dtype(DType::F32)?, &[16_777_216.0, 4_294_967_296.0]);
    eq(&big.to_dtype(DType::F64)?, &[16_777_217.0, 4_294_967_295.0]);
    Ok(())
}

// ----- indexing -------------------------------------------------------------------------------

#[test]
fn index_select_gather_scatter_add_by_hand() -> R {
    for dt in FLOATS {
        // x = [[0,1,2,3],[4,5,6,7],[8,9,10,11]]
        let x = arange(0.0, 12.0, dt).reshape((3, 4))?;
        let s = x.index_select(&ids(&[2, 0, 2], 3), 0)?;
        eq(&s, &[8., 9., 10., 11., 0., 1., 2., 3., 8., 9., 10., 11.]);
        let s = x.index_select(&ids(&[3, 0], 2), 1)?;
        eq(&s, &[3., 0., 7., 4., 11., 8.]);
        // Row 1 of x^T is column 1 of x: [1, 5, 9].
        eq(&x.t()?.index_select(&ids(&[1], 1), 0)?, &[1., 5., 9.]);
        // gather dim 1, ids [[0,0],[3,1],[2,2]] -> [[0,0],[7,5],[10,10]]
        let g1 = ids(&[0, 0, 3, 1, 2, 2], (3, 2));
        eq(&x.gather(&g1, 1)?, &[0., 0., 7., 5., 10., 10.]);
        // gather dim 0, ids [[2,1,0,0]] -> [[8,5,2,3]]
        eq(
            &x.gather(&ids(&[2, 1, 0, 0], (1, 4)), 0)?,
            &[8., 5., 2., 3.],
        );
        // scatter_add into zeros along dim 1 with src [[1,2],[3,4],[5,6]]:
        // row 0: col 0 += 1 + 2; row 1: col 3 += 3, col 1 += 4; row 2: col 2 += 5 + 6.
        let src = arange(1.0, 7.0, dt).reshape((3, 2))?;
        let z = Tensor::zeros((3, 4), dt, &CPU)?;
        let y = z.scatter_add(&g1, &src, 1)?;
        eq(&y, &[3., 0., 0., 0., 0., 4., 0., 3., 0., 0., 11., 0.]);
        eq(&z, &[0.0; 12]); // scatter_add does not modify its input
                            // scatter_add into ones along dim 0, ids [[2,0,1,2]], src [[10,20,30,40]].
        let src = tt(&[10.0, 20.0, 30.0, 40.0], (1, 4), dt);
        let y = Tensor::ones((3, 4), dt, &CPU)?;
        let y = y.scatter_add(&ids(&[2, 0, 1, 2], (1, 4)), &src, 0)?;
        eq(&y, &[1., 21., 1., 1., 1., 1., 31., 1., 11., 1., 1., 41.]);
    }
    Ok(())
}

#[test]
fn gather_and_scatter_add_middle_dim_against_loops() -> R {
    let mut rng = Lcg(9);
    let (a, s, c, j) = (2usize, 5usize, 3usize, 4usize);
    let x = randn((a, s, c), DType::F64, 31);
    let src = randn((a, j, c), DType::F64, 32);
    let (xv, sv) = (v(&x), v(&src));
    let idv: Vec<u32> = (0..a * j * c).map(|_| rng.next(s) as u32).collect();
    let idx = ids(&idv, (a, j, c));
    // gather: out[p][q][r] = x[p][ids[p][q][r]][r]; scatter_add: x[p][ids[p][q][r]][r] += src.
    let g = v(&x.gather(&idx, 1)?);
    let mut want = xv.clone();
    for (k, &i) in idv.iter().enumerate() {
        let [p, _, r] = [k / (j * c), k / c % j, k % c];
        assert_eq!(g[k], xv[(p * s + i as usize) * c + r]);
        want[(p * s + i as usize) * c + r] += sv[k];
    }
    let y = x.scatter_add(&idx, &src, 1)?;
    check("scatter_add dim 1", &y, &want, DType::F64);
    // index_select along the middle dim of a permuted view equals that of its copy.
    let (p, sel) = (x.permute(&[2, 1, 0])?, ids(&[4, 4, 0], 3));
    let c = p.contiguous()?;
    assert_eq!(v(&p.index_select(&sel, 1)?), v(&c.index_select(&sel, 1)?));
    Ok(())
}

/// (index, size) of an IndexOutOfRange error naming `op`.
fn out_of_range(r: Result<Tensor>, op: &str) -> (u64, usize) {
    match r {
        Err(Error::IndexOutOfRange {
            index, size, op: o, ..
        }) if o == op => (index, size),
        other => panic!("{op}: expected IndexOutOfRange, got {other:?}"),
    }
}

#[test]
fn index_errors() -> R {
    let x = Tensor::zeros((3, 4), DType::F32, &CPU)?;
    let r = x.index_select(&ids(&[0, 3], 2), 0);
    assert_eq!(out_of_range(r, "index_select"), (3, 3));
    let r = x.gather(&ids(&[0, 4, 1, 1, 1, 1], (3, 2)), 1);
    assert_eq!(out_of_range(r, "gather"), (4, 4));
    let src = Tensor::ones((3, 2), DType::F32, &CPU)?;
    let r = x.scatter_add(&ids(&[0, 0, 9, 0, 0, 0], (3, 2)), &src, 1);
    assert_eq!(out_of_range(r, "scatter_add"), (9, 4));
    // Float indices and mismatched shapes are rejected.
    let float_ids = Tensor::zeros(2, DType::F32, &CPU)?;
    assert!(x.index_select(&float_ids, 0).is_err());
    let r = x.gather(&ids(&[0, 0], (1, 2)), 1);
    assert!(matches!(r, Err(Error::ShapeMismatch { .. })));
    Ok(())
}

// ----- construction ---------------------------------------------------------------------------

#[test]
fn constructors() -> R {
    eq(&arange(0.0, 5.0, DType::F32), &[0., 1., 2., 3., 4.]);
    // 1, 1.25, 1.5, 1.75 (2 excluded); 5, 3, 1 with a negative step.
    let r = Tensor::arange_step(1.0, 2.0, 0.25, DType::F64, &CPU)?;
    eq(&r, &[1., 1.25, 1.5, 1.75]);
    let r = Tensor::arange_step(5.0, 0.0, -2.0, DType::U32, &CPU)?;
    assert_eq!(r.to_vec::<u32>()?, vec![5, 3, 1]);
    assert_eq!(arange(3.0, 3.0, DType::F32).elem_count(), 0);
    assert!(Tensor::arange_step(0.0, 1.0, 0.0, DType::F32, &CPU).is_err());
    for dt in ALL {
        let z = Tensor::zeros((2, 3), dt, &CPU)?;
        assert_eq!((z.dims(), z.dtype()), (&[2, 3][..], dt));
        eq(&z, &[0.0; 6]);
        eq(&Tensor::ones(7, dt, &CPU)?, &[1.0; 7]);
        eq(&z.ones_like()?, &[1.0; 6]);
        // 2.5 is exact in every float dtype; u32 truncates it to 2.
        let f = v(&Tensor::full(2.5, (1, 3), dt, &CPU)?);
        assert_eq!(f, vec![if dt == DType::U32 { 2.0 } else { 2.5 }; 3]);
    }
    let s = Tensor::full(4.0, (), DType::F32, &CPU)?;
    assert_eq!((s.rank(), s.elem_count(), s.to_scalar_f64()?), (0, 1, 4.0));
    let e = Tensor::from_vec(vec![1.0f32; 5], (2, 3), &CPU).unwrap_err();
    assert!(matches!(e, Error::ElementCount { count: 5, .. }), "{e}");
    assert!(e.to_string().contains("[2, 3]"), "{e}");
    let x = Tensor::from_vec(vec![1.5f64, 2.5], 2, &CPU)?;
    assert!(x.to_vec::<f32>().is_err());
    assert_eq!(x.to_vec::<f64>()?, vec![1.5, 2.5]);
    assert!(x.to_scalar_f64().is_err());
    Ok(())
}

#[test]
fn random_is_seeded() -> R {
    for dt in FLOATS {
        let a = v(&randn(1000, dt, 7));
        assert_eq!(a, v(&randn(1000, dt, 7)));
        let b = v(&randn(1000, dt, 8));
        let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
        assert!(same < 50, "{same} equal elements across seeds ({dt})");
        // Every dtype rounds the same numbers.
        assert_eq!(a, v(&randn(1000, DType::F64, 7).to_dtype(dt)?));
        let u = v(&Tensor::rand(1001, dt, &CPU, 3)?);
        assert!(u.iter().all(|&x| (0.0..=1.0).contains(&x)));
        assert_ne!(u, v(&Tensor::rand(1001, dt, &CPU, 4)?));
    }
    // Counter based: a prefix is the same whatever the length.
    let long = v(&Tensor::rand(4099, DType::F64, &CPU, 5)?);
    assert_eq!(v(&Tensor::rand(13, DType::F64, &CPU, 5)?)[..], long[..13]);
    let u = v(&Tensor::rand_uniform(-2.0, 5.0, 9999, DType::F64, &CPU, 6)?);
    assert!(u.iter().all(|&x| (-2.0..5.0).contains(&x)));
    assert!(Tensor::rand(3, DType::U32, &CPU, 1).is_err());
    // Moments of 100k standard normals: the standard error of the mean is 0.003.
    let z = v(&randn(100_000, DType::F64, 2024));
    let n = z.len() as f64;
    let mean = z.iter().sum::<f64>() / n;
    let std = (z.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
    assert!(mean.abs() < 0.02, "mean {mean}");
    assert!((std - 1.0).abs() < 0.02, "std {std}");
    let z = Tensor::randn_normal(3.0, 2.0, 100_000, DType::F64, &CPU, 1)?;
    let z = v(&z);
    let mean = z.iter().sum::<f64>() / n;
    assert!((mean - 3.0).abs() < 0.04, "mean {mean}");
    Ok(())
}

// ----- cat, stack, chunk ----------------------------------------------------------------------

#[test]
fn cat_stack_chunk() -> R {
    // a = [[0,1],[2,3]], b = [[4,5]]
    let a = arange(0.0, 4.0, DType::F32).reshape((2, 2))?;
    let b = arange(4.0, 6.0, DType::F32).reshape((1, 2))?;
    let c = Tensor::cat(&[&a, &b], 0)?;
    assert_eq!(c.dims(), &[3, 2]);
    eq(&c, &[0., 1., 2., 3., 4., 5.]);
    // [a | a^T] = [[0,1,0,2],[2,3,1,3]]
    let c = Tensor::cat(&[&a, &a.t()?], 1)?;
    assert_eq!(c.dims(), &[2, 4]);
    eq(&c, &[0., 1., 0., 2., 2., 3., 1., 3.]);
    // stack dim 0: [a, a^T]; stack dim 2: [[[0,0],[1,2]],[[2,1],[3,3]]]
    let s = Tensor::stack(&[&a, &a.t()?], 0)?;
    assert_eq!(s.dims(), &[2, 2, 2]);
    eq(&s, &[0., 1., 2., 3., 0., 2., 1., 3.]);
    eq(
        &Tensor::stack(&[&a, &a.t()?], 2)?,
        &[0., 0., 1., 2., 2., 1., 3., 3.],
    );
    assert_eq!(Tensor::stack(&[&a, &a, &a], -1)?.dims(), &[2, 2, 3]);
    assert!(Tensor::cat(&[], 0).is_err());
    assert!(Tensor::cat(&[&a, &b], 1).is_err());
    assert!(Tensor::cat(&[&a, &a.to_dtype(DType::F64)?], 0).is_err());
    // chunk of 0..7 into 3: [0,1,2], [3,4,5], [6] (views); into 4: sizes 2,2,2,1;
    // 0..3 into 5: 3 chunks of 1.
    let r = arange(0.0, 7.0, DType::F32);
    let ch = r.chunk(3, 0)?;
    let want: [&[f64]; 3] = [&[0., 1., 2.], &[3., 4., 5.], &[6.]];
    ch.iter().zip(want).for_each(|(c, w)| eq(c, w));
    assert!(ch.iter().all(|t| t.same_storage(&r)));
    let sizes: Vec<usize> = r.chunk(4, 0)?.iter().map(|t| t.elem_count()).collect();
    assert_eq!(sizes, vec![2, 2, 2, 1]);
    assert_eq!(r.narrow(0, 0, 3)?.chunk(5, 0)?.len(), 3);
    assert!(r.chunk(0, 0).is_err());
    // Chunks of a (2, 7) along dim 1 put back together give the original.
    let m = randn((2, 7), DType::F64, 3);
    let parts = m.chunk(3, 1)?;
    let back = Tensor::cat(&parts.iter().collect::<Vec<_>>(), 1)?;
    assert_eq!(v(&back), v(&m));
    // A large cat along dim 1 of transposed views: [x^T | x^T].
    let xt = Tensor::rand((999, 1001), DType::F32, &CPU, 8)?.t()?;
    let c = Tensor::cat(&[&xt, &xt], 1)?;
    assert_eq!(c.dims(), &[1001, 1998]);
    assert_eq!(v(&c.narrow(1, 999, 999)?), v(&xt));
    Ok(())
}

// ----- in place, threads ----------------------------------------------------------------------

#[test]
fn assign_updates_in_place_and_views_see_it() -> R {
    let x = Tensor::zeros((2, 3), DType::F32, &CPU)?;
    let (t, col, alias) = (x.t()?, x.narrow(1, 1, 1)?, x.clone());
    let src = arange(0.0, 6.0, DType::F32).reshape((2, 3))?;
    x.assign(&src)?;
    eq(&alias, &[0., 1., 2., 3., 4., 5.]);
    eq(&t, &[0., 3., 1., 4., 2., 5.]);
    eq(&col, &[1., 4.]);
    // Writing through a view changes the base: column 1 := [9, 9].
    col.assign(&Tensor::full(9.0, (2, 1), DType::F32, &CPU)?)?;
    eq(&x, &[0., 9., 2., 3., 9., 5.]);
    // Through the transpose: x^T := [[10,11],[12,13],[14,15]], so x = [[10,12,14],[11,13,15]].
    t.assign(&arange(10.0, 16.0, DType::F32).reshape((3, 2))?)?;
    eq(&x, &[10., 12., 14., 11., 13., 15.]);
    // From its own transpose (same storage): y := y^T for y = [[0,1],[2,3]].
    let y = arange(0.0, 4.0, DType::F64).reshape((2, 2))?;
    y.assign(&y.t()?)?;
    eq(&y, &[0., 2., 1., 3.]);
    // Errors: shape, dtype, a broadcast destination, a tensor recorded on the tape.
    let r = x.assign(&y);
    assert!(matches!(r, Err(Error::ShapeMismatch { op: "assign", .. })));
    let r = x.assign(&src.to_dtype(DType::F64)?);
    assert!(matches!(r, Err(Error::DTypeMismatch { .. })));
    let b = Tensor::zeros((2, 1), DType::F32, &CPU)?.broadcast_as((2, 3))?;
    assert!(b.assign(&src).is_err());
    let w = Tensor::ones(2, DType::F64, &CPU)?.requires_grad_()?;
    let out = w.exp()?;
    assert!(out.assign(&w.detach()).is_err());
    // A leaf is updated in place (the optimizer's path), and a recorded tensor under no_grad.
    w.assign(&Tensor::full(3.0, 2, DType::F64, &CPU)?)?;
    eq(&w, &[3.0, 3.0]);
    let _g = flame::no_grad();
    out.assign(&w.detach())?;
    eq(&out, &[3.0, 3.0]);
    Ok(())
}

const fn assert_send_sync<T: Send + Sync>() {}
const _: () = assert_send_sync::<Tensor>();

// ----- fused softmax --------------------------------------------------------------------------

#[test]
fn fused_softmax_matches_its_composite_twin() -> R {
    for dt in FLOATS {
        for (shape, dim) in [
            (vec![1], 0usize),
            (vec![7], 0),
            (vec![3, 1000], 1),
            (vec![5, 4, 3], 0),
            (vec![5, 4, 3], 1),
        ] {
            let x = randn(shape.clone(), dt, 11).affine(3.0, 0.0)?;
            let fused = x.softmax(dim)?;
            let composite = x.softmax_composite(dim)?;
            check(
                &format!("softmax {shape:?} dim {dim} {dt}"),
                &fused,
                &v(&composite),
                dt,
            );
            // Rows sum to one.
            let sums = v(&fused.to_dtype(DType::F64)?.sum(&[dim])?);
            assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-2), "{sums:?}");
        }
    }
    // -inf entries get 0; a row of -inf or with a NaN is NaN, as in PyTorch.
    let x = tt(
        &[
            0.0,
            f64::NEG_INFINITY,
            0.0,
            f64::NEG_INFINITY,
            f64::NEG_INFINITY,
            f64::NEG_INFINITY,
            1.0,
            f64::NAN,
            2.0,
        ],
        (3, 3),
        DType::F32,
    );
    let y = v(&x.softmax(1)?);
    assert_eq!(&y[..3], &[0.5, 0.0, 0.5]);
    assert!(y[3..].iter().all(|v| v.is_nan()), "{y:?}");
    Ok(())
}

#[test]
fn fused_norms_match_their_composite_twins() -> R {
    use flame::Grads;
    for dt in FLOATS {
        for shape in [vec![7], vec![3, 1000], vec![4, 2, 129]] {
            let x = randn(shape.clone(), dt, 71).affine(3.0, 1.0)?;
            let cols = *shape.last().unwrap_or(&1);
            let w = randn(cols, dt, 72);
            let b = randn(cols, dt, 73);
            let cases: [(&str, Tensor, Tensor); 3] = [
                (
                    "layer_norm",
                    x.layer_norm(None, None, 1e-5)?,
                    x.layer_norm_composite(None, None, 1e-5)?,
                ),
                (
                    "layer_norm affine",
                    x.layer_norm(Some(&w), Some(&b), 1e-5)?,
                    x.layer_norm_composite(Some(&w), Some(&b), 1e-5)?,
                ),
                (
                    "rms_norm",
                    x.rms_norm(Some(&w), 1e-6)?,
                    x.rms_norm_composite(Some(&w), 1e-6)?,
                ),
            ];
            for (name, fused, composite) in cases {
                check(&format!("{name} {shape:?}"), &fused, &v(&composite), dt);
            }
            // Backward of the fused norm against the composite's, through a random dy.
            let xv = x.detach().requires_grad_()?;
            let dy = randn(shape.clone(), dt, 74);
            for (name, fused) in [("layer_norm", true), ("rms_norm", false)] {
                let (mut gf, mut gc) = (Grads::new(), Grads::new());
                if fused {
                    xv.layer_norm(None, None, 1e-5)?
                        .backward_with_grad(&dy, &mut gf, false)?;
                    xv.layer_norm_composite(None, None, 1e-5)?
                        .backward_with_grad(&dy, &mut gc, false)?;
                } else {
                    xv.rms_norm(None, 1e-6)?
                        .backward_with_grad(&dy, &mut gf, false)?;
                    xv.rms_norm_composite(None, 1e-6)?
                        .backward_with_grad(&dy, &mut gc, false)?;
                }
                let (a, c) = (
                    gf.get(&xv).expect("fused grad"),
                    gc.get(&xv).expect("composite grad"),
                );
                // dx sums n terms of size ~rstd * |dy|: compare against that magnitude.
                let mag: Vec<f64> = v(c).iter().map(|_| 3.0).collect();
                check_mag(&format!("d{name} {shape:?}"), a, &v(c), Some(&mag), dt);
            }
        }
    }
    Ok(())
}

#[test]
fn fused_activations_match_their_composite_twins() -> R {
    use flame::Grads;
    type Act = fn(&Tensor) -> Result<Tensor>;
    let pairs: [(&str, Act, Act); 3] = [
        ("gelu", |x| x.gelu(), |x| x.gelu_composite()),
        ("gelu_tanh", |x| x.gelu_tanh(), |x| x.gelu_tanh_composite()),
        ("silu", |x| x.silu(), |x| x.silu_composite()),
    ];
    for dt in FLOATS {
        // Wide inputs, including |x| = 30 where exp-based forms would overflow in f16.
        let mut vals = v(&randn((7, 13), DType::F64, 81).affine(4.0, 0.0)?);
        vals[0] = 30.0;
        vals[1] = -30.0;
        let x = tt(&vals, (7, 13), dt);
        let dy = randn((7, 13), dt, 82);
        // The reference: the composite in f32 (f64 for f64), rounded once; in a half type the
        // composite itself rounds at every step (its erf rounds to -1, say) and is the worse one.
        let wide = if dt == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        for (name, fused, composite) in pairs {
            let reference = composite(&x.to_dtype(wide)?)?.to_dtype(dt)?;
            check(&format!("{name} {dt}"), &fused(&x)?, &v(&reference), dt);
            let (xv, xw) = (
                x.detach().requires_grad_()?,
                x.to_dtype(wide)?.requires_grad_()?,
            );
            let (mut gf, mut gc) = (Grads::new(), Grads::new());
            fused(&xv)?.backward_with_grad(&dy, &mut gf, false)?;
            composite(&xw)?.backward_with_grad(&dy.to_dtype(wide)?, &mut gc, false)?;
            let a = gf.get(&xv).expect("fused grad");
            let c = gc.get(&xw).expect("composite grad").to_dtype(dt)?;
            let mag: Vec<f64> = v(&dy).iter().map(|d| 2.0 * d.abs()).collect();
            check_mag(&format!("d{name} {dt}"), a, &v(&c), Some(&mag), dt);
            assert!(
                v(a).iter().all(|g| g.is_finite()),
                "{name} {dt}: non-finite gradient"
            );
        }
    }
    Ok(())
}
