//! safetensors files: lazy loading through a memory map (a tensor's bytes are read when it is
//! loaded) and atomic saving (a temporary file renamed into place, so a crash never leaves a
//! half-written file under the real name). Every malformed input is an error naming the file
//! and, where one is at fault, the tensor.
//!
//! Format (<https://github.com/huggingface/safetensors>): 8-byte little-endian header length N,
//! N bytes of JSON `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {..}}`,
//! then the data; offsets are relative to the end of the header.

use crate::{CpuStorage, DType, Device, Error, Result, Tensor};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Largest header accepted (the reference implementation's limit).
const MAX_HEADER: u64 = 100_000_000;

/// The metadata key of a single `.safetensors` (or `.gguf`, as a string value) file that
/// holds its model's `config.json` (as text), for files whose shapes do not pin the config
/// down: a diffusion model's diffusers config, or a lone text encoder's or autoencoder's
/// transformers / diffusers config.
pub const CONFIG_METADATA: &str = "config";

/// One tensor's entry in the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The dtype as the file names it (`F32`, `BF16`, `I64`, ...).
    pub dtype: String,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Byte range in the data section.
    pub data_offsets: (usize, usize),
}

impl TensorInfo {
    /// FLAME's dtype for this entry, if FLAME can hold it.
    pub fn flame_dtype(&self) -> Option<DType> {
        match self.dtype.as_str() {
            "F32" => Some(DType::F32),
            "F64" => Some(DType::F64),
            "BF16" => Some(DType::BF16),
            "F16" => Some(DType::F16),
            "U32" => Some(DType::U32),
            _ => None,
        }
    }
}

fn file_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::F64 => safetensors::Dtype::F64,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F16 => safetensors::Dtype::F16,
        DType::U32 => safetensors::Dtype::U32,
    }
}

/// Bits per element of every dtype the format defines.
fn dtype_bits(name: &str) -> Option<usize> {
    Some(match name {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" | "F8_E4M3FNUZ"
        | "F8_E5M2FNUZ" => 8,
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

/// An open safetensors file. Opening reads and checks only the header.
pub struct SafeTensorsFile {
    path: PathBuf,
    mmap: memmap2::Mmap,
    data_start: usize,
    tensors: BTreeMap<String, TensorInfo>,
    metadata: BTreeMap<String, String>,
}

impl std::fmt::Debug for SafeTensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SafeTensorsFile({}, {} tensors)",
            self.path.display(),
            self.tensors.len()
        )
    }
}

#[derive(serde::Deserialize)]
struct RawInfo {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

impl SafeTensorsFile {
    /// Maps the file at `path` and parses its header; errors name the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let io = |source| Error::Io {
            path: path.clone(),
            source,
        };
        let file = std::fs::File::open(&path).map_err(io)?;
        let mmap = map_file(&file).map_err(io)?;
        let (data_start, tensors, metadata) = parse_header(&mmap, &path)?;
        Ok(SafeTensorsFile {
            path,
            mmap,
            data_start,
            tensors,
            metadata,
        })
    }

    /// The file's path, as given to `open`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }

    /// Number of tensors in the file.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when the file holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Whether a tensor called `name` is in the file.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The header entry of tensor `name`, if present.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// The `__metadata__` strings of the header.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    fn err(&self, tensor: &str, msg: impl Into<String>) -> Error {
        Error::SafeTensors {
            path: self.path.clone(),
            tensor: Some(tensor.to_string()),
            msg: msg.into(),
        }
    }

    /// Reads one tensor (its bytes are read now) onto `device`, in the file's dtype (FP8
    /// E4M3 decoded into f32). On a GPU the bytes cross from the mapped file as they are
    /// (`Tensor::from_le_bytes`).
    pub fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        crate::progress::tick();
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| self.err(name, "no such tensor in the file"))?;
        let shape = info.shape.clone();
        match info.flame_dtype() {
            // The header's shapes and byte ranges agree (checked at open).
            Some(dtype) => {
                let bytes = self.bytes(name)?;
                Tensor::from_le_bytes(bytes, dtype, shape, device)
            }
            // FP8 codes decode on the host; other dtypes are refused there, named.
            None => Tensor::from_host(self.host(name)?, shape, device),
        }
    }

    /// Reads one tensor's values into host memory, in the file's dtype.
    pub fn host(&self, name: &str) -> Result<CpuStorage> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| self.err(name, "no such tensor in the file"))?;
        let (b, e) = info.data_offsets;
        if info.dtype == "F8_E4M3" {
            // FP8 E4M3 (OCP, PyTorch's float8_e4m3fn) decodes exactly into f32.
            let bytes = &self.mmap[self.data_start + b..self.data_start + e];
            return Ok(CpuStorage::F32(
                bytes
                    .iter()
                    .map(|&c| crate::backend::fp8::decode(c))
                    .collect(),
            ));
        }
        let dtype = info.flame_dtype().ok_or_else(|| {
            self.err(
                name,
                format!(
                    "dtype {} is not supported (FLAME reads F32, F64, BF16, F16, U32, F8_E4M3)",
                    info.dtype
                ),
            )
        })?;
        let bytes = &self.mmap[self.data_start + b..self.data_start + e];
        CpuStorage::from_bytes(dtype, bytes)
            .ok_or_else(|| self.err(name, "byte count is not a multiple of the element size"))
    }

    /// The bytes of tensor `name` as the file stores them, whatever its dtype (FP8 codes, a
    /// `U8` tensor of ComfyUI's quantization records).
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| self.err(name, "no such tensor in the file"))?;
        let (b, e) = info.data_offsets;
        Ok(&self.mmap[self.data_start + b..self.data_start + e])
    }

    /// Reads one tensor and converts it to `dtype`.
    pub fn load_as(&self, name: &str, device: &Device, dtype: DType) -> Result<Tensor> {
        let _g = crate::no_grad();
        self.load(name, device)?.to_dtype(dtype)
    }

    /// Reads every tensor.
    pub fn load_all(&self, device: &Device) -> Result<BTreeMap<String, Tensor>> {
        self.names()
            .map(|n| Ok((n.to_string(), self.load(n, device)?)))
            .collect()
    }
}

fn map_file(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the map is read-only; a file truncated by another process while mapped would
    // fault, which memory maps cannot prevent (every mmap-based loader shares this).
    unsafe { memmap2::Mmap::map(file) }
}

type Header = (
    usize,
    BTreeMap<String, TensorInfo>,
    BTreeMap<String, String>,
);

fn parse_header(buf: &[u8], path: &Path) -> Result<Header> {
    let err = |tensor: Option<&str>, msg: String| Error::SafeTensors {
        path: path.to_path_buf(),
        tensor: tensor.map(str::to_string),
        msg,
    };
    if buf.len() < 8 {
        return Err(err(
            None,
            format!(
                "file is {} bytes, too short for the 8-byte header length",
                buf.len()
            ),
        ));
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&buf[..8]);
    let n = u64::from_le_bytes(len8);
    if n > MAX_HEADER {
        return Err(err(
            None,
            format!("header length {n} exceeds the {MAX_HEADER}-byte limit"),
        ));
    }
    let n = n as usize;
    if 8 + n > buf.len() {
        return Err(err(
            None,
            format!(
                "header length {n} runs past the end of the {}-byte file (truncated?)",
                buf.len()
            ),
        ));
    }
    let text = std::str::from_utf8(&buf[8..8 + n])
        .map_err(|e| err(None, format!("header is not UTF-8: {e}")))?;
    let json: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text)
        .map_err(|e| err(None, format!("header is not a JSON object: {e}")))?;
    let data_len = buf.len() - 8 - n;
    let mut tensors = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    for (name, value) in json {
        if name == "__metadata__" {
            metadata = serde_json::from_value(value)
                .map_err(|e| err(None, format!("__metadata__ is not a map of strings: {e}")))?;
            continue;
        }
        let raw: RawInfo = serde_json::from_value(value)
            .map_err(|e| err(Some(&name), format!("bad header entry: {e}")))?;
        let bits = dtype_bits(&raw.dtype)
            .ok_or_else(|| err(Some(&name), format!("unknown dtype {:?}", raw.dtype)))?;
        let count = raw
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .and_then(|c| c.checked_mul(bits))
            .map(|b| b.div_ceil(8))
            .ok_or_else(|| err(Some(&name), format!("shape {:?} overflows", raw.shape)))?;
        let (b, e) = raw.data_offsets;
        if b > e || e - b != count {
            return Err(err(
                Some(&name),
                format!(
                    "shape {:?} of {} needs {count} bytes but data_offsets [{b}, {e}] hold {}",
                    raw.shape,
                    raw.dtype,
                    e.saturating_sub(b)
                ),
            ));
        }
        if e > data_len {
            return Err(err(
                Some(&name),
                format!("data_offsets [{b}, {e}] run past the {data_len} bytes of data (truncated file?)"),
            ));
        }
        tensors.insert(
            name,
            TensorInfo {
                dtype: raw.dtype,
                shape: raw.shape,
                data_offsets: (b, e),
            },
        );
    }
    // Tensors may not overlap.
    let mut spans: Vec<(&String, (usize, usize))> =
        tensors.iter().map(|(k, v)| (k, v.data_offsets)).collect();
    spans.sort_by_key(|(_, o)| *o);
    for w in spans.windows(2) {
        if w[1].1 .0 < w[0].1 .1 {
            return Err(err(
                Some(w[1].0),
                format!("data overlaps tensor '{}'", w[0].0),
            ));
        }
    }
    Ok((8 + n, tensors, metadata))
}

/// Whether the weights at `path` hold FP8 E4M3 tensors (ComfyUI's and BFL's FP8 files): a
/// .safetensors file, or a folder whose .safetensors files are read (a transformers folder's
/// shards). Errors name a file whose header cannot be read.
pub fn holds_fp8(path: impl AsRef<Path>) -> Result<bool> {
    let path = path.as_ref();
    let files: Vec<PathBuf> = if path.is_dir() {
        std::fs::read_dir(path)
            .map_err(|source| Error::Io {
                path: path.to_path_buf(),
                source,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect()
    } else {
        vec![path.to_path_buf()]
    };
    for f in files {
        let file = SafeTensorsFile::open(&f)?;
        if file.tensors.values().any(|t| t.dtype == "F8_E4M3") {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Opens `path` and loads every tensor.
pub fn load(path: impl AsRef<Path>, device: &Device) -> Result<BTreeMap<String, Tensor>> {
    SafeTensorsFile::open(path)?.load_all(device)
}

struct HostView {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: CpuStorage,
}

impl safetensors::View for HostView {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.data.as_bytes())
    }
    fn data_len(&self) -> usize {
        self.data.as_bytes().len()
    }
}

impl safetensors::View for &HostView {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.data.as_bytes())
    }
    fn data_len(&self) -> usize {
        self.data.as_bytes().len()
    }
}

/// Saves named tensors. The file appears under `path` only once fully written.
pub fn save<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
    path: impl AsRef<Path>,
) -> Result<()> {
    save_with_metadata(tensors, &BTreeMap::new(), path)
}

/// Saves named tensors with `__metadata__` strings.
pub fn save_with_metadata<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
    metadata: &BTreeMap<String, String>,
    path: impl AsRef<Path>,
) -> Result<()> {
    save_views(tensors, metadata, false, path.as_ref())
}

/// Saves named tensors with `__metadata__` strings and the two hashes kohya's sd-scripts
/// records for sd-webui-additional-networks (`train_util.precalculate_safetensors_hashes`):
/// `sshs_model_hash`, the SHA-256 (hex) of the tensor bytes after the header, and
/// `sshs_legacy_hash`, the first 8 hex digits of the SHA-256 of bytes 0x100000..0x110000 of
/// the file the tensors make with only the metadata's `ss_*` keys (empty bytes, hence
/// `e3b0c442`, for a file shorter than 1 MiB).
pub fn save_with_hashes<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
    metadata: &BTreeMap<String, String>,
    path: impl AsRef<Path>,
) -> Result<()> {
    save_views(tensors, metadata, true, path.as_ref())
}

/// The sd-webui-additional-networks hashes of a serialized file (see [`save_with_hashes`]).
pub fn addnet_hashes(bytes: &[u8]) -> (String, String) {
    use sha2::{Digest, Sha256};
    let hex = |d: &[u8]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let n = bytes.get(..8).map_or(0, |b| {
        u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize
    });
    let data = bytes.get(8 + n..).unwrap_or(&[]);
    let model = hex(&Sha256::digest(data));
    let lo = 0x10_0000.min(bytes.len());
    let hi = 0x11_0000.min(bytes.len());
    let legacy = hex(&Sha256::digest(&bytes[lo..hi]))[..8].to_string();
    (model, legacy)
}

fn save_views<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
    metadata: &BTreeMap<String, String>,
    hashes: bool,
    path: &Path,
) -> Result<()> {
    let err = |tensor: Option<&str>, msg: String| Error::SafeTensors {
        path: path.to_path_buf(),
        tensor: tensor.map(str::to_string),
        msg,
    };
    let mut views: BTreeMap<String, HostView> = BTreeMap::new();
    for (name, t) in tensors {
        if name == "__metadata__" {
            return Err(err(Some(name), "the name is reserved".into()));
        }
        let view = HostView {
            dtype: file_dtype(t.dtype()),
            shape: t.dims().to_vec(),
            data: t.to_host()?,
        };
        if views.insert(name.to_string(), view).is_some() {
            return Err(err(Some(name), "name given twice".into()));
        }
    }
    let mut metadata = metadata.clone();
    if hashes {
        // The file the tensors make with the `ss_*` keys alone, as sd-scripts hashes it.
        let ss: HashMap<String, String> = metadata
            .iter()
            .filter(|(k, _)| k.starts_with("ss_"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let bytes = safetensors::serialize(&views, (!ss.is_empty()).then_some(ss))
            .map_err(|e| err(None, format!("serializing failed: {e}")))?;
        let (model, legacy) = addnet_hashes(&bytes);
        metadata.insert("sshs_model_hash".into(), model);
        metadata.insert("sshs_legacy_hash".into(), legacy);
    }
    let meta: Option<HashMap<String, String>> = (!metadata.is_empty()).then(|| {
        metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    });
    let file_name = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{file_name}.tmp-{}", std::process::id()));
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| Error::Io { path: p, source }
    };
    let result = (|| {
        // The safetensors crate writes through a private temporary file (mode 0600); a file
        // made here first tells the mode the umask gives (0644 under umask 022).
        let mode = std::fs::File::create(&tmp)
            .and_then(|f| f.metadata())
            .map_err(io(&tmp))?
            .permissions();
        safetensors::serialize_to_file(views, meta, &tmp)
            .map_err(|e| err(None, format!("writing failed: {e}")))?;
        canonical_header(&tmp).map_err(io(&tmp))?;
        std::fs::set_permissions(&tmp, mode).map_err(io(&tmp))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .and_then(|()| crate::fault::point(&format!("write:{file_name}")))
            .map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io(path))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Rewrites a safetensors header with its JSON keys sorted (the `__metadata__` map comes out
/// of the safetensors crate in hash order), so identical tensors and metadata always give
/// identical bytes. Same content, same length: the header is replaced in place.
fn canonical_header(path: &Path) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n)?;
    let n = u64::from_le_bytes(n) as usize;
    let mut header = vec![0u8; n];
    f.read_exact(&mut header)?;
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    // serde_json's maps are sorted by key.
    let v: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| bad(&format!("header: {e}")))?;
    let mut sorted = serde_json::to_vec(&v).map_err(|e| bad(&e.to_string()))?;
    if sorted.len() > n {
        return Err(bad("the sorted header is longer than the original"));
    }
    sorted.resize(n, b' ');
    if sorted != header {
        f.seek(SeekFrom::Start(8))?;
        f.write_all(&sorted)?;
    }
    Ok(())
}
