//! Attention on the CPU: the fused op against its composite twin (outputs and every gradient),
//! masks and causality, the dispatching `scaled_dot_product_attention`, and bad input. The
//! numbers to match come from the composite (matmul, softmax, matmul), itself gradchecked in
//! f64 (tests/gradcheck/attention.rs). The CUDA flash kernels against the same composite are
//! in attention/flash.rs (they need a GPU).
#![cfg(feature = "cpu-ref")]

mod common;
#[cfg(feature = "cuda")]
#[path = "attention/flash.rs"]
mod flash;

use flame::nn::scaled_dot_product_attention;
use flame::{DType, Device, Error, Grads, Result, Tensor};

const CPU: Device = Device::Cpu;

fn randn(shape: &[usize], dt: DType, seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F64, &CPU, seed)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
}

/// Output and (dq, dk, dv) of `f` on leaf copies of q, k, v, backpropagating `dy`.
fn run(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dy: &Tensor,
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Vec<Vec<f64>> {
    let l: Vec<Tensor> = [q, k, v]
        .iter()
        .map(|t| t.detach().requires_grad_().unwrap())
        .collect();
    let y = f(&l[0], &l[1], &l[2]).unwrap();
    let mut g = Grads::new();
    y.backward_with_grad(dy, &mut g, false).unwrap();
    let mut out = vec![y.to_vec_f64().unwrap()];
    out.extend(l.iter().map(|t| g.get(t).unwrap().to_vec_f64().unwrap()));
    out
}

fn assert_close(what: &str, a: &[Vec<f64>], b: &[Vec<f64>], tol: f64) {
    for (n, (x, y)) in ["o", "dq", "dk", "dv"].iter().zip(a.iter().zip(b)) {
        let scale = y.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
        for (i, (p, r)) in x.iter().zip(y).enumerate() {
            assert!(
                (p - r).abs() <= tol * scale,
                "{what} {n}[{i}]: fused {p} vs composite {r} (max |ref| {scale})"
            );
        }
    }
}

/// (name, B, H, Lq, Lk, D, causal, mask flags (B * Lk) or empty)
type Config = (
    &'static str,
    usize,
    usize,
    usize,
    usize,
    usize,
    bool,
    Vec<f64>,
);

fn configs() -> Vec<Config> {
    let alt = |n: usize| (0..n).map(|i| f64::from(i % 3 != 1)).collect::<Vec<_>>();
    let mut hidden = alt(9);
    hidden.extend([0.0; 9]);
    vec![
        ("plain", 2, 3, 7, 7, 8, false, vec![]),
        ("Lq != Lk", 1, 2, 5, 11, 16, false, vec![]),
        ("causal", 2, 2, 9, 9, 8, true, vec![]),
        ("causal Lq > Lk", 1, 2, 12, 5, 8, true, vec![]),
        ("causal Lq < Lk", 1, 2, 4, 10, 8, true, vec![]),
        ("key mask", 2, 2, 6, 9, 8, false, alt(18)),
        ("mask, one batch fully hidden", 2, 1, 5, 9, 4, false, hidden),
        ("mask and causal", 2, 2, 8, 6, 8, true, alt(12)),
        ("one key", 1, 1, 3, 1, 8, false, vec![]),
    ]
}

#[test]
fn fused_matches_the_composite_in_f64_and_f32() {
    for (name, b, h, lq, lk, d, causal, flags) in configs() {
        for (dt, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
            let q = randn(&[b, h, lq, d], dt, 1);
            let k = randn(&[b, h, lk, d], dt, 2);
            let v = randn(&[b, h, lk, d], dt, 3);
            let dy = randn(&[b, h, lq, d], dt, 4);
            let mask =
                (!flags.is_empty()).then(|| Tensor::from_slice(&flags, (b, lk), &CPU).unwrap());
            let scale = 0.9 / (d as f64).sqrt();
            let fused = run(&q, &k, &v, &dy, |q, k, v| {
                q.attention_fused(k, v, mask.as_ref(), causal, scale)
            });
            let comp = run(&q, &k, &v, &dy, |q, k, v| {
                q.attention_composite(k, v, mask.as_ref(), causal, scale)
            });
            assert_close(&format!("{name} [{dt}]"), &fused, &comp, tol);
            assert!(fused.iter().flatten().all(|x| x.is_finite()), "{name}");
        }
    }
}

#[test]
fn a_query_that_sees_no_key_outputs_zero_and_passes_no_gradient() -> Result<()> {
    let (q, k, v) = (
        randn(&[2, 1, 3, 4], DType::F64, 5),
        randn(&[2, 1, 4, 4], DType::F64, 6),
        randn(&[2, 1, 4, 4], DType::F64, 7),
    );
    // Batch 0 sees keys 1 and 3; batch 1 sees none.
    let mask = Tensor::from_slice(&[0u32, 2, 0, 1, 0, 0, 0, 0], (2, 4), &CPU)?;
    let dy = randn(&[2, 1, 3, 4], DType::F64, 8);
    let r = run(&q, &k, &v, &dy, |q, k, v| {
        q.attention_fused(k, v, Some(&mask), false, 0.5)
    });
    assert!(r[0][12..].iter().all(|&x| x == 0.0), "batch 1 output");
    assert!(r[0][..12].iter().any(|&x| x != 0.0), "batch 0 output");
    for g in &r[1..] {
        let half = g.len() / 2;
        assert!(g[half..].iter().all(|&x| x == 0.0), "batch 1 gradient");
    }
    // Hidden keys of batch 0 get no gradient either.
    for j in [0, 2] {
        assert!(
            r[2][j * 4..j * 4 + 4].iter().all(|&x| x == 0.0),
            "dk of hidden key {j}"
        );
        assert!(
            r[3][j * 4..j * 4 + 4].iter().all(|&x| x == 0.0),
            "dv of hidden key {j}"
        );
    }
    Ok(())
}

#[test]
fn one_visible_key_returns_its_value() -> Result<()> {
    // Causal: query 0 sees only key 0, so o[0] = v[0] whatever the scores.
    let q = randn(&[1, 1, 4, 8], DType::F64, 11);
    let k = randn(&[1, 1, 6, 8], DType::F64, 12);
    let v = randn(&[1, 1, 6, 8], DType::F64, 13);
    for o in [
        q.attention_fused(&k, &v, None, true, 0.3)?,
        q.attention_composite(&k, &v, None, true, 0.3)?,
    ] {
        let (o, v) = (o.to_vec_f64()?, v.to_vec_f64()?);
        for c in 0..8 {
            assert!((o[c] - v[c]).abs() < 1e-14, "{} vs {}", o[c], v[c]);
        }
    }
    Ok(())
}

#[test]
fn sdpa_defaults_to_one_over_sqrt_d_and_runs_the_composite_on_the_cpu() -> Result<()> {
    let q = randn(&[1, 2, 5, 16], DType::F32, 21);
    let k = randn(&[1, 2, 6, 16], DType::F32, 22);
    let v = randn(&[1, 2, 6, 16], DType::F32, 23);
    let a = scaled_dot_product_attention(&q, &k, &v, None, false, None)?;
    let b = q.attention_composite(&k, &v, None, false, 0.25)?;
    assert_eq!(a.to_vec_f64()?, b.to_vec_f64()?);
    // A broadcast (1, Lk) mask equals the (B, Lk) one.
    let q2 = randn(&[2, 1, 3, 8], DType::F32, 24);
    let k2 = randn(&[2, 1, 4, 8], DType::F32, 25);
    let m1 = Tensor::from_slice(&[1f32, 0., 1., 1.], (1, 4), &CPU)?;
    let m2 = Tensor::from_slice(&[1f32, 0., 1., 1., 1., 0., 1., 1.], (2, 4), &CPU)?;
    let x = q2.attention_fused(&k2, &k2, Some(&m1), false, 0.4)?;
    let y = q2.attention_fused(&k2, &k2, Some(&m2), false, 0.4)?;
    assert_eq!(x.to_vec_f64()?, y.to_vec_f64()?);
    Ok(())
}

#[test]
fn bad_shapes_and_dtypes_are_errors_naming_attention() {
    let t = |s: &[usize]| randn(s, DType::F32, 31);
    let (q, k) = (t(&[1, 2, 5, 8]), t(&[1, 2, 6, 8]));
    let cases: Vec<(&str, Result<Tensor>)> = vec![
        (
            "rank 3 q",
            t(&[2, 5, 8]).attention_fused(&k, &k, None, false, 1.0),
        ),
        (
            "head dims differ",
            q.attention_fused(&t(&[1, 2, 6, 4]), &k, None, false, 1.0),
        ),
        (
            "heads differ",
            q.attention_composite(&t(&[1, 3, 6, 8]), &k, None, false, 1.0),
        ),
        (
            "k and v lengths differ",
            q.attention_fused(&k, &t(&[1, 2, 7, 8]), None, false, 1.0),
        ),
        (
            "mask length",
            q.attention_fused(&k, &k, Some(&t(&[1, 5])), false, 1.0),
        ),
        (
            "dtype",
            q.attention_fused(&k.to_dtype(DType::F64).unwrap(), &k, None, false, 1.0),
        ),
        ("scale", q.attention_fused(&k, &k, None, false, f64::NAN)),
    ];
    for (what, r) in cases {
        let e = r.expect_err(what);
        assert!(
            matches!(
                e,
                Error::InvalidArgument { .. }
                    | Error::ShapeMismatch { .. }
                    | Error::DTypeMismatch { .. }
            ) && e.to_string().contains("attention"),
            "{what}: {e}"
        );
    }
}

#[test]
fn large_attention_on_the_cpu_runs_row_by_row() -> Result<()> {
    // Scores of 1 x 1 x 8200 x 8200 f32 (269 MB) pass the composite's limit: the fused pass
    // runs, so the result is its own, bit for bit.
    let l = 8200;
    assert!((l * l * 4) as u64 > flame::nn::CPU_COMPOSITE_SCORES);
    let q = randn(&[1, 1, l, 8], DType::F32, 41);
    let k = randn(&[1, 1, l, 8], DType::F32, 42);
    let v = randn(&[1, 1, l, 8], DType::F32, 43);
    let a = scaled_dot_product_attention(&q, &k, &v, None, false, None)?;
    let f = q.attention_fused(&k, &v, None, false, 1.0 / 8f64.sqrt())?;
    assert_eq!(a.to_vec_f64()?, f.to_vec_f64()?);
    Ok(())
}
