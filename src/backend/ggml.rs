//! GGML tensor types: the block layouts of the tensors a GGUF file holds (F32, F16, BF16 and
//! the quantized Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), and their
//! dequantization on the host, the reference cuda/ggml.cu is tested against.
//!
//! The layouts are ggml's (ggml/src/ggml-common.h, `block_q4_0` ... `block_q6_K`; the
//! dequantizers of ggml/src/ggml-quants.c, `dequantize_row_*`), with the values in the order
//! and the f32 arithmetic of gguf-py's `gguf.quants` (`dequantize_blocks` of each class), so
//! the values here are gguf-py's bit for bit (tests/gguf.rs, from fixtures made by
//! scripts/make_gguf_fixtures.py). A row of `cols` values is `cols / block_values` blocks;
//! a tensor's rows follow each other without padding. Every scale is an IEEE f16 (`d`,
//! `dmin`), little-endian.
//!
//! Per block, `q` the stored integers, `j` the value's index in the block:
//!
//! | type | values | bytes | layout | value |
//! |---|---|---|---|---|
//! | Q4_0 | 32 | 18 | d, qs\[16\] (j < 16 low nibbles, then high) | d (q - 8) |
//! | Q4_1 | 32 | 20 | d, m, qs\[16\] | d q + m |
//! | Q5_0 | 32 | 22 | d, qh (u32: bit j), qs\[16\] | d (q - 16) |
//! | Q5_1 | 32 | 24 | d, m, qh, qs\[16\] | d q + m |
//! | Q8_0 | 32 | 34 | d, qs\[32\] i8 | d q |
//! | Q2_K | 256 | 84 | scales\[16\] (4-bit scale, 4-bit min), qs\[64\] 2-bit, d, dmin | d sc q - dmin m |
//! | Q3_K | 256 | 110 | hmask\[32\], qs\[64\] 2-bit, scales\[12\] (16 6-bit), d | d (sc - 32) (q - 4 h') |
//! | Q4_K | 256 | 144 | d, dmin, scales\[12\] (8 6-bit scales, 8 6-bit mins), qs\[128\] | d sc q - dmin m |
//! | Q5_K | 256 | 176 | d, dmin, scales\[12\], qh\[32\], qs\[128\] | d sc q - dmin m |
//! | Q6_K | 256 | 210 | ql\[128\], qh\[64\], scales\[16\] i8, d | d sc (q - 32) |

/// The types this crate reads, by their ggml ids (ggml.h `enum ggml_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    /// IEEE f32 (id 0).
    F32,
    /// IEEE f16 (id 1).
    F16,
    /// bfloat16 (id 30).
    BF16,
    /// 32 values: f16 scale, 4-bit codes (id 2).
    Q4_0,
    /// 32 values: f16 scale and minimum, 4-bit codes (id 3).
    Q4_1,
    /// 32 values: f16 scale, 5-bit codes (id 6).
    Q5_0,
    /// 32 values: f16 scale and minimum, 5-bit codes (id 7).
    Q5_1,
    /// 32 values: f16 scale, 8-bit codes (id 8).
    Q8_0,
    /// 256 values in 16 groups of 16: 2-bit codes (id 10).
    Q2_K,
    /// 256 values in 16 groups of 16: 3-bit codes (id 11).
    Q3_K,
    /// 256 values in 8 groups of 32: 4-bit codes (id 12).
    Q4_K,
    /// 256 values in 8 groups of 32: 5-bit codes (id 13).
    Q5_K,
    /// 256 values in 16 groups of 16: 6-bit codes (id 14).
    Q6_K,
}

/// The values of a K-quant super-block (ggml-common.h `QK_K`).
pub const QK_K: usize = 256;

impl GgmlType {
    /// Every type, in id order.
    pub const ALL: [GgmlType; 13] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::BF16,
    ];

    /// The type of ggml id `id`, if this crate reads it.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.id() == id)
    }

    /// Its ggml id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::BF16 => 30,
        }
    }

    /// Its name as ggml spells it (`Q4_K`), lower-cased in kernel names.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2_K => "Q2_K",
            GgmlType::Q3_K => "Q3_K",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
        }
    }

    /// Values a block holds.
    pub fn block_values(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                32
            }
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
                QK_K
            }
        }
    }

    /// Bytes a block takes (ggml-common.h's `static_assert`s on each `block_*`).
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 2 + 16,
            GgmlType::Q4_1 => 4 + 16,
            GgmlType::Q5_0 => 2 + 4 + 16,
            GgmlType::Q5_1 => 4 + 4 + 16,
            GgmlType::Q8_0 => 2 + 32,
            GgmlType::Q2_K => QK_K / 16 + QK_K / 4 + 4,
            GgmlType::Q3_K => QK_K / 8 + QK_K / 4 + 12 + 2,
            GgmlType::Q4_K => 4 + 12 + QK_K / 2,
            GgmlType::Q5_K => 4 + 12 + QK_K / 8 + QK_K / 2,
            GgmlType::Q6_K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
        }
    }

    /// Whether it is a block-quantized type (not F32, F16 or BF16).
    pub fn is_quantized(self) -> bool {
        self.block_values() > 1
    }

    /// Bytes of `values` values, `None` when they are not whole blocks (or overflow).
    pub fn bytes_of(self, values: usize) -> Option<usize> {
        let bv = self.block_values();
        if values % bv != 0 {
            return None;
        }
        (values / bv).checked_mul(self.block_bytes())
    }
}

/// The name of a ggml type id this crate does not read (for errors), if ggml has one.
pub fn unsupported_name(id: u32) -> Option<&'static str> {
    Some(match id {
        9 => "Q8_1",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return None,
    })
}

/// Bytes packed little end first into u32 words (the last one padded with zeros): how a
/// packed weight is held in a tensor, FLAME having no u8 dtype.
pub fn to_words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect()
}

/// The bytes of `words` (the inverse of [`to_words`], with the padding).
pub fn word_bytes(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantizes `out.len()` values of type `ty` from `bytes` (whole blocks, `bytes` holding
/// at least their bytes) into `out`, in f32. `Err` says what does not fit.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> std::result::Result<(), String> {
    use rayon::prelude::*;
    let (bv, bb) = (ty.block_values(), ty.block_bytes());
    let need = ty.bytes_of(out.len()).ok_or_else(|| {
        format!(
            "{} values are not whole {} blocks of {bv}",
            out.len(),
            ty.name()
        )
    })?;
    if bytes.len() < need {
        return Err(format!(
            "{} values of {} take {need} bytes, {} given",
            out.len(),
            ty.name(),
            bytes.len()
        ));
    }
    let block: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => |b, y| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b, y| y[0] = f16_at(b, 0),
        GgmlType::BF16 => |b, y| y[0] = half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q2_K => q2_k,
        GgmlType::Q3_K => q3_k,
        GgmlType::Q4_K => q4_k,
        GgmlType::Q5_K => q5_k,
        GgmlType::Q6_K => q6_k,
    };
    // Chunks of many blocks a task (one value a block would be a task a value for F32).
    let per_task = (4096 / bv).max(1);
    out.par_chunks_mut(bv * per_task)
        .zip(bytes[..need].par_chunks(bb * per_task))
        .for_each(|(y, b)| {
            for (y, b) in y.chunks_mut(bv).zip(b.chunks(bb)) {
                block(b, y);
            }
        });
    Ok(())
}

// The block dequantizers: gguf-py's arithmetic in f32 (quants.py), ggml's layouts
// (ggml-common.h). `y` holds the block's values.

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = d * (f32::from(q & 0x0F) - 8.0);
        y[j + 16] = d * (f32::from(q >> 4) - 8.0);
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..16 {
        let q = b[4 + j];
        y[j] = d * f32::from(q & 0x0F) + m;
        y[j + 16] = d * f32::from(q >> 4) + m;
    }
}

/// The 5-bit code `j` of a Q5 block whose high bits are `qh` and low nibbles `qs`.
fn q5_code(qh: u32, qs: &[u8], j: usize) -> u8 {
    let lo = if j < 16 {
        qs[j] & 0x0F
    } else {
        qs[j - 16] >> 4
    };
    lo | ((((qh >> j) & 1) as u8) << 4)
}

fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, v) in y.iter_mut().enumerate().take(32) {
        *v = d * (f32::from(q5_code(qh, &b[6..], j)) - 16.0);
    }
}

fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, v) in y.iter_mut().enumerate().take(32) {
        *v = d * f32::from(q5_code(qh, &b[8..], j)) + m;
    }
}

fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, v) in y.iter_mut().enumerate().take(32) {
        *v = f32::from(b[2 + j] as i8) * d;
    }
}

fn q2_k(b: &[u8], y: &mut [f32]) {
    // scales[16] | qs[64] | d | dmin
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (j, v) in y.iter_mut().enumerate().take(QK_K) {
        let (half, shift, l) = (j / 128, (j % 128) / 32, j % 32);
        let q = (qs[half * 32 + l] >> (2 * shift)) & 3;
        let s = scales[j / 16];
        let dl = d * f32::from(s & 0x0F);
        let ml = dmin * f32::from(s >> 4);
        *v = dl * f32::from(q) - ml;
    }
}

fn q3_k(b: &[u8], y: &mut [f32]) {
    // hmask[32] | qs[64] | scales[12] | d
    let (hmask, qs, sc) = (&b[..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    let scale = |i: usize| -> f32 {
        let lo = if i < 8 { sc[i] & 0x0F } else { sc[i - 8] >> 4 };
        let hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        f32::from(((lo | (hi << 4)) as i8) - 32)
    };
    for (j, v) in y.iter_mut().enumerate().take(QK_K) {
        let (half, shift, l) = (j / 128, (j % 128) / 32, j % 32);
        let lo = ((qs[half * 32 + l] >> (2 * shift)) & 3) as i8;
        // The high bit set means no offset (gguf-py: "the offset is zero when the bitmask is 1").
        let h = ((hmask[l] >> (j / 32)) & 1) ^ 1;
        let q = lo - ((h << 2) as i8);
        *v = (d * scale(j / 16)) * f32::from(q);
    }
}

/// Scale and minimum of group `g` (0..8) of a Q4_K / Q5_K block's 12 scale bytes.
fn k_scale_min(sc: &[u8], g: usize) -> (u8, u8) {
    if g < 4 {
        (sc[g] & 0x3F, sc[g + 4] & 0x3F)
    } else {
        let (d, m, md) = (sc[g - 4], sc[g], sc[g + 4]);
        (
            (md & 0x0F) | ((d >> 2) & 0x30),
            (md >> 4) | ((m >> 2) & 0x30),
        )
    }
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    // d | dmin | scales[12] | qs[128]
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, qs) = (&b[4..16], &b[16..144]);
    for g in 0..8 {
        let (s, m) = k_scale_min(sc, g);
        let (dl, ml) = (d * f32::from(s), dmin * f32::from(m));
        for l in 0..32 {
            let q = (qs[(g / 2) * 32 + l] >> (4 * (g % 2))) & 0x0F;
            y[g * 32 + l] = dl * f32::from(q) - ml;
        }
    }
}

fn q5_k(b: &[u8], y: &mut [f32]) {
    // d | dmin | scales[12] | qh[32] | qs[128]
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for g in 0..8 {
        let (s, m) = k_scale_min(sc, g);
        let (dl, ml) = (d * f32::from(s), dmin * f32::from(m));
        for l in 0..32 {
            let lo = (qs[(g / 2) * 32 + l] >> (4 * (g % 2))) & 0x0F;
            let q = lo | (((qh[l] >> g) & 1) << 4);
            y[g * 32 + l] = dl * f32::from(q) - ml;
        }
    }
}

fn q6_k(b: &[u8], y: &mut [f32]) {
    // ql[128] | qh[64] | scales[16] i8 | d
    let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (j, v) in y.iter_mut().enumerate().take(QK_K) {
        let (half, r) = (j / 128, j % 128);
        let lo = (ql[half * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
        let hi = (qh[half * 32 + r % 32] >> (2 * (r / 32))) & 3;
        let q = ((lo | (hi << 4)) as i8) - 32;
        *v = (d * f32::from(sc[j / 16] as i8)) * f32::from(q);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_sizes_match_ggml() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert!(unsupported_name(t.id()).is_none());
        }
        // ggml-common.h: sizeof(block_q4_K) = 2*2 + 12 + 128, block_q6_K = 128 + 64 + 16 + 2.
        assert_eq!(GgmlType::Q4_K.block_bytes(), 144);
        assert_eq!(GgmlType::Q5_K.block_bytes(), 176);
        assert_eq!(GgmlType::Q6_K.block_bytes(), 210);
        assert_eq!(GgmlType::Q2_K.block_bytes(), 84);
        assert_eq!(GgmlType::Q3_K.block_bytes(), 110);
        assert_eq!(GgmlType::Q8_0.bytes_of(64), Some(68));
        assert_eq!(GgmlType::Q8_0.bytes_of(33), None);
    }

    #[test]
    fn q8_0_and_q4_0_by_hand() {
        // d = 0.5 (f16 0x3800): code -4 -> -2, code 127 -> 63.5.
        let mut b = vec![0x00, 0x38];
        b.extend((0..32).map(|i| if i == 0 { (-4i8) as u8 } else { 127 }));
        let mut y = [0f32; 32];
        dequantize(GgmlType::Q8_0, &b, &mut y).unwrap();
        assert_eq!(y[0], -2.0);
        assert_eq!(y[31], 63.5);
        // Q4_0, d = 2: byte 0x9F gives value 0 code 15 -> 14 and value 16 code 9 -> 2.
        let mut b = vec![0x00, 0x40, 0x9F];
        b.extend([0u8; 15]);
        dequantize(GgmlType::Q4_0, &b, &mut y).unwrap();
        assert_eq!((y[0], y[16], y[1]), (14.0, 2.0, -16.0));
        assert!(dequantize(GgmlType::Q4_0, &b[..17], &mut y).is_err());
        assert!(dequantize(GgmlType::Q4_0, &b, &mut y[..31]).is_err());
    }

    #[test]
    fn words_round_trip_with_padding() {
        let b: Vec<u8> = (0..7).collect();
        let w = to_words(&b);
        assert_eq!(w, vec![0x0302_0100, 0x0006_0504]);
        assert_eq!(&word_bytes(&w)[..7], &b[..]);
    }
}
