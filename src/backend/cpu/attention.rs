//! Attention on the CPU, the reference of the CUDA flash kernels: every row in f64, one key at
//! a time, so like them it never holds an Lq x Lk matrix. Shape letters: B batch, H heads,
//! Lq queries, Lk keys, D head dim; q, o, dq are (B, H, Lq, D), k, v, dk, dv (B, H, Lk, D).

use rayon::prelude::*;

/// What every pass needs to know about one call.
pub(crate) struct Attn<'a> {
    pub h: usize,
    pub lq: usize,
    pub lk: usize,
    pub d: usize,
    pub causal: bool,
    pub scale: f64,
    /// keep (B, Lk): key j of batch b is visible where it is not 0.
    pub keep: Option<&'a [f64]>,
}

impl Attn<'_> {
    /// Whether query i of batch b sees key j.
    fn sees(&self, b: usize, i: usize, j: usize) -> bool {
        !(self.causal && j > i) && self.keep.is_none_or(|k| k[b * self.lk + j] != 0.0)
    }

    /// Scores scale q_i.k_j of the keys row i sees, as (j, score).
    fn scores(&self, bh: usize, i: usize, q: &[f64], k: &[f64]) -> Vec<(usize, f64)> {
        let d = self.d;
        let qi = &q[(bh * self.lq + i) * d..][..d];
        (0..self.lk)
            .filter(|&j| self.sees(bh / self.h, i, j))
            .map(|j| {
                let kj = &k[(bh * self.lk + j) * d..][..d];
                (j, self.scale * dot(qi, kj))
            })
            .collect()
    }

    /// (o, lse): o_i = sum_j softmax_j(s_ij) v_j, lse_i = log sum_j exp(s_ij); a row that
    /// sees no key gives o = 0, lse = +inf.
    pub fn forward(&self, bhs: usize, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let d = self.d;
        let mut o = vec![0.0; bhs * self.lq * d];
        let mut lse = vec![f64::INFINITY; bhs * self.lq];
        o.par_chunks_mut(d)
            .zip(lse.par_iter_mut())
            .enumerate()
            .for_each(|(row, (o, lse))| {
                let (bh, i) = (row / self.lq, row % self.lq);
                let s = self.scores(bh, i, q, k);
                let Some(m) = s.iter().map(|p| p.1).reduce(f64::max) else {
                    return;
                };
                let mut l = 0.0;
                for &(j, sj) in &s {
                    let p = (sj - m).exp();
                    l += p;
                    let vj = &v[(bh * self.lk + j) * d..][..d];
                    o.iter_mut().zip(vj).for_each(|(o, v)| *o += p * v);
                }
                o.iter_mut().for_each(|o| *o /= l);
                *lse = m + l.ln();
            });
        (o, lse)
    }

    /// (dq, dk, dv) from the saved o and lse, with P_ij = exp(s_ij - lse_i),
    /// dP_ij = do_i.v_j and dS_ij = P_ij (dP_ij - do_i.o_i):
    /// dq_i = scale sum_j dS_ij k_j, dk_j = scale sum_i dS_ij q_i, dv_j = sum_i P_ij do_i.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        bhs: usize,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        o: &[f64],
        dout: &[f64],
        lse: &[f64],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let d = self.d;
        let (nq, nk) = (self.lq * d, self.lk * d);
        let mut dq = vec![0.0; bhs * nq];
        let mut dk = vec![0.0; bhs * nk];
        let mut dv = vec![0.0; bhs * nk];
        dq.par_chunks_mut(nq)
            .zip(dk.par_chunks_mut(nk).zip(dv.par_chunks_mut(nk)))
            .enumerate()
            .for_each(|(bh, (dq, (dk, dv)))| {
                for i in 0..self.lq {
                    let row = bh * self.lq + i;
                    let (qi, doi) = (&q[row * d..][..d], &dout[row * d..][..d]);
                    let di = dot(doi, &o[row * d..][..d]);
                    for (j, sj) in self.scores(bh, i, q, k) {
                        let p = (sj - lse[row]).exp();
                        let kv = (bh * self.lk + j) * d;
                        let ds = p * (dot(doi, &v[kv..][..d]) - di);
                        let kj = &k[kv..][..d];
                        for c in 0..d {
                            dq[i * d + c] += self.scale * ds * kj[c];
                            dk[j * d + c] += self.scale * ds * qi[c];
                            dv[j * d + c] += p * doi[c];
                        }
                    }
                }
            });
        (dq, dk, dv)
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
