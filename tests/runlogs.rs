//! What other tools read of a run: TensorBoard event files (framing, CRCs and values decoded
//! here; `scripts/check_tensorboard.py` reads the committed fixture with TensorBoard's own
//! reader), the kohya / ModelSpec metadata of saved adapters, and the moving average of the
//! weights (diffusers' EMAModel decay from `scripts/make_ema_fixture.py`, exact resume).
#![cfg(feature = "cpu-ref")]

use flame::safetensors::SafeTensorsFile;
use flame::train::config::{EmaDevice, EmaSection, MetadataLevel};
use flame::train::ema::{Ema, EmaSchedule};
use flame::train::metadata::{self, DatasetFacts, IDENTIFYING_KEYS, TIME_KEYS};
use flame::train::rundir::read_log;
use flame::train::tensorboard::{self, crc32c, masked_crc32c, read_records, EventWriter};
use flame::train::{RunEnd, RunOptions, TrainConfig, Trainer};
use flame::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-runlogs-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tiny example's config under `dir` with `steps` steps, a checkpoint every 4, and
/// `extra` appended (whole sections).
fn tiny(dir: &Path, steps: usize, extra: &str) -> TrainConfig {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny-encoded.toml");
    let text = std::fs::read_to_string(example).unwrap();
    let text = text
        .replace("steps = 200", &format!("steps = {steps}"))
        .replace("save_every = 50", "save_every = 4")
        .replace("device = \"auto\"", "device = \"cpu\"")
        .replace("warmup_steps = 10", "warmup_steps = 2")
        + extra;
    let p = dir.join("train.toml");
    std::fs::write(&p, text).unwrap();
    let cfg = TrainConfig::from_file(&p).unwrap();
    flame::train::demo::make_tiny(&cfg).unwrap();
    cfg
}

fn run(cfg: &TrainConfig, opts: RunOptions) -> RunEnd {
    Trainer::new(cfg.clone())
        .unwrap()
        .run(&opts, &mut |_| {})
        .unwrap()
}

fn resume() -> RunOptions {
    RunOptions {
        resume: true,
        ..Default::default()
    }
}

// ----- protobuf decoding (only what the event files use) ---------------------------------

/// A decoded field: varint, fixed 64 / 32 bits, or bytes.
#[derive(Clone, Debug)]
enum Field {
    Varint(u64),
    F64(f64),
    F32(f32),
    Bytes(Vec<u8>),
}

fn varint(b: &[u8], at: &mut usize) -> u64 {
    let mut x = 0u64;
    let mut shift = 0;
    loop {
        let byte = b[*at];
        *at += 1;
        x |= ((byte & 0x7F) as u64) << shift;
        if byte < 0x80 {
            return x;
        }
        shift += 7;
    }
}

fn fields(b: &[u8]) -> Vec<(u32, Field)> {
    let mut v = vec![];
    let mut at = 0;
    while at < b.len() {
        let key = varint(b, &mut at);
        let (num, wire) = ((key >> 3) as u32, key & 7);
        let f = match wire {
            0 => Field::Varint(varint(b, &mut at)),
            1 => {
                let x = f64::from_le_bytes(b[at..at + 8].try_into().unwrap());
                at += 8;
                Field::F64(x)
            }
            5 => {
                let x = f32::from_le_bytes(b[at..at + 4].try_into().unwrap());
                at += 4;
                Field::F32(x)
            }
            2 => {
                let n = varint(b, &mut at) as usize;
                let x = b[at..at + n].to_vec();
                at += n;
                Field::Bytes(x)
            }
            w => panic!("unexpected wire type {w}"),
        };
        v.push((num, f));
    }
    v
}

fn get(fs: &[(u32, Field)], n: u32) -> Option<&Field> {
    fs.iter().find(|(k, _)| *k == n).map(|(_, f)| f)
}

fn bytes(fs: &[(u32, Field)], n: u32) -> Option<Vec<u8>> {
    match get(fs, n) {
        Some(Field::Bytes(b)) => Some(b.clone()),
        _ => None,
    }
}

/// An event as the tests read it.
#[derive(Debug, Default)]
struct Ev {
    step: i64,
    file_version: Option<String>,
    restart: bool,
    scalar: Option<(String, f32)>,
    image: Option<(String, i64, i64, i64, Vec<u8>)>,
}

fn decode_event(data: &[u8]) -> Ev {
    let fs = fields(data);
    let mut e = Ev {
        step: match get(&fs, 2) {
            Some(Field::Varint(s)) => *s as i64,
            _ => 0,
        },
        ..Default::default()
    };
    assert!(
        matches!(get(&fs, 1), Some(Field::F64(t)) if *t > 1.0e9),
        "wall_time"
    );
    e.file_version = bytes(&fs, 3).map(|b| String::from_utf8(b).unwrap());
    if let Some(s) = bytes(&fs, 7) {
        e.restart = matches!(get(&fields(&s), 1), Some(Field::Varint(1)));
    }
    if let Some(summary) = bytes(&fs, 5) {
        let value = fields(&bytes(&fields(&summary), 1).unwrap());
        let tag = String::from_utf8(bytes(&value, 1).unwrap()).unwrap();
        if let Some(Field::F32(x)) = get(&value, 2) {
            e.scalar = Some((tag.clone(), *x));
        }
        if let Some(img) = bytes(&value, 4) {
            let img = fields(&img);
            let int = |n| match get(&img, n) {
                Some(Field::Varint(x)) => *x as i64,
                _ => -1,
            };
            e.image = Some((tag, int(1), int(2), int(3), bytes(&img, 4).unwrap()));
        }
    }
    e
}

fn events_of(path: &Path) -> Vec<Ev> {
    let b = std::fs::read(path).unwrap();
    read_records(&b, path)
        .unwrap()
        .iter()
        .map(|d| decode_event(d))
        .collect()
}

fn event_files(out: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(out.join("tensorboard"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    v.sort();
    v
}

// ----- TensorBoard -----------------------------------------------------------------------

#[test]
fn crc32c_and_record_framing() {
    // CRC-32C check value (RFC 3720 B.4, and every CRC catalogue): "123456789".
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    // 32 zero bytes (RFC 3720 B.4).
    assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    let c = crc32c(b"abc");
    assert_eq!(
        masked_crc32c(b"abc"),
        c.rotate_right(15).wrapping_add(0xA282_EAD8)
    );
    let r = tensorboard::record(b"hello");
    assert_eq!(r.len(), 8 + 4 + 5 + 4);
    assert_eq!(u64::from_le_bytes(r[..8].try_into().unwrap()), 5);
    let p = Path::new("x");
    assert_eq!(read_records(&r, p).unwrap(), vec![b"hello".to_vec()]);
    // A torn last record ends the list; a damaged one is an error.
    let mut two = r.clone();
    two.extend_from_slice(&r[..10]);
    assert_eq!(read_records(&two, p).unwrap().len(), 1);
    let mut bad = r.clone();
    bad[13] ^= 1;
    assert!(read_records(&bad, p).is_err());
    let mut bad_len = r;
    bad_len[0] ^= 1;
    assert!(read_records(&bad_len, p).is_err());
}

#[test]
fn event_writer_writes_scalars_images_and_restarts() {
    let d = temp("writer");
    let mut w = EventWriter::create(&d).unwrap();
    w.scalar(3, "train/loss", 0.25).unwrap();
    w.restart(7).unwrap();
    let png_path = d.join("img.png");
    let img = Tensor::from_vec(
        (0..3 * 5 * 6)
            .map(|i| (i as f32 / 45.0) - 1.0)
            .collect::<Vec<_>>(),
        (3, 5, 6),
        &Device::Cpu,
    )
    .unwrap();
    flame::data::save_png(&img, &png_path).unwrap();
    let png = std::fs::read(&png_path).unwrap();
    w.png(7, "samples/0", &png).unwrap();
    assert!(w.png(8, "samples/1", b"not a png").is_err());
    let name = w.path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(tensorboard::is_event_file_name(&name), "{name}");
    let ev = events_of(&w.path);
    assert_eq!(ev.len(), 4);
    assert_eq!(ev[0].file_version.as_deref(), Some("brain.Event:2"));
    assert_eq!(ev[1].step, 3);
    assert_eq!(ev[1].scalar, Some(("train/loss".into(), 0.25)));
    assert!(ev[2].restart && ev[2].step == 7);
    let (tag, h, w_, cs, bytes) = ev[3].image.clone().unwrap();
    assert_eq!((tag.as_str(), h, w_, cs), ("samples/0", 5, 6, 3));
    assert_eq!(bytes, png);
    // A second writer in the same second gets a name of its own.
    let w2 = EventWriter::create(&d).unwrap();
    assert_ne!(w2.path, w.path);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_run_logs_its_steps_to_tensorboard_and_a_resume_marks_the_restart() {
    let d = temp("tb-run");
    let cfg = tiny(&d, 6, "");
    let out = cfg.train.output_dir.clone();
    // Stopped after step 5: checkpoint 4 is the last, and a resume redoes step 5.
    let stop5 = RunOptions {
        stop_at: Some(5),
        ..Default::default()
    };
    assert_eq!(run(&cfg, stop5), RunEnd::Stopped(5));
    assert!(matches!(run(&cfg, resume()), RunEnd::Finished(_)));
    let files = event_files(&out);
    assert_eq!(files.len(), 2, "{files:?}");
    let first = events_of(&files[0]);
    let second = events_of(&files[1]);
    // The resumed file restarts at step 5 (after checkpoint 4).
    assert!(second[1].restart && second[1].step == 5, "{:?}", second[1]);
    // What TensorBoard shows: the first file's events before the restart, then the second's.
    let mut shown: BTreeMap<(String, i64), f32> = BTreeMap::new();
    for e in first.iter().filter(|e| e.step < 5).chain(second.iter()) {
        if let Some((tag, x)) = &e.scalar {
            shown.insert((tag.clone(), e.step), *x);
        }
    }
    let log = read_log(&out.join("loss.jsonl")).unwrap();
    assert_eq!(log.len(), 6);
    for (step, line) in log {
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        for (key, tag) in [
            ("loss", "train/loss"),
            ("lr", "train/lr"),
            ("grad_norm", "train/grad_norm"),
        ] {
            let want = v[key].as_f64().unwrap() as f32;
            assert_eq!(
                shown[&(tag.to_string(), step as i64)],
                want,
                "{tag} at {step}"
            );
        }
    }
    // The event files are the run's: recorded, so --overwrite deletes them.
    let m = flame::train::rundir::RunDir::new(&out)
        .manifest()
        .unwrap()
        .unwrap();
    for f in &files {
        let rel = format!("tensorboard/{}", f.file_name().unwrap().to_string_lossy());
        assert!(m.files.contains_key(&rel), "{rel} not recorded");
    }
    let over = RunOptions {
        overwrite: true,
        stop_at: Some(1),
        ..Default::default()
    };
    run(&cfg, over);
    assert_eq!(event_files(&out).len(), 1);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn tensorboard_can_be_turned_off() {
    let d = temp("tb-off");
    let mut cfg = tiny(&d, 2, "");
    cfg.train.tensorboard = false;
    run(&cfg, RunOptions::default());
    assert!(!cfg.train.output_dir.join("tensorboard").exists());
    std::fs::remove_dir_all(&d).ok();
}

/// The committed fixture (`tests/fixtures/tensorboard/`, which
/// `scripts/check_tensorboard.py` reads with TensorBoard's reader) decodes here too; with
/// FLAME_WRITE_FIXTURES=1 it is written anew from a tiny run (stopped at 5 and resumed) and
/// an image.
#[test]
fn the_tensorboard_fixture_decodes() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tensorboard");
    if std::env::var("FLAME_WRITE_FIXTURES").is_ok() {
        let d = temp("tb-fixture");
        let cfg = tiny(&d, 6, "");
        let out = cfg.train.output_dir.clone();
        let stop = RunOptions {
            stop_at: Some(5),
            ..Default::default()
        };
        run(&cfg, stop);
        run(&cfg, resume());
        let _ = std::fs::remove_dir_all(&fixture);
        std::fs::create_dir_all(&fixture).unwrap();
        for (i, f) in event_files(&out).iter().enumerate() {
            std::fs::copy(
                f,
                fixture.join(format!("events.out.tfevents.000000000{i}.fixture")),
            )
            .unwrap();
        }
        let mut w = EventWriter::create(&d.join("img")).unwrap();
        let img = Tensor::from_vec(
            (0..3 * 8 * 12)
                .map(|i| ((i * 7 % 23) as f32 / 11.5) - 1.0)
                .collect::<Vec<_>>(),
            (3, 8, 12),
            &Device::Cpu,
        )
        .unwrap();
        flame::data::save_png(&img, d.join("s.png")).unwrap();
        let png = std::fs::read(d.join("s.png")).unwrap();
        w.png(6, "samples/0", &png).unwrap();
        std::fs::copy(
            &w.path,
            fixture.join("events.out.tfevents.0000000002.fixture"),
        )
        .unwrap();
        let log: Vec<serde_json::Value> = read_log(&out.join("loss.jsonl"))
            .unwrap()
            .iter()
            .map(|(_, l)| serde_json::from_str(l).unwrap())
            .collect();
        let expected = serde_json::json!({
            "scalars": log,
            "images": [{"tag": "samples/0", "step": 6, "width": 12, "height": 8}],
        });
        std::fs::write(fixture.join("expected.json"), expected.to_string()).unwrap();
        std::fs::remove_dir_all(&d).ok();
    }
    let mut n = 0;
    for e in std::fs::read_dir(&fixture).unwrap() {
        let p = e.unwrap().path();
        if p.to_string_lossy().contains("tfevents") {
            let ev = events_of(&p);
            assert_eq!(ev[0].file_version.as_deref(), Some("brain.Event:2"));
            n += 1;
        }
    }
    assert_eq!(n, 3);
}

// ----- metadata --------------------------------------------------------------------------

fn meta_of(path: &Path) -> BTreeMap<String, String> {
    SafeTensorsFile::open(path).unwrap().metadata().clone()
}

#[test]
fn tag_frequency_counts_as_kohya_does() {
    let item = |dir: &str, caption: &str, repeats| flame::data::Item {
        path: PathBuf::from(format!("/data/{dir}/a.png")),
        name: "a.png".into(),
        caption: caption.into(),
        width: 8,
        height: 8,
        repeats,
        reg: false,
        references: vec![],
    };
    let f = DatasetFacts::of_items(&[
        item("10_cat", "Cat, sitting , ,cat", 10),
        item("10_cat", "a cat", 10),
        item("style", "painting", 1),
    ]);
    assert_eq!(f.images, 21);
    assert_eq!(f.dirs["10_cat"], (10, 2));
    assert_eq!(f.dirs["style"], (1, 1));
    let cat = &f.tags["10_cat"];
    assert_eq!(cat["cat"], 2);
    assert_eq!(cat["sitting"], 1);
    assert_eq!(cat["a cat"], 1);
    assert_eq!(f.tags["style"]["painting"], 1);
}

#[test]
fn the_identity_follows_the_peers_names() {
    let id = |f, g, b, a, v| metadata::identity(f, g, b, a, v);
    assert_eq!(
        id("flux", true, 19, false, false).architecture,
        "flux-1-dev/lora"
    );
    assert_eq!(
        id("flux", false, 19, false, false).architecture,
        "flux-1-schnell/lora"
    );
    let sd35 = id("sd3", false, 38, false, false);
    assert_eq!(sd35.architecture, "stable-diffusion-3-5-large/lora");
    assert_eq!(sd35.base_version, "5-large");
    let sdxl = id("sdxl", false, 0, false, true);
    assert_eq!(sdxl.architecture, "stable-diffusion-xl-v1-base/lora");
    assert_eq!(sdxl.prediction, Some("v"));
    assert_eq!(
        id("flux2", false, 5, false, false).architecture,
        "Flux.2-klein-4b/lora"
    );
    assert_eq!(
        id("flux2", false, 8, false, false).architecture,
        "Flux.2-klein-9b/lora"
    );
    assert_eq!(
        id("zimage", false, 30, false, false).architecture,
        "Z-Image/lora"
    );
    assert_eq!(metadata::iso_date(0.0), "1970-01-01T00:00:00");
    assert_eq!(metadata::iso_date(1_795_977_045.7), "2026-11-29T18:30:45");
    assert_eq!(metadata::iso_date(951_782_400.0), "2000-02-29T00:00:00");
    let names = [
        "double_blocks.0.x",
        "double_blocks.18.img_attn.qkv.weight",
        "x.double_blocks.3",
    ];
    assert_eq!(
        metadata::count_blocks(names.into_iter(), &["double_blocks."]),
        19
    );
}

/// sd-scripts' `addnet_hash_safetensors` / `addnet_hash_legacy` of `path`'s tensors with only
/// its `ss_*` metadata: the data after the header, and bytes 0x100000..0x110000 of that file.
fn kohya_hashes(path: &Path) -> (String, String) {
    let f = SafeTensorsFile::open(path).unwrap();
    let tensors = flame::safetensors::load(path, &Device::Cpu).unwrap();
    let ss: BTreeMap<String, String> = f
        .metadata()
        .iter()
        .filter(|(k, _)| k.starts_with("ss_"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let tmp = path.with_extension("ss-only");
    flame::safetensors::save_with_metadata(tensors.iter().map(|(k, t)| (k.as_str(), t)), &ss, &tmp)
        .unwrap();
    let bytes = std::fs::read(&tmp).unwrap();
    std::fs::remove_file(&tmp).ok();
    flame::safetensors::addnet_hashes(&bytes)
}

#[test]
fn saved_adapters_carry_kohya_and_modelspec_metadata() {
    let d = temp("meta");
    let cfg = tiny(&d, 4, "");
    let out = cfg.train.output_dir.clone();
    run(&cfg, RunOptions::default());
    for f in ["lora.safetensors", "checkpoint-0000004/adapter.safetensors"] {
        let m = meta_of(&out.join(f));
        let want = [
            ("ss_network_dim", "8"),
            ("ss_network_alpha", "8"),
            ("ss_network_module", "networks.lora"),
            ("ss_base_model_version", "flux1"),
            ("ss_steps", "4"),
            ("ss_seed", "7"),
            ("ss_learning_rate", "0.003"),
            ("ss_lr_scheduler", "cosine"),
            ("ss_max_train_steps", "4"),
            ("ss_output_name", "out-encoded"),
            ("ss_sd_model_name", "flux-tiny.safetensors"),
            ("modelspec.sai_model_spec", "1.0.1"),
            ("modelspec.architecture", "flux-1-dev/lora"),
            (
                "modelspec.implementation",
                "https://github.com/black-forest-labs/flux",
            ),
            ("modelspec.title", "out-encoded"),
            ("flame_kind", "lora"),
        ];
        for (k, v) in want {
            assert_eq!(m.get(k).map(String::as_str), Some(v), "{f}: {k}");
        }
        let res = cfg.data.resolution;
        assert_eq!(m["ss_resolution"], format!("({res}, {res})"));
        assert_eq!(m["modelspec.resolution"], format!("{res}x{res}"));
        assert!(m["ss_optimizer"].starts_with("torch.optim.adamw.AdamW(weight_decay=0,"));
        let n = std::fs::read_dir(cfg.data.dir.as_ref().unwrap())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .path()
                    .extension()
                    .is_some_and(|x| x == "safetensors")
            })
            .count();
        assert_eq!(m["ss_num_train_images"], n.to_string());
        // 4 steps of 4 samples over n samples: epoch ceil(16 / n).
        assert_eq!(m["ss_epoch"], (16_usize).div_ceil(n).max(1).to_string());
        let dirs: serde_json::Value = serde_json::from_str(&m["ss_dataset_dirs"]).unwrap();
        assert_eq!(dirs["data"]["img_count"], n);
        assert_eq!(m["ss_tag_frequency"], "{}");
        let started: f64 = m["ss_training_started_at"].parse().unwrap();
        let finished: f64 = m["ss_training_finished_at"].parse().unwrap();
        assert!(started > 1.0e9 && finished >= started);
        assert_eq!(m["modelspec.date"], metadata::iso_date(finished));
        let (model, legacy) = kohya_hashes(&out.join(f));
        assert_eq!(m["sshs_model_hash"], model, "{f}");
        assert_eq!(m["sshs_legacy_hash"], legacy, "{f}");
        // Under 1 MiB: the legacy hash is SHA-256 of nothing.
        assert_eq!(legacy, "e3b0c442");
    }
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn minimal_metadata_leaves_out_what_identifies_the_data() {
    let d = temp("meta-min");
    let mut cfg = tiny(&d, 2, "");
    cfg.train.metadata = MetadataLevel::Minimal;
    run(&cfg, RunOptions::default());
    let m = meta_of(&cfg.train.output_dir.join("lora.safetensors"));
    for k in IDENTIFYING_KEYS {
        assert!(
            !m.contains_key(k),
            "{k} written with train.metadata = \"minimal\""
        );
    }
    assert!(m["modelspec.title"].starts_with("LoRA@"));
    assert_eq!(m["ss_network_dim"], "8");
    assert_eq!(m["modelspec.architecture"], "flux-1-dev/lora");
    assert!(m.contains_key("sshs_model_hash"));
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn the_peft_layout_keeps_its_keys_and_gains_the_run_metadata() {
    let d = temp("meta-peft");
    let mut cfg = tiny(&d, 2, "");
    cfg.adapter.format = flame::train::config::AdapterFormat::Peft;
    run(&cfg, RunOptions::default());
    let m = meta_of(&cfg.train.output_dir.join("lora.safetensors"));
    assert_eq!(m["format"], "pt");
    assert_eq!(m["flame_rank"], "8");
    assert_eq!(m["ss_network_dim"], "8");
    assert_eq!(m["ss_steps"], "2");
    assert_eq!(m["modelspec.architecture"], "flux-1-dev/lora");
    std::fs::remove_dir_all(&d).ok();
}

/// Two runs of one config write the same tensors and metadata, the times aside.
#[test]
fn two_runs_differ_only_in_their_times() {
    let (a, b) = (temp("same-a"), temp("same-b"));
    let mut outs = vec![];
    for d in [&a, &b] {
        let cfg = tiny(d, 2, "");
        run(&cfg, RunOptions::default());
        outs.push(cfg.train.output_dir);
    }
    let strip = |p: &Path| {
        let mut m = meta_of(p);
        for k in TIME_KEYS {
            assert!(m.remove(k).is_some(), "{k}");
        }
        m
    };
    let (x, y) = (
        outs[0].join("lora.safetensors"),
        outs[1].join("lora.safetensors"),
    );
    assert_eq!(strip(&x), strip(&y));
    let data = |p: &Path| {
        let b = std::fs::read(p).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        b[8 + n..].to_vec()
    };
    assert!(data(&x) == data(&y));
    std::fs::remove_dir_all(&a).ok();
    std::fs::remove_dir_all(&b).ok();
}

// ----- EMA -------------------------------------------------------------------------------

fn fixture() -> serde_json::Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ema/decay.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn schedule_of(s: &serde_json::Value) -> EmaSchedule {
    EmaSchedule {
        decay: s["decay"].as_f64().unwrap(),
        min_decay: s["min_decay"].as_f64().unwrap(),
        update_after_step: s["update_after_step"].as_u64().unwrap(),
        warmup: s["use_ema_warmup"].as_bool().unwrap(),
        inv_gamma: s["inv_gamma"].as_f64().unwrap(),
        power: s["power"].as_f64().unwrap(),
    }
}

/// The decay of every step equals diffusers' EMAModel.get_decay (a Python float: the same
/// f64 operations, so to the last bit or within one rounding of `powf`).
#[test]
fn the_decay_schedule_is_diffusers() {
    let fx = fixture();
    for case in fx["cases"].as_array().unwrap() {
        let sch = schedule_of(&case["settings"]);
        for (i, want) in case["decay"].as_array().unwrap().iter().enumerate() {
            let want = want.as_f64().unwrap();
            let got = sch.decay_at(i as u64 + 1);
            assert!(
                (got - want).abs() <= 4.0 * f64::EPSILON * want.abs(),
                "{:?} step {}: {got} vs {want}",
                case["settings"],
                i + 1
            );
        }
    }
    // The defaults are EMAModel's.
    let d = EmaSchedule::of(&default_ema());
    assert_eq!(
        (
            d.decay,
            d.min_decay,
            d.update_after_step,
            d.warmup,
            d.inv_gamma,
            d.power
        ),
        (0.9999, 0.0, 0, false, 1.0, 2.0 / 3.0)
    );
}

fn default_ema() -> EmaSection {
    let cfg = TrainConfig::from_toml(
        "[model]\narch = \"flux\"\npath = \"m\"\n[adapter]\ntargets = [\"x\"]\n[train]\nsteps = 1\noutput_dir = \"o\"\n[data]\ndir = \"d\"\n",
    )
    .unwrap();
    cfg.ema
}

/// One update from a fixture's shadow at step k-1 and the parameter at step k gives its
/// shadow at step k, on the device and in host memory (f32: within an ulp or two).
#[test]
fn an_update_is_diffusers_step() {
    let fx = fixture();
    for case in fx["cases"].as_array().unwrap() {
        let sch = schedule_of(&case["settings"]);
        let shadows = case["shadows"].as_array().unwrap();
        let vals = |v: &serde_json::Value| -> Vec<f32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        };
        let start = vals(&case["start"]);
        // (step k's shadow, from step k-1's: the first from the start weights).
        let mut pairs = vec![(start.clone(), &shadows[0])];
        for w in shadows.windows(2) {
            if w[1]["step"].as_u64() == w[0]["step"].as_u64().map(|s| s + 1) {
                pairs.push((vals(&w[0]["shadow"]), &w[1]));
            }
        }
        assert!(pairs.len() >= 5);
        for place in [EmaDevice::Gpu, EmaDevice::Cpu] {
            for (before, after) in &pairs {
                let k = after["step"].as_u64().unwrap();
                let t = |v: &[f32]| Tensor::from_slice(v, (7, 3), &Device::Cpu).unwrap();
                let mut ema = Ema::new(&[("w".into(), t(before))], sch, place).unwrap();
                // Put the schedule at step k - 1.
                let tmp = temp(&format!("ema-step-{k}-{place:?}"));
                ema.save(&tmp.join("e.safetensors"), &Device::Cpu).unwrap();
                let mut m = BTreeMap::new();
                m.insert(
                    flame::train::ema::STEPS_KEY.to_string(),
                    (k - 1).to_string(),
                );
                let f = flame::safetensors::load(tmp.join("e.safetensors"), &Device::Cpu).unwrap();
                flame::safetensors::save_with_metadata(
                    f.iter().map(|(n, t)| (n.as_str(), t)),
                    &m,
                    tmp.join("e.safetensors"),
                )
                .unwrap();
                ema.load(&tmp.join("e.safetensors"), &Device::Cpu).unwrap();
                std::fs::remove_dir_all(&tmp).ok();
                let p = t(&vals(&after["param"]));
                ema.update(&[("w".into(), p)]).unwrap();
                assert_eq!(ema.steps(), k);
                let got = ema.tensors(&Device::Cpu).unwrap()[0]
                    .to_vec::<f32>()
                    .unwrap();
                let want = vals(&after["shadow"]);
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() <= 2.0 * f32::EPSILON * w.abs().max(1.0),
                        "{place:?} step {k}: {g} vs {w}"
                    );
                }
            }
        }
    }
}

/// Swapping the average in and back out leaves the weights bit for bit as they were.
#[test]
fn swapping_the_average_in_and_out_is_exact() {
    let w: Vec<f32> = (0..33).map(|i| (i as f32 * 0.37).sin()).collect();
    let p = Tensor::from_slice(&w, (3, 11), &Device::Cpu).unwrap();
    let params = vec![("a".to_string(), p.clone())];
    for place in [EmaDevice::Cpu, EmaDevice::Gpu] {
        let mut ema = Ema::new(&params, EmaSchedule::of(&default_ema()), place).unwrap();
        // The average holds the weights of one update ago; the weights move on.
        ema.update(&params).unwrap();
        p.assign(&p.affine(1.5, 0.1).unwrap()).unwrap();
        let before = p.to_vec::<f32>().unwrap();
        let kept = ema.swap_in(&params).unwrap();
        let inside = p.to_vec::<f32>().unwrap();
        assert_eq!(
            inside,
            ema.tensors(&Device::Cpu).unwrap()[0]
                .to_vec::<f32>()
                .unwrap()
        );
        assert_ne!(inside, before);
        Ema::swap_out(&params, &kept).unwrap();
        let after = p.to_vec::<f32>().unwrap();
        assert!(before
            .iter()
            .zip(&after)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

fn tensors(p: &Path) -> BTreeMap<String, Vec<u32>> {
    flame::safetensors::load(p, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t)| {
            let bits = t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
            (k, bits.iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

/// A run with the average resumed after an interruption ends with the adapter and the
/// average bit for bit as the uninterrupted run's, on the device and in host memory.
#[test]
fn the_average_resumes_exactly() {
    for (device, name) in [("gpu", "ema-gpu"), ("cpu", "ema-cpu")] {
        let extra = format!(
            "\n[ema]\nenabled = true\ndecay = 0.9\nwarmup = true\nupdate_after_step = 1\ndevice = \"{device}\"\nfor_outputs = true\n"
        );
        let a = temp(&format!("{name}-full"));
        let cfg_a = tiny(&a, 10, &extra);
        run(&cfg_a, RunOptions::default());
        let b = temp(&format!("{name}-resumed"));
        let cfg_b = tiny(&b, 10, &extra);
        let stop = RunOptions {
            stop_at: Some(6),
            ..Default::default()
        };
        assert_eq!(run(&cfg_b, stop), RunEnd::Stopped(6));
        assert!(matches!(run(&cfg_b, resume()), RunEnd::Finished(_)));
        let (oa, ob) = (&cfg_a.train.output_dir, &cfg_b.train.output_dir);
        for f in [
            "lora.safetensors",
            "lora_ema.safetensors",
            "checkpoint-0000010/ema.safetensors",
        ] {
            assert_eq!(tensors(&oa.join(f)), tensors(&ob.join(f)), "{name}: {f}");
        }
        // The average is not the adapter, and its file has the adapter's layout and keys.
        let (fin, ema) = (
            tensors(&oa.join("lora.safetensors")),
            tensors(&oa.join("lora_ema.safetensors")),
        );
        assert_eq!(
            fin.keys().collect::<Vec<_>>(),
            ema.keys().collect::<Vec<_>>()
        );
        assert_ne!(fin, ema);
        let m = meta_of(&oa.join("lora_ema.safetensors"));
        assert_eq!(m["ss_network_dim"], "8");
        assert_eq!(m["ss_steps"], "10");
        let st = SafeTensorsFile::open(oa.join("checkpoint-0000010/ema.safetensors")).unwrap();
        assert_eq!(st.metadata()[flame::train::ema::STEPS_KEY], "10");
        std::fs::remove_dir_all(&a).ok();
        std::fs::remove_dir_all(&b).ok();
    }
}

#[test]
fn ema_settings_are_checked() {
    let base = "[model]\narch = \"flux\"\npath = \"m\"\n[adapter]\ntargets = [\"x\"]\n[train]\nsteps = 1\noutput_dir = \"o\"\n[data]\ndir = \"d\"\n";
    for (bad, key) in [
        ("[ema]\ndecay = 1.5\n", "ema.decay"),
        ("[ema]\ndecay = 0.9\nmin_decay = 0.95\n", "ema.min_decay"),
        ("[ema]\ninv_gamma = 0\n", "ema.inv_gamma"),
        ("[ema]\npower = -1\n", "ema.power"),
        ("[ema]\nfor_outputs = true\n", "ema.for_outputs"),
        ("[ema]\ndevice = \"tpu\"\n", "ema.device"),
        ("[train]\n", "train"),
    ] {
        let text = match bad.starts_with("[train]") {
            true => base.replace("[train]\n", "[train]\nmetadata = \"some\"\n"),
            false => format!("{base}{bad}"),
        };
        let e = TrainConfig::from_toml(&text).unwrap_err().to_string();
        let key = if key == "train" {
            "train.metadata"
        } else {
            key
        };
        assert!(e.contains(key), "{bad}: {e}");
    }
}
