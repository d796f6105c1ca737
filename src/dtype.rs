//! Element types. Floating types are f32, f64, bf16 and f16 (the half types are computed in f32);
//! u32 holds indices (argmax results, index_select / gather / scatter_add indices).

use half::{bf16, f16};

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float (gradcheck and reference computations).
    F64,
    /// bfloat16: f32's exponent range with an 8-bit mantissa.
    BF16,
    /// IEEE half precision.
    F16,
    /// 32-bit unsigned integer, for indices.
    U32,
}

impl DType {
    /// The floating-point dtypes, in declaration order.
    pub const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

    /// Bytes per element: 2, 4 or 8.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F64 => 8,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// True for every dtype except `U32`.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::U32)
    }

    /// The lowercase name (`"f32"`, `"bf16"`, `"u32"`, ...), also the `Display` form.
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::U32 => "u32",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Rust element type that a tensor can hold.
pub trait WithDType:
    Copy + Send + Sync + 'static + std::fmt::Debug + PartialOrd + bytemuck::Pod
{
    /// The dtype of this Rust type.
    const DTYPE: DType;
    /// The value as f64 (exact for every dtype).
    fn to_f64(self) -> f64;
    /// The nearest value of this type (u32 truncates and saturates at 0 and `u32::MAX`).
    fn from_f64(v: f64) -> Self;
    /// Wraps a vector in the matching `CpuStorage` variant.
    fn to_storage(v: Vec<Self>) -> CpuStorage;
    /// The elements of `s` if it holds this type, else None.
    fn from_storage(s: &CpuStorage) -> Option<&[Self]>;
}

macro_rules! with_dtype {
    ($t:ty, $variant:ident, $to:expr, $from:expr) => {
        impl WithDType for $t {
            const DTYPE: DType = DType::$variant;
            fn to_f64(self) -> f64 {
                $to(self)
            }
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            fn to_storage(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(v)
            }
            fn from_storage(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
with_dtype!(f32, F32, |x: f32| x as f64, |v: f64| v as f32);
with_dtype!(f64, F64, |x: f64| x, |v: f64| v);
with_dtype!(bf16, BF16, |x: bf16| x.to_f64(), bf16_nearest);
with_dtype!(f16, F16, |x: f16| x.to_f64(), f16_nearest);
// Saturating: negative values become 0, values past u32::MAX become u32::MAX.
with_dtype!(u32, U32, |x: u32| x as f64, |v: f64| v as u32);

/// Host memory of one dtype: the CPU backend's storage and the form data takes on its way to and
/// from files and other devices.
#[derive(Debug, Clone)]
pub enum CpuStorage {
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// f16 elements.
    F16(Vec<f16>),
    /// u32 elements.
    U32(Vec<u32>),
}

impl CpuStorage {
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::U32(_) => DType::U32,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            CpuStorage::U32(v) => v.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The raw little-endian bytes, as safetensors stores them.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            CpuStorage::F32(v) => bytemuck::cast_slice(v),
            CpuStorage::F64(v) => bytemuck::cast_slice(v),
            CpuStorage::BF16(v) => bytemuck::cast_slice(v),
            CpuStorage::F16(v) => bytemuck::cast_slice(v),
            CpuStorage::U32(v) => bytemuck::cast_slice(v),
        }
    }

    /// Decodes little-endian bytes of `dtype`; `bytes` need not be aligned.
    /// Returns None when the byte count is not a multiple of the element size.
    pub fn from_bytes(dtype: DType, bytes: &[u8]) -> Option<CpuStorage> {
        fn decode<T: bytemuck::Pod>(bytes: &[u8]) -> Option<Vec<T>> {
            let size = std::mem::size_of::<T>();
            if bytes.len() % size != 0 {
                return None;
            }
            match bytemuck::try_cast_slice::<u8, T>(bytes) {
                Ok(s) => Some(s.to_vec()),
                // Unaligned (a header length that is not a multiple of the element size).
                Err(_) => Some(
                    bytes
                        .chunks_exact(size)
                        .map(bytemuck::pod_read_unaligned)
                        .collect(),
                ),
            }
        }
        Some(match dtype {
            DType::F32 => CpuStorage::F32(decode(bytes)?),
            DType::F64 => CpuStorage::F64(decode(bytes)?),
            DType::BF16 => CpuStorage::BF16(decode(bytes)?),
            DType::F16 => CpuStorage::F16(decode(bytes)?),
            DType::U32 => CpuStorage::U32(decode(bytes)?),
        })
    }

    /// Every element as f64 (exact for all dtypes).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match self {
            CpuStorage::F32(v) => v.iter().map(|x| x.to_f64()).collect(),
            CpuStorage::F64(v) => v.clone(),
            CpuStorage::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            CpuStorage::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            CpuStorage::U32(v) => v.iter().map(|x| x.to_f64()).collect(),
        }
    }
}

/// Runs `$body` with `$v` bound to the Vec inside a CpuStorage, whatever its dtype.
#[macro_export]
#[doc(hidden)]
macro_rules! map_cpu_storage {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            $crate::CpuStorage::F32($v) => $crate::CpuStorage::F32($body),
            $crate::CpuStorage::F64($v) => $crate::CpuStorage::F64($body),
            $crate::CpuStorage::BF16($v) => $crate::CpuStorage::BF16($body),
            $crate::CpuStorage::F16($v) => $crate::CpuStorage::F16($body),
            $crate::CpuStorage::U32($v) => $crate::CpuStorage::U32($body),
        }
    };
}

/// The bf16 nearest to `v`, ties to even, as CUDA's `__float2bfloat16_rn` and PyTorch round.
/// `half::bf16::from_f64` loses the bits below its rounding bit: an f32 just above a tie
/// (0x66ee8004) came out rounded down. Here `v` goes to f32 rounded to odd (toward zero, the
/// last bit set where any was lost), which keeps what the second rounding needs, then to bf16
/// from the f32, which rounds correctly.
pub fn bf16_nearest(v: f64) -> bf16 {
    bf16::from_f32(f32_odd(v))
}

/// The f16 nearest to `v`, ties to even, as CUDA's `__float2half_rn` rounds: through the f32
/// rounded to odd (`bf16_nearest`), then from the f32, which rounds correctly, where
/// `half::f16::from_f64` may drop the bits below its rounding bit.
pub fn f16_nearest(v: f64) -> f16 {
    f16::from_f32(f32_odd(v))
}

/// `v` as f32 rounded to odd: toward zero, the last bit set where any bit was lost (`v`
/// itself where it is an f32, or not finite as one). A second rounding from it to a format of
/// at most 22 significant bits (bf16's 8, f16's 11) is the correct rounding of `v`.
fn f32_odd(v: f64) -> f32 {
    let f = v as f32;
    if !f.is_finite() || f64::from(f) == v {
        return f;
    }
    // `f` is `v` rounded to nearest; toward zero is `f` or the f32 before it.
    let mut bits = f.to_bits();
    if f64::from(f).abs() > v.abs() {
        bits -= 1;
    }
    f32::from_bits(bits | 1)
}
