//! A small GGUF writer and random GGML blocks for the GGUF tests: the format as
//! src/gguf.rs describes it (version, counts, key/values, tensor table, aligned data).
#![allow(dead_code)]

use flame::backend::ggml::GgmlType;

/// A metadata value to write: (GGUF value type, its bytes).
pub fn kv_u32(v: u32) -> (u32, Vec<u8>) {
    (4, v.to_le_bytes().to_vec())
}

/// A string value.
pub fn kv_str(s: &str) -> (u32, Vec<u8>) {
    (8, string(s))
}

fn string(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend(s.as_bytes());
    b
}

/// One tensor to write: name, shape (outermost first), type, stored bytes.
pub struct Entry {
    pub name: String,
    pub shape: Vec<usize>,
    pub ty: GgmlType,
    pub bytes: Vec<u8>,
}

/// The bytes of a GGUF file of `version` with `kvs` and `tensors`, data aligned to
/// `alignment` (written as `general.alignment` when not 32).
pub fn gguf_bytes(
    version: u32,
    kvs: &[(&str, (u32, Vec<u8>))],
    tensors: &[Entry],
    alignment: usize,
) -> Vec<u8> {
    let mut kvs: Vec<(String, (u32, Vec<u8>))> = kvs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    if alignment != 32 {
        kvs.push(("general.alignment".into(), kv_u32(alignment as u32)));
    }
    let mut b = b"GGUF".to_vec();
    b.extend(version.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kvs.len() as u64).to_le_bytes());
    for (k, (ty, v)) in &kvs {
        b.extend(string(k));
        b.extend(ty.to_le_bytes());
        b.extend(v);
    }
    let mut offset = 0usize;
    let mut offsets = vec![];
    for t in tensors {
        b.extend(string(&t.name));
        b.extend((t.shape.len() as u32).to_le_bytes());
        for d in t.shape.iter().rev() {
            b.extend((*d as u64).to_le_bytes());
        }
        b.extend(t.ty.id().to_le_bytes());
        b.extend((offset as u64).to_le_bytes());
        offsets.push(offset);
        offset = (offset + t.bytes.len()).div_ceil(alignment) * alignment;
    }
    let start = b.len().div_ceil(alignment) * alignment;
    b.resize(start, 0);
    for (t, o) in tensors.iter().zip(offsets) {
        b.resize(start + o, 0);
        b.extend(&t.bytes);
    }
    b
}

/// Deterministic bytes (64-bit LCG, Knuth's constants).
pub fn lcg_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 56) as u8
        })
        .collect()
}

/// Byte offsets of the f16 scales in a block of `ty` (ggml-common.h).
pub fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => &[],
    }
}

/// `values` values of `ty` as random blocks whose f16 scales are +-`scale` times a factor in
/// [0.5, 1.5) (every other byte pattern is a valid code); F32/F16/BF16 as random values in
/// [-1, 1).
pub fn random_blocks(ty: GgmlType, values: usize, seed: u64, scale: f32) -> Vec<u8> {
    let n = ty.bytes_of(values).expect("whole blocks");
    let mut b = lcg_bytes(n, seed);
    let unit = |i: usize| f32::from(b[i]) / 128.0 - 1.0;
    match ty {
        GgmlType::F32 => {
            let v: Vec<f32> = (0..values).map(|i| unit(4 * i)).collect();
            return v.iter().flat_map(|x| x.to_le_bytes()).collect();
        }
        GgmlType::F16 => {
            let v: Vec<f32> = (0..values).map(|i| unit(2 * i)).collect();
            return v
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect();
        }
        GgmlType::BF16 => {
            let v: Vec<f32> = (0..values).map(|i| unit(2 * i)).collect();
            return v
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect();
        }
        _ => {}
    }
    let bb = ty.block_bytes();
    for blk in 0..n / bb {
        for &at in scale_offsets(ty) {
            let i = blk * bb + at;
            let f = (0.5 + f32::from(b[i]) / 256.0) * scale;
            let f = if b[i + 1] & 1 == 0 { f } else { -f };
            b[i..i + 2].copy_from_slice(&half::f16::from_f32(f).to_le_bytes());
        }
    }
    b
}

/// gguf-py's Q8_0 quantization (quants.py `Q8_0.quantize_blocks`): d = absmax / 127 as f16,
/// codes round(x / d) (half away from zero).
pub fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = vec![];
    for blk in x.chunks(32) {
        let d = blk.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend(half::f16::from_f32(d).to_le_bytes());
        out.extend(blk.iter().map(|v| ((v * id).round() as i8) as u8));
    }
    out
}
