//! safetensors I/O: round trips for every dtype, lazy loading, atomic saving, and one test per
//! kind of damaged file, each checking that the error names the file and the tensor.
#![cfg(feature = "cpu-ref")]

use flame::safetensors::{load, save, save_with_metadata, SafeTensorsFile};
use flame::{DType, Device, Error, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("flame-st-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes a file from a raw JSON header and data bytes.
fn raw_file(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

/// The error of opening (or, if opening works, of loading `tensor` from) a file.
fn error_of(path: &Path, tensor: &str) -> Error {
    match SafeTensorsFile::open(path) {
        Err(e) => e,
        Ok(f) => f
            .load(tensor, &Device::Cpu)
            .expect_err("loading should fail"),
    }
}

fn assert_names(e: &Error, path: &Path, tensor: Option<&str>, words: &str) {
    let msg = e.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "no file in: {msg}"
    );
    if let Some(t) = tensor {
        assert!(msg.contains(&format!("'{t}'")), "no tensor name in: {msg}");
    }
    assert!(msg.contains(words), "expected {words:?} in: {msg}");
}

#[test]
fn round_trip_every_dtype_with_metadata() {
    let dir = TempDir::new("rt");
    let dev = Device::Cpu;
    let base = Tensor::randn((3, 5), DType::F64, &dev, 1).unwrap();
    let mut named = vec![];
    for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        named.push((format!("w.{dt}"), base.to_dtype(dt).unwrap()));
    }
    named.push((
        "ids".into(),
        Tensor::from_vec(vec![7u32, 0, 4_000_000_000], 3, &dev).unwrap(),
    ));
    // A transposed (non-contiguous) view is written in its logical order.
    named.push(("wt".into(), base.t().unwrap()));
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let path = dir.file("a.safetensors");
    save_with_metadata(named.iter().map(|(n, t)| (n.as_str(), t)), &meta, &path).unwrap();

    let f = SafeTensorsFile::open(&path).unwrap();
    assert_eq!(f.metadata(), &meta);
    assert_eq!(f.len(), named.len());
    for (name, t) in &named {
        let info = f.info(name).unwrap();
        assert_eq!(info.shape, t.dims());
        let back = f.load(name, &dev).unwrap();
        assert_eq!(back.dtype(), t.dtype());
        assert_eq!(back.dims(), t.dims());
        assert_eq!(
            back.to_vec_f64().unwrap(),
            t.to_vec_f64().unwrap(),
            "{name}"
        );
    }
    // Conversion on load.
    let up = f.load_as("w.bf16", &dev, DType::F32).unwrap();
    assert_eq!(up.dtype(), DType::F32);
    assert_eq!(up.to_vec_f64().unwrap(), named[2].1.to_vec_f64().unwrap());
    assert_eq!(load(&path, &dev).unwrap().len(), named.len());
}

#[test]
fn unaligned_data_loads() {
    // A header of odd length puts the f32 data at an unaligned offset.
    let dir = TempDir::new("align");
    let path = dir.file("u.safetensors");
    let header = r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}  "#;
    let data: Vec<u8> = [1.5f32, -2.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    raw_file(&path, header, &data);
    let t = SafeTensorsFile::open(&path)
        .unwrap()
        .load("x", &Device::Cpu)
        .unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.5, -2.0]);
}

#[test]
fn truncated_files() {
    let dir = TempDir::new("trunc");
    let path = dir.file("t.safetensors");
    let x = Tensor::arange(0.0, 10.0, DType::F32, &Device::Cpu).unwrap();
    save([("x", &x)], &path).unwrap();
    let full = std::fs::read(&path).unwrap();

    std::fs::write(&path, &full[..5]).unwrap();
    assert_names(&error_of(&path, "x"), &path, None, "too short");

    std::fs::write(&path, &full[..20]).unwrap();
    assert_names(&error_of(&path, "x"), &path, None, "runs past the end");

    std::fs::write(&path, &full[..full.len() - 4]).unwrap();
    assert_names(&error_of(&path, "x"), &path, Some("x"), "truncated");
}

#[test]
fn bad_headers() {
    let dir = TempDir::new("hdr");
    let path = dir.file("h.safetensors");
    raw_file(&path, "this is not json", &[]);
    assert_names(&error_of(&path, "x"), &path, None, "not a JSON object");

    let mut bytes = u64::MAX.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&path, bytes).unwrap();
    assert_names(&error_of(&path, "x"), &path, None, "exceeds");

    let mut bytes = 2u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(&[0xff, 0xfe]);
    std::fs::write(&path, bytes).unwrap();
    assert_names(&error_of(&path, "x"), &path, None, "UTF-8");

    raw_file(
        &path,
        r#"{"x":{"dtype":"F32","shape":"two","data_offsets":[0,8]}}"#,
        &[0; 8],
    );
    assert_names(&error_of(&path, "x"), &path, Some("x"), "bad header entry");

    raw_file(&path, r#"{"__metadata__":{"a":1}}"#, &[]);
    assert_names(&error_of(&path, "x"), &path, None, "__metadata__");
}

#[test]
fn unknown_and_unsupported_dtypes() {
    let dir = TempDir::new("dtype");
    let path = dir.file("d.safetensors");
    raw_file(
        &path,
        r#"{"q":{"dtype":"Q9","shape":[2],"data_offsets":[0,8]}}"#,
        &[0; 8],
    );
    assert_names(&error_of(&path, "q"), &path, Some("q"), "unknown dtype");

    // A dtype the format knows but FLAME does not hold: the file opens, loading names it.
    raw_file(
        &path,
        r#"{"pos":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},"w":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}}"#,
        &[1; 20],
    );
    let f = SafeTensorsFile::open(&path).unwrap();
    assert!(f.load("w", &Device::Cpu).is_ok());
    assert_names(
        &f.load("pos", &Device::Cpu).unwrap_err(),
        &path,
        Some("pos"),
        "I64 is not supported",
    );
}

#[test]
fn shape_disagreeing_with_byte_count() {
    let dir = TempDir::new("shape");
    let path = dir.file("s.safetensors");
    raw_file(
        &path,
        r#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}}"#,
        &[0; 20],
    );
    assert_names(&error_of(&path, "w"), &path, Some("w"), "needs 24 bytes");

    raw_file(
        &path,
        r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#,
        &[0; 8],
    );
    assert_names(
        &error_of(&path, "w"),
        &path,
        Some("w"),
        "data_offsets [8, 0]",
    );

    raw_file(
        &path,
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
        &[0; 12],
    );
    assert_names(&error_of(&path, "a"), &path, Some("b"), "overlaps");
}

#[test]
fn missing_tensor_is_named() {
    let dir = TempDir::new("missing");
    let path = dir.file("m.safetensors");
    save(
        [(
            "present",
            &Tensor::ones(2, DType::F32, &Device::Cpu).unwrap(),
        )],
        &path,
    )
    .unwrap();
    let f = SafeTensorsFile::open(&path).unwrap();
    assert_names(
        &f.load("absent", &Device::Cpu).unwrap_err(),
        &path,
        Some("absent"),
        "no such tensor",
    );
    let missing = dir.file("nope.safetensors");
    assert!(matches!(
        SafeTensorsFile::open(&missing),
        Err(Error::Io { .. })
    ));
}

#[test]
fn failed_saves_leave_no_file() {
    let dir = TempDir::new("atomic");
    let x = Tensor::ones(3, DType::F32, &Device::Cpu).unwrap();
    // Duplicate names: nothing is written.
    let path = dir.file("dup.safetensors");
    let e = save([("x", &x), ("x", &x)], &path).unwrap_err();
    assert!(e.to_string().contains("given twice"), "{e}");
    assert!(!path.exists());
    // A directory that does not exist: an error, no file, no temporary left behind.
    let bad = dir.file("no/such/dir/x.safetensors");
    assert!(save([("x", &x)], &bad).is_err());
    assert!(!bad.exists());
    // A successful save replaces an existing file and leaves only the file.
    let path = dir.file("ok.safetensors");
    std::fs::write(&path, b"old contents").unwrap();
    save([("x", &x)], &path).unwrap();
    let names: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("ok.safetensors")]);
    assert_eq!(
        SafeTensorsFile::open(&path)
            .unwrap()
            .load("x", &Device::Cpu)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        vec![1.0; 3]
    );
}

#[test]
fn saves_are_byte_identical_and_readable_by_others() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("flame-st-bytes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let t = Tensor::from_vec(
        (0..12).map(|i| i as f32).collect::<Vec<_>>(),
        (3, 4),
        &Device::Cpu,
    )
    .unwrap();
    let u = Tensor::zeros(5, DType::BF16, &Device::Cpu).unwrap();
    // Several metadata entries: the safetensors crate writes them in hash order.
    let meta: BTreeMap<String, String> = (0..8)
        .map(|i| (format!("key{i}"), format!("v{i}")))
        .collect();
    let mut files = vec![];
    for name in ["a.safetensors", "b.safetensors"] {
        let p = dir.join(name);
        save_with_metadata([("t", &t), ("u", &u)], &meta, &p).unwrap();
        files.push(std::fs::read(&p).unwrap());
        assert_eq!(SafeTensorsFile::open(&p).unwrap().metadata(), &meta);
    }
    assert!(files[0] == files[1], "identical tensors, different bytes");
    let probe = dir.join("probe");
    std::fs::write(&probe, b"").unwrap();
    let usual = std::fs::metadata(&probe).unwrap().permissions().mode() & 0o777;
    let mode = std::fs::metadata(dir.join("a.safetensors"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, usual, "mode {mode:o}, the umask gives {usual:o}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `holds_fp8` reads headers only: a file with an F8_E4M3 tensor, a folder with such a shard,
/// neither in bf16-only files; a corrupt header is an error naming the file.
#[test]
fn holds_fp8_reads_the_headers() {
    let dir = TempDir::new("fp8");
    let fp8 = dir.file("qwen_3_4b_fp8_scaled.safetensors");
    raw_file(
        &fp8,
        r#"{"w":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[0,4]},"w_scale":{"dtype":"F32","shape":[],"data_offsets":[4,8]}}"#,
        &[0x38, 0x40, 0xb8, 0x00, 0, 0, 128, 63],
    );
    assert!(flame::safetensors::holds_fp8(&fp8).unwrap());
    let shards = dir.file("folder");
    std::fs::create_dir_all(&shards).unwrap();
    let bf16 = Tensor::from_vec(vec![1f32, 2.0], 2, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    save(
        [("a", &bf16)],
        shards.join("model-00001-of-00002.safetensors"),
    )
    .unwrap();
    assert!(!flame::safetensors::holds_fp8(&shards).unwrap());
    std::fs::copy(&fp8, shards.join("model-00002-of-00002.safetensors")).unwrap();
    assert!(flame::safetensors::holds_fp8(&shards).unwrap());
    let bad = dir.file("bad.safetensors");
    raw_file(&bad, "{not json", &[]);
    let e = flame::safetensors::holds_fp8(&bad).unwrap_err();
    assert!(e.to_string().contains("bad.safetensors"), "{e}");
}

/// `Tensor::from_le_bytes` reads little-endian values at any address (the way loads hand it a
/// mapped file's tensor) and refuses a byte count that is not the shape's.
#[test]
fn tensors_from_little_endian_bytes_at_any_address() {
    let values = [1.5f32, -2.25, 3.0e-3, f32::MAX, -0.0, 7.0];
    let mut raw = vec![0xAAu8];
    for v in values {
        raw.extend_from_slice(&v.to_le_bytes());
    }
    let t = Tensor::from_le_bytes(&raw[1..], DType::F32, (2, 3), &Device::Cpu).unwrap();
    assert_eq!(t.dims(), &[2, 3]);
    let back = t.to_vec::<f32>().unwrap();
    assert!(back
        .iter()
        .zip(values)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let halves: Vec<u8> = [0x3f80u16, 0xc000, 0x0001]
        .iter()
        .flat_map(|h| h.to_le_bytes())
        .collect();
    let b = Tensor::from_le_bytes(&halves, DType::BF16, 3, &Device::Cpu).unwrap();
    assert_eq!(
        b.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap()[..2],
        [1.0, -2.0]
    );
    let e = Tensor::from_le_bytes(&raw[1..], DType::F32, (2, 2), &Device::Cpu).unwrap_err();
    assert!(matches!(e, Error::ElementCount { .. }), "{e}");
    assert!(Tensor::from_le_bytes(&raw[1..24], DType::F32, 6, &Device::Cpu).is_err());
}
