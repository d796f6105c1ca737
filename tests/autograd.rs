//! Autograd with some inputs frozen: recorded ops keep by value only what their VJP reads
//! given which inputs need gradients (the rest are graph edges without storage), and VJPs
//! compute gradients only for inputs that need them. The gradients of the trainable inputs
//! must equal those of a run where everything is trainable, bit for bit (same ops, same order).
#![cfg(feature = "cpu-ref")]

use flame::{DType, Device, Grads, Result, Tensor};

const CPU: Device = Device::Cpu;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape.to_vec(), DType::F64, &CPU, seed).unwrap()
}

/// A block touching every op kind that slims its record: matmul with a weight, mul and div
/// by tensors, modulate, exp / tanh / sqrt / recip (which read their outputs), softmax,
/// where, cat, narrow, broadcast, reshape, permute, cast, sum, index_select, rope.
fn block(x: &Tensor, w: &Tensor, s: &Tensor, ids: &Tensor, rot: &Tensor) -> Result<Tensor> {
    let h = x.matmul(w)?; // (6, 4)
    let h = h
        .mul(&s.broadcast_as((6, 4))?)?
        .add(&h.exp()?.affine(0.1, 0.0)?)?;
    let h = h.div(&s.sqr()?.add_scalar(1.0)?.sqrt()?.broadcast_as((6, 4))?)?;
    let m = h
        .reshape((1, 6, 4))?
        .modulate(&s.reshape((1, 4))?, &s.tanh()?.reshape((1, 4))?)?;
    let sm = m.softmax(2)?.reshape((6, 4))?;
    let pos = sm.cmp_scalar(0.2, flame::CmpOp::Gt)?;
    let wh = pos.where_cond(&sm, &h.recip()?.clamp(-3.0, 3.0)?)?;
    let c = Tensor::cat(
        &[
            &wh.narrow(0, 0, 3)?,
            &h.permute(&[1, 0])?.t()?.narrow(0, 3, 3)?,
        ],
        0,
    )?;
    let r = c
        .reshape((1, 2, 3, 4))?
        .apply_rope(rot)?
        .reshape((6, 4))?
        .to_dtype(DType::F32)?
        .to_dtype(DType::F64)?;
    let picked = r.index_select(ids, 0)?;
    picked
        .sum_keepdim(&[1])?
        .mul(&picked.narrow(1, 0, 1)?)?
        .sum_all()
}

fn grads(x: &Tensor, w: &Tensor, s: &Tensor, train_params: bool) -> Result<(Grads, Tensor)> {
    let x = x.detach().requires_grad_()?;
    let (w, s) = if train_params {
        (w.detach().requires_grad_()?, s.detach().requires_grad_()?)
    } else {
        (w.detach(), s.detach())
    };
    let ids = Tensor::from_slice(&[0u32, 2, 5, 5, 1], 5, &CPU)?;
    let rot = randn(&[1, 3, 2, 2, 2], 9);
    let rot = rot.reshape(vec![1, 1, 3, 2, 2, 2])?;
    let g = block(&x, &w, &s, &ids, &rot)?.backward()?;
    Ok((g, x))
}

#[test]
fn frozen_operands_leave_the_trainable_gradients_unchanged() -> Result<()> {
    let (x, w, s) = (randn(&[6, 5], 1), randn(&[5, 4], 2), randn(&[4], 3));
    let (all, xa) = grads(&x, &w, &s, true)?;
    let (frozen, xf) = grads(&x, &w, &s, false)?;
    let (ga, gf) = (all.get(&xa).unwrap(), frozen.get(&xf).unwrap());
    assert_eq!(ga.to_vec_f64()?, gf.to_vec_f64()?);
    assert!(ga.to_vec_f64()?.iter().any(|v| *v != 0.0));
    // Only x is a leaf with a gradient in the frozen run.
    assert_eq!(frozen.len(), 1);
    Ok(())
}

#[test]
fn frozen_activation_side_of_a_matmul_still_trains_the_weight() -> Result<()> {
    // The other way round: x frozen, w trainable; x must be kept by value for dW = x^T g.
    let (x, w) = (randn(&[6, 5], 4), randn(&[5, 4], 5));
    let wv = w.detach().requires_grad_()?;
    let y = x.matmul(&wv)?.tanh()?.sum_all()?;
    let g = y.backward()?;
    let dw = g.get(&wv).unwrap().to_vec_f64()?;
    // Reference: dW = x^T (1 - tanh^2(x w)) by loops.
    let (xv, wvv) = (x.to_vec_f64()?, w.to_vec_f64()?);
    for i in 0..5 {
        for j in 0..4 {
            let mut acc = 0.0;
            for r in 0..6 {
                let z: f64 = (0..5).map(|k| xv[r * 5 + k] * wvv[k * 4 + j]).sum();
                acc += xv[r * 5 + i] * (1.0 - z.tanh().powi(2));
            }
            assert!((dw[i * 4 + j] - acc).abs() < 1e-12, "dW[{i},{j}]");
        }
    }
    Ok(())
}

/// Sizes of the head-split case: batch, tokens, heads, head dim, MLP width, and the
/// projection's width (2 columns past the MLP's are never read).
const SPLIT: (usize, usize, usize, usize, usize) = (2, 5, 3, 4, 6);

fn split_width() -> usize {
    let (_, _, heads, e, m) = SPLIT;
    3 * heads * e + m + 2
}

/// The gradient of `x` (B, N, width) through heads split off a fused projection h = 2 x (q, k,
/// v permuted to (B, H, N, E), as Flux's and FLUX.2's single blocks split `linear1`'s output)
/// beside an MLP part of h, each multiplied by a constant and summed; with `again`, k's
/// columns of h are read a second time (squared) past the split. Inputs are drawn in f64 on
/// the CPU and cast to `dtype` on `dev`.
fn head_split_grad(dev: &Device, dtype: DType, again: bool) -> Result<Vec<f64>> {
    let (b, n, heads, e, m) = SPLIT;
    let d = heads * e;
    let on = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
    let x = on(randn(&[b, n, split_width()], 11))?.requires_grad_()?;
    let c = (0..3)
        .map(|i| on(randn(&[b, heads, n, e], 12 + i)))
        .collect::<Result<Vec<_>>>()?;
    let cm = on(randn(&[b, n, m], 15))?;
    let h = x.affine(2.0, 0.0)?;
    let (q, k, v) = flame::nn::split_qkv(&h.narrow(2, 0, 3 * d)?, heads)?;
    let mlp = h.narrow(2, 3 * d, m)?;
    let mut loss = q
        .mul(&c[0])?
        .sum_all()?
        .add(&k.mul(&c[1])?.sum_all()?)?
        .add(&v.mul(&c[2])?.sum_all()?)?
        .add(&mlp.mul(&cm)?.sum_all()?)?;
    if again {
        loss = loss.add(&h.narrow(2, d, d)?.sqr()?.sum_all()?)?;
    }
    let g = loss.backward()?;
    g.get(&x).unwrap().to_vec_f64()
}

/// The gradients of heads split off a fused projection land in the projection's gradient
/// where each head's values came from, the MLP's part beside them and zeros where no part was
/// read; with one head's gradient reaching the projection twice (read again past the split),
/// the sum is the fold's.
#[test]
fn heads_split_off_a_fused_projection_lay_their_gradients_in_place() -> Result<()> {
    let (b, n, heads, e, m) = SPLIT;
    let (d, width) = (heads * e, split_width());
    let cv: Vec<Vec<f64>> = (0..3)
        .map(|i| randn(&[b, heads, n, e], 12 + i).to_vec_f64().unwrap())
        .collect();
    let cmv = randn(&[b, n, m], 15).to_vec_f64()?;
    let hv = randn(&[b, n, width], 11).affine(2.0, 0.0)?.to_vec_f64()?;
    for again in [false, true] {
        let got = head_split_grad(&CPU, DType::F64, again)?;
        for bi in 0..b {
            for ni in 0..n {
                for col in 0..width {
                    let at = (bi * n + ni) * width + col;
                    let want = if col < 3 * d {
                        let (part, hh, ee) = (col / d, (col % d) / e, col % e);
                        let mut w = cv[part][((bi * heads + hh) * n + ni) * e + ee];
                        if again && part == 1 {
                            w += 2.0 * hv[at];
                        }
                        2.0 * w
                    } else if col < 3 * d + m {
                        2.0 * cmv[(bi * n + ni) * m + col - 3 * d]
                    } else {
                        0.0
                    };
                    assert!(
                        (got[at] - want).abs() < 1e-12,
                        "again {again} [{bi},{ni},{col}]: {} vs {want}",
                        got[at]
                    );
                }
            }
        }
    }
    Ok(())
}

/// The same on CUDA, bit for bit the CPU's in f32 and bf16 (every value is a copy, a product
/// by a power of two or one rounded sum of two).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn heads_split_off_a_fused_projection_lay_their_gradients_in_place_on_cuda() -> Result<()> {
    let gpu = Device::cuda(0)?;
    for dtype in [DType::F32, DType::BF16] {
        for again in [false, true] {
            assert_eq!(
                head_split_grad(&gpu, dtype, again)?,
                head_split_grad(&CPU, dtype, again)?,
                "{dtype} again {again}"
            );
        }
    }
    Ok(())
}
