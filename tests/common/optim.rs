//! Helpers of the optimizer test files.

use flame::{Error, Result, Tensor};

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
