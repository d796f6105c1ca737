//! Helpers of the optimizer test files.

use flame::{DType, Device, Error, Grads, Result, Tensor};

/// Independent copies of the parameters as new trainable leaves (new storage, same values and
/// device: what a resumed run would load).
pub fn copies(params: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    params
        .iter()
        .map(|(n, t)| {
            let c = Tensor::from_host(t.to_host().unwrap(), t.dims().to_vec(), t.device()).unwrap();
            c.set_requires_grad(true).unwrap();
            (n.clone(), c)
        })
        .collect()
}

/// The values' bits, for equality to the bit.
pub fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// The optimizer and message of an `Error::Optimizer`.
pub fn opt_err<T: std::fmt::Debug>(r: Result<T>) -> (&'static str, String) {
    match r {
        Err(Error::Optimizer { optimizer, msg }) => (optimizer, msg),
        other => panic!("expected Error::Optimizer, got {other:?}"),
    }
}

/// Deterministic pseudo-random numbers (64-bit LCG, Knuth's constants), uniform in [-1, 1).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// A trainable parameter of `dtype` on `dev` from f32 values.
pub fn param_on(v: Vec<f32>, dims: &[usize], dtype: DType, dev: &Device) -> Tensor {
    let t = Tensor::from_vec(v, dims.to_vec(), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let t = Tensor::from_host(t.to_host().unwrap(), dims.to_vec(), dev).unwrap();
    t.set_requires_grad(true).unwrap();
    t
}

/// Gradients of step `k`: a pull towards 0.5 plus pseudo-random noise, in each parameter's
/// dtype and device.
pub fn grads_at(params: &[(String, Tensor)], k: u64) -> Grads {
    let mut g = Grads::new();
    for (i, (_, p)) in params.iter().enumerate() {
        let mut r = Lcg(k * 1000 + i as u64 + 1);
        let v: Vec<f32> = p
            .to_vec_f64()
            .unwrap()
            .iter()
            .map(|&x| (x as f32 - 0.5) + 0.3 * r.next())
            .collect();
        let t = Tensor::from_vec(v, p.dims().to_vec(), &Device::Cpu)
            .unwrap()
            .to_dtype(p.dtype())
            .unwrap();
        g.insert(
            p,
            Tensor::from_host(t.to_host().unwrap(), p.dims().to_vec(), p.device()).unwrap(),
        );
    }
    g
}

pub fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_vec_f64().unwrap().iter().map(|&x| x as f32).collect()
}
