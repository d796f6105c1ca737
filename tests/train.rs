//! The training loop on the tiny Flux (made on first use, as examples/flux-tiny.toml does):
//! exact resume after an interruption, checkpoint rotation, the loss falling, and bad input
//! caught before anything is written.
#![cfg(feature = "cpu-ref")]

use flame::train::trainer::{checkpoints, read_log};
use flame::train::{TrainConfig, Trainer};
use std::path::{Path, PathBuf};

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-train-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tiny example's config with its files under `dir` and `steps` steps.
fn tiny(dir: &Path, steps: usize, extra: &str) -> PathBuf {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny.toml");
    let text = std::fs::read_to_string(example).unwrap();
    let text = text
        .replace("steps = 200", &format!("steps = {steps}"))
        .replace("save_every = 50", "save_every = 4")
        .replace("device = \"auto\"", "device = \"cpu\"")
        .replace("[adapter]\n", &format!("[adapter]\n{extra}"));
    let p = dir.join("train.toml");
    std::fs::write(&p, text).unwrap();
    p
}

fn losses(out: &Path) -> Vec<String> {
    read_log(&out.join("loss.jsonl"))
        .unwrap()
        .into_iter()
        .map(|(_, l)| l)
        .collect()
}

#[test]
fn an_interrupted_run_resumes_exactly() {
    // Dropout and gradient accumulation on, so their randomness and state must resume too.
    let extra = "dropout = 0.1\n";
    let a = temp("full");
    let cfg = TrainConfig::from_file(tiny(&a, 10, extra)).unwrap();
    let mut cfg_acc = cfg.clone();
    cfg_acc.train.grad_accum = 2;
    Trainer::new(cfg_acc.clone())
        .unwrap()
        .run(false, None, false)
        .unwrap();
    let full = losses(&cfg.train.output_dir);
    assert_eq!(full.len(), 10);
    // Kept: the last two checkpoints (8 and 10 of 4, 8, 10) and the final adapter.
    let kept: Vec<usize> = checkpoints(&cfg.train.output_dir)
        .unwrap()
        .iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(kept, [8, 10]);
    assert!(cfg.train.output_dir.join("lora.safetensors").is_file());

    let b = temp("resumed");
    let mut cfg_b = TrainConfig::from_file(tiny(&b, 10, extra)).unwrap();
    cfg_b.train.grad_accum = 2;
    // Killed after step 6: the last checkpoint is at 4, and steps 4 and 5 are logged.
    Trainer::new(cfg_b.clone())
        .unwrap()
        .run(false, Some(6), false)
        .unwrap();
    assert_eq!(losses(&cfg_b.train.output_dir).len(), 6);
    assert!(!cfg_b.train.output_dir.join("lora.safetensors").exists());
    // A new process resumes from checkpoint 4 and redoes 4 and 5.
    Trainer::new(cfg_b.clone())
        .unwrap()
        .run(true, None, false)
        .unwrap();
    assert_eq!(
        losses(&cfg_b.train.output_dir),
        full,
        "resumed losses equal, bit for bit"
    );
    // The same final adapter (the tensors; metadata order may differ).
    let load = |c: &TrainConfig| {
        flame::safetensors::load(
            c.train.output_dir.join("lora.safetensors"),
            &flame::Device::Cpu,
        )
        .unwrap()
    };
    let (fa, fb) = (load(&cfg_acc), load(&cfg_b));
    assert_eq!(fa.keys().collect::<Vec<_>>(), fb.keys().collect::<Vec<_>>());
    for (k, t) in &fa {
        let same = t.to_vec_f64().unwrap() == fb[k].to_vec_f64().unwrap();
        assert!(same, "final adapter tensor {k} differs after resuming");
    }
    std::fs::remove_dir_all(&a).ok();
    std::fs::remove_dir_all(&b).ok();
}

#[test]
fn the_tiny_example_learns() {
    let d = temp("learns");
    let cfg = TrainConfig::from_file(tiny(&d, 60, "")).unwrap();
    Trainer::new(cfg.clone())
        .unwrap()
        .run(false, None, false)
        .unwrap();
    let l: Vec<f64> = read_log(&cfg.train.output_dir.join("loss.jsonl"))
        .unwrap()
        .iter()
        .map(|(_, line)| {
            serde_json::from_str::<serde_json::Value>(line).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect();
    let (first, last) = (
        l[..10].iter().sum::<f64>() / 10.0,
        l[50..].iter().sum::<f64>() / 10.0,
    );
    assert!(last < 0.85 * first, "loss {first} -> {last}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn bad_configs_and_data_fail_before_writing() {
    let d = temp("bad");
    let good = std::fs::read_to_string(tiny(&d, 4, "")).unwrap();
    let check = |text: String, want: &[&str]| {
        let p = d.join("bad.toml");
        std::fs::write(&p, text).unwrap();
        let e = TrainConfig::from_file(&p)
            .and_then(Trainer::new)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        for w in want {
            assert!(e.contains(w), "{w:?} not in: {e}");
        }
        assert!(!d.join("tiny/out").exists(), "nothing written: {e}");
    };
    // An unknown key, with its line.
    let line = good.lines().position(|l| l == "rank = 8").unwrap() + 1;
    check(
        good.replace("rank = 8", "rank = 8\nrnak = 3"),
        &["unknown field `rnak`", &format!("line {}", line + 1)],
    );
    // A wrong type.
    check(
        good.replace("rank = 8", "rank = \"eight\""),
        &["rank", &format!("line {line}")],
    );
    // A bad value.
    check(
        good.replace("device = \"cpu\"", "device = \"tpu\""),
        &["train.device", "tpu"],
    );
    // A missing model file (and no create_if_missing).
    check(
        good.replace("create_if_missing = \"flux-tiny\"\n", "")
            .replace("tiny/flux-tiny.safetensors", "nowhere.safetensors"),
        &["nowhere.safetensors", "no such file"],
    );
    // Patterns that match nothing.
    check(
        good.replace("targets = [", "targets = [\"nothing.here\"]\n#"),
        &["match no Linear layer"],
    );
    // A data file with the wrong shape.
    let cfg = TrainConfig::from_file(d.join("train.toml")).unwrap();
    drop(Trainer::new(cfg).unwrap()); // makes the model and the synthetic data
    let bad = flame::Tensor::zeros((3, 8, 8), flame::DType::F32, &flame::Device::Cpu).unwrap();
    let sample = d.join("tiny/data/sample-0003.safetensors");
    let mut t = flame::safetensors::load(&sample, &flame::Device::Cpu).unwrap();
    t.insert("latents".into(), bad);
    flame::safetensors::save(t.iter().map(|(k, v)| (k.as_str(), v)), &sample).unwrap();
    check(
        good.clone(),
        &[
            "sample-0003.safetensors",
            "latents",
            "shape [3, 8, 8]",
            "needs [4, _, _]",
        ],
    );
    std::fs::remove_dir_all(&d).ok();
}
