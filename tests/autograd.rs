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
