//! What a run may do to the files around it, and how it tells the user: it deletes or
//! replaces only files its records prove it wrote, never makes stand-ins for a path it cannot
//! find, checks what it can before its first write, ties its final adapter to the step that
//! made it, keeps its loss log whole, and speaks one command-line convention (usage errors 2,
//! failures 1, `-h`, `--version`). On the tiny Flux, made as `train --make-tiny` makes it.
#![cfg(feature = "cpu-ref")]

use flame::train::{Event, FolderAction, RunEnd, RunOptions, TrainConfig, Trainer};
use std::path::{Path, PathBuf};

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-folder-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The pre-encoded tiny example under `dir` with `steps` steps (checkpoints every 4, a
/// constant schedule so a resume may extend it), its files made.
fn tiny(dir: &Path, steps: usize) -> PathBuf {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny-encoded.toml");
    let text = std::fs::read_to_string(example)
        .unwrap()
        .replace("steps = 200", &format!("steps = {steps}"))
        .replace("save_every = 50", "save_every = 4")
        .replace("device = \"auto\"", "device = \"cpu\"")
        .replace("kind = \"cosine\"", "kind = \"constant\"")
        .replace("warmup_steps = 10", "warmup_steps = 0");
    let p = dir.join("train.toml");
    std::fs::write(&p, text).unwrap();
    flame::train::demo::make_tiny(&TrainConfig::from_file(&p).unwrap()).unwrap();
    p
}

/// The image example under `dir` (8 steps, validation and samples every 4), files made.
fn images(dir: &Path) -> PathBuf {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny.toml");
    let text = std::fs::read_to_string(example)
        .unwrap()
        .replace("steps = 200", "steps = 8")
        .replace("save_every = 50", "save_every = 4")
        .replace("validate_every = 50", "validate_every = 4")
        .replace("every = 100", "every = 4")
        .replace("device = \"auto\"", "device = \"cpu\"")
        .replace("warmup_steps = 10", "warmup_steps = 2");
    let p = dir.join("train.toml");
    std::fs::write(&p, text).unwrap();
    flame::train::demo::make_tiny(&TrainConfig::from_file(&p).unwrap()).unwrap();
    p
}

fn run(cfg: &TrainConfig, opts: RunOptions) -> flame::Result<(RunEnd, Vec<String>)> {
    let mut notes = vec![];
    let end = Trainer::new(cfg.clone())?.run(&opts, &mut |e| {
        if let Event::Note(n) = e {
            notes.push(n)
        }
    })?;
    Ok((end, notes))
}

fn opts(resume: bool, overwrite: bool) -> RunOptions {
    RunOptions {
        resume,
        overwrite,
        ..Default::default()
    }
}

fn log(out: &Path) -> Vec<String> {
    flame::train::rundir::read_log(&out.join("loss.jsonl"))
        .unwrap()
        .into_iter()
        .map(|(_, l)| l)
        .collect()
}

#[cfg(feature = "cli")]
fn train_bin(args: &[&std::ffi::OsStr], fault: Option<&str>) -> std::process::Output {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_train"));
    c.args(args);
    match fault {
        Some(f) => c.env("FLAME_FAULT", f),
        None => c.env_remove("FLAME_FAULT"),
    };
    c.output().unwrap()
}

#[test]
fn overwrite_deletes_only_what_the_run_recorded() {
    let d = temp("overwrite");
    let cfg = TrainConfig::from_file(images(&d)).unwrap();
    let out = cfg.train.output_dir.clone();
    // A user's own files beside a run's names, made before the run.
    std::fs::create_dir_all(out.join("checkpoint-best-by-hand")).unwrap();
    std::fs::write(out.join("checkpoint-best-by-hand/keep.txt"), b"mine").unwrap();
    std::fs::write(out.join("checkpoint-notes.md"), b"notes").unwrap();
    std::fs::create_dir_all(out.join("samples")).unwrap();
    std::fs::write(out.join("samples/my-picture.png"), b"not a png").unwrap();
    run(&cfg, opts(false, false)).unwrap();
    assert!(out.join("samples/step-0000008-0.png").is_file());
    assert!(out.join("loss.png").is_file());
    // A file dropped into a checkpoint of the run: --overwrite refuses, naming it, and
    // deletes nothing.
    std::fs::write(out.join("checkpoint-0000008/why.txt"), b"mine").unwrap();
    let e = run(&cfg, opts(false, true)).unwrap_err().to_string();
    assert!(e.contains("why.txt"), "{e}");
    assert!(out.join("checkpoint-0000008/adapter.safetensors").is_file());
    std::fs::rename(
        out.join("checkpoint-0000008/why.txt"),
        out.join("checkpoint-best-by-hand/why.txt"),
    )
    .unwrap();
    let (_, notes) = run(&cfg, opts(false, true)).unwrap();
    assert!(notes.iter().any(|n| n.contains("--overwrite")), "{notes:?}");
    for f in [
        "checkpoint-best-by-hand/keep.txt",
        "checkpoint-notes.md",
        "samples/my-picture.png",
        "checkpoint-best-by-hand/why.txt",
    ] {
        assert!(out.join(f).is_file(), "{f} was deleted");
    }
    assert_eq!(
        log(&out).iter().filter(|l| l.contains("\"loss\"")).count(),
        8
    );
    // A file at a run's name that no run recorded: refused, naming it, nothing deleted.
    std::fs::write(out.join("loss.png"), b"my own plot").unwrap();
    for o in [opts(false, true), opts(false, false), opts(true, false)] {
        let e = run(&cfg, o).unwrap_err();
        assert!(matches!(e, flame::Error::RunFolder { .. }), "{e}");
        let e = e.to_string();
        assert!(
            e.contains("loss.png")
                && (e.contains("no run recorded") || e.contains("did not record")),
            "{e}"
        );
    }
    assert_eq!(std::fs::read(out.join("loss.png")).unwrap(), b"my own plot");
    assert!(out.join("lora.safetensors").is_file());
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn resume_needs_a_run_and_keeps_the_whole_log() {
    let d = temp("resume");
    let cfg = TrainConfig::from_file(tiny(&d, 8)).unwrap();
    let out = cfg.train.output_dir.clone();
    // No run there: a typo in the folder is an error, not a new run.
    let mut typo = cfg.clone();
    typo.train.output_dir = d.join("tiny/out-encodde");
    let e = run(&typo, opts(true, false)).unwrap_err();
    assert!(
        matches!(e, flame::Error::RunFolder { .. }) && e.to_string().contains("no run to resume"),
        "{e}"
    );
    assert!(!typo.train.output_dir.exists());
    // A folder of other things: no run either.
    std::fs::create_dir_all(&typo.train.output_dir).unwrap();
    std::fs::write(typo.train.output_dir.join("notes.txt"), b"x").unwrap();
    let e = run(&typo, opts(true, false)).unwrap_err().to_string();
    assert!(e.contains("has no run.json"), "{e}");
    // The full run, then a run stopped at 6 whose log is deleted: the resume restores it
    // from its checkpoint (4) and ends with the same log.
    run(&cfg, opts(false, false)).unwrap();
    let want = log(&out);
    let b = temp("resume-b");
    let cfg_b = TrainConfig::from_file(tiny(&b, 8)).unwrap();
    let stop = RunOptions {
        stop_at: Some(6),
        ..Default::default()
    };
    run(&cfg_b, stop).unwrap();
    std::fs::remove_file(cfg_b.train.output_dir.join("loss.jsonl")).unwrap();
    let (_, notes) = run(&cfg_b, opts(true, false)).unwrap();
    assert!(
        notes.iter().any(|n| n.contains("lacked 4 of steps 1-4")),
        "{notes:?}"
    );
    assert_eq!(log(&cfg_b.train.output_dir), want);
    std::fs::remove_dir_all(&d).ok();
    std::fs::remove_dir_all(&b).ok();
}

/// A finished run extended with `--resume` (more steps) and killed after its new last
/// checkpoint is in place but before `lora.safetensors` is replaced: the next `--resume`
/// replaces the stale adapter with the one of the last step.
#[cfg(feature = "cli")]
#[test]
fn a_stale_final_adapter_is_replaced() {
    let a = temp("stale-a");
    let b = temp("stale-b");
    let (pa, pb) = (tiny(&a, 12), tiny(&b, 8));
    assert!(train_bin(&[pa.as_os_str()], None).status.success());
    let want =
        flame::train::metadata::content(&a.join("tiny/out-encoded/lora.safetensors")).unwrap();
    assert!(train_bin(&[pb.as_os_str()], None).status.success());
    let out = b.join("tiny/out-encoded");
    let eight = flame::train::metadata::content(&out.join("lora.safetensors")).unwrap();
    assert_ne!(eight, want);
    // Extend to 12 steps; killed as the final adapter is written.
    let text = std::fs::read_to_string(&pb)
        .unwrap()
        .replace("steps = 8", "steps = 12");
    std::fs::write(&pb, text).unwrap();
    let resume = std::ffi::OsStr::new("--resume");
    let o = train_bin(
        &[pb.as_os_str(), resume],
        Some("kill:write:lora.safetensors"),
    );
    assert!(!o.status.success());
    assert!(out.join("checkpoint-0000012").is_dir());
    assert_eq!(
        flame::train::metadata::content(&out.join("lora.safetensors")).unwrap(),
        eight
    );
    let o = train_bin(&[pb.as_os_str(), resume], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        flame::train::metadata::content(&out.join("lora.safetensors")).unwrap(),
        want
    );
    assert_eq!(log(&out), log(&a.join("tiny/out-encoded")));
    std::fs::remove_dir_all(&a).ok();
    std::fs::remove_dir_all(&b).ok();
}

#[test]
fn checks_come_before_the_first_write() {
    let d = temp("checks");
    let p = images(&d);
    let base = std::fs::read_to_string(&p).unwrap();
    let out = d.join("tiny/out");
    let cache = out.join("cache");
    let check = |text: String, want: &[&str]| {
        std::fs::write(&p, &text).unwrap();
        let e = TrainConfig::from_file(&p)
            .and_then(|c| {
                Trainer::new(c.clone())?.run(&RunOptions::default(), &mut |_| {})?;
                Ok(())
            })
            .unwrap_err()
            .to_string();
        for w in want {
            assert!(e.contains(w), "{w:?} not in: {e}");
        }
        assert!(!out.join("run.json").exists(), "a run was started: {e}");
        assert!(!cache.exists(), "caching started: {e}");
    };
    // Buckets whose sides the model cannot take, naming the key.
    check(
        base.replace("bucket_step = 16", "bucket_step = 7"),
        &["data.bucket_step = 7", "multiples of 4"],
    );
    // A sample size the model cannot take.
    check(
        base.replace("[sample]\n", "[sample]\nsize = [48, 40]\n"),
        &["sample.size", "[48, 40]"],
    );
    // A batch larger than the data.
    check(
        base.replace("batch_size = 4", "batch_size = 1000000"),
        &["train.batch_size = 1000000", "training views"],
    );
    // T5 past its length.
    check(
        base.replace("t5_tokens = 32", "t5_tokens = 100000"),
        &["encoders.t5_tokens", "at most 512"],
    );
    // An adapter rank a layer cannot take, targets that match nothing, and (on the
    // adapters of a weightless build) both before the latents are cached.
    check(
        base.replace("rank = 8", "rank = 100000"),
        &["adapter.rank = 100000", "at most the smaller width"],
    );
    let targets = base
        .lines()
        .find(|l| l.starts_with("targets = "))
        .unwrap()
        .to_string();
    check(
        base.replace(&targets, "targets = [\"no_such_layer.*\"]"),
        &["adapter.targets", "match no Linear layer"],
    );
    // Paths that are missing or of the wrong kind, each named by its key, all at once.
    check(
        base.replace("\"tiny/images\"", "\"tiny/no-images\"")
            .replace("vae = \"tiny/vae\"", "vae = \"tiny/no-vae\""),
        &[
            "data.dirs[0].path = ",
            "no-images: no such file or folder",
            "encoders.vae = ",
        ],
    );
    std::fs::write(d.join("a-file"), b"").unwrap();
    check(
        base.replace("output_dir = \"tiny/out\"", "output_dir = \"a-file\""),
        &["train.output_dir = ", "is a file, not a folder"],
    );
    // Every epoch's shuffled captions encoded ahead: bounded.
    check(
        base.replace("flip = true", "flip = true\nshuffle_tags = true")
            .replace("[train]\nsteps = 8", "[train]\nsteps = 100000000000"),
        &["data.shuffle_tags", "at most 1000000 captions"],
    );
    // Repeats past the bound, with the number as written.
    check(
        base.replace("repeats = 2", "repeats = 100000000000"),
        &["repeats = 100000000000", "at most 100000"],
    );
    // [sample] with pre-encoded data.
    let e = TrainConfig::from_toml(
        &std::fs::read_to_string(tiny(&d, 4))
            .unwrap()
            .replace("[data]\n", "[sample]\nprompts = [\"a cat\"]\n\n[data]\n"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("sample.prompts") && e.contains("pre-encoded"),
        "{e}"
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_signal_during_caching_stops_it_at_once() {
    let d = temp("signal");
    let cfg = TrainConfig::from_file(images(&d)).unwrap();
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let place = flame::train::Placement {
        interrupt: Some(flag),
        ..Default::default()
    };
    let start = std::time::Instant::now();
    let e = Trainer::open_in(
        cfg.clone(),
        flame::train::Prepare::Encode,
        place,
        &mut |_| {},
    )
    .err()
    .unwrap();
    assert!(matches!(e, flame::Error::Interrupted(_)), "{e}");
    assert!(e.to_string().contains("caching latents"), "{e}");
    // Nothing of the run, and no cache entry (the first image was not encoded).
    assert!(!cfg.train.output_dir.join("run.json").exists());
    let entries = std::fs::read_dir(cfg.train.output_dir.join("cache"))
        .map(|r| r.count())
        .unwrap_or(0);
    assert!(entries <= 2, "{entries} cache entries");
    assert!(start.elapsed().as_secs() < 60);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn nan_in_a_cache_entry_is_blamed_on_the_entry() {
    let d = temp("nan-cache");
    let cfg = TrainConfig::from_file(images(&d)).unwrap();
    // Fill the caches, then damage every latent entry with a NaN.
    drop(Trainer::new(cfg.clone()).unwrap());
    let cache = cfg.train.output_dir.join("cache");
    let mut damaged = 0;
    for e in walk(&cache) {
        if e.extension().is_some_and(|x| x == "safetensors") {
            let mut t = flame::safetensors::load(&e, &flame::Device::Cpu).unwrap();
            if let Some(l) = t.get("latents").cloned() {
                let mut v = l.to_vec_f64().unwrap();
                v[0] = f64::NAN;
                let n = flame::Tensor::from_vec(
                    v.iter().map(|&x| x as f32).collect::<Vec<_>>(),
                    l.dims().to_vec(),
                    &flame::Device::Cpu,
                )
                .unwrap();
                t.insert("latents".into(), n);
                let meta = flame::safetensors::SafeTensorsFile::open(&e)
                    .unwrap()
                    .metadata()
                    .clone();
                flame::safetensors::save_with_metadata(
                    t.iter().map(|(k, v)| (k.as_str(), v)),
                    &meta,
                    &e,
                )
                .unwrap();
                damaged += 1;
            }
        }
    }
    assert!(damaged > 0);
    let e = run(&cfg, opts(false, false)).unwrap_err().to_string();
    assert!(
        e.contains("input latents") && e.contains("as read from the data"),
        "{e}"
    );
    assert!(e.contains(&cache.display().to_string()), "{e}");
    std::fs::remove_dir_all(&d).ok();
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut v = vec![];
    if let Ok(r) = std::fs::read_dir(dir) {
        for e in r.flatten() {
            let p = e.path();
            if p.is_dir() {
                v.extend(walk(&p));
            } else {
                v.push(p);
            }
        }
    }
    v
}

#[test]
fn plan_folder_refuses_before_loading() {
    let d = temp("plan-folder");
    let cfg = TrainConfig::from_file(tiny(&d, 4)).unwrap();
    assert_eq!(
        flame::train::plan_folder(&cfg, 1, &opts(false, false)).unwrap(),
        FolderAction::New
    );
    run(&cfg, opts(false, false)).unwrap();
    let e = flame::train::plan_folder(&cfg, 1, &opts(false, false)).unwrap_err();
    assert!(matches!(e, flame::Error::RunFolder { .. }), "{e}");
    assert_eq!(
        flame::train::plan_folder(&cfg, 1, &opts(true, false)).unwrap(),
        FolderAction::AlreadyFinished(4)
    );
    std::fs::remove_dir_all(&d).ok();
}

/// One convention for both binaries: usage errors exit 2 naming `--help`, `-h` and
/// `--version` work, and the train binary's help says what it trains from.
#[cfg(feature = "cli")]
#[test]
fn both_binaries_speak_one_convention() {
    for exe in [env!("CARGO_BIN_EXE_train"), env!("CARGO_BIN_EXE_sample")] {
        let cmd = || std::process::Command::new(exe);
        let o = cmd().output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{exe}: no arguments");
        let o = cmd().arg("--no-such-flag").output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{exe}: an unknown flag");
        assert!(String::from_utf8_lossy(&o.stderr).contains("--help"));
        for h in ["-h", "--help"] {
            let o = cmd().arg(h).output().unwrap();
            assert!(o.status.success(), "{exe} {h}");
            assert!(!o.stdout.is_empty());
        }
        // A flag with a value no run can take is a usage error too.
        if exe.ends_with("sample") {
            let o = cmd()
                .args([
                    "--arch", "flux", "--model", "m", "--prompt", "a", "--steps", "0",
                ])
                .output()
                .unwrap();
            assert_eq!(o.status.code(), Some(2));
            assert!(String::from_utf8_lossy(&o.stderr).contains("--steps 0"));
        }
        let o = cmd().arg("--version").output().unwrap();
        assert!(o.status.success(), "{exe} --version");
        assert!(String::from_utf8_lossy(&o.stdout).contains(env!("CARGO_PKG_VERSION")));
    }
    for args in [
        &["c.toml", "--gpus", "abc"][..],
        &["c.toml", "--gpus", "0", "--workers", "2"][..],
        &["c.toml", "--resume", "--overwrite"][..],
    ] {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
            .args(args)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}");
    }
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .arg("-h")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(
        help.contains("images with") && help.contains("--make-tiny"),
        "{help}"
    );
}

/// `--make-tiny` makes what is missing and says so; a run whose files are missing makes
/// nothing and fails; `--plan` writes nothing, and a full disk says what to do.
#[cfg(feature = "cli")]
#[test]
fn stand_ins_only_when_asked() {
    let d = temp("make-tiny");
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny.toml");
    let p = d.join("train.toml");
    std::fs::copy(&example, &p).unwrap();
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("steps = 200", "steps = 2")
        .replace("warmup_steps = 10", "warmup_steps = 0")
        .replace("device = \"auto\"", "device = \"cpu\"");
    std::fs::write(&p, text).unwrap();
    // Nothing there: the run (and its plan) fail naming a missing file, making nothing.
    for extra in [None, Some("--plan")] {
        let mut args = vec![p.as_os_str()];
        args.extend(extra.map(std::ffi::OsStr::new));
        let o = train_bin(&args, None);
        assert_eq!(o.status.code(), Some(1), "{extra:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("tiny"), "{err}");
        assert_eq!(
            std::fs::read_dir(&d).unwrap().count(),
            1,
            "only the config: {err}"
        );
    }
    let make = std::ffi::OsStr::new("--make-tiny");
    // A config naming a path outside its own folder: refused, nothing made anywhere.
    let elsewhere = temp("make-tiny-elsewhere").join("flux1-dev.safetensors");
    let other = d.join("other.toml");
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "path = \"tiny/flux-tiny.safetensors\"",
        &format!("path = \"{}\"", elsewhere.display()),
    );
    std::fs::write(&other, text).unwrap();
    let o = train_bin(&[make, other.as_os_str()], None);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("model.path"));
    assert!(!elsewhere.exists());
    assert!(!d.join("tiny").exists());
    std::fs::remove_file(&other).unwrap();
    let o = train_bin(&[make, p.as_os_str()], None);
    assert!(o.status.success());
    let said = String::from_utf8_lossy(&o.stderr);
    assert_eq!(said.matches("made ").count(), 7, "{said}");
    let o = train_bin(&[make, p.as_os_str()], None);
    assert!(String::from_utf8_lossy(&o.stderr).contains("nothing to make"));
    // A full disk at the first checkpoint: exit 1, and what to do next.
    let o = train_bin(&[p.as_os_str()], Some("enospc:write:adapter.safetensors"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("free space") && err.contains("--resume"),
        "{err}"
    );
    std::fs::remove_dir_all(&d).ok();
}

/// A host buffer larger than the machine can give is an error naming it, not an abort: a
/// matmul of broadcast views whose output would take 2^62 elements.
#[test]
fn a_host_buffer_too_large_is_an_error() {
    let dev = flame::Device::Cpu;
    let one = flame::Tensor::zeros((1, 1), flame::DType::F32, &dev).unwrap();
    let a = one.broadcast_as((1usize << 31, 1)).unwrap();
    let b = one.broadcast_as((1, 1usize << 31)).unwrap();
    let e = a.matmul(&b).unwrap_err();
    assert!(matches!(e, flame::Error::HostMemory { .. }), "{e}");
    assert!(e.to_string().contains("matmul output"), "{e}");
}

/// A signal in a long gradient accumulation stops between micro-batches: the step in flight
/// is dropped and a checkpoint of the steps done is saved.
#[test]
fn a_signal_stops_a_long_accumulation_between_micro_batches() {
    let d = temp("accum-signal");
    let mut cfg = TrainConfig::from_file(tiny(&d, 8)).unwrap();
    cfg.train.grad_accum = 3;
    let stop = RunOptions {
        stop_at: Some(5),
        ..Default::default()
    };
    run(&cfg, stop).unwrap();
    let mut t = Trainer::new(cfg.clone()).unwrap();
    t.interrupt_flag()
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let end = t.run(&opts(true, false), &mut |_| {}).unwrap();
    let out = &cfg.train.output_dir;
    assert_eq!(end, RunEnd::Interrupted(4, out.join("checkpoint-0000004")));
    assert_eq!(log(out).len(), 4);
    // The run goes on from there.
    let (end, _) = run(&cfg, opts(true, false)).unwrap();
    assert!(matches!(end, RunEnd::Finished(_)), "{end:?}");
    assert_eq!(log(out).len(), 8);
    std::fs::remove_dir_all(&d).ok();
}

/// A cache folder holding someone else's `files.json`: refused before anything is written
/// over it.
#[test]
fn a_cache_folder_of_other_files_is_refused() {
    let d = temp("cache-other");
    let p = images(&d);
    let mine = d.join("mycache");
    std::fs::create_dir_all(&mine).unwrap();
    std::fs::write(mine.join("files.json"), br#"{"my": 1}"#).unwrap();
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("[data]\n", "[data]\ncache_dir = \"mycache\"\n");
    std::fs::write(&p, text).unwrap();
    let cfg = TrainConfig::from_file(&p).unwrap();
    let e = Trainer::new(cfg).err().unwrap().to_string();
    assert!(
        e.contains("files.json") && e.contains("data.cache_dir"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(mine.join("files.json")).unwrap(),
        br#"{"my": 1}"#
    );
    std::fs::remove_dir_all(&d).ok();
}

/// `--plan` decodes the pixels a cache fill would (a truncated picture passes the header
/// scan); `--workers` checks what every rank would refuse once, before any worker starts;
/// `sample` names the flag whose file is missing before loading anything, and says how far
/// the denoising is.
#[cfg(feature = "cli")]
#[test]
fn the_binaries_check_before_they_start() {
    let d = temp("binaries");
    let p = images(&d);
    let cfg = TrainConfig::from_file(&p).unwrap();
    let pictures = d.join("tiny/images");
    let first = std::fs::read(pictures.join("picture-00.png")).unwrap();
    std::fs::write(pictures.join("cut.png"), &first[..first.len() / 2]).unwrap();
    std::fs::write(pictures.join("cut.txt"), b"half a picture").unwrap();
    let o = train_bin(&[p.as_os_str(), "--plan".as_ref()], None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("cut.png") && err.contains("decode"), "{err}");
    assert!(!cfg.train.output_dir.exists(), "--plan wrote");
    std::fs::remove_file(pictures.join("cut.png")).unwrap();
    std::fs::remove_file(pictures.join("cut.txt")).unwrap();

    // 1000 CPU workers on 20 samples: one error, from the launcher, no worker started.
    let o = train_bin(
        &[p.as_os_str(), "--workers".as_ref(), "1000".as_ref()],
        None,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(
        err.lines().filter(|l| l.starts_with("error")).count(),
        1,
        "{err}"
    );
    assert!(
        err.contains("x 1000 ranks") && !err.contains("rank 0"),
        "{err}"
    );
    assert!(!cfg.train.output_dir.exists());

    let tiny = d.join("tiny");
    let sample = |extra: &[&str]| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_sample"));
        c.current_dir(&tiny).args([
            "--arch",
            "flux",
            "--model",
            "flux-tiny.safetensors",
            "--text-encoder",
            "text_encoder",
            "--text-encoder",
            "text_encoder_2",
            "--tokenizer",
            "tokenizer",
            "--tokenizer",
            "tokenizer_2",
            "--vae",
            "vae",
            "--dtype",
            "f32",
            "--device",
            "cpu",
            "--t5-tokens",
            "32",
            "--steps",
            "3",
            "--width",
            "32",
            "--height",
            "32",
            "--prompt",
            "a red circle",
        ]);
        c.args(extra).output().unwrap()
    };
    let o = sample(&[
        "--lora",
        "no-such.safetensors",
        "--latents",
        "nor-this.safetensors",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--lora no-such.safetensors") && err.contains("--latents nor-this"),
        "{err}"
    );
    // A file that is not a LoRA: the error names the flag.
    let o = sample(&["--lora", "vae/config.json", "--out", "s1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("error: --lora vae/config.json: "), "{err}");
    let o = sample(&["--out", "s2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    for s in 1..=3 {
        assert!(err.contains(&format!("image 1/1: step {s}/3")), "{err}");
    }
    // Where the run's time went: each phase, what they leave out, the whole.
    let time = err
        .lines()
        .find(|l| l.starts_with("time: "))
        .unwrap_or_else(|| panic!("no time line: {err}"));
    for phase in [
        "text encoders",
        "autoencoder and references",
        "loading the model",
        "denoising",
        "decoding and writing",
    ] {
        assert!(time.contains(&format!("{phase} ")), "{phase}: {time}");
    }
    assert!(time.ends_with(" s in all"), "{time}");
    std::fs::remove_dir_all(&d).ok();
}

/// The timeline sums each phase's spans in the order first met, and the line says what the
/// phases leave of the whole.
#[test]
fn the_timeline_sums_spans_by_phase() {
    use flame::progress::{time_line, Timeline};
    let mut t = Timeline::new();
    t.add("caching", 2.0);
    t.add("training steps", 10.0);
    t.add("caching", 0.5);
    t.end("validation"); // no span open: nothing counted
    t.begin();
    t.end("validation");
    let phases = t.phases().to_vec();
    assert_eq!(phases.len(), 3, "{phases:?}");
    assert_eq!(phases[0], ("caching", 2.5));
    assert_eq!(phases[1], ("training steps", 10.0));
    assert_eq!(phases[2].0, "validation");
    assert!(phases[2].1 >= 0.0 && phases[2].1 < 5.0, "{phases:?}");
    let line = time_line(
        &[("caching", 2.5), ("training steps", 10.0)],
        20.0,
        "the rest",
    );
    assert_eq!(
        line,
        "time: caching 2.5 s, training steps 10.0 s; the rest 7.5 s; 20.0 s in all"
    );
    assert_eq!(
        time_line(&[], 1.5, "start-up"),
        "time: no phase timed; start-up 1.5 s; 1.5 s in all"
    );
}

#[test]
fn the_run_records_the_machine_it_planned_with() {
    use flame::memory::Machine;
    use flame::train::rundir::{Manifest, RunDir};
    let out = temp("machine");
    std::fs::create_dir_all(&out).unwrap();
    let mut m = Manifest::new(vec![("train.steps", "3".into())]);
    // A machine that decoded nothing has an infinite decode rate: it must read back too.
    let machine = Machine {
        upload_gib_per_s: 12.25,
        wire_decode_gib_per_s: [f64::INFINITY, 300.0, 150.0],
        ..Machine::REFERENCE
    };
    m.machine = Some(machine);
    RunDir::new(&out).create(&m).unwrap();
    assert_eq!(RunDir::new(&out).manifest().unwrap(), Some(m.clone()));
    assert_eq!(flame::train::recorded_machine(&out).unwrap(), Some(machine));
    // A run without one (no budget, a plan by hand) records none.
    let bare = temp("machine-none");
    std::fs::create_dir_all(&bare).unwrap();
    m.machine = None;
    RunDir::new(&bare).create(&m).unwrap();
    assert_eq!(flame::train::recorded_machine(&bare).unwrap(), None);
    let absent = temp("machine-absent");
    assert_eq!(flame::train::recorded_machine(&absent).unwrap(), None);
    // A machine that is not one is a damaged manifest, named.
    let path = out.join("run.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let broken = text.replace("upload_gib_per_s = 12.25", "upload_gib_per_s = -1.0");
    assert_ne!(text, broken);
    std::fs::write(&path, broken).unwrap();
    let err = flame::train::recorded_machine(&out)
        .unwrap_err()
        .to_string();
    assert!(err.contains("machine") && err.contains("run.json"), "{err}");
    for d in [out, bare, absent] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn the_run_records_the_share_it_planned_its_phases_within() {
    use flame::train::rundir::{Manifest, RunDir};
    let out = temp("share");
    std::fs::create_dir_all(&out).unwrap();
    let mut m = Manifest::new(vec![("train.steps", "3".into())]);
    m.share_at_start = Some(11 << 30);
    RunDir::new(&out).create(&m).unwrap();
    assert_eq!(RunDir::new(&out).manifest().unwrap(), Some(m.clone()));
    assert_eq!(
        flame::train::recorded_share_at_start(&out).unwrap(),
        Some(11 << 30)
    );
    // A run on the CPU records none; a folder without a run has none.
    let bare = temp("share-none");
    std::fs::create_dir_all(&bare).unwrap();
    m.share_at_start = None;
    RunDir::new(&bare).create(&m).unwrap();
    assert_eq!(flame::train::recorded_share_at_start(&bare).unwrap(), None);
    let absent = temp("share-absent");
    assert_eq!(
        flame::train::recorded_share_at_start(&absent).unwrap(),
        None
    );
    // A share that is not a byte count is a damaged manifest, named.
    let path = out.join("run.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let broken = text.replace(&format!("{}", 11u64 << 30), "-3");
    assert_ne!(text, broken);
    std::fs::write(&path, broken).unwrap();
    let err = flame::train::recorded_share_at_start(&out)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("share_at_start") && err.contains("run.json"),
        "{err}"
    );
    for d in [out, bare, absent] {
        std::fs::remove_dir_all(d).unwrap();
    }
}
