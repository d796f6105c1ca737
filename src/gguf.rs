//! GGUF files (ggml's single-file format, the one city96's quantized diffusion models ship
//! in): read through a memory map, the header and tensor table checked on opening, a
//! tensor's bytes read when it is loaded. Every malformed input is an error naming the file
//! and, where one is at fault, the tensor; nothing in a file can make the reader panic.
//!
//! Format (ggml/docs/gguf.md; gguf-py's `GGUFReader`), little-endian:
//!
//! ```text
//! magic "GGUF" | version u32 (2 or 3) | tensor count u64 | key/value count u64
//! key/values:  key string | value type u32 | value
//! tensor info: name string | n_dims u32 | dims u64 x n_dims | ggml type u32 | offset u64
//! padding to `general.alignment` (default 32) | data
//! ```
//!
//! A string is a u64 length and UTF-8 bytes; an array is an element type u32, a count u64 and
//! the elements. Dims are ggml's `ne`, innermost first: a (rows, cols) tensor is stored with
//! dims \[cols, rows\], so the shape here is the dims reversed. A tensor's offset is relative to
//! the data section and a multiple of the alignment. Version 1 (u32 counts) is refused, as is
//! a big-endian file (its version reads as a huge number).

use crate::backend::ggml::{self, GgmlType};
use crate::{CpuStorage, DType, Device, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Most dims a tensor may have (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;

/// Most nesting of arrays in arrays accepted (a corrupt file could otherwise recurse deep).
const MAX_DEPTH: usize = 8;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 6.
    F32(f32),
    /// Type 7 (one byte, 0 or 1).
    Bool(bool),
    /// Type 8.
    String(String),
    /// Type 9: values of one type.
    Array(Vec<Value>),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 12.
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor's entry in the tensor table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Its type.
    pub ty: GgmlType,
    /// Dimensions, outermost first: the file's dims reversed, or the shape the converter
    /// recorded before reshaping the tensor ([`ORIG_SHAPE_PREFIX`]).
    pub shape: Vec<usize>,
    /// Byte offset of its data from the start of the file.
    pub start: usize,
    /// Bytes of its data.
    pub bytes: usize,
}

impl TensorInfo {
    /// Values it holds.
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An open GGUF file. Opening reads and checks the header and the tensor table.
pub struct GgufFile {
    path: PathBuf,
    mmap: memmap2::Mmap,
    version: u32,
    alignment: u64,
    metadata: BTreeMap<String, Value>,
    tensors: BTreeMap<String, TensorInfo>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GgufFile({}, v{}, {} tensors)",
            self.path.display(),
            self.version,
            self.tensors.len()
        )
    }
}

/// Whether `path` names a GGUF file by its extension.
pub fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// A cursor over the file's bytes; each read checks that the bytes are there.
struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> std::result::Result<&'a [u8], String> {
        match self.at.checked_add(n) {
            Some(end) if end <= self.b.len() => {
                let s = &self.b[self.at..end];
                self.at = end;
                Ok(s)
            }
            _ => Err(format!(
                "truncated: {what} at byte {} needs {n} bytes, the file has {}",
                self.at,
                self.b.len()
            )),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> std::result::Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> std::result::Result<String, String> {
        let n = self.u64(what)?;
        let n = usize::try_from(n).map_err(|_| format!("{what}: length {n} is too large"))?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
    }

    fn value(&mut self, ty: u32, what: &str, depth: usize) -> std::result::Result<Value, String> {
        Ok(match ty {
            0 => Value::U8(u8::from_le_bytes(self.array(what)?)),
            1 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format!("{what}: bool byte {b} is neither 0 nor 1")),
            },
            8 => Value::String(self.string(what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(format!("{what}: arrays nested deeper than {MAX_DEPTH}"));
                }
                let ety = self.u32(what)?;
                let n = self.u64(what)?;
                // Each element takes at least one byte: a count past the bytes left is corrupt
                // (and must not size an allocation).
                let left = (self.b.len() - self.at) as u64;
                if n > left {
                    return Err(format!(
                        "truncated: {what} is an array of {n} elements with {left} bytes left"
                    ));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, what, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            t => return Err(format!("{what}: unknown value type {t}")),
        })
    }
}

/// The header, metadata and tensor table of `b` (the whole file), or what is wrong as
/// (tensor, message).
#[allow(clippy::type_complexity)]
fn parse(
    b: &[u8],
) -> std::result::Result<
    (
        u32,
        u64,
        BTreeMap<String, Value>,
        BTreeMap<String, TensorInfo>,
    ),
    (Option<String>, String),
> {
    let file = |m: String| (None, m);
    let mut c = Cursor { b, at: 0 };
    let magic = c.take(4, "the magic").map_err(file)?;
    if magic != b"GGUF" {
        return Err(file(format!(
            "not a GGUF file: it starts with {magic:02x?}, not \"GGUF\""
        )));
    }
    let version = c.u32("the version").map_err(file)?;
    if !(2..=3).contains(&version) {
        let hint = if version.swap_bytes() <= 3 {
            " (a big-endian file?)"
        } else {
            ""
        };
        return Err(file(format!(
            "GGUF version {version} is not read (versions 2 and 3 are){hint}"
        )));
    }
    let n_tensors = c.u64("the tensor count").map_err(file)?;
    let n_kv = c.u64("the key/value count").map_err(file)?;
    let left = (b.len() - c.at) as u64;
    // A key/value takes at least 12 bytes and a tensor info at least 24.
    if n_kv > left / 12 || n_tensors > left / 24 {
        return Err(file(format!(
            "corrupt: {n_tensors} tensors and {n_kv} key/values cannot fit in {left} bytes"
        )));
    }
    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = c
            .string(&format!("the key of key/value {i}"))
            .map_err(file)?;
        let what = format!("the value of '{key}'");
        let ty = c.u32(&what).map_err(file)?;
        let v = c.value(ty, &what, 0).map_err(file)?;
        if metadata.insert(key.clone(), v).is_some() {
            return Err(file(format!("key '{key}' appears twice")));
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => a,
            _ => {
                return Err(file(format!(
                    "general.alignment = {v:?} is not a power of two"
                )))
            }
        },
    };
    let mut raw = vec![];
    for i in 0..n_tensors {
        let name = c.string(&format!("the name of tensor {i}")).map_err(file)?;
        let t = |m: String| (Some(name.clone()), m);
        let n_dims = c.u32("its dim count").map_err(t)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(t(format!("{n_dims} dims (1 to {MAX_DIMS} are allowed)")));
        }
        let mut dims = vec![];
        for _ in 0..n_dims {
            dims.push(c.u64("its dims").map_err(t)?);
        }
        let id = c.u32("its type").map_err(t)?;
        let offset = c.u64("its offset").map_err(t)?;
        let ty = GgmlType::from_id(id).ok_or_else(|| {
            t(match ggml::unsupported_name(id) {
                Some(n) => format!(
                    "type {n} ({id}) is not read (FLAME reads F32, F16, BF16, Q4_0, Q4_1, \
                     Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)"
                ),
                None => format!("unknown ggml type {id}"),
            })
        })?;
        raw.push((name, dims, ty, offset));
    }
    let data_start = (c.at as u64).div_ceil(alignment) * alignment;
    let mut tensors = BTreeMap::new();
    for (name, dims, ty, offset) in raw {
        let t = |m: String| (Some(name.clone()), m);
        let values = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| t(format!("dims {dims:?} overflow")))?;
        if dims[0] % ty.block_values() as u64 != 0 {
            return Err(t(format!(
                "its rows of {} values are not whole {} blocks of {}",
                dims[0],
                ty.name(),
                ty.block_values()
            )));
        }
        let bytes = ty
            .bytes_of(values)
            .ok_or_else(|| t(format!("dims {dims:?} overflow")))?;
        if offset % alignment != 0 {
            return Err(t(format!(
                "offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        let start = data_start.checked_add(offset);
        let end = start.and_then(|s| s.checked_add(bytes as u64));
        match (start, end) {
            (Some(s), Some(e)) if e <= b.len() as u64 => {
                let shape = dims.iter().rev().map(|&d| d as usize).collect();
                let info = TensorInfo {
                    ty,
                    shape,
                    start: s as usize,
                    bytes,
                };
                if tensors.insert(name.clone(), info).is_some() {
                    return Err(t("appears twice in the tensor table".into()));
                }
            }
            _ => {
                return Err(t(format!(
                    "out of bounds: {bytes} bytes of {} at offset {offset} from the data \
                     section at {data_start}, in a file of {} bytes",
                    ty.name(),
                    b.len()
                )))
            }
        }
    }
    original_shapes(&metadata, &mut tensors)?;
    Ok((version, alignment, metadata, tensors))
}

/// The prefix of the metadata key under which city96's converter records a tensor's shape
/// before it reshaped it to rows of 256 values (ComfyUI-GGUF tools/convert.py, `shape_fix`,
/// at commit 795e45156ece99afbc3efef911e63fcb46e6a20d: SD1.x / SDXL tensors of 2+ dims, at
/// least 512 values, a whole number of 256s and a last dim that is not), an INT32 array read
/// back by its loader.py `get_orig_shape`.
pub const ORIG_SHAPE_PREFIX: &str = "comfy.gguf.orig_shape.";

/// Gives each tensor with a recorded original shape ([`ORIG_SHAPE_PREFIX`]) that shape: its
/// values are the same in the same order (the reshape moves none), so it reads as the tensor
/// it was.
fn original_shapes(
    metadata: &BTreeMap<String, Value>,
    tensors: &mut BTreeMap<String, TensorInfo>,
) -> std::result::Result<(), (Option<String>, String)> {
    for (key, v) in metadata.range(ORIG_SHAPE_PREFIX.to_string()..) {
        let Some(name) = key.strip_prefix(ORIG_SHAPE_PREFIX) else {
            break;
        };
        let t = |m: String| (Some(name.to_string()), m);
        let info = tensors
            .get_mut(name)
            .ok_or_else(|| t(format!("metadata '{key}' names no tensor of the file")))?;
        let dims = match v {
            Value::Array(a) if !a.is_empty() && a.len() <= MAX_DIMS as usize => a
                .iter()
                .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                .collect::<Option<Vec<usize>>>(),
            _ => None,
        }
        .ok_or_else(|| {
            t(format!(
                "metadata '{key}' = {v:?} is not a shape (1 to {MAX_DIMS} non-negative integers)"
            ))
        })?;
        let values = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if values != Some(info.elem_count()) {
            return Err(t(format!(
                "metadata '{key}' gives shape {dims:?}, but the tensor holds {} values ({:?})",
                info.elem_count(),
                info.shape
            )));
        }
        info.shape = dims;
    }
    Ok(())
}

impl GgufFile {
    /// Maps the file at `path` and checks its header and tensor table; errors name the file
    /// and the tensor at fault.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let io = |source| Error::Io {
            path: path.clone(),
            source,
        };
        let file = std::fs::File::open(&path).map_err(io)?;
        // SAFETY: the map is read-only; a file truncated by another process while mapped
        // would fault on access, as with any memory-mapped reader (safetensors does the same).
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let (version, alignment, metadata, tensors) =
            parse(&mmap).map_err(|(tensor, msg)| Error::Gguf {
                path: path.clone(),
                tensor,
                msg,
            })?;
        Ok(GgufFile {
            path,
            mmap,
            version,
            alignment,
            metadata,
            tensors,
        })
    }

    fn err(&self, tensor: &str, msg: impl Into<String>) -> Error {
        Error::Gguf {
            path: self.path.clone(),
            tensor: Some(tensor.to_string()),
            msg: msg.into(),
        }
    }

    /// The file's path, as given to `open`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of its tensors' data.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// The metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }

    /// The table entry of tensor `name`.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// The stored bytes of tensor `name` (its blocks, as the file holds them).
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let i = self
            .info(name)
            .ok_or_else(|| self.err(name, "no such tensor in the file"))?;
        // Checked against the file's length on opening.
        Ok(&self.mmap[i.start..i.start + i.bytes])
    }

    /// Tensor `name` dequantized on the host, in f32 (exact for F32, F16 and BF16).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>> {
        crate::progress::tick();
        let bytes = self.bytes(name)?;
        let ty = self.tensors[name].ty;
        let mut out = vec![0f32; self.tensors[name].elem_count()];
        ggml::dequantize(ty, bytes, &mut out).map_err(|m| self.err(name, m))?;
        Ok(out)
    }

    /// Tensor `name` on `device` in `dtype`: F32, F16 and BF16 as stored then converted,
    /// quantized types dequantized on the host in f32 then converted.
    pub fn load_as(&self, name: &str, device: &Device, dtype: DType) -> Result<Tensor> {
        let _g = crate::no_grad();
        let info = self
            .info(name)
            .ok_or_else(|| self.err(name, "no such tensor in the file"))?;
        let host = match info.ty {
            GgmlType::F16 | GgmlType::BF16 | GgmlType::F32 => {
                let d = match info.ty {
                    GgmlType::F16 => DType::F16,
                    GgmlType::BF16 => DType::BF16,
                    _ => DType::F32,
                };
                CpuStorage::from_bytes(d, self.bytes(name)?)
                    .ok_or_else(|| self.err(name, "byte count is not whole elements"))?
            }
            _ => CpuStorage::F32(self.dequantize(name)?),
        };
        Tensor::from_host(host, info.shape.clone(), device)?.to_dtype(dtype)
    }

    /// Tensor `name`'s blocks as stored, packed into u32 words (`ggml::to_words`), with its
    /// type: what a packed weight holds.
    pub fn packed_words(&self, name: &str) -> Result<(GgmlType, Vec<u32>)> {
        crate::progress::tick();
        let ty = self
            .info(name)
            .ok_or_else(|| self.err(name, "no such tensor in the file"))?
            .ty;
        Ok((ty, ggml::to_words(self.bytes(name)?)))
    }
}
