//! The one tolerance table of the test suites: for each kind of comparison and dtype, the
//! bound that follows from how the compared results are rounded. Shared by the CPU suites
//! (`common::tol`, conv, pipeline), the suites on every device (`devices::oracle`: kernels,
//! primitives) and the flash attention tests (attention/flash.rs).
#![allow(dead_code)]

use flame::DType;

/// What a result is compared against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Against {
    /// A reference computed in f64 from the same inputs: half types are computed in f32 and
    /// rounded once, so their error is about half an ulp of the result (2^-9 for bf16, 2^-12
    /// for f16).
    F64,
    /// The CPU backend, for a CUDA result: both compute half types in f32 and round once;
    /// CUDA's math functions differ from libm by a few f32 ulps, so a half-type result near
    /// a rounding boundary may land one ulp apart (2^-8 relative for bf16, 2^-11 for f16).
    Cpu,
    /// The composite attention (matmul, softmax, matmul in f32 on the same rounded inputs),
    /// for the flash kernels, as max |flash - reference| over max |reference| per tensor
    /// (the rtol; atol 0): the kernels round P (and dS) to the input type before their
    /// tensor-core products and each output once, 2^-9 (bf16) or 2^-12 (f16) a term averaging
    /// out over the sums; the bounds leave about 2x over the measured worst cases.
    Composite,
    /// A whole network's output (a text encoder through its layers) against its f64
    /// reference, as max |got - want| over max |want| (the rtol; atol 0): f32 1e-4 (measured
    /// 9.9e-6 on the CPU, 9.6e-6 on an H100: T5's context at 512 tokens); bf16's 8-bit
    /// mantissas (2^-8 a rounding) through every layer 0.1 (measured 5.2e-2 on an H100: T5's
    /// context at 32 tokens).
    Network,
}

/// (atol, rtol) for a result of `dt` compared `against`.
pub fn tolerance(against: Against, dt: DType) -> (f64, f64) {
    match (against, dt) {
        (_, DType::U32) => (0.0, 0.0),
        (Against::F64, DType::F64) => (1e-12, 1e-12),
        (Against::F64, DType::F32) => (1e-6, 1e-5),
        (Against::F64, DType::BF16) => (1e-3, 1e-2),
        (Against::F64, DType::F16) => (1e-4, 2e-3),
        (Against::Cpu, DType::F64) => (1e-12, 1e-12),
        (Against::Cpu, DType::F32) => (1e-6, 2e-6),
        (Against::Cpu, DType::BF16) => (1e-6, 7.9e-3),
        (Against::Cpu, DType::F16) => (1e-6, 9.8e-4),
        (Against::Composite, DType::BF16) => (0.0, 1e-2),
        (Against::Composite, _) => (0.0, 2e-3),
        (Against::Network, DType::BF16) => (0.0, 0.1),
        (Against::Network, _) => (0.0, 1e-4),
    }
}
