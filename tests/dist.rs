//! Data-parallel training over the CPU process group (TCP on loopback, one thread per rank
//! here, one process per rank through the `train` binary): the collectives, the bucketed
//! gradient sums, the tiny model trained on 2 and 4 ranks against one process with the same
//! global batch, exact resume, and a failing rank named instead of a hang.
#![cfg(feature = "cpu-ref")]

use flame::dist::{shard, GradReducer, Launch, Pending, ProcessGroup, TcpGroup};
use flame::train::rundir::read_log;
use flame::train::{Placement, Prepare, RunEnd, RunOptions, TrainConfig, Trainer};
use flame::{DType, Device, Grads, Tensor};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(120);

/// Runs `f(rank, group)` on `world` threads, each a rank of one TCP group.
fn ranks<T: Send>(
    world: usize,
    f: impl Fn(usize, Arc<dyn ProcessGroup>) -> T + Sync,
) -> Vec<flame::Result<T>> {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let mut first = Some(l);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let l = if r == 0 { first.take() } else { None };
                let f = &f;
                s.spawn(move || -> flame::Result<T> {
                    let g: Arc<dyn ProcessGroup> = match l {
                        Some(l) => Arc::new(TcpGroup::host(l, world, TIMEOUT)?),
                        None => Arc::new(TcpGroup::connect("127.0.0.1", port, r, world, TIMEOUT)?),
                    };
                    Ok(f(r, g))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn the_cpu_group_sums_broadcasts_and_agrees_bit_for_bit() {
    let out = ranks(3, |r, g| {
        assert_eq!((g.rank(), g.world()), (r, 3));
        let mut v = [r as f64, 1.0, 0.1 * (r + 1) as f64];
        g.sum_host(&mut v).unwrap();
        let t = Tensor::from_vec(vec![r as f32 + 0.5; 7], 7, &Device::Cpu).unwrap();
        let u = Tensor::from_vec(vec![(r * 10) as f32; 4], (2, 2), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        g.all_reduce_sum(&[&t, &u]).unwrap().wait().unwrap();
        let b = Tensor::from_vec(vec![r as f32 + 1.0; 3], 3, &Device::Cpu).unwrap();
        g.broadcast(&[&b]).unwrap();
        g.barrier().unwrap();
        (
            v,
            t.to_vec::<f32>().unwrap(),
            u.to_vec_f64().unwrap(),
            b.to_vec::<f32>().unwrap(),
        )
    });
    let out: Vec<_> = out.into_iter().map(|o| o.unwrap()).collect();
    for o in &out {
        assert_eq!(o.0, out[0].0, "every rank has the same bits");
        assert_eq!(o.0[..2], [3.0, 3.0]);
        assert_eq!(o.1, vec![0.5 + 1.5 + 2.5; 7]);
        assert_eq!(o.2, vec![30.0; 4]);
        assert_eq!(o.3, vec![1.0; 3], "rank 0's values");
    }
}

#[test]
fn shards_cover_a_batch_once_in_order() {
    for n in 0..12 {
        for world in 1..6 {
            let parts: Vec<_> = (0..world).map(|r| shard(n, r, world)).collect();
            let joined: Vec<usize> = parts.iter().flat_map(|p| p.clone()).collect();
            assert_eq!(joined, (0..n).collect::<Vec<_>>(), "n {n} world {world}");
            let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
            assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
        }
    }
}

#[test]
fn launch_reads_torchrun_variables_and_names_bad_ones() {
    let vars = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    assert_eq!(Launch::from_vars(vars(&[])).unwrap(), None);
    assert_eq!(
        Launch::from_vars(vars(&[("WORLD_SIZE", "1")])).unwrap(),
        None
    );
    let l = Launch::from_vars(vars(&[
        ("WORLD_SIZE", "4"),
        ("RANK", "3"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "10.0.0.2"),
        ("MASTER_PORT", "29511"),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!((l.rank, l.world, l.local_rank), (3, 4, 1));
    // No count of this machine's processes given: every rank is taken to be here.
    assert_eq!(l.local_world, 4);
    assert_eq!(
        (l.addr.as_str(), l.port, l.gpu().unwrap()),
        ("10.0.0.2", 29511, 1)
    );
    let g = Launch::from_vars(vars(&[
        ("WORLD_SIZE", "2"),
        ("RANK", "1"),
        ("FLAME_GPUS", "2,5"),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!((g.gpu().unwrap(), g.local_world), (5, 2));
    // torchrun's count of this machine's processes, across two machines.
    let t = Launch::from_vars(vars(&[
        ("WORLD_SIZE", "8"),
        ("RANK", "5"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!(t.local_world, 4);
    for (bad, name) in [
        (&[("WORLD_SIZE", "two")][..], "WORLD_SIZE"),
        (&[("WORLD_SIZE", "2")][..], "RANK"),
        (&[("WORLD_SIZE", "2"), ("RANK", "2")][..], "RANK"),
        (
            &[("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_PORT", "x")][..],
            "MASTER_PORT",
        ),
        (
            &[
                ("WORLD_SIZE", "2"),
                ("RANK", "0"),
                ("LOCAL_WORLD_SIZE", "-1"),
            ][..],
            "LOCAL_WORLD_SIZE",
        ),
    ] {
        let e = Launch::from_vars(vars(bad)).unwrap_err().to_string();
        assert!(e.contains(name), "{e}");
    }
}

/// The TCP group behaving as NCCL does: a tensor sum is queued when started and done when
/// waited on, so the reducer starts buckets during the backward.
struct Queued(Arc<dyn ProcessGroup>);

impl ProcessGroup for Queued {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world(&self) -> usize {
        self.0.world()
    }
    fn all_reduce_sum(&self, tensors: &[&Tensor]) -> flame::Result<Pending> {
        let (g, ts) = (
            self.0.clone(),
            tensors.iter().map(|t| (*t).clone()).collect::<Vec<_>>(),
        );
        Ok(Pending::deferred(move || {
            g.all_reduce_sum(&ts.iter().collect::<Vec<_>>())?.wait()
        }))
    }
    fn asynchronous(&self) -> bool {
        true
    }
    fn broadcast(&self, tensors: &[&Tensor]) -> flame::Result<()> {
        self.0.broadcast(tensors)
    }
    fn sum_host(&self, values: &mut [f64]) -> flame::Result<()> {
        self.0.sum_host(values)
    }
    fn fail(&self, why: &str) {
        self.0.fail(why)
    }
    fn watch(&self, on_abort: flame::dist::OnAbort) -> flame::Result<()> {
        self.0.watch(on_abort)
    }
    fn describe(&self) -> String {
        format!("{} (queued)", self.0.describe())
    }
}

/// A rank with no samples adds zeros; a gradient that grows after its bucket started is
/// summed again; the buckets never mix parameters up: with the blocking TCP group (all in
/// `finish`) and with a queued one (buckets started in the backward, as with NCCL).
#[test]
fn the_reducer_sums_final_gradients_in_buckets() {
    reducer_case(false);
    reducer_case(true);
}

fn reducer_case(queued: bool) {
    let out = ranks(2, |r, g| {
        let g: Arc<dyn ProcessGroup> = match queued {
            true => Arc::new(Queued(g)),
            false => g,
        };
        let dev = Device::Cpu;
        let params: Vec<Tensor> = (0..5)
            .map(|i| {
                Tensor::randn((3, i + 2), DType::F32, &dev, i as u64)
                    .unwrap()
                    .requires_grad_()
                    .unwrap()
            })
            .collect();
        // 64-byte buckets: several buckets of one or two parameters.
        let red = GradReducer::new(g, params.clone(), 64);
        assert!(red.buckets() >= 3);
        let mut grads = Grads::new();
        grads.set_hook(Some(red.clone()));
        red.arm().unwrap();
        if r == 0 {
            // Two backward passes: params[4] grows after its bucket may have started.
            let loss = |k: f64| {
                let mut acc = Tensor::zeros((), DType::F32, &dev).unwrap();
                for (i, p) in params.iter().enumerate() {
                    let w = p
                        .sqr()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .affine(k * (i + 1) as f64, 0.0);
                    acc = acc.add(&w.unwrap()).unwrap();
                }
                acc
            };
            loss(1.0).backward_into(&mut grads).unwrap();
            params[4]
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .backward_into(&mut grads)
                .unwrap();
        }
        red.finish(&mut grads).unwrap();
        params
            .iter()
            .map(|p| grads.get(p).unwrap().to_vec::<f32>().unwrap())
            .collect::<Vec<_>>()
    });
    let out: Vec<_> = out.into_iter().map(|o| o.unwrap()).collect();
    assert_eq!(out[0], out[1], "queued {queued}");
    // d/dp of sum_i (i+1) |p_i|^2 + |p_4|^2 = 2 (i+1) p_i (+ 2 p_4).
    for (i, got) in out[0].iter().enumerate() {
        let p = Tensor::randn((3, i + 2), DType::F32, &Device::Cpu, i as u64)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let k = 2.0 * (i + 1) as f32 + if i == 4 { 2.0 } else { 0.0 };
        for (g, p) in got.iter().zip(&p) {
            assert!(
                (g - k * p).abs() <= 1e-5 * (1.0 + (k * p).abs()),
                "param {i}"
            );
        }
    }
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-dist-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tiny example under `dir`: `steps` steps, `batch` samples per rank, checkpoints every
/// 4 steps, the model and data in `shared` (made once).
fn tiny(dir: &Path, shared: &Path, steps: usize, batch: usize, accum: usize) -> TrainConfig {
    let cfg = TrainConfig::from_toml(&tiny_text(dir, shared, steps, batch, accum)).unwrap();
    make_tiny_once(&cfg);
    cfg
}

/// The shared model and samples `cfg` names, as `train --make-tiny` makes them, one test at
/// a time (tests run side by side).
fn make_tiny_once(cfg: &TrainConfig) {
    static MAKE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = MAKE.lock().unwrap_or_else(|e| e.into_inner());
    flame::train::demo::make_tiny(cfg).unwrap();
}

fn tiny_text(dir: &Path, shared: &Path, steps: usize, batch: usize, accum: usize) -> String {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny-encoded.toml");
    let text = std::fs::read_to_string(example)
        .unwrap()
        .replace("steps = 200", &format!("steps = {steps}"))
        .replace(
            "batch_size = 4",
            &format!("batch_size = {batch}\ngrad_accum = {accum}"),
        )
        .replace("save_every = 50", "save_every = 4")
        .replace("device = \"auto\"", "device = \"cpu\"")
        .replace("warmup_steps = 10", "warmup_steps = 2")
        .replace("[adapter]\n", "[adapter]\ndropout = 0.1\n")
        .replace("tiny/", &format!("{}/", shared.display()))
        .replace(
            &format!("{}/out-encoded", shared.display()),
            &dir.join("out").display().to_string(),
        );
    text
}

fn log(cfg: &TrainConfig) -> Vec<serde_json::Value> {
    read_log(&cfg.train.output_dir.join("loss.jsonl"))
        .unwrap()
        .into_iter()
        .map(|(_, l)| serde_json::from_str(&l).unwrap())
        .collect()
}

/// Trains `cfg` on `world` ranks (`queued`: through [`Queued`], so gradient buckets start
/// during the backward).
fn train(cfg: &TrainConfig, world: usize, opts: RunOptions, queued: bool) -> Vec<RunEnd> {
    if world == 1 {
        return vec![Trainer::new(cfg.clone())
            .unwrap()
            .run(&opts, &mut |_| {})
            .unwrap()];
    }
    ranks(world, |_, g| {
        let g: Arc<dyn ProcessGroup> = match queued {
            true => Arc::new(Queued(g)),
            false => g,
        };
        let place = Placement {
            device: Some(Device::Cpu),
            group: Some(g),
            ..Default::default()
        };
        Trainer::open_in(cfg.clone(), Prepare::Encode, place, &mut |_| {})?.run(&opts, &mut |_| {})
    })
    .into_iter()
    .map(|r| r.unwrap().unwrap())
    .collect()
}

/// The loss logs agree to f32 rounding (the ranks' means are summed instead of one mean).
fn close(a: &[serde_json::Value], b: &[serde_json::Value], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x["step"], y["step"]);
        for k in ["loss", "grad_norm", "val_loss"] {
            let (Some(u), Some(v)) = (x[k].as_f64(), y[k].as_f64()) else {
                assert_eq!(
                    x[k].is_null(),
                    y[k].is_null(),
                    "{what}: step {} {k}",
                    x["step"]
                );
                continue;
            };
            assert!(
                (u - v).abs() <= 2e-5 * u.abs().max(v.abs()),
                "{what}: step {} {k}: {u} vs {v}",
                x["step"]
            );
        }
    }
}

#[test]
fn two_and_four_ranks_train_as_one_process_with_the_global_batch_and_resume_exactly() {
    let shared = temp("shared");
    let steps = 8;
    // One process: batches of 4, two micro-batches a step.
    let one = tiny(&temp("one"), &shared, steps, 4, 2);
    train(&one, 1, RunOptions::default(), false);
    let base = log(&one);
    assert_eq!(base.len(), steps);
    // 2 ranks x 2 samples and 4 ranks x 1 sample (buckets started in the backward): the
    // same global batches.
    let two = tiny(&temp("two"), &shared, steps, 2, 2);
    let ends = train(&two, 2, RunOptions::default(), false);
    assert!(
        ends.iter().all(|e| matches!(e, RunEnd::Finished(_))),
        "{ends:?}"
    );
    close(&base, &log(&two), "2 ranks");
    let four = tiny(&temp("four"), &shared, steps, 1, 2);
    train(&four, 4, RunOptions::default(), true);
    close(&base, &log(&four), "4 ranks");

    // 2 ranks stopped after step 6 (checkpoint at 4) and resumed: the same log, bit for bit,
    // and the same adapter.
    let again = tiny(&temp("again"), &shared, steps, 2, 2);
    let stop = RunOptions {
        stop_at: Some(6),
        ..Default::default()
    };
    assert_eq!(train(&again, 2, stop, true), vec![RunEnd::Stopped(6); 2]);
    let resume = RunOptions {
        resume: true,
        ..Default::default()
    };
    train(&again, 2, resume, false);
    assert_eq!(
        log(&again),
        log(&two),
        "a resumed 2-rank run equals the uninterrupted one"
    );
    let load = |c: &TrainConfig| {
        flame::safetensors::load(c.train.output_dir.join("lora.safetensors"), &Device::Cpu).unwrap()
    };
    let (a, b) = (load(&two), load(&again));
    for (k, t) in &a {
        assert_eq!(t.to_vec_f64().unwrap(), b[k].to_vec_f64().unwrap(), "{k}");
    }
    // Resuming on another number of ranks is refused by name.
    let e = Trainer::new(again.clone())
        .unwrap()
        .run(
            &RunOptions {
                resume: true,
                ..Default::default()
            },
            &mut |_| {},
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("ranks"), "{e}");
    for d in [&shared, &one.train.output_dir, &two.train.output_dir] {
        std::fs::remove_dir_all(d).ok();
    }
}

/// A rank that fails mid-run (saying so, or vanishing without a word) makes the others stop
/// with an error naming it, of the kind that says the cause is another rank's
/// (`Error::PeerFailed`: a launcher names the failing rank, not these).
#[test]
fn a_failing_rank_is_named_by_the_others() {
    for says in [true, false] {
        let out = ranks(3, |r, g| {
            g.barrier().unwrap();
            if r == 2 {
                if says {
                    g.fail("out of memory in step 3");
                }
                drop(g);
                return Ok(());
            }
            let mut v = [1.0];
            g.sum_host(&mut v)
        });
        for (r, o) in out.into_iter().enumerate().take(2) {
            let e = o.unwrap().unwrap_err();
            assert!(
                matches!(e, flame::Error::PeerFailed(_)),
                "rank {r}, says {says}: {e:?}"
            );
            let e = e.to_string();
            assert!(
                e.contains("rank 2") || (r > 0 && e.contains("rank 0")),
                "rank {r}: {e}"
            );
        }
    }
}

/// The tiny config (10 steps, `batch` samples a rank, on `device`) written to a fresh
/// folder `name`, with the model and data in `shared`.
#[cfg(feature = "cli")]
fn write_tiny(name: &str, shared: &Path, batch: usize, device: &str) -> (PathBuf, TrainConfig) {
    let d = temp(name);
    let text = tiny_text(&d, shared, 10, batch, 1)
        .replace("device = \"cpu\"", &format!("device = \"{device}\""));
    let p = d.join("train.toml");
    std::fs::write(&p, &text).unwrap();
    let cfg = TrainConfig::from_toml(&text).unwrap();
    make_tiny_once(&cfg);
    (p, cfg)
}

/// The `train` binary (`FLAME_TRAIN_EXE` where the build's path does not exist) on `cfg`
/// with `args`, and `fault` = (FLAME_FAULT, the rank it hits) if given; fails if it hangs.
#[cfg(feature = "cli")]
fn train_bin(cfg: &Path, args: &[&str], fault: Option<(&str, &str)>) -> std::process::Output {
    let exe = std::env::var("FLAME_TRAIN_EXE").unwrap_or(env!("CARGO_BIN_EXE_train").into());
    let mut c = std::process::Command::new(exe);
    c.arg(cfg)
        .args(args)
        .env_remove("FLAME_FAULT")
        .env_remove("WORLD_SIZE");
    if let Some((f, rank)) = fault {
        c.env("FLAME_FAULT", f).env("FLAME_FAULT_RANK", rank);
    }
    let start = std::time::Instant::now();
    let out = c.output().unwrap();
    assert!(start.elapsed().as_secs() < 120, "the run hung");
    out
}

/// The `train` binary with `--workers 2` (one process a rank, TCP on loopback): its log
/// equals one process's with the same global batch; a rank killed mid-run (or failing with
/// an error) stops the run with a message naming it, and `--resume` on 2 workers then
/// reproduces the uninterrupted 2-worker log exactly.
#[cfg(feature = "cli")]
#[test]
fn the_launcher_trains_worker_processes_and_names_a_failing_rank() {
    let shared = temp("bin-shared");
    let write = |name: &str, batch: usize| write_tiny(name, &shared, batch, "cpu");
    let run = train_bin;
    let (one_p, one) = write("bin-one", 4);
    assert!(run(&one_p, &[], None).status.success());
    let (two_p, two) = write("bin-two", 2);
    let out = run(&two_p, &["--workers", "2"], None);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    assert!(err.contains("2 ranks x batch 2"), "{err}");
    close(&log(&one), &log(&two), "2 worker processes");

    for (fault, rank, says) in [
        ("kill:step@7", "1", "rank 1"),
        ("enospc:step@7", "0", "No space left"),
    ] {
        let (p, cfg) = write("bin-fault", 2);
        let out = run(&p, &["--workers", "2"], Some((fault, rank)));
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{fault}: {err}");
        let named = format!("error: rank {rank} (CPU worker) failed");
        assert!(err.contains(says) && err.contains(&named), "{fault}: {err}");
        let out = run(&p, &["--workers", "2", "--resume"], None);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{fault}: {err}");
        assert!(err.contains("resuming after step 4"), "{err}");
        assert_eq!(log(&cfg), log(&two), "{fault}: resumed on 2 workers");
    }
    let out = run(&two_p, &["--workers", "2", "--gpus", "0,1"], None);
    assert!(!out.status.success());
    for d in [&shared, &one.train.output_dir, &two.train.output_dir] {
        std::fs::remove_dir_all(d).ok();
    }
}

/// From images, two worker processes fill the latent and caption caches together, each its
/// share, and then train as one process with the global batch does from a cache it filled
/// alone: the same losses, and every cache entry on disk once.
#[cfg(feature = "cli")]
#[test]
fn worker_processes_cache_their_share_of_the_images_and_train_as_one() {
    let home = temp("images-shared");
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny.toml");
    let base = std::fs::read_to_string(example)
        .unwrap()
        .replace("steps = 200", "steps = 6")
        .replace("warmup_steps = 10", "warmup_steps = 2")
        .replace("device = \"auto\"", "device = \"cpu\"")
        .replace("tiny/", &format!("{}/", home.display()));
    let write = |name: &str, batch: usize| {
        let d = temp(name);
        let text = base
            .replace("batch_size = 4", &format!("batch_size = {batch}"))
            .replace(
                &format!("{}/out", home.display()),
                &d.join("out").display().to_string(),
            );
        let p = d.join("train.toml");
        std::fs::write(&p, &text).unwrap();
        let cfg = TrainConfig::from_toml(&text).unwrap();
        make_tiny_once(&cfg);
        (p, cfg)
    };
    let (one_p, one) = write("images-one", 4);
    let out = train_bin(&one_p, &[], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (two_p, two) = write("images-two", 2);
    let out = train_bin(&two_p, &["--workers", "2"], None);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    assert!(err.contains("captions, rank 0 of 2's share"), "{err}");
    assert!(err.contains("every rank's share done"), "{err}");
    close(&log(&one), &log(&two), "2 workers caching their shares");
    let entries = |cfg: &TrainConfig, sub: &str| {
        let mut v: Vec<String> = std::fs::read_dir(cfg.train.output_dir.join("cache").join(sub))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    for sub in ["latents", "text"] {
        assert_eq!(entries(&one, sub), entries(&two, sub), "{sub}");
    }
    for d in [&home, &one.train.output_dir, &two.train.output_dir] {
        std::fs::remove_dir_all(d).ok();
    }
}

/// A rank that stays alive but stops making progress (stuck in a kernel, a file system, a
/// deadlock: here a thread that sleeps for good at the start of step 3) is found by the
/// watchdog once `FLAME_STALL_TIMEOUT` passes without progress while the other rank waits
/// for it: the message names it and its phase, and every process exits (no hang, non-zero).
#[cfg(feature = "cli")]
#[test]
fn a_stuck_rank_is_named_and_every_process_stops() {
    let shared = temp("stuck-shared");
    for stuck in ["1", "0"] {
        let (p, cfg) = write_tiny(&format!("stuck-{stuck}"), &shared, 2, "cpu");
        let exe = std::env::var("FLAME_TRAIN_EXE").unwrap_or(env!("CARGO_BIN_EXE_train").into());
        let start = std::time::Instant::now();
        let out = std::process::Command::new(exe)
            .arg(&p)
            .args(["--workers", "2"])
            .env_remove("WORLD_SIZE")
            .env("FLAME_FAULT", "hang:step@3")
            .env("FLAME_FAULT_RANK", stuck)
            .env("FLAME_STALL_TIMEOUT", "2")
            .output()
            .unwrap();
        let took = start.elapsed().as_secs();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "rank {stuck} stuck: {err}");
        assert!(took < 60, "rank {stuck} stuck: the run took {took} s");
        let named = format!("rank {stuck} (last: training step 3) made no progress for 2 s");
        assert!(err.contains(&named), "rank {stuck} stuck: {err}");
        assert!(err.contains("stopped the run on every rank"), "{err}");
        std::fs::remove_dir_all(&cfg.train.output_dir).ok();
    }
    std::fs::remove_dir_all(&shared).ok();
}

/// On a machine with two GPUs, through NCCL: `train --gpus 0,1` with
/// 2 samples per GPU logs what `--gpus 0` with 4 logs (f32, to rounding); a rank killed at
/// step 7 stops the run naming it, and `--resume` reproduces the uninterrupted 2-GPU log
/// bit for bit. `FLAME_TRAIN_EXE` names the `train` executable where the build's path
/// does not exist.
#[cfg(all(feature = "cuda", feature = "cli"))]
#[test]
#[ignore = "needs two GPUs"]
fn two_gpus_over_nccl_train_as_one_and_resume_exactly() {
    assert!(flame::cuda::device_count().unwrap() >= 2, "needs two GPUs");
    let shared = temp("gpu-shared");
    let write = |name: &str, batch: usize| write_tiny(name, &shared, batch, "cuda");
    let run = train_bin;
    let (one_p, one) = write("gpu-one", 4);
    let out = run(&one_p, &["--gpus", "0"], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (two_p, two) = write("gpu-two", 2);
    let out = run(&two_p, &["--gpus", "0,1"], None);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    eprintln!("{err}");
    assert!(out.status.success(), "{err}");
    assert!(err.contains("NCCL"), "{err}");
    close(&log(&one), &log(&two), "2 GPUs over NCCL");
    let (p, cfg) = write("gpu-fault", 2);
    let out = run(&p, &["--gpus", "0,1"], Some(("kill:step@7", "1")));
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(err.contains("error: rank 1 (GPU 1) failed"), "{err}");
    let out = run(&p, &["--gpus", "0,1", "--resume"], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(log(&cfg), log(&two), "resumed on 2 GPUs");
    for d in [&shared, &one.train.output_dir, &two.train.output_dir] {
        std::fs::remove_dir_all(d).ok();
    }
}

/// On one GPU: an NCCL group of one rank sums (the identity) and broadcasts whole tensors
/// and offset views in place in every float dtype, leaving the rest of their buffers alone;
/// and the tiny model trained through that group (bucket copies, the collectives stream,
/// its events, the sums put back as views) logs exactly what it logs without one.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU and libnccl.so"]
fn an_nccl_group_of_one_gpu_is_the_identity_and_trains_the_same() {
    let dev = Device::cuda(0).unwrap();
    let Device::Cuda(c) = &dev else {
        unreachable!()
    };
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let g: Arc<dyn ProcessGroup> =
        Arc::new(flame::dist::NcclGroup::new(TcpGroup::host(l, 1, TIMEOUT).unwrap(), c).unwrap());
    assert!(g.asynchronous());
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let whole = Tensor::randn(12_347, dtype, &dev, 3).unwrap();
        let base = Tensor::randn(1001, dtype, &dev, 4).unwrap();
        let view = base.narrow(0, 17, 555).unwrap();
        let (w0, b0) = (whole.to_vec_f64().unwrap(), base.to_vec_f64().unwrap());
        g.all_reduce_sum(&[&whole, &view]).unwrap().wait().unwrap();
        g.broadcast(&[&whole]).unwrap();
        c.synchronize().unwrap();
        assert_eq!(whole.to_vec_f64().unwrap(), w0, "{dtype:?}");
        assert_eq!(base.to_vec_f64().unwrap(), b0, "{dtype:?}");
    }
    let shared = temp("nccl1-shared");
    let text =
        |d: &Path| tiny_text(d, &shared, 6, 4, 2).replace("device = \"cpu\"", "device = \"cuda\"");
    let plain = TrainConfig::from_toml(&text(&temp("nccl1-plain"))).unwrap();
    let grouped = TrainConfig::from_toml(&text(&temp("nccl1-group"))).unwrap();
    make_tiny_once(&plain);
    Trainer::new(plain.clone())
        .unwrap()
        .run(&RunOptions::default(), &mut |_| {})
        .unwrap();
    let place = Placement {
        device: Some(dev.clone()),
        group: Some(g),
        ..Default::default()
    };
    Trainer::open_in(grouped.clone(), Prepare::Encode, place, &mut |_| {})
        .unwrap()
        .run(&RunOptions::default(), &mut |_| {})
        .unwrap();
    assert_eq!(log(&plain), log(&grouped));
}

/// `memory.trial_steps` on 2 ranks: both time the same plans (the planner's rivals to its
/// pick, the same on every rank), their steps' sums in step with each other, keep the same
/// plan, and train what 2 ranks train without timing anything, bit for bit. Where the ranks
/// work out different plans to time, none is timed; a rival whose load fails on one rank is
/// left out on both; the run is the same.
#[test]
fn ranks_time_the_same_plans_and_train_nothing_while_timing() {
    use flame::train::Event;
    let shared = temp("trial-shared");
    let steps = 4;
    let with = |dir: &str, trial: usize| {
        let text = tiny_text(&temp(dir), &shared, steps, 2, 1)
            + &format!(
                "\n[memory]\nbudget_gb = 1000.0\ntrial_steps = {trial}\ntrial_share = 1e9\n"
            );
        let cfg = TrainConfig::from_toml(&text).unwrap();
        make_tiny_once(&cfg);
        cfg
    };
    // Each rank's notes and kept plan; `differ`: rank 1 drops its rivals; `broken`: one
    // rival, streaming the first block, but on rank 1 a block the model lacks (its load
    // fails there alone; the plan reads the same on both ranks).
    let run = |cfg: &TrainConfig, differ: bool, broken: bool| {
        ranks(2, |rank, g| {
            let place = Placement {
                device: Some(Device::Cpu),
                group: Some(g),
                ..Default::default()
            };
            let mut t = Trainer::open_in(cfg.clone(), Prepare::Encode, place, &mut |_| {})?;
            if differ && rank == 1 {
                t.memory.rivals.clear();
            }
            if broken {
                let (prof, _) = t.memory.sized.clone().unwrap();
                let first = prof.blocks[0].prefix.clone();
                let plan = prof
                    .settle(&flame::memory::Plan {
                        checkpointing: flame::memory::Checkpointing::All,
                        streamed: vec![first],
                        prefetch: 1,
                        ..Default::default()
                    })
                    .unwrap();
                let streamed = match rank {
                    0 => plan.streamed.clone(),
                    _ => vec!["no_such_block".to_string()],
                };
                t.memory.rivals = vec![flame::memory::Planned {
                    peak: prof.peak(&plan),
                    streamed_bytes: prof.streamed_bytes(&plan),
                    slowdown: prof.step_ms(&plan) / prof.resident_ms(),
                    plan: flame::memory::Plan { streamed, ..plan },
                }];
            }
            let mut notes = vec![];
            t.run(&RunOptions::default(), &mut |e| {
                if let Event::Note(n) = e {
                    notes.push(n)
                }
            })?;
            Ok::<_, flame::Error>((notes, t.memory.plan.to_string()))
        })
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect::<Vec<_>>()
    };
    let plain = with("trial-plain", 0);
    run(&plain, false, false);
    let timed = with("trial-timed", 2);
    let out = run(&timed, false, false);
    let timing = |notes: &[String]| -> Vec<String> {
        notes
            .iter()
            .filter(|n| n.starts_with("timing plans: "))
            .cloned()
            .collect()
    };
    let (a, b) = (timing(&out[0].0), timing(&out[1].0));
    assert!(a.len() >= 3, "{a:?}");
    assert_eq!(a.len(), b.len(), "{a:?} {b:?}");
    assert!(a.last().unwrap().contains("kept"), "{a:?}");
    assert_eq!(a.last(), b.last(), "the same plan kept");
    assert_eq!(out[0].1, out[1].1);
    assert_eq!(log(&timed), log(&plain), "timing plans trains nothing");
    // Rank 1 with no rival: no rank times anything.
    let differ = with("trial-differ", 2);
    let out = run(&differ, true, false);
    for (notes, _) in &out {
        assert!(!notes.iter().any(|n| n.contains("ms a step")), "{notes:?}");
    }
    assert!(
        out[0]
            .0
            .iter()
            .any(|n| n.contains("the ranks worked out different plans")),
        "{:?}",
        out[0].0
    );
    assert_eq!(log(&differ), log(&plain));
    // A rival whose load fails on rank 1 alone: left out on both ranks, which go on in step.
    let broken = with("trial-broken", 2);
    let out = run(&broken, false, true);
    let (a, b) = (timing(&out[0].0), timing(&out[1].0));
    assert_eq!(a.len(), 3, "{a:?}");
    assert!(a[1].contains("its load failed on 1 of 2 ranks"), "{a:?}");
    assert!(b[1].contains("not a block"), "{b:?}");
    assert!(
        a[2].contains("kept") && a[2].contains("the planner's pick"),
        "{a:?}"
    );
    assert_eq!(a[2], b[2]);
    assert_eq!(log(&broken), log(&plain));
    std::fs::remove_dir_all(&shared).ok();
}
