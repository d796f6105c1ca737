//! Adapters on T5 and Qwen3 against transformers + peft: tests/fixtures/text_lora/t5_qwen3_*,
//! made by scripts/make_te_lora_fixtures.py (torch 2.15, transformers 5.24, peft 0.21.2;
//! computed in f64, stored in f32) over the tiny encoders of tests/fixtures/encoders/t5 and
//! tests/fixtures/qwen3/text_encoder: a rank-4 LoRA on every Linear, read from the PEFT layout
//! FLAME writes (`text_encoder_2.` for Flux's T5, `text_encoder.model.` for Qwen3), gives
//! peft's outputs and peft's gradients of every LoRA factor; streamed from host memory the
//! same; and the kohya layout round-trips under `lora_te3_` / `lora_te_model_`.
//!
//! Tolerance: max |flame - peft| / max |peft| per tensor, 1e-5 in f32 on the CPU.
#![cfg(feature = "cpu-ref")]

mod common;

use common::check_rel as check;
use flame::encoders::{EncoderPatch, Qwen3Encoder, Qwen3Options, T5Encoder};
use flame::nn::adapter::{
    load_kohya_sets, load_peft_sets, save_kohya_sets, save_peft_sets, FileSet,
};
use flame::nn::{AdapterConfig, Adapters, KeyMap, KeySource};
use flame::train::config::{QWEN3_TARGETS, T5_TARGETS};
use flame::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

const CPU: Device = Device::Cpu;
/// The bound on the CPU; on a GPU, f32 matmuls in another order.
fn tol(dev: &Device) -> f64 {
    if dev.is_cuda() {
        1e-4
    } else {
        1e-5
    }
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn outputs(dev: &Device) -> BTreeMap<String, Tensor> {
    flame::safetensors::load(root().join("text_lora/t5_qwen3_outputs.safetensors"), dev).unwrap()
}

fn lora_file() -> PathBuf {
    root().join("text_lora/t5_qwen3_lora.safetensors")
}

/// The fixture's LoRA: rank 4, alpha 4 (scale 1), on `targets`.
fn lora(targets: &[&str]) -> Arc<Adapters> {
    let c: AdapterConfig = flame::nn::LoraConfig {
        rank: 4,
        alpha: 4.0,
        dropout: 0.0,
        targets: targets.iter().map(|t| t.to_string()).collect(),
        seed: 7,
    }
    .into();
    Adapters::new(c).unwrap()
}

fn identity() -> KeyMap {
    Arc::new(|k: &str| Some(KeySource::Key(k.to_string())))
}

fn qwen3_map() -> KeyMap {
    Arc::new(|k: &str| Some(KeySource::Key(format!("model.{k}"))))
}

/// T5 from its transformers folder with adapters on `dev`, streamed `stream` blocks ahead or
/// resident.
fn t5_on(dev: &Device, stream: Option<usize>) -> (T5Encoder, Arc<Adapters>) {
    let a = lora(&T5_TARGETS);
    let (m, _) = T5Encoder::load_adapted(
        root().join("encoders/t5"),
        None,
        DType::F32,
        dev,
        None,
        stream,
        EncoderPatch::adapters(a.clone()),
    )
    .unwrap();
    (m, a)
}

fn t5(stream: Option<usize>) -> (T5Encoder, Arc<Adapters>) {
    t5_on(&CPU, stream)
}

/// Qwen3 from its transformers folder with adapters on `dev`, streamed or resident.
fn qwen3_on(dev: &Device, stream: Option<usize>) -> (Qwen3Encoder, Arc<Adapters>) {
    let a = lora(&QWEN3_TARGETS);
    let opts = Qwen3Options {
        stream,
        patch: EncoderPatch::adapters(a.clone()),
        ..Qwen3Options::default()
    };
    let (m, _) =
        Qwen3Encoder::load(root().join("qwen3/text_encoder"), DType::F32, dev, &opts).unwrap();
    (m, a)
}

fn qwen3(stream: Option<usize>) -> (Qwen3Encoder, Arc<Adapters>) {
    qwen3_on(&CPU, stream)
}

fn t5_set<'a>(a: &'a Adapters, map: &'a KeyMap) -> FileSet<'a> {
    FileSet {
        adapters: a,
        kohya: "lora_te3",
        peft: "text_encoder_2",
        map,
    }
}

fn qwen3_set<'a>(a: &'a Adapters, map: &'a KeyMap) -> FileSet<'a> {
    FileSet {
        adapters: a,
        kohya: "lora_te_model",
        peft: "text_encoder",
        map,
    }
}

/// peft's name of a LoRA factor FLAME names in kohya's words.
fn peft_name(name: &str) -> &str {
    match name {
        "lora_down.weight" => "lora_A.weight",
        "lora_up.weight" => "lora_B.weight",
        n => n,
    }
}

/// Every factor's gradient against peft's, `<what>.grad.<prefix>.<module>.<peft tensor>`.
fn check_grads(
    what: &str,
    a: &Adapters,
    grads: &flame::Grads,
    io: &BTreeMap<String, Tensor>,
    prefix: &str,
    tol: f64,
) -> usize {
    let mut n = 0;
    for l in a.layers().unwrap() {
        for (name, t) in l.params() {
            let key = format!("{what}.grad.{prefix}.{}.{}", l.path(), peft_name(name));
            let want = io.get(&key).unwrap_or_else(|| panic!("no {key}"));
            check(&key, grads.get(&t).unwrap(), want, tol);
            n += 1;
        }
    }
    n
}

/// The fixture's file read into T5's and Qwen3's adapters (it holds both sets).
fn read(t: &Adapters, q: &Adapters) {
    let (map, qmap) = (identity(), qwen3_map());
    load_peft_sets(&[t5_set(t, &map), qwen3_set(q, &qmap)], lora_file()).unwrap();
}

/// T5 on `dev` with the fixture's LoRA, its output and the gradients of sum(out * w).
fn t5_run(dev: &Device, stream: Option<usize>) -> (Tensor, flame::Grads, Arc<Adapters>) {
    let io = outputs(dev);
    let (m, a) = t5_on(dev, stream);
    read(&a, &qwen3_on(dev, None).1);
    let out = m.forward(&io["t5.ids"], None).unwrap();
    let grads = out
        .mul(&io["t5.w"])
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    (out, grads, a)
}

/// transformers' T5EncoderModel with peft's LoRA on q, k, v, o, wi_0, wi_1 and wo: the same
/// last hidden state and the same gradient of every factor, resident and with its blocks
/// streamed from host memory (the adapters on the device).
fn t5_lora_matches_peft(dev: &Device) {
    let io = outputs(dev);
    for stream in [None, Some(1)] {
        let (out, grads, a) = t5_run(dev, stream);
        check(
            &format!("t5 out, stream {stream:?}"),
            &out,
            &io["t5.out"],
            tol(dev),
        );
        let n = check_grads("t5", &a, &grads, &io, "text_encoder_2", tol(dev));
        assert_eq!(n, 2 * 7 * 2, "two factors on seven Linears in two blocks");
    }
}

/// Qwen3 on `dev` with the fixture's LoRA: hidden states 2 and 4 and the gradients of
/// sum(h2 * w2) + sum(h4 * w4).
fn qwen3_run(dev: &Device, stream: Option<usize>) -> (Vec<Tensor>, flame::Grads, Arc<Adapters>) {
    let io = outputs(dev);
    let (m, q) = qwen3_on(dev, stream);
    read(&t5_on(dev, None).1, &q);
    let hs = m
        .hidden_states(&io["qwen3.ids"], Some(&io["qwen3.mask"]), &[2, 4])
        .unwrap();
    let loss = hs[0]
        .mul(&io["qwen3.w2"])
        .unwrap()
        .sum_all()
        .unwrap()
        .add(&hs[1].mul(&io["qwen3.w4"]).unwrap().sum_all().unwrap())
        .unwrap();
    let grads = loss.backward().unwrap();
    (hs, grads, q)
}

/// transformers' Qwen3ForCausalLM with peft's LoRA on every Linear of its attention and MLP,
/// with right padding: the same hidden states 2 and 4 and the same factor gradients,
/// resident and with its layers streamed.
fn qwen3_lora_matches_peft(dev: &Device) {
    let io = outputs(dev);
    for stream in [None, Some(1)] {
        let (hs, grads, q) = qwen3_run(dev, stream);
        check(
            &format!("qwen3 h2, stream {stream:?}"),
            &hs[0],
            &io["qwen3.h2"],
            tol(dev),
        );
        check(
            &format!("qwen3 h4, stream {stream:?}"),
            &hs[1],
            &io["qwen3.h4"],
            tol(dev),
        );
        let n = check_grads("qwen3", &q, &grads, &io, "text_encoder.model", tol(dev));
        assert_eq!(n, 2 * 7 * 4, "two factors on seven Linears in four layers");
    }
}

common::devices::on_every_device!(t5_lora_matches_peft, qwen3_lora_matches_peft);

/// Both sets written in the kohya layout (`lora_te3_encoder_block_0_layer_0_SelfAttention_q`,
/// `lora_te_model_layers_0_self_attn_q_proj`) and the PEFT layout read back into fresh
/// adapters equal to what was written; a tensor no set takes is refused by name.
#[test]
fn t5_and_qwen3_files_round_trip() {
    let (_, t) = t5(None);
    let (_, q) = qwen3(None);
    read(&t, &q);
    let (map, qmap) = (identity(), qwen3_map());
    let dir = std::env::temp_dir().join(format!("flame-te-t5q-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let host = |a: &Adapters| -> Vec<(String, Vec<f64>)> {
        a.params()
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.to_vec_f64().unwrap()))
            .collect()
    };
    for kohya in [true, false] {
        let file = dir.join(format!("lora-{kohya}.safetensors"));
        let sets = [t5_set(&t, &map), qwen3_set(&q, &qmap)];
        match kohya {
            true => save_kohya_sets(&sets, &file, DType::F32, &BTreeMap::new()).unwrap(),
            false => save_peft_sets(&sets, &file, DType::F32, &BTreeMap::new()).unwrap(),
        }
        let names: Vec<String> = flame::safetensors::SafeTensorsFile::open(&file)
            .unwrap()
            .names()
            .map(str::to_string)
            .collect();
        let want = match kohya {
            true => [
                "lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_down.weight",
                "lora_te_model_layers_3_mlp_down_proj.lora_up.weight",
            ],
            false => [
                "text_encoder_2.encoder.block.1.layer.1.DenseReluDense.wi_0.lora_A.weight",
                "text_encoder.model.layers.0.self_attn.o_proj.lora_B.weight",
            ],
        };
        for w in want {
            assert!(names.iter().any(|n| n == w), "{w} not in {names:?}");
        }
        let (_, t2) = t5(None);
        let (_, q2) = qwen3(None);
        let sets2 = [t5_set(&t2, &map), qwen3_set(&q2, &qmap)];
        match kohya {
            true => load_kohya_sets(&sets2, &file).unwrap(),
            false => load_peft_sets(&sets2, &file).unwrap(),
        }
        assert_eq!(host(&t2), host(&t));
        assert_eq!(host(&q2), host(&q));
        // T5's set alone leaves Qwen3's tensors over: refused, naming one.
        let (_, t3) = t5(None);
        let e = match kohya {
            true => load_kohya_sets(&[t5_set(&t3, &map)], &file),
            false => load_peft_sets(&[t5_set(&t3, &map)], &file),
        }
        .unwrap_err()
        .to_string();
        let named = match kohya {
            true => "lora_te_model_layers_",
            false => "text_encoder.model.layers.",
        };
        assert!(e.contains(named), "{e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// diffusers' text-encoder loader reads Qwen3's part of FLAME's PEFT-layout file and peft
/// T5's, every tensor taken, and the encoders give peft's outputs
/// (scripts/check_t5_qwen3_lora_diffusers.py, exit 0).
#[test]
#[ignore = "needs Python with torch, transformers, diffusers and peft (FLAME_PYTHON, default python3)"]
fn diffusers_loader_reads_t5_and_qwen3_adapters() {
    let (_, t) = t5(None);
    let (_, q) = qwen3(None);
    read(&t, &q);
    let dir = std::env::temp_dir().join(format!("flame-te-t5q-py-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("lora.safetensors");
    let (map, qmap) = (identity(), qwen3_map());
    save_peft_sets(
        &[t5_set(&t, &map), qwen3_set(&q, &qmap)],
        &file,
        DType::F32,
        &BTreeMap::new(),
    )
    .unwrap();
    let python = std::env::var("FLAME_PYTHON").unwrap_or_else(|_| "python3".into());
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/check_t5_qwen3_lora_diffusers.py");
    let out = std::process::Command::new(python)
        .arg(script)
        .arg(&file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The streamed encoders' bf16 weights cross the link in the wire code only where adapters
/// train on them: a caption's pass uploads every block once, uncoded, while a training step
/// uploads them again and again.
#[test]
fn streamed_encoders_code_their_weights_only_where_adapters_train() {
    let io = outputs(&CPU);
    for trains in [false, true] {
        let patch = match trains {
            true => EncoderPatch::adapters(lora(&T5_TARGETS)),
            false => EncoderPatch::default(),
        };
        let (t5, _) = T5Encoder::load_adapted(
            root().join("encoders/t5"),
            None,
            DType::BF16,
            &CPU,
            None,
            Some(1),
            patch,
        )
        .unwrap();
        let _ = t5.forward(&io["t5.ids"], None).unwrap();
        let patch = match trains {
            true => EncoderPatch::adapters(lora(&QWEN3_TARGETS)),
            false => EncoderPatch::default(),
        };
        let opts = Qwen3Options {
            stream: Some(1),
            patch,
            ..Qwen3Options::default()
        };
        let (qwen3, _) =
            Qwen3Encoder::load(root().join("qwen3/text_encoder"), DType::BF16, &CPU, &opts)
                .unwrap();
        let _ = qwen3
            .hidden_states(&io["qwen3.ids"], Some(&io["qwen3.mask"]), &[2, 4])
            .unwrap();
        for (name, exec) in [("t5", t5.exec()), ("qwen3", qwen3.exec())] {
            let s = exec.streamer.as_ref().unwrap();
            assert_eq!(s.wire_code().unwrap(), trains, "{name}");
            let r = s.report().unwrap();
            assert!(r.uploads > 0 && r.host_bytes > 0, "{name}: {r:?}");
            if !trains {
                assert_eq!(r.uploaded_bytes, r.decoded_bytes, "{name} uncoded: {r:?}");
            }
        }
    }
}
