//! The training loop on the tiny Flux (made as `train --make-tiny examples/flux-tiny-encoded.toml` does):
//! exact resume after an interruption, checkpoint rotation, the loss falling, bad input
//! caught before anything is written, run folders that cannot mix, non-finite guards, and
//! (with the `train` binary) crash safety under injected kills and write failures.
#![cfg(feature = "cpu-ref")]

use flame::memory::{Checkpointing, Switches};
use flame::train::config::{
    CheckpointSetting, LossScale, OnNonFinite, OptimizerKind, ScheduleKind,
};
use flame::train::rundir::{checkpoints, read_log};
use flame::train::{Event, RunEnd, RunOptions, TrainConfig, Trainer};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Runs `cfg` with `opts`, collecting the notes.
fn run_with(cfg: &TrainConfig, opts: RunOptions) -> flame::Result<(RunEnd, Vec<String>)> {
    let mut notes = vec![];
    let end = Trainer::new(cfg.clone())?.run(&opts, &mut |e| {
        if let Event::Note(n) = e {
            notes.push(n)
        }
    })?;
    Ok((end, notes))
}

fn fresh() -> RunOptions {
    RunOptions::default()
}

fn resume() -> RunOptions {
    RunOptions {
        resume: true,
        ..Default::default()
    }
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-train-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tiny example's config with its files under `dir` and `steps` steps.
fn tiny(dir: &Path, steps: usize, extra: &str) -> PathBuf {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny-encoded.toml");
    let text = std::fs::read_to_string(example).unwrap();
    let text = text
        .replace("steps = 200", &format!("steps = {steps}"))
        .replace("save_every = 50", "save_every = 4")
        .replace("device = \"auto\"", "device = \"cpu\"")
        .replace(
            "warmup_steps = 10",
            &format!("warmup_steps = {}", steps.min(40) / 4),
        )
        .replace("[adapter]\n", &format!("[adapter]\n{extra}"));
    let p = dir.join("train.toml");
    std::fs::write(&p, text).unwrap();
    // The tiny model and its synthetic samples, as `train --make-tiny` makes them.
    flame::train::demo::make_tiny(&TrainConfig::from_file(&p).unwrap()).unwrap();
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
    run_with(&cfg_acc, fresh()).unwrap();
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
    let stop = RunOptions {
        stop_at: Some(6),
        ..Default::default()
    };
    assert_eq!(run_with(&cfg_b, stop).unwrap().0, RunEnd::Stopped(6));
    assert_eq!(losses(&cfg_b.train.output_dir).len(), 6);
    assert!(!cfg_b.train.output_dir.join("lora.safetensors").exists());
    // A new process resumes from checkpoint 4 and redoes 4 and 5.
    let (end, notes) = run_with(&cfg_b, resume()).unwrap();
    assert!(
        matches!(end, RunEnd::Finished(ref p) if p.is_file()),
        "{end:?}"
    );
    assert!(
        notes.iter().any(|n| n.contains("resuming after step 4")),
        "{notes:?}"
    );
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
    run_with(&cfg, fresh()).unwrap();
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

/// `adapter.tucker` is checked with the config: the kinds without a Tucker form and the
/// PEFT layout refuse it, naming the key; it is one of the keys a resumed run must keep.
#[test]
fn the_tucker_form_is_checked_with_the_config() {
    let d = temp("tucker-config");
    let good = std::fs::read_to_string(tiny(&d, 4, "tucker = true\n")).unwrap();
    // A run resumes only with the form it was trained in (runs written before the key
    // existed, without it, still resume).
    let keys = |c: &TrainConfig| {
        c.resume_keys()
            .into_iter()
            .any(|(k, _)| k == "adapter.tucker")
    };
    assert!(keys(&TrainConfig::from_toml(&good).unwrap()));
    assert!(!keys(
        &TrainConfig::from_toml(&good.replace("tucker = true\n", "")).unwrap()
    ));
    for (from, to, want) in [
        ("[adapter]\n", "[adapter]\nkind = \"dora\"\n", "applies to"),
        (
            "format = \"kohya\"",
            "format = \"peft\"",
            "kohya layout only",
        ),
    ] {
        assert!(good.contains(from), "{from}");
        let text = good.replace(from, to);
        let e = TrainConfig::from_toml(&text).unwrap_err().to_string();
        assert!(
            e.contains("adapter.tucker") && e.contains(want),
            "{to}: {e}"
        );
    }
    // LoKr's and LoHa's Tucker forms are PEFT's use_effective_conv2d: "peft" takes them.
    for kind in ["lokr", "loha"] {
        let text = good
            .replace("[adapter]\n", &format!("[adapter]\nkind = \"{kind}\"\n"))
            .replace("format = \"kohya\"", "format = \"peft\"");
        let c = TrainConfig::from_toml(&text).unwrap();
        assert!(c.adapter_config().tucker, "{kind}");
    }
}

/// `adapter.weight_decompose` is checked with the config: it reaches the adapters' config,
/// the kinds without it (LoRA, pointed to "dora") and the PEFT layout refuse it, naming the
/// key; it is one of the keys a resumed run must keep.
#[test]
fn the_weight_decomposition_is_checked_with_the_config() {
    let d = temp("decompose-config");
    let good =
        std::fs::read_to_string(tiny(&d, 4, "kind = \"lokr\"\nweight_decompose = true\n")).unwrap();
    let keys = |c: &TrainConfig| {
        c.resume_keys()
            .into_iter()
            .any(|(k, _)| k == "adapter.weight_decompose")
    };
    let cfg = TrainConfig::from_toml(&good).unwrap();
    assert!(keys(&cfg));
    assert!(cfg.adapter_config().weight_decompose);
    let without = TrainConfig::from_toml(&good.replace("weight_decompose = true\n", "")).unwrap();
    assert!(!keys(&without) && !without.adapter_config().weight_decompose);
    for (from, to, want) in [
        ("kind = \"lokr\"", "kind = \"lora\"", "is kind = \"dora\""),
        (
            "format = \"kohya\"",
            "format = \"peft\"",
            "kohya layout only",
        ),
    ] {
        assert!(good.contains(from), "{from}");
        let text = good.replace(from, to);
        let e = TrainConfig::from_toml(&text).unwrap_err().to_string();
        assert!(
            e.contains("adapter.weight_decompose") && e.contains(want),
            "{to}: {e}"
        );
    }
    std::fs::remove_dir_all(&d).ok();
}

/// The `[memory]` keys that are now the planner's switches (`memory::Switches`) still read
/// in an older config: into the switches, each with a note naming its line; a value other
/// than a boolean, or an unknown key beside them, is refused.
#[test]
fn older_memory_keys_are_read_into_the_planner_switches() {
    let d = temp("retired");
    let good = std::fs::read_to_string(tiny(&d, 4, "")).unwrap();
    let plain = TrainConfig::from_toml(&good).unwrap();
    assert_eq!(plain.planner, Switches::default());
    assert!(plain.notes.is_empty());
    let old =
        format!("{good}\n[memory]\nprefetch = 1\nwire_code = false\nmeasure_machine = false\n");
    let line = old.lines().position(|l| l == "wire_code = false").unwrap() + 1;
    let c = TrainConfig::from_toml(&old).unwrap();
    assert_eq!(c.memory.prefetch, 1);
    assert_eq!(
        c.planner,
        Switches::parse("wire_code=off,measure_machine=off").unwrap()
    );
    assert_eq!(c.notes.len(), 2, "{:?}", c.notes);
    assert!(
        c.notes[0].starts_with(&format!("line {line}: memory.wire_code"))
            && c.notes[0].contains("FLAME_PLANNER"),
        "{:?}",
        c.notes
    );
    let e = TrainConfig::from_toml(&old.replace("wire_code = false", "wire_code = \"no\""))
        .unwrap_err()
        .to_string();
    assert!(e.contains(&format!("line {line}: memory.wire_code")), "{e}");
    let e = TrainConfig::from_toml(&old.replace("prefetch = 1", "prefetch = 1\nprefetsh = 2"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown field `prefetsh`"), "{e}");
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
        assert!(!d.join("tiny/out-encoded").exists(), "nothing written: {e}");
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
    // Every bad choice and bad type at once, each with its line and the choices there are;
    // the other checks still run beside them.
    let dev = good.lines().position(|l| l == "device = \"cpu\"").unwrap() + 1;
    check(
        good.replace(
            "device = \"cpu\"",
            "device = \"tpu\"\non_nonfinite = \"ignore\"",
        )
        .replace("rank = 8", "rank = \"eight\"")
        .replace("max_grad_norm = 1.0", "max_grad_norm = -1.0"),
        &[
            &format!("line {dev}: train.device = \"tpu\": unknown variant `tpu`"),
            "expected one of `auto`, `cuda`, `cpu`",
            &format!("line {}: train.on_nonfinite = \"ignore\"", dev + 1),
            "`stop` or `skip`",
            &format!("line {line}: adapter.rank = \"eight\": invalid type"),
            "train.max_grad_norm",
        ],
    );
    // A missing required key beside a bad value: both said.
    check(
        good.replace("steps = 4\n", "")
            .replace("device = \"cpu\"", "device = \"tpu\""),
        &["missing key `train.steps`", "train.device = \"tpu\""],
    );
    // A missing model file: an error, and nothing made in its place.
    check(
        good.replace("tiny/flux-tiny.safetensors", "nowhere.safetensors"),
        &["nowhere.safetensors", "no such file"],
    );
    assert!(!d.join("nowhere.safetensors").exists());
    // A missing data folder: an error, and nothing made in its place.
    check(
        good.replace("dir = \"tiny/data\"", "dir = \"tiny/dta\""),
        &["tiny/dta"],
    );
    assert!(!d.join("tiny/dta").exists());
    // Patterns that match nothing.
    check(
        good.replace("targets = [", "targets = [\"nothing.here\"]\n#"),
        &["match no Linear layer"],
    );
    // A data file with the wrong shape.
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
            "needs [4, 2k, 2k]",
        ],
    );
    std::fs::remove_dir_all(&d).ok();
}

/// Waits until the run in `out` has logged `n` steps (or fails after a minute).
#[cfg(feature = "cli")]
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
#[cfg(feature = "cli")]
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
    let want = losses(&full.join("tiny/out-encoded"));
    assert_eq!(want.len(), 120);

    // SIGKILL: no chance to save; resume from the last periodic checkpoint.
    let killed = temp("bin-killed");
    let mut child = run(&killed).spawn().unwrap();
    wait_for_steps(&killed.join("tiny/out-encoded"), 30, &mut child);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!killed.join("tiny/out-encoded/lora.safetensors").exists());
    assert!(run(&killed).arg("--resume").status().unwrap().success());
    assert_eq!(losses(&killed.join("tiny/out-encoded")), want);

    // Ctrl-C (SIGINT), and SIGTERM as `docker stop` and Slurm send it: the step in flight
    // finishes, a checkpoint of it is saved, exit code 130.
    let mut dirs = vec![full, killed];
    for signal in ["-INT", "-TERM"] {
        let d = temp(&format!("bin-signal{signal}"));
        let out = d.join("tiny/out-encoded");
        let mut child = run(&d).spawn().unwrap();
        wait_for_steps(&out, 30, &mut child);
        let sent = Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(130), "{signal}");
        let stopped = losses(&out).len();
        let last = checkpoints(&out).unwrap().pop().unwrap().0;
        assert_eq!(
            last, stopped,
            "{signal}: a checkpoint of the last finished step"
        );
        assert!(run(&d).arg("--resume").status().unwrap().success());
        assert_eq!(losses(&out), want, "{signal}");
        dirs.push(d);
    }
    for d in dirs {
        std::fs::remove_dir_all(d).ok();
    }
}

/// The templates for real checkpoints parse and pass every check that needs no files.
#[test]
fn the_templates_parse() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    for (name, arch) in [
        ("flux.toml", "flux"),
        ("sd35.toml", "sd3"),
        ("sdxl.toml", "sdxl"),
        ("klein.toml", "flux2"),
    ] {
        let c = TrainConfig::from_file(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(c.model.arch, arch, "{name}");
        assert!(c.model.path.is_absolute() && c.train.steps > 0, "{name}");
    }
}

/// The error of loading `cfg` into a trainer.
fn load_err(cfg: &TrainConfig) -> String {
    Trainer::new(cfg.clone())
        .map(|_| ())
        .unwrap_err()
        .to_string()
}

#[test]
fn every_checkable_value_is_refused_with_its_key_and_line() {
    let d = temp("values");
    let good = std::fs::read_to_string(tiny(&d, 4, "")).unwrap();
    let line = |needle: &str| good.lines().position(|l| l.starts_with(needle)).unwrap() + 1;
    let cases: Vec<(String, Vec<String>)> = vec![
        (
            good.replace("eps = 1e-8", "eps = 0.0"),
            vec!["optimizer.eps".into(), format!("line {}", line("eps ="))],
        ),
        (
            good.replace("guidance = 1.0", "guidance = nan"),
            vec![
                "model.guidance".into(),
                format!("line {}", line("guidance =")),
            ],
        ),
        (
            good.replace("warmup_steps = 1\n", "warmup_steps = 10\n"),
            vec!["schedule.warmup_steps".into(), "longer than the run".into()],
        ),
        (
            good.replace("lr = 3e-3", "lr = -1.0"),
            vec!["optimizer.lr".into(), format!("line {}", line("lr ="))],
        ),
        (
            good.replace("betas = [0.9, 0.999]", "betas = [0.9, 1.0]"),
            vec!["optimizer.betas".into()],
        ),
        (
            good.replace("keep_last = 2", "keep_last = 0"),
            vec!["train.keep_last".into()],
        ),
        (
            good.replace("arch = \"flux\"", "arch = \"flux9\""),
            vec!["model.arch".into(), "flux, sd3, sdxl".into()],
        ),
        (
            good.replace("steps = 4\n", ""),
            vec!["missing key `train.steps`".into()],
        ),
        (
            good.replace(
                "[train]\n",
                "[memory]\ncheckpointing = \"every:0\"\n[train]\n",
            ),
            vec!["memory.checkpointing".into()],
        ),
        (
            good.replace(
                "[train]\n",
                "[memory]\ncheckpointing = \"all-but:x\"\n[train]\n",
            ),
            vec!["memory.checkpointing".into(), "all-but:N".into()],
        ),
        (
            good.replace("[train]\n", "[memory]\nbudget_gb = -2.0\n[train]\n"),
            vec!["memory.budget_gb".into(), ">= 0".into()],
        ),
        (
            good.replace("lr = 3e-3", "kind = \"lamb\"\nlr = 3e-3"),
            vec!["optimizer.kind".into(), "adamw8bit".into()],
        ),
    ];
    for (text, want) in cases {
        let p = d.join("bad.toml");
        std::fs::write(&p, text).unwrap();
        let e = TrainConfig::from_file(&p).unwrap_err().to_string();
        for w in &want {
            assert!(e.contains(w.as_str()), "{w:?} not in: {e}");
        }
    }
    // Checkpointing as given, every block but the first three.
    let p = d.join("all-but.toml");
    std::fs::write(
        &p,
        good.replace(
            "[train]\n",
            "[memory]\ncheckpointing = \"all-but:3\"\n[train]\n",
        ),
    )
    .unwrap();
    assert_eq!(
        TrainConfig::from_file(&p).unwrap().checkpointing(),
        Some(flame::memory::Checkpointing::AllBut(3))
    );
    // Several problems are reported together.
    std::fs::write(
        d.join("bad.toml"),
        good.replace("eps = 1e-8", "eps = 0.0")
            .replace("lr = 3e-3", "lr = 0.0"),
    )
    .unwrap();
    let e = TrainConfig::from_file(d.join("bad.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("optimizer.eps") && e.contains("optimizer.lr"),
        "{e}"
    );
    // A rank above a targeted layer's width (the tiny model is 32 wide), before anything
    // is written.
    let mut cfg = TrainConfig::from_file(d.join("train.toml")).unwrap();
    cfg.adapter.rank = 40;
    let e = load_err(&cfg);
    assert!(
        e.contains("adapter.rank = 40") && e.contains("at most"),
        "{e}"
    );
    assert!(!cfg.train.output_dir.exists());
    std::fs::remove_dir_all(&d).ok();
}

/// Replaces tensor `name` of sample file `path` with `t`.
fn put_tensor(path: &Path, name: &str, t: flame::Tensor) {
    let mut all = flame::safetensors::load(path, &flame::Device::Cpu).unwrap();
    all.insert(name.into(), t);
    flame::safetensors::save(all.iter().map(|(k, v)| (k.as_str(), v)), path).unwrap();
}

#[test]
fn bad_samples_are_refused_naming_file_and_tensor() {
    use flame::{DType, Device, Tensor};
    let d = temp("samples");
    let cfg = TrainConfig::from_file(tiny(&d, 4, "")).unwrap();
    let sample = cfg
        .data
        .dir
        .as_ref()
        .unwrap()
        .join("sample-0002.safetensors");
    let orig = std::fs::read(&sample).unwrap();
    let cpu = Device::Cpu;
    let cases: Vec<(&str, Tensor, &[&str])> = vec![
        // Odd latent sizes: Flux packs 2x2 patches.
        (
            "latents",
            Tensor::zeros((4, 7, 8), DType::F32, &cpu).unwrap(),
            &["latents", "[4, 2k, 2k]"],
        ),
        (
            "latents",
            Tensor::zeros((4, 0, 8), DType::F32, &cpu).unwrap(),
            &["latents", "shape [4, 0, 8]"],
        ),
        // An empty text sequence.
        (
            "context",
            Tensor::zeros((0, 32), DType::F32, &cpu).unwrap(),
            &["context", "[_, 32]"],
        ),
        // Non-finite values.
        (
            "context",
            Tensor::from_vec(
                (0..6 * 32)
                    .map(|i| if i == 77 { f32::NAN } else { 0.0 })
                    .collect::<Vec<f32>>(),
                (6, 32),
                &cpu,
            )
            .unwrap(),
            &["context", "non-finite", "flat index 77"],
        ),
        (
            "pooled",
            Tensor::from_vec(vec![f32::INFINITY; 16], 16, &cpu).unwrap(),
            &["pooled", "non-finite"],
        ),
        // Integers are no latents.
        (
            "latents",
            Tensor::zeros((4, 8, 8), DType::U32, &cpu).unwrap(),
            &["latents", "dtype U32"],
        ),
    ];
    for (name, t, want) in cases {
        std::fs::write(&sample, &orig).unwrap();
        put_tensor(&sample, name, t);
        let e = load_err(&cfg);
        assert!(e.contains("sample-0002.safetensors"), "{e}");
        for w in want {
            assert!(e.contains(w), "{w:?} not in: {e}");
        }
        assert!(!cfg.train.output_dir.exists(), "nothing written: {e}");
    }
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_run_owns_its_folder() {
    let d = temp("owns");
    let mut cfg = TrainConfig::from_file(tiny(&d, 8, "")).unwrap();
    // Under a cosine schedule train.steps is part of every learning rate, so a resume must
    // keep it; under a constant one it may grow or shrink.
    let mut cosine = cfg.clone();
    cfg.schedule.kind = ScheduleKind::Constant;
    let out = cfg.train.output_dir.clone();
    run_with(&cfg, fresh()).unwrap();
    let first = losses(&out);
    // A new run in the same folder is refused, naming the way out; nothing is touched.
    let before = checkpoints(&out).unwrap();
    let e = run_with(&cfg, fresh()).unwrap_err().to_string();
    assert!(
        e.contains("another run") && e.contains("--overwrite"),
        "{e}"
    );
    assert_eq!(checkpoints(&out).unwrap(), before);
    assert_eq!(losses(&out), first);
    // --resume of a finished run: nothing to do, the final LoRA is there (rewritten if lost).
    std::fs::remove_file(out.join("lora.safetensors")).unwrap();
    let (end, _) = run_with(&cfg, resume()).unwrap();
    assert!(
        matches!(end, RunEnd::Finished(ref p) if p.is_file()),
        "{end:?}"
    );
    assert_eq!(losses(&out), first);
    // --resume with fewer steps than the checkpoint: an error naming train.steps.
    let mut short = cfg.clone();
    short.train.steps = 6;
    let e = run_with(&short, resume()).unwrap_err().to_string();
    assert!(e.contains("past train.steps = 6"), "{e}");
    cosine.train.steps = 10;
    let e = run_with(&cosine, resume()).unwrap_err().to_string();
    assert!(e.contains("schedule.kind was \"constant\""), "{e}");
    assert!(
        e.contains("train.steps was (absent), the config says 10"),
        "{e}"
    );
    // --resume with another seed or rank: refused, naming the key.
    let mut other = cfg.clone();
    other.train.seed = 99;
    other.adapter.alpha = 4.0;
    let e = run_with(&other, resume()).unwrap_err().to_string();
    assert!(
        e.contains("train.seed was 7") && e.contains("adapter.alpha"),
        "{e}"
    );
    // --overwrite replaces the run: another seed, fresh checkpoints, rotation keeps them.
    let o = RunOptions {
        overwrite: true,
        ..Default::default()
    };
    run_with(&other, o).unwrap();
    let kept: Vec<usize> = checkpoints(&out).unwrap().iter().map(|c| c.0).collect();
    assert_eq!(kept, [4, 8]);
    assert_ne!(losses(&out), first);
    assert_eq!(losses(&out).len(), 8);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn rotation_deletes_only_this_runs_older_checkpoints() {
    let d = temp("rotation");
    let cfg = TrainConfig::from_file(tiny(&d, 8, "")).unwrap();
    let out = cfg.train.output_dir.clone();
    // A foreign checkpoint with a later step sits in the folder of a run being resumed.
    let stop = RunOptions {
        stop_at: Some(5),
        ..Default::default()
    };
    run_with(&cfg, stop).unwrap();
    let foreign = out.join("checkpoint-0000099");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(
        foreign.join("state.json"),
        r#"{"step":99,"seed":7,"run_id":"other","files":{}}"#,
    )
    .unwrap();
    // The resume passes over another run's checkpoint, saying so, and resumes its own...
    let (end, notes) = run_with(&cfg, resume()).unwrap();
    assert!(matches!(end, RunEnd::Finished(_)), "{end:?}");
    assert!(
        notes
            .iter()
            .any(|n| n.contains("checkpoint-0000099 was written by another run")),
        "{notes:?}"
    );
    assert!(
        notes.iter().any(|n| n.contains("resuming after step 4")),
        "{notes:?}"
    );
    // ... whose rotation never deletes it.
    let kept: Vec<usize> = checkpoints(&out).unwrap().iter().map(|c| c.0).collect();
    assert_eq!(kept, [4, 8, 99]);
    assert!(foreign.join("state.json").is_file());
    // --overwrite cannot prove it was this run's: refused, naming it; nothing deleted.
    let o = RunOptions {
        overwrite: true,
        ..Default::default()
    };
    let e = run_with(&cfg, o).unwrap_err().to_string();
    assert!(
        e.contains("checkpoint-0000099") && e.contains("no run recorded"),
        "{e}"
    );
    assert_eq!(losses(&out).len(), 8);
    assert!(out.join("lora.safetensors").is_file());
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn non_finite_steps_stop_or_skip_and_never_reach_a_saved_adapter() {
    let d = temp("nan");
    // A learning rate that blows the adapter up after the first step.
    let mut cfg = TrainConfig::from_file(tiny(&d, 8, "")).unwrap();
    cfg.optimizer.lr = Some(1e30);
    cfg.schedule.warmup_steps = 0;
    cfg.train.save_every = 1;
    let e = run_with(&cfg, fresh()).unwrap_err().to_string();
    assert!(e.contains("step 2:") && e.contains("on_nonfinite"), "{e}");
    assert!(e.contains("sample-00"), "the batch's files: {e}");
    assert!(!cfg.train.output_dir.join("lora.safetensors").exists());
    for (_, c) in checkpoints(&cfg.train.output_dir).unwrap() {
        let a =
            flame::safetensors::load(c.join("adapter.safetensors"), &flame::Device::Cpu).unwrap();
        for (k, t) in a {
            assert!(
                t.to_vec_f64().unwrap().iter().all(|v| v.is_finite()),
                "{k} in {c:?}"
            );
        }
    }
    // Skipping: the optimizer does not step; too many in a row stop the run.
    cfg.train.on_nonfinite = OnNonFinite::Skip;
    cfg.train.max_skipped = 3;
    let o = RunOptions {
        overwrite: true,
        ..Default::default()
    };
    let e = run_with(&cfg, o).unwrap_err().to_string();
    assert!(
        e.contains("step 5:") && e.contains("4 steps skipped in a row"),
        "{e}"
    );
    let log = losses(&cfg.train.output_dir);
    assert_eq!(log.len(), 4);
    assert!(
        log[1..].iter().all(|l| l.contains("\"skipped\"")),
        "{log:?}"
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_damaged_checkpoint_falls_back_to_the_one_before() {
    let d = temp("damaged");
    let cfg = TrainConfig::from_file(tiny(&d, 10, "")).unwrap();
    let out = cfg.train.output_dir.clone();
    run_with(&cfg, fresh()).unwrap();
    let want = losses(&out);
    let b = temp("damaged-b");
    let cfg_b = TrainConfig::from_file(tiny(&b, 10, "")).unwrap();
    let stop = RunOptions {
        stop_at: Some(9),
        ..Default::default()
    };
    run_with(&cfg_b, stop).unwrap();
    // checkpoint-8 loses bytes: the resume passes over it to checkpoint-4, saying so.
    let f = cfg_b
        .train
        .output_dir
        .join("checkpoint-0000008/adapter.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() - 100]).unwrap();
    let (_, notes) = run_with(&cfg_b, resume()).unwrap();
    assert!(
        notes
            .iter()
            .any(|n| n.contains("checkpoint-0000008 is damaged")),
        "{notes:?}"
    );
    assert!(
        notes.iter().any(|n| n.contains("resuming after step 4")),
        "{notes:?}"
    );
    assert_eq!(losses(&cfg_b.train.output_dir), want);
    std::fs::remove_dir_all(&d).ok();
    std::fs::remove_dir_all(&b).ok();
}

#[test]
fn written_files_are_readable_by_others_and_reproducible() {
    use std::os::unix::fs::PermissionsExt;
    let (a, b) = (temp("bytes-a"), temp("bytes-b"));
    let mut outs = vec![];
    for d in [&a, &b] {
        let cfg = TrainConfig::from_file(tiny(d, 4, "")).unwrap();
        run_with(&cfg, fresh()).unwrap();
        outs.push(cfg.train.output_dir);
    }
    // The umask of the test process decides; under the usual 022 that is 0644.
    let probe = a.join("probe");
    std::fs::write(&probe, b"").unwrap();
    let usual = std::fs::metadata(&probe).unwrap().permissions().mode() & 0o777;
    for f in [
        "lora.safetensors",
        "loss.jsonl",
        "run.json",
        "checkpoint-0000004/adapter.safetensors",
        "checkpoint-0000004/optimizer.safetensors",
        "checkpoint-0000004/state.json",
    ] {
        let mode = std::fs::metadata(outs[0].join(f))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, usual, "{f}: {mode:o}");
    }
    // Two runs of one config write the same bytes, but for the adapters' times in their
    // metadata (`train::metadata::TIME_KEYS`): the same tensor bytes and other keys.
    for f in [
        "lora.safetensors",
        "checkpoint-0000004/adapter.safetensors",
        "checkpoint-0000004/optimizer.safetensors",
    ] {
        let (x, y) = (
            std::fs::read(outs[0].join(f)).unwrap(),
            std::fs::read(outs[1].join(f)).unwrap(),
        );
        if f.contains("optimizer") {
            assert!(x == y, "{f} differs between identical runs");
            continue;
        }
        let split = |b: &[u8]| {
            let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            (b[8..8 + n].to_vec(), b[8 + n..].to_vec())
        };
        let ((hx, dx), (hy, dy)) = (split(&x), split(&y));
        assert!(dx == dy, "{f}: tensor bytes differ between identical runs");
        let meta = |h: &[u8]| {
            let v: serde_json::Value = serde_json::from_slice(h).unwrap();
            let mut m = v["__metadata__"].as_object().unwrap().clone();
            for k in flame::train::metadata::TIME_KEYS {
                assert!(m.remove(k).is_some(), "{f} lacks {k}");
            }
            m
        };
        assert_eq!(
            meta(&hx),
            meta(&hy),
            "{f}: metadata differs between identical runs"
        );
    }
    std::fs::remove_dir_all(&a).ok();
    std::fs::remove_dir_all(&b).ok();
}

#[test]
fn the_config_reference_is_in_the_docs() {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/CONFIG.md"))
        .unwrap();
    let table = TrainConfig::reference_markdown();
    assert!(
        doc.contains(&table),
        "docs/CONFIG.md lacks the current config reference; paste `train --print-config`:\n{table}"
    );
    // Every key is documented.
    for k in TrainConfig::reference() {
        assert!(!k.doc.is_empty(), "{} has no doc", k.key);
    }
}

/// The `train` binary on a config in `dir`, with `FLAME_FAULT` set to `fault` if given.
#[cfg(feature = "cli")]
fn train_bin(dir: &Path, steps: usize, fault: Option<&str>, args: &[&str]) -> std::process::Output {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_train"));
    c.arg(tiny(dir, steps, "")).args(args);
    match fault {
        Some(f) => c.env("FLAME_FAULT", f),
        None => c.env_remove("FLAME_FAULT"),
    };
    c.output().unwrap()
}

/// Kills (as `kill -9` would) and full-disk write failures at every point where a run or a
/// resume writes a file; after each, `--resume` reproduces the uninterrupted run's log and
/// writes the final LoRA.
#[cfg(feature = "cli")]
#[test]
fn the_binary_survives_kills_and_full_disks_at_every_write() {
    let steps = 12; // checkpoints at 4, 8, 12; two kept
    let full = temp("fault-full");
    let o = train_bin(&full, steps, None, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    // The summary says where the run's time went, phase by phase (the latents come
    // encoded: no caching phase).
    let time = err
        .lines()
        .find(|l| l.starts_with("time: "))
        .unwrap_or_else(|| panic!("no time line: {err}"));
    for phase in ["loading the model", "training steps", "checkpoints"] {
        assert!(time.contains(&format!("{phase} ")), "{phase}: {time}");
    }
    assert!(time.ends_with(" s in all"), "{time}");
    let want = losses(&full.join("tiny/out-encoded"));
    let lora =
        flame::train::metadata::content(&full.join("tiny/out-encoded/lora.safetensors")).unwrap();
    let points = [
        "write:run.json",
        "write:loss.jsonl",
        "log-append@6",
        "write:adapter.safetensors@2",
        "write:optimizer.safetensors",
        "write:state.json@3",
        "checkpoint:8",
        "rotation",
        "write:lora.safetensors",
    ];
    for (i, point) in points.iter().enumerate() {
        for kind in ["kill", "enospc"] {
            let d = temp(&format!("fault-{i}-{kind}"));
            let out = d.join("tiny/out-encoded");
            let fault = format!("{kind}:{point}");
            let o = train_bin(&d, steps, Some(&fault), &[]);
            assert!(!o.status.success(), "{fault}: the run must fail");
            if kind == "enospc" {
                let err = String::from_utf8_lossy(&o.stderr);
                assert_eq!(o.status.code(), Some(1), "{fault}: {err}");
                assert!(err.contains("No space left on device"), "{fault}: {err}");
                assert_eq!(
                    err.matches("error:").count(),
                    1,
                    "{fault}: printed once: {err}"
                );
                assert!(!err.contains("done:"), "{fault}: {err}");
            }
            // A kill during the resume's own bookkeeping (its log rewrite) changes nothing.
            if !point.starts_with("write:run.json") {
                let o = train_bin(&d, steps, Some("kill:write:loss.jsonl"), &["--resume"]);
                assert!(!o.status.success(), "{fault}: the resume was killed");
            }
            let o = train_bin(&d, steps, None, &["--resume"]);
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(o.status.success(), "{fault}: resume failed: {err}");
            assert_eq!(losses(&out), want, "{fault}");
            assert_eq!(
                flame::train::metadata::content(&out.join("lora.safetensors")).unwrap(),
                lora,
                "{fault}"
            );
            std::fs::remove_dir_all(&d).ok();
        }
    }
    // --overwrite killed midway: the manifest goes last, so the folder is still the run's:
    // refused without --overwrite, what is left still resumes, and --overwrite then works.
    let d = temp("fault-clear");
    let out = d.join("tiny/out-encoded");
    assert!(train_bin(&d, steps, None, &[]).status.success());
    assert!(!train_bin(&d, steps, Some("kill:clear"), &["--overwrite"])
        .status
        .success());
    let o = train_bin(&d, steps, None, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("--overwrite"), "{err}");
    let o = train_bin(&d, steps, None, &["--resume"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        flame::train::metadata::content(&out.join("lora.safetensors")).unwrap(),
        lora
    );
    assert!(train_bin(&d, steps, None, &["--overwrite"])
        .status
        .success());
    assert_eq!(losses(&out), want);
    for d in [full, d] {
        std::fs::remove_dir_all(d).ok();
    }
}

#[cfg(feature = "cli")]
#[test]
fn the_binary_explains_itself() {
    use std::process::Command;
    let exe = env!("CARGO_BIN_EXE_train");
    for h in ["-h", "--help"] {
        let o = Command::new(exe).arg(h).output().unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{h}");
        for flag in [
            "--resume",
            "--overwrite",
            "--plan",
            "--print-config",
            "--version",
        ] {
            assert!(text.contains(flag), "{h} lacks {flag}: {text}");
        }
    }
    let o = Command::new(exe).arg("--version").output().unwrap();
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains(env!("CARGO_PKG_VERSION")));
    let o = Command::new(exe).arg("--print-config").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        TrainConfig::reference_markdown()
    );
    let o = Command::new(exe).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).starts_with("error: no config file"));
    // A bad config: one error, on its own line, exit 1, nothing written.
    let d = temp("explains");
    let p = tiny(&d, 4, "");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("eps = 1e-8", "eps = 0.0");
    std::fs::write(&p, text).unwrap();
    let o = Command::new(exe).arg(&p).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("error: ") && err.matches("error:").count() == 1,
        "{err}"
    );
    assert!(err.contains("optimizer.eps"), "{err}");
    // --plan: everything checked and said, nothing written.
    let p = tiny(&d, 4, "");
    let o = Command::new(exe).arg(&p).arg("--plan").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("plan: start a new run") && err.contains("nothing was written"),
        "{err}"
    );
    assert!(!d.join("tiny/out-encoded").exists());
    // Under a budget the step's predicted peak is said by its terms too.
    let text = std::fs::read_to_string(&p).unwrap();
    std::fs::write(
        &p,
        text.replace("[train]\n", "[memory]\nbudget_gb = 1.0\n[train]\n"),
    )
    .unwrap();
    let o = Command::new(exe).arg(&p).arg("--plan").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let terms = err
        .lines()
        .find(|l| l.contains("the step's predicted peak: weights"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(terms.contains("work") && terms.ends_with("GiB"), "{terms}");
    // The plans of other kinds that `memory.trial_steps` would time beside the pick.
    std::fs::write(
        &p,
        std::fs::read_to_string(&p)
            .unwrap()
            .replace("[memory]\n", "[memory]\ntrial_steps = 0\n"),
    )
    .unwrap();
    let o = Command::new(exe).arg(&p).arg("--plan").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("plans of other kinds predicted near it (memory.trial_steps > 0"),
        "{err}"
    );
    std::fs::write(
        &p,
        std::fs::read_to_string(&p)
            .unwrap()
            .replace("trial_steps = 0\n", "trial_steps = 3\n"),
    )
    .unwrap();
    let o = Command::new(exe).arg(&p).arg("--plan").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("before the first step, 3 steps each of it and of these, as many as fit in"),
        "{err}"
    );
    std::fs::remove_dir_all(&d).ok();
}

/// `optimizer.kind = "adamw8bit"` trains through the trainer and resumes exactly (its state
/// goes into the checkpoints like AdamW's).
#[test]
fn adamw8bit_from_the_config_resumes_exactly() {
    let a = temp("adam8-full");
    let mut cfg = TrainConfig::from_file(tiny(&a, 8, "")).unwrap();
    cfg.optimizer.kind = OptimizerKind::AdamW8bit;
    run_with(&cfg, fresh()).unwrap();
    let full = losses(&cfg.train.output_dir);
    let b = temp("adam8-resumed");
    let mut cfg_b = TrainConfig::from_file(tiny(&b, 8, "")).unwrap();
    cfg_b.optimizer.kind = OptimizerKind::AdamW8bit;
    let stop = RunOptions {
        stop_at: Some(6),
        ..Default::default()
    };
    assert_eq!(run_with(&cfg_b, stop).unwrap().0, RunEnd::Stopped(6));
    run_with(&cfg_b, resume()).unwrap();
    assert_eq!(losses(&cfg_b.train.output_dir), full);
    // The checkpoints hold AdamW8bit's state (the tiny adapters are all under its 4096-value
    // threshold, so their moments stay f32 and the steps equal AdamW's: the quantized path
    // is tests/optim8bit.rs's).
    let (_, dir) = checkpoints(&cfg_b.train.output_dir).unwrap().pop().unwrap();
    let f = flame::safetensors::SafeTensorsFile::open(dir.join("optimizer.safetensors")).unwrap();
    assert_eq!(
        f.metadata().get("optimizer").map(String::as_str),
        Some("adamw8bit")
    );
}

#[test]
fn f16_with_dynamic_loss_scaling_skips_overflows_and_resumes_exactly() {
    use flame::train::config::ModelDType;
    let f16 = |dir: &Path| {
        let mut cfg = TrainConfig::from_file(tiny(dir, 10, "")).unwrap();
        cfg.model.dtype = ModelDType::F16;
        // 2^20: the loss times the scale overflows f16's 65504 until the scale has halved
        // a few times; growth after 3 clean steps, so the saved count matters on resume.
        cfg.train.loss_scale_init = 1048576.0;
        cfg.train.loss_scale_growth_interval = 3;
        cfg
    };
    let a = temp("f16-full");
    let cfg = f16(&a);
    assert!(cfg.loss_scaler().is_some(), "auto scales f16");
    let mut tr = Trainer::new(cfg.clone()).unwrap();
    let mut skipped = 0;
    for _ in 0..10 {
        let before = tr.scaler.unwrap().scale;
        let r = tr.train_step().unwrap();
        let after = tr.scaler.unwrap().scale;
        match &r.skipped {
            Some(why) => {
                assert!(why.contains("overflowed"), "{why}");
                assert_eq!(after, before / 2.0);
                skipped += 1;
            }
            None => {
                assert!(r.loss.is_finite() && r.grad_norm.is_finite());
                assert!(after == before || after == 2.0 * before);
            }
        }
    }
    assert!((1..10).contains(&skipped), "{skipped} of 10 steps skipped");
    for (n, p) in tr.adapters.params().unwrap() {
        let s = flame::sum_sq_multi(&[&p]).unwrap();
        assert!(s.is_finite(), "{n}");
    }

    // Stopped and resumed: the same losses as one run, the scale restored from state.json.
    run_with(&cfg, fresh()).unwrap();
    let full = losses(&cfg.train.output_dir);
    let b = temp("f16-resumed");
    let cfg_b = f16(&b);
    let stop = RunOptions {
        stop_at: Some(7),
        ..Default::default()
    };
    assert_eq!(run_with(&cfg_b, stop).unwrap().0, RunEnd::Stopped(7));
    let (_, dir) = checkpoints(&cfg_b.train.output_dir).unwrap().pop().unwrap();
    let state = std::fs::read_to_string(dir.join("state.json")).unwrap();
    assert!(state.contains("\"loss_scale\""), "{state}");
    run_with(&cfg_b, resume()).unwrap();
    assert_eq!(losses(&cfg_b.train.output_dir), full);

    // "off" never scales; a bad initial scale is refused with its key.
    let mut off = f16(&temp("f16-off"));
    off.train.loss_scale = LossScale::Off;
    assert!(off.loss_scaler().is_none());
    let mut bad = f16(&temp("f16-bad"));
    bad.train.loss_scale_init = 0.5;
    assert!(load_err(&bad).contains("train.loss_scale_init"));
}

/// Every adapter kind trains on the tiny model from the config switch and writes its own
/// tensors (LoKr and LoHa with LyCORIS's weight decomposition too, their magnitudes beside
/// their factors); a run stopped after step 5 resumes from its checkpoint at 4 to the same
/// losses and the same adapter file, bit for bit.
#[test]
fn every_adapter_kind_trains_and_resumes_exactly() {
    for (kind, more, tensors) in [
        ("dora", "", &["dora_scale"][..]),
        ("lokr", "", &["lokr_w1"][..]),
        ("loha", "", &["hada_w1_a"][..]),
        ("full", "", &["diff"][..]),
        (
            "lokr",
            "weight_decompose = true\n",
            &["lokr_w1", "dora_scale"][..],
        ),
        (
            "loha",
            "weight_decompose = true\n",
            &["hada_w1_a", "dora_scale"][..],
        ),
    ] {
        let extra = format!("kind = \"{kind}\"\n{more}");
        let kind = &format!("{kind}{}", if more.is_empty() { "" } else { "-decomposed" });
        let a = temp(&format!("kind-{kind}"));
        let cfg = TrainConfig::from_file(tiny(&a, 6, &extra)).unwrap();
        run_with(&cfg, fresh()).unwrap();
        let full = losses(&cfg.train.output_dir);
        assert_eq!(full.len(), 6, "{kind}");
        let finite = |l: &String| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["loss"].as_f64().is_some_and(f64::is_finite)
        };
        assert!(full.iter().all(finite), "{kind}: {full:?}");
        let load = |c: &TrainConfig| {
            flame::safetensors::load(
                c.train.output_dir.join("lora.safetensors"),
                &flame::Device::Cpu,
            )
            .unwrap()
        };
        let fa = load(&cfg);
        for tensor in tensors {
            assert!(
                fa.keys().any(|k| k.ends_with(tensor)),
                "{kind}: {tensor} not in {:?}",
                fa.keys()
            );
        }

        let b = temp(&format!("kind-{kind}-resumed"));
        let cfg_b = TrainConfig::from_file(tiny(&b, 6, &extra)).unwrap();
        let stop = RunOptions {
            stop_at: Some(5),
            ..Default::default()
        };
        assert_eq!(run_with(&cfg_b, stop).unwrap().0, RunEnd::Stopped(5));
        run_with(&cfg_b, resume()).unwrap();
        assert_eq!(
            losses(&cfg_b.train.output_dir),
            full,
            "{kind}: resumed losses"
        );
        let fb = load(&cfg_b);
        assert_eq!(fa.len(), fb.len());
        for (k, t) in &fa {
            assert_eq!(
                t.to_vec_f64().unwrap(),
                fb[k].to_vec_f64().unwrap(),
                "{kind}: {k} after resume"
            );
        }
        std::fs::remove_dir_all(&a).ok();
        std::fs::remove_dir_all(&b).ok();
    }
}

/// Streamed blocks with their conditioning products on the host: each micro-batch's inputs
/// are fetched and announced to the model during the micro-batch before
/// (`DiffusionModel::prepare`, the products computed ahead). The run takes the same batches
/// and timesteps as with the products on the device (the same losses up to the order of the
/// products' f32 sums) and resumes exactly. Batches of two: the tiny Flux's modulations (32
/// wide) then see few enough rows to be held on the host.
#[test]
fn announced_micro_batches_train_as_read_in_turn_and_resume_exactly() {
    let cfg_for = |name: &str, host: bool| {
        let dir = temp(name);
        let mut cfg = TrainConfig::from_file(tiny(&dir, 6, "")).unwrap();
        cfg.train.batch_size = 2;
        cfg.train.grad_accum = 2;
        cfg.memory.checkpointing = CheckpointSetting::Fixed(Checkpointing::All);
        cfg.memory.stream_blocks = 2;
        cfg.memory.prefetch = 1;
        cfg.planner.host_products = host;
        // Adapters in the blocks only: one on the final layer (outside them) would have the
        // conditioning need a gradient.
        cfg.adapter
            .targets
            .retain(|t| !t.starts_with("final_layer"));
        cfg
    };
    // The losses of the log's lines.
    let values = |l: &[String]| -> Vec<f64> {
        l.iter()
            .map(|x| {
                serde_json::from_str::<serde_json::Value>(x).unwrap()["loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect()
    };
    let plain = cfg_for("announce-off", false);
    run_with(&plain, fresh()).unwrap();
    let want = values(&losses(&plain.train.output_dir));
    assert_eq!(want.len(), 6);
    let cfg = cfg_for("announce-on", true);
    assert!(
        Trainer::new(cfg.clone()).unwrap().memory.plan.host_products,
        "the plan holds the modulations on the host"
    );
    let mut trainer = Trainer::new(cfg.clone()).unwrap();
    trainer.run(&fresh(), &mut |_| {}).unwrap();
    let full = losses(&cfg.train.output_dir);
    // Every micro-batch's products but the first were computed ahead and taken: 12
    // micro-batches, the first announced by none, the last announcing none.
    let host = trainer.stream_report().unwrap().unwrap().host;
    assert_eq!((host.announced, host.taken_ahead), (11, 11), "{host:?}");
    for (a, b) in values(&full).iter().zip(&want) {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "{a} against {b}");
    }
    let b = cfg_for("announce-resumed", true);
    let stop = RunOptions {
        stop_at: Some(3),
        ..Default::default()
    };
    assert_eq!(run_with(&b, stop).unwrap().0, RunEnd::Stopped(3));
    run_with(&b, resume()).unwrap();
    assert_eq!(losses(&b.train.output_dir), full);
}

/// The tiny run of `announced_micro_batches_…` as a config file under `dir` (streamed
/// blocks, their modulations on the host, each micro-batch announced during the one before).
#[cfg(feature = "cli")]
fn tiny_announced(dir: &Path, steps: usize) -> PathBuf {
    let p = tiny(dir, steps, "");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("batch_size = 4", "batch_size = 2\ngrad_accum = 2")
        .replace(", \"final_layer.linear\"]", "]");
    let text = format!(
        "{text}\n[memory]\ncheckpointing = \"all\"\nstream_blocks = 2\nprefetch = 1\nhost_products = true\n"
    );
    std::fs::write(&p, text).unwrap();
    p
}

/// An announcement whose worker fails to bring its input to the host (`FLAME_FAULT`'s
/// `announce` point, a full-disk error there) costs that micro-batch its products ahead,
/// nothing else: the run ends, exit 0, with the uninterrupted run's log and LoRA, bit for
/// bit.
#[cfg(feature = "cli")]
#[test]
fn a_failed_announcement_leaves_the_run_as_it_was() {
    let run = |name: &str, fault: Option<&str>| {
        let d = temp(name);
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_train"));
        c.arg(tiny_announced(&d, 4));
        match fault {
            Some(f) => c.env("FLAME_FAULT", f),
            None => c.env_remove("FLAME_FAULT"),
        };
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{fault:?}: {err}");
        let out = d.join("tiny/out-encoded");
        (
            losses(&out),
            flame::train::metadata::content(&out.join("lora.safetensors")).unwrap(),
        )
    };
    let (want, lora) = run("announce-whole", None);
    assert_eq!(want.len(), 4);
    for point in ["enospc:announce", "enospc:announce@4"] {
        let (got, got_lora) = run(&format!("announce-{}", point.len()), Some(point));
        assert_eq!(got, want, "{point}");
        assert!(got_lora == lora, "{point}: the LoRA differs");
    }
}

/// The tiny run of `steps` steps training DoRA, its file written in the layout `format`.
fn tiny_dora(dir: &Path, steps: usize, format: &str) -> TrainConfig {
    let p = tiny(dir, steps, "kind = \"dora\"\n");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("format = \"kohya\"", &format!("format = \"{format}\""));
    std::fs::write(&p, text).unwrap();
    let cfg = TrainConfig::from_file(&p).unwrap();
    assert_eq!(format!("{:?}", cfg.adapter.format).to_lowercase(), format);
    cfg
}

/// `adapter.format = "comfyui"`: the final DoRA file carries the magnitudes ComfyUI's reading
/// needs and says so in its metadata, the checkpoints keep the kohya layout (the one the exact
/// resume tests read), and the `sample` binary's merge computes the same weights from either
/// (what ComfyUI computes from the final file: tests/comfy.rs).
#[test]
fn dora_in_the_comfyui_layout() {
    let d = temp("dora-comfyui");
    let cfg = tiny_dora(&d, 4, "comfyui");
    run_with(&cfg, fresh()).unwrap();
    let out = &cfg.train.output_dir;
    let last = checkpoints(out).unwrap().last().unwrap().1.clone();
    let (final_file, ckpt_file) = (
        out.join("lora.safetensors"),
        last.join("adapter.safetensors"),
    );
    let meta = |f: &Path| {
        flame::safetensors::SafeTensorsFile::open(f)
            .unwrap()
            .metadata()
            .get("flame_layout")
            .cloned()
    };
    assert_eq!(meta(&final_file).as_deref(), Some("comfyui"));
    assert_eq!(meta(&ckpt_file), None);
    let weights = flame::safetensors::load(&cfg.model.path, &flame::Device::Cpu).unwrap();
    let a = flame::safetensors::load(&final_file, &flame::Device::Cpu).unwrap();
    let b = flame::safetensors::load(&ckpt_file, &flame::Device::Cpu).unwrap();
    let merge = |f: &Path| flame::nn::LoraMerge::open(f, 1.0, "transformer").unwrap();
    let (ma, mb) = (merge(&final_file), merge(&ckpt_file));
    let mut layers = 0;
    for key in a.keys().filter(|k| k.ends_with(".dora_scale")) {
        let name = key.trim_end_matches(".dora_scale");
        let differ = a[key]
            .sub(&b[key])
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar_f64()
            .unwrap();
        assert!(differ > 0.0, "{key}: the magnitudes as kohya writes them");
        let path = name.trim_start_matches("lora_unet_");
        let wkey = weights
            .keys()
            .find(|k| {
                k.strip_suffix(".weight").map(|s| s.replace('.', "_")) == Some(path.to_string())
            })
            .unwrap_or_else(|| panic!("no weight for {name}"))
            .clone();
        let w = &weights[&wkey];
        let da = ma.delta_for(&wkey, w).unwrap().unwrap();
        let db = mb.delta_for(&wkey, w).unwrap().unwrap();
        let scale = db
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar_f64()
            .unwrap();
        let e = da
            .sub(&db)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar_f64()
            .unwrap();
        assert!(e <= 1e-5 * scale.max(1e-6), "{wkey}: merged {e} apart");
        layers += 1;
    }
    assert!(layers > 0);
    std::fs::remove_dir_all(&d).ok();
}

/// DoRA in PEFT's layout on layers PEFT splits (Flux's fused qkv into to_q, to_k, to_v): the
/// layout is checked before training without the magnitudes (set at a layer's first use),
/// and the file holds each part's magnitude.
#[test]
fn dora_in_the_peft_layout_splits_fused_layers() {
    let d = temp("dora-peft");
    let cfg = tiny_dora(&d, 2, "peft");
    assert!(cfg.adapter.targets.iter().any(|t| t.contains("_attn.qkv")));
    run_with(&cfg, fresh()).unwrap();
    let f = flame::safetensors::load(
        cfg.train.output_dir.join("lora.safetensors"),
        &flame::Device::Cpu,
    )
    .unwrap();
    for part in ["to_q", "to_k", "to_v"] {
        let k = format!("transformer.transformer_blocks.0.attn.{part}.lora_magnitude_vector");
        assert!(f.contains_key(&k), "{k} not in {:?}", f.keys());
    }
    std::fs::remove_dir_all(&d).ok();
}

/// `adapter.format = "peft"`: beside the final adapter and each checkpoint's, PEFT's
/// `adapter_config.json` with the keys `PeftModel.from_pretrained` reads (peft 0.21's
/// `LoraConfig` / `LoKrConfig` / `LoHaConfig` fields): the type, r and its alpha (= r: the
/// file's tensors carry the scale), the diffusers modules of the file's tensors as
/// `target_modules` (Flux's fused qkv and linear1 as their diffusers parts), the rank and
/// alpha patterns, and the kind's own fields (`use_dora`, `lora_dropout`). A run stopped at a
/// checkpoint resumes from it with the config beside it.
#[test]
fn the_peft_layout_writes_its_adapter_config() {
    for kind in ["lora", "dora"] {
        let d = temp(&format!("peft-config-{kind}"));
        let extra = format!("kind = \"{kind}\"\n");
        let toml = tiny(&d, 8, &extra);
        let text = std::fs::read_to_string(&toml)
            .unwrap()
            .replace("format = \"kohya\"", "format = \"peft\"");
        std::fs::write(&toml, text).unwrap();
        let cfg = TrainConfig::from_file(&toml).unwrap();
        let stop = RunOptions {
            stop_at: Some(4),
            ..Default::default()
        };
        assert_eq!(run_with(&cfg, stop).unwrap().0, RunEnd::Stopped(4));
        let (_, ckpt) = checkpoints(&cfg.train.output_dir).unwrap().pop().unwrap();
        assert!(ckpt.join("adapter_config.json").is_file(), "{ckpt:?}");
        run_with(&cfg, resume()).unwrap();
        let out = &cfg.train.output_dir;
        let read = |p: &Path| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
        };
        let c = read(&out.join("adapter_config.json"));
        assert_eq!(c["peft_type"], "LORA", "{kind}: {c}");
        let r = cfg.adapter.rank as u64;
        assert_eq!(c["r"].as_u64(), Some(r), "{kind}: {c}");
        assert_eq!(c["lora_alpha"].as_u64(), Some(r), "{kind}: {c}");
        assert!(
            c["rank_pattern"].is_object() && c["alpha_pattern"].is_object(),
            "{c}"
        );
        // Every module of the file is a target, and every target a module of the file.
        let f = flame::safetensors::SafeTensorsFile::open(out.join("lora.safetensors")).unwrap();
        let leaf = ".lora_A.weight";
        let modules: BTreeSet<String> = f
            .names()
            .filter_map(|n| n.strip_suffix(leaf))
            .map(|n| n.trim_start_matches("transformer.").to_string())
            .collect();
        let targets: BTreeSet<String> = c["target_modules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect();
        assert!(!modules.is_empty());
        assert_eq!(targets, modules, "{kind}");
        assert_eq!(c["use_dora"], kind == "dora", "{c}");
        assert!(c["lora_dropout"].is_number(), "{c}");
        // The checkpoint's config is the final one's (the same adapters).
        assert_eq!(read(&ckpt.join("adapter_config.json")), c);
        std::fs::remove_dir_all(&d).ok();
    }
}

/// LoKr with `adapter.per_projection` trains through the trainer (its memory plan builds the
/// model's layers with the model's key map too), stops and resumes exactly, in the kohya and
/// the PEFT layouts; the PEFT run writes LoKr's `adapter_config.json`.
#[test]
fn per_projection_lokr_trains_and_resumes_exactly() {
    for format in ["kohya", "peft"] {
        let make = |name: &str| {
            let d = temp(&format!("per-projection-{format}-{name}"));
            let toml = tiny(&d, 8, "kind = \"lokr\"\nper_projection = true\n");
            let text = std::fs::read_to_string(&toml)
                .unwrap()
                .replace("format = \"kohya\"", &format!("format = \"{format}\""));
            std::fs::write(&toml, text).unwrap();
            (d, TrainConfig::from_file(&toml).unwrap())
        };
        let (a, full) = make("full");
        run_with(&full, fresh()).unwrap();
        let (b, parted) = make("resumed");
        let stop = RunOptions {
            stop_at: Some(4),
            ..Default::default()
        };
        assert_eq!(run_with(&parted, stop).unwrap().0, RunEnd::Stopped(4));
        run_with(&parted, resume()).unwrap();
        let expected = losses(&full.train.output_dir);
        assert_eq!(expected.len(), 8, "{format}");
        assert_eq!(losses(&parted.train.output_dir), expected, "{format}");
        if format == "peft" {
            let c: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(parted.train.output_dir.join("adapter_config.json"))
                    .unwrap(),
            )
            .unwrap();
            assert_eq!(c["peft_type"], "LOKR", "{c}");
        }
        std::fs::remove_dir_all(&a).ok();
        std::fs::remove_dir_all(&b).ok();
    }
}

/// `optimizer.kind = "prodigy"` trains through the trainer and resumes exactly: the global
/// estimate d rides in the checkpoints' optimizer state. lr defaults to 1.0 for Prodigy.
#[test]
fn prodigy_from_the_config_resumes_exactly() {
    let set = |cfg: &mut TrainConfig| {
        cfg.optimizer.kind = OptimizerKind::Prodigy;
        cfg.optimizer.lr = None;
        // The tiny example warms up: Prodigy then needs safeguard_warmup.
        cfg.optimizer.safeguard_warmup = Some(true);
    };
    let a = temp("prodigy-full");
    let mut cfg = TrainConfig::from_file(tiny(&a, 8, "")).unwrap();
    set(&mut cfg);
    assert_eq!(cfg.optimizer.lr(), 1.0);
    run_with(&cfg, fresh()).unwrap();
    let full = losses(&cfg.train.output_dir);
    assert_eq!(full.len(), 8);
    let b = temp("prodigy-resumed");
    let mut cfg_b = TrainConfig::from_file(tiny(&b, 8, "")).unwrap();
    set(&mut cfg_b);
    let stop = RunOptions {
        stop_at: Some(6),
        ..Default::default()
    };
    assert_eq!(run_with(&cfg_b, stop).unwrap().0, RunEnd::Stopped(6));
    run_with(&cfg_b, resume()).unwrap();
    assert_eq!(losses(&cfg_b.train.output_dir), full);
    let (_, dir) = checkpoints(&cfg_b.train.output_dir).unwrap().pop().unwrap();
    let f = flame::safetensors::SafeTensorsFile::open(dir.join("optimizer.safetensors")).unwrap();
    let m = f.metadata();
    assert_eq!(m.get("optimizer").map(String::as_str), Some("prodigy"));
    let d: f64 = m.get("d").unwrap().parse().unwrap();
    assert!(d > 1e-6, "d grew from d0: {d}");
    std::fs::remove_dir_all(&a).ok();
    std::fs::remove_dir_all(&b).ok();
}

/// `optimizer.kind = "lion"` and `"lion8bit"` train through the trainer and resume exactly;
/// betas default to Lion's [0.9, 0.99]. (The tiny adapters are all under Lion8bit's
/// 4096-value threshold, so its momenta stay f32: the quantized path is tests/lion.rs's.)
/// With LoRA+ the optimizer is one Lion per parameter group, their states in one file.
#[test]
fn lion_from_the_config_resumes_exactly() {
    for (kind, name, extra, prefix) in [
        (OptimizerKind::Lion, "lion", "", ""),
        (OptimizerKind::Lion8bit, "lion8bit", "", ""),
        (
            OptimizerKind::Lion,
            "lion-loraplus",
            "loraplus_lr_ratio = 4.0\n",
            "group.1.",
        ),
    ] {
        let set = |cfg: &mut TrainConfig| {
            cfg.optimizer.kind = kind;
            cfg.optimizer.lr = Some(3e-4);
            cfg.optimizer.betas = None;
        };
        let a = temp(&format!("{name}-full"));
        let mut cfg = TrainConfig::from_file(tiny(&a, 8, extra)).unwrap();
        set(&mut cfg);
        assert_eq!(cfg.optimizer.betas(), [0.9, 0.99]);
        run_with(&cfg, fresh()).unwrap();
        let full = losses(&cfg.train.output_dir);
        assert_eq!(full.len(), 8);
        let b = temp(&format!("{name}-resumed"));
        let mut cfg_b = TrainConfig::from_file(tiny(&b, 8, extra)).unwrap();
        set(&mut cfg_b);
        let stop = RunOptions {
            stop_at: Some(6),
            ..Default::default()
        };
        assert_eq!(run_with(&cfg_b, stop).unwrap().0, RunEnd::Stopped(6));
        run_with(&cfg_b, resume()).unwrap();
        assert_eq!(losses(&cfg_b.train.output_dir), full, "{name}");
        let (_, dir) = checkpoints(&cfg_b.train.output_dir).unwrap().pop().unwrap();
        let f =
            flame::safetensors::SafeTensorsFile::open(dir.join("optimizer.safetensors")).unwrap();
        let m = f.metadata();
        let kind_name = match prefix {
            "" => name,
            _ => "groups",
        };
        assert_eq!(m.get("optimizer").map(String::as_str), Some(kind_name));
        let beta2 = format!("{prefix}beta2");
        assert_eq!(m.get(&beta2).map(String::as_str), Some("0.99"));
        if !prefix.is_empty() {
            assert_eq!(m.get("group.1.lr_scale").map(String::as_str), Some("4"));
            assert_eq!(m.get("group.1.optimizer").map(String::as_str), Some("lion"));
        }
        std::fs::remove_dir_all(&a).ok();
        std::fs::remove_dir_all(&b).ok();
    }
}

/// `optimizer.kind = "adafactor"` in kohya's settings (a given lr on the example's warm-up
/// and schedule) trains through the trainer and resumes exactly; its keys are checked with
/// the config, naming the key: lr or a schedule with relative steps, warmup_init without
/// them, and keys of another kind.
#[test]
fn adafactor_from_the_config_resumes_exactly() {
    let kohya = "kind = \"adafactor\"\nlr = 1e-3\nscale_parameter = false\n\
                 relative_step = false\nwarmup_init = false\nbeta1 = 0.9";
    let config = |dir: &Path| {
        let text = std::fs::read_to_string(tiny(dir, 8, ""))
            .unwrap()
            .replace("[optimizer]\nlr = 3e-3", &format!("[optimizer]\n{kohya}"));
        let p = dir.join("train.toml");
        std::fs::write(&p, text).unwrap();
        TrainConfig::from_file(&p).unwrap()
    };
    let a = temp("adafactor-full");
    let cfg = config(&a);
    assert_eq!(cfg.optimizer.kind, OptimizerKind::Adafactor);
    run_with(&cfg, fresh()).unwrap();
    let full = losses(&cfg.train.output_dir);
    assert_eq!(full.len(), 8);
    let b = temp("adafactor-resumed");
    let cfg_b = config(&b);
    let stop = RunOptions {
        stop_at: Some(6),
        ..Default::default()
    };
    assert_eq!(run_with(&cfg_b, stop).unwrap().0, RunEnd::Stopped(6));
    run_with(&cfg_b, resume()).unwrap();
    assert_eq!(losses(&cfg_b.train.output_dir), full);
    let (_, dir) = checkpoints(&cfg_b.train.output_dir).unwrap().pop().unwrap();
    let f = flame::safetensors::SafeTensorsFile::open(dir.join("optimizer.safetensors")).unwrap();
    let m = f.metadata();
    assert_eq!(m.get("optimizer").map(String::as_str), Some("adafactor"));
    assert_eq!(m.get("relative_step").map(String::as_str), Some("false"));
    assert!(f.names().any(|n| n.ends_with(".exp_avg_sq_row")));

    let good = std::fs::read_to_string(a.join("train.toml")).unwrap();
    for (from, to, key, want) in [
        // transformers refuses lr with relative_step=True.
        (
            "relative_step = false",
            "relative_step = true",
            "optimizer.lr",
            "relative_step",
        ),
        (
            "lr = 1e-3\nscale_parameter = false\nrelative_step = false",
            "scale_parameter = false",
            "schedule.kind",
            "constant",
        ),
        (
            "warmup_init = false",
            "warmup_init = true",
            "optimizer.warmup_init",
            "relative_step",
        ),
        ("beta1 = 0.9", "beta1 = 1.5", "optimizer.beta1", "[0, 1)"),
        (
            "beta1 = 0.9",
            "decay_rate = 0.5",
            "optimizer.decay_rate",
            "<= 0",
        ),
        (
            "beta1 = 0.9",
            "clip_threshold = 0.0",
            "optimizer.clip_threshold",
            "> 0",
        ),
        (
            "kind = \"adafactor\"",
            "kind = \"adamw\"",
            "optimizer.beta1",
            "only",
        ),
    ] {
        assert!(good.contains(from), "{from}");
        let e = TrainConfig::from_toml(&good.replace(from, to))
            .unwrap_err()
            .to_string();
        assert!(e.contains(key) && e.contains(want), "{to}: {e}");
    }
    std::fs::remove_dir_all(&a).ok();
    std::fs::remove_dir_all(&b).ok();
}

/// Prodigy's keys are checked with the config, naming the key: they belong to kind =
/// "prodigy", their values are checked, a warm-up needs safeguard_warmup, and a set key is one
/// a resumed run must keep.
#[test]
fn prodigy_keys_are_checked_with_the_config() {
    let d = temp("prodigy-config");
    let good = std::fs::read_to_string(tiny(&d, 4, "")).unwrap().replace(
        "[optimizer]\nlr = 3e-3",
        "[optimizer]\nkind = \"prodigy\"\nsafeguard_warmup = true\nd_coef = 0.5",
    );
    let c = TrainConfig::from_toml(&good).unwrap();
    assert_eq!(c.optimizer.lr(), 1.0);
    assert!(c
        .resume_keys()
        .iter()
        .any(|(k, v)| *k == "optimizer.d_coef" && v.contains("0.5")));
    for (from, to, key, want) in [
        (
            "kind = \"prodigy\"",
            "kind = \"adamw\"",
            "optimizer.d_coef",
            "kind = \"prodigy\" only",
        ),
        ("d_coef = 0.5", "d_coef = -1.0", "optimizer.d_coef", "> 0"),
        ("d_coef = 0.5", "beta3 = 1.5", "optimizer.beta3", "[0, 1)"),
        ("d_coef = 0.5", "d0 = 0.0", "optimizer.d0", "> 0"),
        (
            "safeguard_warmup = true",
            "safeguard_warmup = false",
            "optimizer.safeguard_warmup",
            "warmup_steps",
        ),
    ] {
        assert!(good.contains(from), "{from}");
        let e = TrainConfig::from_toml(&good.replace(from, to))
            .unwrap_err()
            .to_string();
        assert!(e.contains(key) && e.contains(want), "{to}: {e}");
    }
    std::fs::remove_dir_all(&d).ok();
}

/// The schedule-free kinds through the trainer: a run stopped after its checkpoint at step 4
/// and resumed equals the uninterrupted one (losses and the final adapter bit for bit), and
/// the adapters saved are x (the optimizer state beside them says it was saved in eval
/// mode, and the final adapter equals the last checkpoint's). With LoRA+, every parameter
/// group's optimizer moves to x and back.
#[test]
fn schedule_free_kinds_save_x_and_resume_exactly() {
    for (kind, name, extra, prefix) in [
        (
            OptimizerKind::AdamWScheduleFree,
            "adamw_schedulefree",
            "",
            "",
        ),
        (
            OptimizerKind::ProdigyScheduleFree,
            "prodigy_schedulefree",
            "",
            "",
        ),
        (
            OptimizerKind::AdamWScheduleFree,
            "adamw_schedulefree-loraplus",
            "loraplus_lr_ratio = 4.0\n",
            "group.",
        ),
    ] {
        let config = |dir: &Path| {
            let mut cfg = TrainConfig::from_file(tiny(dir, 8, extra)).unwrap();
            cfg.optimizer.kind = kind;
            cfg.optimizer.lr = None;
            cfg.schedule.kind = ScheduleKind::Constant;
            cfg.schedule.warmup_steps = 0;
            cfg.validate().unwrap();
            cfg
        };
        let a = temp(&format!("{name}-full"));
        let cfg = config(&a);
        run_with(&cfg, fresh()).unwrap();
        let full = losses(&cfg.train.output_dir);
        let b = temp(&format!("{name}-resumed"));
        let cfg_b = config(&b);
        let stop = RunOptions {
            stop_at: Some(6),
            ..Default::default()
        };
        assert_eq!(run_with(&cfg_b, stop).unwrap().0, RunEnd::Stopped(6));
        run_with(&cfg_b, resume()).unwrap();
        assert_eq!(losses(&cfg_b.train.output_dir), full, "{name}: losses");
        let tensors = |p: PathBuf| {
            let f = flame::safetensors::SafeTensorsFile::open(&p).unwrap();
            let mut v: Vec<(String, Vec<u64>)> = f
                .names()
                .map(|n| {
                    let t = f.load(n, &flame::Device::Cpu).unwrap();
                    let bits = t
                        .to_vec_f64()
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits())
                        .collect();
                    (n.to_string(), bits)
                })
                .collect();
            v.sort();
            v
        };
        let lora = |c: &TrainConfig| tensors(c.train.output_dir.join("lora.safetensors"));
        assert_eq!(lora(&cfg), lora(&cfg_b), "{name}: the final adapters");
        let (step, dir) = checkpoints(&cfg_b.train.output_dir).unwrap().pop().unwrap();
        assert_eq!(step, 8);
        let f =
            flame::safetensors::SafeTensorsFile::open(dir.join("optimizer.safetensors")).unwrap();
        let m = f.metadata();
        if prefix.is_empty() {
            assert_eq!(m.get("optimizer").map(String::as_str), Some(name));
            assert_eq!(
                m.get("train_mode").map(String::as_str),
                Some("false"),
                "{name}: saved at x"
            );
        } else {
            assert_eq!(m.get("optimizer").map(String::as_str), Some("groups"));
            for i in 0..2 {
                assert_eq!(
                    m.get(&format!("{prefix}{i}.train_mode"))
                        .map(String::as_str),
                    Some("false"),
                    "{name}: group {i} saved at x"
                );
            }
        }
        assert_eq!(
            tensors(dir.join("adapter.safetensors")),
            tensors(cfg_b.train.output_dir.join("lora.safetensors")),
            "{name}: the final adapter is the last checkpoint's x"
        );
    }
}

/// The trainers' own layouts (`adapter.format = "ai-toolkit"` / `"musubi"`) hold plain LoRAs:
/// the other kinds are refused with the config, naming the key and the kinds they hold.
#[test]
fn the_tools_layouts_refuse_the_kinds_they_do_not_hold() {
    let d = temp("tool-kinds");
    let good = std::fs::read_to_string(tiny(&d, 4, "")).unwrap();
    for format in ["ai-toolkit", "musubi"] {
        for kind in ["dora", "lokr", "loha", "full"] {
            let text = good
                .replace("[adapter]\n", &format!("[adapter]\nkind = \"{kind}\"\n"))
                .replace("format = \"kohya\"", &format!("format = \"{format}\""));
            let e = TrainConfig::from_toml(&text).unwrap_err().to_string();
            assert!(
                e.contains("adapter.format") && e.contains("written for lora, not"),
                "{format} {kind}: {e}"
            );
        }
        let lora = good.replace("format = \"kohya\"", &format!("format = \"{format}\""));
        if let Err(e) = TrainConfig::from_toml(&lora) {
            assert!(!e.to_string().contains("written for lora, not"), "{e}");
        }
    }
    std::fs::remove_dir_all(&d).ok();
}
