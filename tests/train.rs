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

/// Waits until the run in `out` has logged `n` steps (or fails after a minute).
fn wait_for_steps(out: &Path, n: usize, child: &mut std::process::Child) {
    let start = std::time::Instant::now();
    while losses(out).len() < n {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it was stopped"
        );
        assert!(
            start.elapsed().as_secs() < 60,
            "the run did not reach step {n}"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The `train` binary, killed (SIGKILL) midway and interrupted (SIGINT, Ctrl-C) midway, each
/// resumed with --resume: both logs equal the uninterrupted run's, line for line.
#[test]
fn the_binary_resumes_after_kill_and_ctrl_c() {
    use std::process::{Command, Stdio};
    let exe = env!("CARGO_BIN_EXE_train");
    let run = |dir: &Path| {
        let mut c = Command::new(exe);
        c.arg(tiny(dir, 120, "")).stderr(Stdio::null());
        c
    };
    let full = temp("bin-full");
    assert!(run(&full).status().unwrap().success());
    let want = losses(&full.join("tiny/out"));
    assert_eq!(want.len(), 120);

    // SIGKILL: no chance to save; resume from the last periodic checkpoint.
    let killed = temp("bin-killed");
    let mut child = run(&killed).spawn().unwrap();
    wait_for_steps(&killed.join("tiny/out"), 30, &mut child);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!killed.join("tiny/out/lora.safetensors").exists());
    assert!(run(&killed).arg("--resume").status().unwrap().success());
    assert_eq!(losses(&killed.join("tiny/out")), want);

    // Ctrl-C: the step in flight finishes, a checkpoint of it is saved, exit code 130.
    let ctrl_c = temp("bin-ctrl-c");
    let out = ctrl_c.join("tiny/out");
    let mut child = run(&ctrl_c).spawn().unwrap();
    wait_for_steps(&out, 30, &mut child);
    let sent = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    let stopped = losses(&out).len();
    let last = checkpoints(&out).unwrap().pop().unwrap().0;
    assert_eq!(last, stopped, "a checkpoint of the last finished step");
    assert!(run(&ctrl_c).arg("--resume").status().unwrap().success());
    assert_eq!(losses(&out), want);
    for d in [full, killed, ctrl_c] {
        std::fs::remove_dir_all(d).ok();
    }
}

/// The templates for real checkpoints parse and pass every check that needs no files.
#[test]
fn the_templates_parse() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    for (name, arch) in [
        ("flux.toml", flame::train::config::Arch::Flux),
        ("sd35.toml", flame::train::config::Arch::Sd3),
        ("sdxl.toml", flame::train::config::Arch::Sdxl),
    ] {
        let c = TrainConfig::from_file(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(c.model.arch, arch, "{name}");
        assert!(c.model.path.is_absolute() && c.train.steps > 0, "{name}");
    }
}
