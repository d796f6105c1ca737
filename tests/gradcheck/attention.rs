//! Gradcheck cases of attention: the fused kernel (`attention_fused`, whose CPU backward is the
//! reference of the flash kernels') and its composite twin, with masks, causality, Lq != Lk
//! and views. Part of the gradcheck executable.

use super::{on, Case, Inputs, CPU};
use flame::Tensor;

/// A key padding mask (B, Lk) from 0/1 flags.
fn mask(flags: &[f64], b: usize) -> Tensor {
    Tensor::from_slice(flags, (b, flags.len() / b), &CPU).unwrap()
}

pub(super) fn cases(g: &mut Inputs) -> Vec<Case> {
    // Batch 1 of this mask hides every key: its rows output 0 and pass no gradient.
    let m25 = mask(&[1., 0., 1., 1., 0., 0., 0., 0., 0., 0.], 2);
    let m27 = mask(&[1., 1., 0., 1., 1., 1., 0., 1., 0., 1., 1., 1., 1., 1.], 2);
    vec![
        Case::new(
            "attention fused, Lq != Lk",
            vec![g.n([1, 2, 5, 4]), g.n([1, 2, 7, 4]), g.n([1, 2, 7, 4])],
            |x| x[0].attention_fused(&x[1], &x[2], None, false, 0.5),
        )
        .expect(&["attention"])
        .forbid(&["softmax", "matmul"]),
        Case::new(
            "attention fused causal, Lq > Lk",
            vec![g.n([2, 1, 6, 3]), g.n([2, 1, 4, 3]), g.n([2, 1, 4, 3])],
            |x| x[0].attention_fused(&x[1], &x[2], None, true, 0.7),
        )
        .expect(&["attention"]),
        Case::new(
            "attention fused, key mask with a fully hidden batch",
            vec![g.n([2, 2, 3, 4]), g.n([2, 2, 5, 4]), g.n([2, 2, 5, 4])],
            {
                let m = m25.clone();
                move |x| x[0].attention_fused(&x[1], &x[2], Some(&on(&m, &x[0])?), false, 0.6)
            },
        )
        .expect(&["attention"]),
        Case::new(
            "attention fused, mask and causal",
            vec![g.n([2, 1, 8, 4]), g.n([2, 1, 7, 4]), g.n([2, 1, 7, 4])],
            {
                let m = m27.clone();
                move |x| x[0].attention_fused(&x[1], &x[2], Some(&on(&m, &x[0])?), true, 0.5)
            },
        )
        .expect(&["attention"]),
        Case::new(
            "attention fused on views of one qkv projection (B, L, 3, H, D)",
            vec![g.n([2, 5, 3, 2, 4])],
            |x| {
                let qkv = x[0].permute(&[2, 0, 3, 1, 4])?;
                let part = |i| qkv.narrow(0, i, 1)?.squeeze(0);
                let (q, k, v) = (part(0)?, part(1)?, part(2)?);
                q.attention_fused(&k, &v, None, false, 0.5)
            },
        )
        .expect(&["attention"]),
        Case::new(
            "attention composite, mask and causal",
            vec![g.n([2, 2, 4, 3]), g.n([2, 2, 5, 3]), g.n([2, 2, 5, 3])],
            {
                let m = m25.clone();
                move |x| x[0].attention_composite(&x[1], &x[2], Some(&on(&m, &x[0])?), true, 0.6)
            },
        )
        .expect(&["softmax", "matmul", "where"]),
    ]
}
