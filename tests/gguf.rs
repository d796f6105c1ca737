//! GGUF files and GGML dequantization: the reader against a file gguf-py's GGUFWriter wrote
//! (metadata of every type, shapes, types), every type's dequantization bit for bit against
//! gguf-py's `gguf.quants.dequantize` (tests/fixtures/gguf, from scripts/make_gguf_fixtures.py),
//! the kernel's CPU reference on packed words, corrupt files as errors naming the file and the
//! tensor, and (ignored unless on a GPU) the CUDA kernels against the CPU bit for bit.
#![cfg(feature = "cpu-ref")]

mod common;
use common::gguf::{gguf_bytes, kv_str, random_blocks, Entry};
use flame::backend::ggml::{self, GgmlType};
use flame::gguf::{GgufFile, Value};
use flame::{DType, Device, Tensor};
use std::path::{Path, PathBuf};

const CPU: Device = Device::Cpu;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

/// A file under the temp folder removed on drop.
struct Temp(PathBuf);

impl Temp {
    fn new(tag: &str, bytes: &[u8]) -> Temp {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "flame-gguf-{}-{tag}-{}.gguf",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&p, bytes).unwrap();
        Temp(p)
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn type_of(name: &str) -> GgmlType {
    let stem = name.split('.').next().unwrap().to_ascii_uppercase();
    GgmlType::ALL
        .into_iter()
        .find(|t| t.name() == stem)
        .unwrap_or_else(|| panic!("no type for {name}"))
}

fn json_of(v: &Value) -> serde_json::Value {
    match v {
        Value::U8(x) => (*x).into(),
        Value::I8(x) => (*x).into(),
        Value::U16(x) => (*x).into(),
        Value::I16(x) => (*x).into(),
        Value::U32(x) => (*x).into(),
        Value::I32(x) => (*x).into(),
        Value::U64(x) => (*x).into(),
        Value::I64(x) => (*x).into(),
        Value::F32(x) => (*x as f64).into(),
        Value::F64(x) => (*x).into(),
        Value::Bool(x) => (*x).into(),
        Value::String(s) => s.clone().into(),
        Value::Array(a) => a.iter().map(json_of).collect::<Vec<_>>().into(),
    }
}

#[test]
fn reads_the_header_metadata_and_tensor_table_gguf_py_wrote() {
    let f = GgufFile::open(fixture("types.gguf")).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 64);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("meta.json")).unwrap()).unwrap();
    for (k, want) in meta.as_object().unwrap() {
        let got = json_of(
            f.metadata()
                .get(k)
                .unwrap_or_else(|| panic!("no metadata {k}")),
        );
        assert_eq!(&got, want, "metadata {k}");
    }
    let values = flame::safetensors::SafeTensorsFile::open(fixture("values.safetensors")).unwrap();
    let names: Vec<&str> = f.names().collect();
    assert_eq!(names, values.names().collect::<Vec<_>>());
    for name in names {
        let info = f.info(name).unwrap();
        assert_eq!(
            info.shape,
            values.info(name).unwrap().shape,
            "{name}: shape"
        );
        assert_eq!(info.start as u64 % f.alignment(), 0, "{name}: aligned");
        if name.contains('.') {
            assert_eq!(info.ty, type_of(name), "{name}: type");
        }
    }
    // dims are stored innermost first: the (3, 5, 2) cube reads back as (3, 5, 2).
    assert_eq!(f.info("cube").unwrap().shape, vec![3, 5, 2]);
    assert_eq!(f.info("bias").unwrap().ty, GgmlType::F16);
}

/// Every tensor of every type dequantizes to gguf-py's f32 values bit for bit, on the host
/// and through the kernel's CPU reference from packed words.
#[test]
fn dequantizes_every_type_as_gguf_py() {
    let f = GgufFile::open(fixture("types.gguf")).unwrap();
    let values = flame::safetensors::SafeTensorsFile::open(fixture("values.safetensors")).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for name in f.names() {
        let want: Vec<u32> = values
            .load(name, &CPU)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let got: Vec<u32> = f
            .dequantize(name)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(got, want, "{name}: host dequantization");
        let info = f.info(name).unwrap();
        seen.insert(info.ty);
        if info.shape.len() == 2 {
            let (ty, words) = f.packed_words(name).unwrap();
            let n = words.len();
            let t = Tensor::from_vec(words, n, &CPU).unwrap();
            let (rows, cols) = (info.shape[0], info.shape[1]);
            let k: Vec<u32> = t
                .dequant_ggml(ty, rows, cols, DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            assert_eq!(k, want, "{name}: the kernel's CPU reference");
            // bf16 output: the f32 values rounded once.
            let b = t.dequant_ggml(ty, rows, cols, DType::BF16).unwrap();
            let wb: Vec<f32> = want
                .iter()
                .map(|&v| half::bf16::from_f32(f32::from_bits(v)).to_f32())
                .collect();
            assert_eq!(
                b.to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap(),
                wb,
                "{name}: bf16"
            );
        }
        // Loading converts to the asked dtype.
        let l = f.load_as(name, &CPU, DType::F32).unwrap();
        assert_eq!(l.dims(), info.shape.as_slice());
    }
    assert_eq!(
        seen.len(),
        GgmlType::ALL.len(),
        "every type covered: {seen:?}"
    );
}

#[test]
fn the_kernel_refuses_operands_that_do_not_fit() {
    let words = Tensor::from_vec(vec![0u32; 8], 8, &CPU).unwrap();
    // 34 bytes a Q8_0 block: one block needs 9 words.
    assert!(words
        .dequant_ggml(GgmlType::Q8_0, 1, 32, DType::F32)
        .is_err());
    // Rows not whole blocks.
    assert!(words
        .dequant_ggml(GgmlType::Q4_0, 1, 16, DType::F32)
        .is_err());
    assert!(words
        .dequant_ggml(GgmlType::Q4_0, 1, 32, DType::U32)
        .is_err());
    let f = Tensor::zeros(8, DType::F32, &CPU).unwrap();
    assert!(f.dequant_ggml(GgmlType::Q4_0, 1, 32, DType::F32).is_err());
    let two = Tensor::from_vec(vec![0u32; 10], (2, 5), &CPU).unwrap();
    assert!(two.dequant_ggml(GgmlType::Q8_0, 1, 32, DType::F32).is_err());
    assert!(Tensor::from_vec(vec![0u32; 9], 9, &CPU)
        .unwrap()
        .dequant_ggml(GgmlType::Q8_0, 1, 32, DType::F32)
        .is_ok());
}

/// A small valid file: one Q8_0 (3, 64) weight and one F32 bias.
fn small_file() -> Vec<u8> {
    let w = Entry {
        name: "layer.weight".into(),
        shape: vec![3, 64],
        ty: GgmlType::Q8_0,
        bytes: random_blocks(GgmlType::Q8_0, 3 * 64, 1, 0.01),
    };
    let b = Entry {
        name: "layer.bias".into(),
        shape: vec![3],
        ty: GgmlType::F32,
        bytes: random_blocks(GgmlType::F32, 3, 2, 1.0),
    };
    gguf_bytes(3, &[("general.architecture", kv_str("flux"))], &[w, b], 32)
}

/// The byte offset of the tensor table's first entry in `small_file`.
fn table_start(b: &[u8]) -> usize {
    let key = b"general.architecture";
    let at = b.windows(key.len()).position(|w| w == key).unwrap();
    at + key.len() + 4 + 8 + 4 // type, string length, "flux"
}

fn open_err(tag: &str, bytes: &[u8]) -> String {
    let t = Temp::new(tag, bytes);
    let e = GgufFile::open(&t.0)
        .map(|_| ())
        .expect_err(&format!("{tag}: should be refused"));
    let msg = e.to_string();
    assert!(
        msg.contains(&t.0.display().to_string()),
        "{tag}: names the file: {msg}"
    );
    msg
}

#[test]
fn corrupt_files_are_errors_naming_the_file_and_the_tensor() {
    let good = small_file();
    let t = Temp::new("good", &good);
    let f = GgufFile::open(&t.0).unwrap();
    assert_eq!(f.info("layer.weight").unwrap().shape, vec![3, 64]);
    assert_eq!(f.version(), 3);
    let v2 = {
        let mut b = good.clone();
        b[4] = 2;
        b
    };
    assert_eq!(
        GgufFile::open(&Temp::new("v2", &v2).0).unwrap().version(),
        2
    );

    // Truncated everywhere: in the header, the key/values, the table, the data.
    for cut in [
        0,
        3,
        7,
        15,
        23,
        30,
        50,
        table_start(&good) + 5,
        good.len() - 1,
    ] {
        let msg = open_err("cut", &good[..cut]);
        assert!(
            msg.contains("truncated") || msg.contains("out of bounds") || msg.contains("corrupt"),
            "cut at {cut}: {msg}"
        );
    }
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(open_err("magic", &bad).contains("not a GGUF file"));
    for v in [1u32, 4, 0x0300_0000] {
        let mut bad = good.clone();
        bad[4..8].copy_from_slice(&v.to_le_bytes());
        assert!(open_err("version", &bad).contains("version"));
    }
    // A key/value count that cannot fit.
    let mut bad = good.clone();
    bad[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(open_err("kv count", &bad).contains("corrupt"));
    // An unknown value type.
    let mut bad = good.clone();
    let key_end = 24 + 8 + "general.architecture".len();
    bad[key_end..key_end + 4].copy_from_slice(&99u32.to_le_bytes());
    assert!(open_err("value type", &bad).contains("unknown value type 99"));

    // The first table entry: name "layer.bias" (the writer's order), dims count, dims, type,
    // offset. The tensors are listed in the order written: weight, then bias.
    let ts = table_start(&good);
    let name_len = "layer.weight".len();
    let ndims_at = ts + 8 + name_len;
    let type_at = ndims_at + 4 + 2 * 8;
    let offset_at = type_at + 4;
    let mut bad = good.clone();
    bad[type_at..type_at + 4].copy_from_slice(&16u32.to_le_bytes());
    let msg = open_err("iq2", &bad);
    assert!(
        msg.contains("layer.weight") && msg.contains("IQ2_XXS"),
        "{msg}"
    );
    bad[type_at..type_at + 4].copy_from_slice(&77u32.to_le_bytes());
    let msg = open_err("type", &bad);
    assert!(
        msg.contains("layer.weight") && msg.contains("unknown ggml type 77"),
        "{msg}"
    );
    let mut bad = good.clone();
    bad[offset_at..offset_at + 8].copy_from_slice(&(1u64 << 20).to_le_bytes());
    let msg = open_err("bounds", &bad);
    assert!(
        msg.contains("layer.weight") && msg.contains("out of bounds"),
        "{msg}"
    );
    let mut bad = good.clone();
    bad[offset_at..offset_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(open_err("overflow", &bad).contains("layer.weight"));
    let mut bad = good.clone();
    bad[offset_at..offset_at + 8].copy_from_slice(&8u64.to_le_bytes());
    assert!(open_err("align", &bad).contains("alignment"));
    for n in [0u32, 5] {
        let mut bad = good.clone();
        bad[ndims_at..ndims_at + 4].copy_from_slice(&n.to_le_bytes());
        assert!(open_err("dims", &bad).contains("layer.weight"));
    }
    // Rows that are not whole blocks: 64 -> 48 values a row of Q8_0.
    let mut bad = good.clone();
    bad[ndims_at + 4..ndims_at + 12].copy_from_slice(&48u64.to_le_bytes());
    assert!(open_err("blocks", &bad).contains("whole Q8_0 blocks"));
    // Huge dims overflow.
    let mut bad = good.clone();
    bad[ndims_at + 12..ndims_at + 20].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(open_err("huge", &bad).contains("layer.weight"));
    // An alignment that is not a power of two.
    let odd = gguf_bytes(3, &[], &[], 48);
    assert!(open_err("alignment", &odd).contains("power of two"));
    // A missing tensor names itself.
    let e = f.dequantize("nope").unwrap_err().to_string();
    assert!(
        e.contains("nope") && e.contains(&t.0.display().to_string()),
        "{e}"
    );

    // Any byte of the header changed to any value: an error or a file, never a panic.
    let header = (offset_at + 8).min(good.len());
    for i in 0..header {
        for v in [0u8, 1, 0x7F, 0xFF] {
            let mut b = good.clone();
            b[i] = v;
            let t = Temp::new("fuzz", &b);
            if let Ok(f) = GgufFile::open(&t.0) {
                for n in f.names().map(str::to_string).collect::<Vec<_>>() {
                    let _ = f.dequantize(&n);
                }
            }
        }
    }
}

#[test]
fn random_blocks_of_every_type_decode_finite() {
    for ty in GgmlType::ALL {
        let n = 3 * ty.block_values().max(8);
        let b = random_blocks(ty, n, 5, 0.05);
        let mut y = vec![0f32; n];
        ggml::dequantize(ty, &b, &mut y).unwrap();
        assert!(y.iter().all(|v| v.is_finite()), "{}", ty.name());
        assert!(y.iter().any(|v| *v != 0.0), "{}", ty.name());
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    fn bits(t: &Tensor) -> Vec<u64> {
        t.to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec::<f64>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    /// Every type's CUDA kernel gives the CPU reference's bits for every output dtype, on
    /// random blocks with odd row counts (and rows of one block and of many).
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_dequant_equals_cpu_bit_for_bit() {
        let _one = common::devices::serial();
        let dev = Device::cuda(0).expect("a CUDA GPU");
        for ty in GgmlType::ALL {
            let bv = ty.block_values().max(32);
            for (rows, blocks_per_row) in [(1, 1), (3, 1), (7, 5), (33, 3), (129, 12)] {
                let cols = bv * blocks_per_row;
                let b = random_blocks(ty, rows * cols, (rows * 31 + cols) as u64, 0.05);
                let words = ggml::to_words(&b);
                let n = words.len();
                let c = Tensor::from_vec(words.clone(), n, &CPU).unwrap();
                let g = Tensor::from_vec(words, n, &dev).unwrap();
                for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                    let a = c.dequant_ggml(ty, rows, cols, dt).unwrap();
                    let d = g.dequant_ggml(ty, rows, cols, dt).unwrap();
                    assert!(d.device().is_cuda());
                    assert_eq!(d.dims(), [rows, cols]);
                    assert_eq!(bits(&a), bits(&d), "{} ({rows}, {cols}) {dt}", ty.name());
                }
            }
        }
    }
}
