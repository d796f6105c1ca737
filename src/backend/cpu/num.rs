//! Numeric traits of the CPU backend: `Real` is the type arithmetic happens in (f32 or f64) and
//! `Elem` maps a stored float type onto it (bf16 and f16 compute in f32).

use half::{bf16, f16};
use std::ops::{Add, Div, Mul, Neg, Sub};

pub trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + 'static
{
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn tanh(self) -> Self;
    fn erf(self) -> Self;
    fn abs(self) -> Self;
    fn powf(self, e: Self) -> Self;
    fn is_nan(self) -> bool;
    /// -1, 0 or 1 (0 for 0 and NaN).
    fn sign(self) -> Self {
        let z = Self::from_f64(0.0);
        if self > z {
            Self::from_f64(1.0)
        } else if self < z {
            Self::from_f64(-1.0)
        } else {
            z
        }
    }
}

macro_rules! real {
    ($t:ty, $erf:path) => {
        impl Real for $t {
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn sin(self) -> Self {
                <$t>::sin(self)
            }
            #[inline]
            fn cos(self) -> Self {
                <$t>::cos(self)
            }
            #[inline]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline]
            fn erf(self) -> Self {
                $erf(self)
            }
            #[inline]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline]
            fn powf(self, e: Self) -> Self {
                <$t>::powf(self, e)
            }
            #[inline]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
        }
    };
}
real!(f32, libm::erff);
real!(f64, libm::erf);

// sqrt(2 / pi) and 0.044715: the tanh approximation of GELU (Hendrycks & Gimpel, 2016).
const GELU_TANH_SCALE: f64 = 0.797_884_560_802_865_4;
const GELU_TANH_CUBIC: f64 = 0.044_715;

/// GELU, its tanh form, SiLU and their derivatives, in the accumulation type. The CUDA kernels
/// (cuda/elementwise.cu) use the same formulas.
pub trait Activation: Real {
    fn half() -> Self {
        Self::from_f64(0.5)
    }
    fn one() -> Self {
        Self::from_f64(1.0)
    }
    /// Phi(x) = (1 + erf(x / sqrt 2)) / 2
    fn phi_cdf(self) -> Self {
        Self::half()
            * (Self::one() + (self * Self::from_f64(std::f64::consts::FRAC_1_SQRT_2)).erf())
    }
    fn gelu(self) -> Self {
        self * self.phi_cdf()
    }
    /// d/dx x Phi(x) = Phi(x) + x phi(x), phi(x) = e^{-x^2/2} / sqrt(2 pi)
    fn gelu_grad(self) -> Self {
        let pdf = (-(self * self) * Self::half()).exp() * Self::from_f64(0.398_942_280_401_432_7);
        self.phi_cdf() + self * pdf
    }
    fn gelu_tanh(self) -> Self {
        let u = Self::from_f64(GELU_TANH_SCALE)
            * (self + Self::from_f64(GELU_TANH_CUBIC) * self * self * self);
        Self::half() * self * (Self::one() + u.tanh())
    }
    /// d/dx x/2 (1 + tanh u) = (1 + t)/2 + x/2 (1 - t^2) k (1 + 3 c x^2), t = tanh u
    fn gelu_tanh_grad(self) -> Self {
        let (k, c) = (
            Self::from_f64(GELU_TANH_SCALE),
            Self::from_f64(GELU_TANH_CUBIC),
        );
        let t = (k * (self + c * self * self * self)).tanh();
        Self::half() * (Self::one() + t)
            + Self::half()
                * self
                * (Self::one() - t * t)
                * k
                * (Self::one() + Self::from_f64(3.0) * c * self * self)
    }
    /// sigmoid as (1 + tanh(x/2)) / 2: no overflow for any x.
    fn sigmoid(self) -> Self {
        Self::half() * (Self::one() + (self * Self::half()).tanh())
    }
    fn silu(self) -> Self {
        self * self.sigmoid()
    }
    /// d/dx x s(x) = s (1 + x (1 - s))
    fn silu_grad(self) -> Self {
        let s = self.sigmoid();
        s * (Self::one() + self * (Self::one() - s))
    }
}
impl<T: Real> Activation for T {}

pub trait Elem: crate::WithDType + Default {
    type Acc: Real;
    fn to_acc(self) -> Self::Acc;
    fn from_acc(v: Self::Acc) -> Self;
}

impl Elem for f32 {
    type Acc = f32;
    #[inline]
    fn to_acc(self) -> f32 {
        self
    }
    #[inline]
    fn from_acc(v: f32) -> Self {
        v
    }
}
impl Elem for f64 {
    type Acc = f64;
    #[inline]
    fn to_acc(self) -> f64 {
        self
    }
    #[inline]
    fn from_acc(v: f64) -> Self {
        v
    }
}
impl Elem for bf16 {
    type Acc = f32;
    #[inline]
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    #[inline]
    fn from_acc(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
impl Elem for f16 {
    type Acc = f32;
    #[inline]
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    #[inline]
    fn from_acc(v: f32) -> Self {
        f16::from_f32(v)
    }
}
