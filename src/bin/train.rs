//! `cargo run --release --bin train -- flux.toml`: trains a LoRA as the TOML file says (see
//! examples/flux-tiny.toml and `train --print-config`). `--resume` continues the run in the
//! output folder; `--overwrite` replaces it; `--plan` checks everything and says what would
//! happen, writing nothing; `--make-tiny` makes the tiny demo's stand-in files.
//!
//! `train init --model PATH --images DIR` writes a commented config for that model and those
//! images (`flame::train::init`), which `train --plan` checks and `train` runs as it is.
//!
//! Exit status: 0 when the run did what was asked, 1 when it failed, 2 for a usage error
//! (an unknown flag, no config), 130 when stopped by a signal.
//!
//! Several GPUs: `--gpus 0,1` (or `train.gpus`) starts one worker process per GPU and waits
//! for them; a process started with torchrun's variables (`WORLD_SIZE`, `RANK`, ...) is one
//! such worker, wherever it runs (see docs/TRAINING.md, "Several GPUs").

use argh::FromArgs;
use flame::dist::{free_port, AbortCause, Launch, ProcessGroup};
use flame::train::config::{DeviceChoice, Gpus};
use flame::train::{
    Event, FolderAction, Placement, Prepare, RunEnd, RunOptions, StepReport, TrainConfig, Trainer,
};
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Train a LoRA (or LoKr, LoHa, DoRA) on Flux, SD3.5, SDXL, FLUX.2 klein or Z-Image from a
/// folder of images with captions (or pre-encoded samples), as a TOML config says. `train init
/// --model PATH --images DIR` writes such a config (see train init --help).
#[derive(FromArgs)]
#[argh(help_triggers("-h", "--help"))]
struct Args {
    /// the TOML config
    #[argh(positional)]
    config: Option<std::path::PathBuf>,
    /// continue the run in the output folder from its newest intact checkpoint
    #[argh(switch)]
    resume: bool,
    /// delete an earlier run's files in the output folder (checkpoints, log, LoRA) first
    #[argh(switch)]
    overwrite: bool,
    /// load and check everything, print what the run would do, write nothing
    #[argh(switch)]
    plan: bool,
    /// print every config key with its type, default and meaning (Markdown)
    #[argh(switch)]
    print_config: bool,
    /// data-parallel training on these GPUs, one process each: "0,1" or "all" (overrides
    /// train.gpus)
    #[argh(option)]
    gpus: Option<String>,
    /// data-parallel training in this many processes on the CPU (train.device = "cpu"): the
    /// multi-GPU path without GPUs
    #[argh(option)]
    workers: Option<usize>,
    /// make the tiny demo's stand-ins (a random tiny Flux, text encoders, autoencoder and
    /// generated pictures, or pre-encoded samples) at the paths the config names that do not
    /// exist, then exit: for examples/flux-tiny*.toml
    #[argh(switch)]
    make_tiny: bool,
    /// print the version
    #[argh(switch)]
    version: bool,
}

use flame::cli::{failure, parse_args, parse_from, INTERRUPTED, USAGE};

/// Write a commented config for a model and a folder of images: the model's family and
/// files found by their keys, the buckets from the images' sizes, the budget from the GPU's
/// free memory and the memory plan it implies, sample prompts from the captions.
#[derive(FromArgs)]
#[argh(help_triggers("-h", "--help"))]
struct InitArgs {
    /// the model: a single .safetensors or .gguf file, a diffusers folder, a Hugging Face
    /// cache folder or snapshot, or a ComfyUI `models/` folder (required)
    #[argh(option)]
    model: Option<std::path::PathBuf>,
    /// the folder of images (png, jpg, webp), each with a .txt caption beside it (required)
    #[argh(option)]
    images: Option<std::path::PathBuf>,
    /// gibibytes of GPU memory the run may hold (default: the GPU's free memory; none on
    /// the CPU)
    #[argh(option)]
    budget: Option<f64>,
    /// optimizer steps (default 2000)
    #[argh(option)]
    steps: Option<usize>,
    /// the family, where the model path holds several: flux, sd3, sdxl, flux2 or zimage
    #[argh(option)]
    arch: Option<String>,
    /// the config file to write (default train.toml)
    #[argh(option, default = "std::path::PathBuf::from(\"train.toml\")")]
    out: std::path::PathBuf,
    /// replace the file at --out if there is one
    #[argh(switch)]
    force: bool,
}

/// `train init ...`: writes the config, says what it found and how to go on.
fn init(rest: &[&str]) -> ExitCode {
    let args: InitArgs = match parse_from("train init", rest) {
        Ok(a) => a,
        Err(code) => return code,
    };
    let (Some(model), Some(images)) = (args.model, args.images) else {
        return flame::cli::usage("train init", "--model and --images are required");
    };
    let opts = flame::train::init::InitOptions {
        model,
        arch: args.arch,
        images,
        budget_gb: args.budget,
        steps: args.steps,
        out: args.out,
        force: args.force,
    };
    match flame::train::init::init(&opts, &mut |n| eprintln!("{n}")) {
        Ok(w) => {
            for line in &w.lines {
                eprintln!("{line}");
            }
            eprintln!(
                "wrote {}: check it with `train --plan {0}`, run it with `train {0}`",
                w.path.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            let (code, msg) = failure(&e);
            eprintln!("{msg}");
            code
        }
    }
}

/// Progress on stderr: a bar redrawn in place on a terminal, else a line every
/// `train.log_every` steps. Knows whether the cursor is mid-line, so every other message
/// starts on its own line.
struct Progress {
    /// Another rank's process: errors only.
    quiet: bool,
    tty: bool,
    every: usize,
    mid_line: bool,
    start: std::time::Instant,
    first: Option<usize>,
    device: flame::Device,
}

impl Progress {
    fn line(&mut self, msg: &str) {
        if self.quiet {
            return;
        }
        if self.mid_line {
            eprintln!();
            self.mid_line = false;
        }
        eprintln!("{msg}");
    }

    fn step(&mut self, r: &StepReport) {
        if self.quiet {
            return;
        }
        let first = *self.first.get_or_insert(r.step - 1);
        let its = (r.step - first) as f64 / self.start.elapsed().as_secs_f64().max(1e-9);
        let mem = flame::train::trainer::gpu_memory(&self.device);
        let skipped = r
            .skipped
            .as_ref()
            .map(|w| format!(" | SKIPPED: {w}"))
            .unwrap_or_default();
        let text = format!(
            "step {}/{} | loss {:.5} | lr {:.2e} | {its:.2} it/s{mem}{skipped}",
            r.step, r.steps, r.loss, r.lr
        );
        if self.tty {
            let done = r.step * 24 / r.steps.max(1);
            let bar = format!("{}{}", "#".repeat(done), ".".repeat(24 - done));
            eprint!("\r[{bar}] {text}   ");
            self.mid_line = true;
            if r.skipped.is_some() {
                self.line("");
            }
        } else if r.skipped.is_some()
            || r.step == r.steps
            || (self.every > 0 && r.step % self.every == 0)
        {
            self.line(&text);
        }
    }
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.first().map(String::as_str) == Some("init") {
        let rest: Vec<&str> = argv[1..].iter().map(String::as_str).collect();
        return init(&rest);
    }
    let args: Args = match parse_args() {
        Ok(a) => a,
        Err(code) => return code,
    };
    if args.version {
        println!("train (flame) {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    if args.print_config {
        print!("{}", TrainConfig::reference_markdown());
        return ExitCode::SUCCESS;
    }
    let Some(path) = args.config.clone() else {
        eprintln!("error: no config file given (see train --help)");
        return ExitCode::from(USAGE);
    };
    if let Some(Err(msg)) = args.gpus.as_deref().map(Gpus::parse) {
        return flame::cli::usage("train", &format!("--gpus: {msg}"));
    }
    if args.workers.is_some() && args.gpus.is_some() {
        return flame::cli::usage("train", "--workers and --gpus exclude each other");
    }
    if args.resume && args.overwrite {
        eprintln!("error: --resume and --overwrite exclude each other (see train --help)");
        return ExitCode::from(USAGE);
    }
    if args.make_tiny {
        return make_tiny(&path);
    }
    // A worker of a data-parallel run: started by `--gpus` below, by torchrun or by srun.
    match Launch::from_env() {
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
        Ok(Some(launch)) => return worker(&args, &path, launch),
        Ok(None) => {}
    }
    let mut progress: Option<Progress> = None;
    let place = match placement(&args, &path) {
        Ok(Start::Alone(place)) => *place,
        Ok(Start::Workers(n, gpus)) => return launch(&args, &path, n, gpus),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(&args, &path, &mut progress, place, None) {
        Ok(code) => code,
        Err(e) => {
            let (code, msg) = failure(&e);
            match progress.as_mut() {
                Some(p) => p.line(&msg),
                None => eprintln!("{msg}"),
            }
            code
        }
    }
}

/// `--make-tiny`: the tiny demo's stand-ins at the paths the config names and lacks.
fn make_tiny(path: &std::path::Path) -> ExitCode {
    let home = path.parent().unwrap_or(std::path::Path::new("."));
    let made = read_config(path).and_then(|c| flame::train::demo::make_tiny_in(&c, Some(home)));
    match made {
        Ok(made) if made.is_empty() => {
            eprintln!("nothing to make: every path the config names exists");
            ExitCode::SUCCESS
        }
        Ok(made) => {
            for p in made {
                eprintln!("made {}", p.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What the flags ask of the output folder.
fn run_options(args: &Args) -> RunOptions {
    RunOptions {
        resume: args.resume,
        overwrite: args.overwrite,
        stop_at: None,
    }
}

/// The config at `path`, with the planner's switches of the environment (`FLAME_PLANNER`)
/// applied over it.
fn read_config(path: &std::path::Path) -> flame::Result<TrainConfig> {
    let mut config = TrainConfig::from_file(path)?;
    config.planner = config.planner.with_env()?;
    Ok(config)
}

/// How a run starts: in this process (on the one GPU `--gpus` names, or as the config
/// says), or as `n` workers (on these GPUs, or on the CPU).
enum Start {
    Alone(Box<Placement>),
    Workers(usize, Option<Vec<usize>>),
}

fn placement(args: &Args, path: &std::path::Path) -> flame::Result<Start> {
    let config = read_config(path)?;
    let gpus = match &args.gpus {
        Some(g) => Gpus::parse(g).map_err(|msg| flame::Error::Config { path: None, msg })?,
        None => config.train.gpus.clone(),
    };
    let workers = args.workers.unwrap_or(1);
    if gpus == Gpus::List(vec![]) {
        if workers > 1 && config.train.device != DeviceChoice::Cpu {
            return Err(flame::Error::Config {
                path: None,
                msg: "--workers runs CPU processes (train.device = \"cpu\"); for GPUs use \
                      --gpus or train.gpus"
                    .into(),
            });
        }
        return Ok(match workers {
            0 | 1 => Start::Alone(Box::default()),
            n => Start::Workers(n, None),
        });
    }
    if args.workers.is_some() {
        return Err(flame::Error::Config {
            path: None,
            msg: "--workers and --gpus (or train.gpus) exclude each other".into(),
        });
    }
    let list = gpus
        .resolve(gpu_count()?)
        .map_err(|msg| flame::Error::Config {
            path: None,
            msg: format!("--gpus / train.gpus: {msg}"),
        })?;
    Ok(match list.len() {
        0 => Start::Alone(Box::default()),
        1 => Start::Alone(Box::new(Placement {
            device: Some(gpu(list[0])?),
            ..Default::default()
        })),
        n => Start::Workers(n, Some(list)),
    })
}

#[cfg(feature = "cuda")]
fn gpu_count() -> flame::Result<usize> {
    flame::cuda::device_count()
}

#[cfg(not(feature = "cuda"))]
fn gpu_count() -> flame::Result<usize> {
    Err(flame::Error::CudaUnavailable(
        "a build without the `cuda` feature".into(),
    ))
}

#[cfg(feature = "cuda")]
fn gpu(i: usize) -> flame::Result<flame::Device> {
    flame::Device::cuda(i)
}

#[cfg(not(feature = "cuda"))]
fn gpu(_: usize) -> flame::Result<flame::Device> {
    Err(flame::Error::CudaUnavailable(
        "a build without the `cuda` feature".into(),
    ))
}

#[cfg(feature = "cpu-ref")]
fn cpu() -> flame::Result<flame::Device> {
    Ok(flame::Device::Cpu)
}

#[cfg(not(feature = "cpu-ref"))]
fn cpu() -> flame::Result<flame::Device> {
    Err(flame::Error::NoBackend("training on the CPU"))
}

/// Sends `sig` to a worker (the workers run in their own process group, so a Ctrl-C at the
/// terminal reaches them once, through here).
fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .stderr(std::process::Stdio::null())
        .status();
}

/// Set in the environment of the workers `--gpus` / `--workers` start.
const LAUNCHED: &str = "FLAME_LAUNCHED";

/// The exit code of a worker stopped because another rank failed.
const STOPPED_BY_PEER: i32 = 3;

/// The exit code of a worker whose watchdog judged the run stuck (it printed why).
const STALLED: i32 = 4;

/// Ends the process at once with `code`, from the watchdog's thread: no exit handlers run
/// (the CUDA driver's would wait for a collective in flight that will never finish), and the
/// driver frees the device with the process.
fn leave(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stderr().flush();
    // SAFETY: _exit ends the process; nothing of this process runs after it.
    unsafe { libc::_exit(code) }
}

/// Starts `n` workers of this run (on `gpus`, or on the CPU), forwards Ctrl-C / SIGTERM to
/// them, and waits: when one fails, the others are stopped (their watchdogs stop them; the
/// ones still running after 30 s are killed) and the failure is reported by rank.
fn launch(args: &Args, path: &std::path::Path, n: usize, gpus: Option<Vec<usize>>) -> ExitCode {
    // What every rank would refuse is said once, before any worker starts.
    let opts = run_options(args);
    let checked = read_config(path).and_then(|config| flame::train::preflight(&config, n, &opts));
    if let Err(e) = checked {
        let (code, msg) = failure(&e);
        eprintln!("{msg}");
        return code;
    }
    let started = (|| -> flame::Result<Vec<std::process::Child>> {
        let exe = std::env::current_exe().map_err(|source| flame::Error::Io {
            path: "the train executable".into(),
            source,
        })?;
        let port = free_port()?;
        let mut children: Vec<std::process::Child> = vec![];
        for rank in 0..n {
            let mut c = std::process::Command::new(&exe);
            c.arg(path);
            for (on, flag) in [
                (args.resume, "--resume"),
                (args.overwrite, "--overwrite"),
                (args.plan, "--plan"),
            ] {
                if on {
                    c.arg(flag);
                }
            }
            c.env("WORLD_SIZE", n.to_string())
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env(LAUNCHED, "1");
            match &gpus {
                Some(g) => {
                    let list: Vec<String> = g.iter().map(|x| x.to_string()).collect();
                    c.env("FLAME_GPUS", list.join(","));
                }
                None => {
                    c.env_remove("FLAME_GPUS");
                }
            }
            #[cfg(unix)]
            {
                use std::os::unix::process::CommandExt;
                c.process_group(0);
            }
            match c.spawn() {
                Ok(ch) => children.push(ch),
                Err(source) => {
                    for ch in &mut children {
                        let _ = ch.kill();
                    }
                    return Err(flame::Error::Io {
                        path: exe.clone(),
                        source,
                    });
                }
            }
        }
        Ok(children)
    })();
    let mut children = match started {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: starting the workers: {e}");
            return ExitCode::FAILURE;
        }
    };
    let where_ = |rank: usize| match &gpus {
        Some(g) => format!("rank {rank} (GPU {})", g[rank]),
        None => format!("rank {rank} (CPU worker)"),
    };
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    let signals = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    {
        let (pids, signals) = (pids.clone(), signals.clone());
        let _ = ctrlc::set_handler(move || {
            // The first signal asks every worker to checkpoint and stop; a second one stops
            // them at once.
            let sig = match signals.fetch_add(1, Ordering::Relaxed) {
                0 => "-INT",
                _ => "-KILL",
            };
            for &p in &pids {
                signal(p, sig);
            }
        });
    }
    let mut status: Vec<Option<std::process::ExitStatus>> = vec![None; n];
    let mut failed: Option<(usize, std::process::ExitStatus)> = None;
    let mut deadline: Option<std::time::Instant> = None;
    while status.iter().any(|s| s.is_none()) {
        for (r, ch) in children.iter_mut().enumerate() {
            if status[r].is_some() {
                continue;
            }
            if let Ok(Some(st)) = ch.try_wait() {
                status[r] = Some(st);
                let clean = st.success() || st.code() == Some(130);
                // The rank that failed first, not one its failure stopped.
                let cause = st.code() != Some(STOPPED_BY_PEER);
                let replace = match failed {
                    None => true,
                    Some((_, f)) => cause && f.code() == Some(STOPPED_BY_PEER),
                };
                if !clean && replace {
                    failed = Some((r, st));
                    deadline = Some(std::time::Instant::now() + std::time::Duration::from_secs(30));
                }
            }
        }
        if deadline.is_some_and(|d| std::time::Instant::now() > d) {
            for (r, ch) in children.iter_mut().enumerate() {
                if status[r].is_none() {
                    let _ = ch.kill();
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    if let Some((r, st)) = failed {
        match st.code() == Some(STALLED) {
            true => eprintln!(
                "error: the watchdog of {} stopped the run on every rank (why: above)",
                where_(r)
            ),
            false => eprintln!(
                "error: {} failed ({st}); the run stopped on every rank",
                where_(r)
            ),
        }
        return ExitCode::FAILURE;
    }
    if status.iter().any(|s| s.and_then(|s| s.code()) == Some(130)) {
        return ExitCode::from(130);
    }
    ExitCode::SUCCESS
}

/// One rank of a data-parallel run: joins the group, starts the watchdog (another rank's
/// failure stops this process with a message naming it), trains; on an error it tells the
/// others before exiting. Only rank 0 prints progress.
fn worker(args: &Args, path: &std::path::Path, launch: Launch) -> ExitCode {
    let rank = launch.rank;
    let joined = (|| -> flame::Result<(flame::Device, Arc<dyn ProcessGroup>)> {
        let config = read_config(path)?;
        let device = match config.train.device {
            DeviceChoice::Cpu => cpu()?,
            DeviceChoice::Auto | DeviceChoice::Cuda => gpu(launch.gpu()?)?,
        };
        let group = launch.join(&device)?;
        // Under this binary's launcher, which names the rank that failed, a rank stopped by
        // another's failure exits quietly; started otherwise (torchrun), it says why.
        let launched = std::env::var_os(LAUNCHED).is_some();
        group.watch(Arc::new(move |msg: &str, cause: AbortCause| {
            if cause == AbortCause::Stalled {
                // This process judged the run stuck: it says why, whoever started it.
                eprintln!("error: {msg}");
                leave(STALLED);
            }
            if !launched {
                eprintln!("rank {rank}: stopping: {msg}");
            }
            leave(STOPPED_BY_PEER);
        }))?;
        Ok((device, group))
    })();
    let (device, group) = match joined {
        Ok(j) => j,
        Err(e) => {
            eprintln!("rank {rank}: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut progress: Option<Progress> = None;
    let place = Placement {
        device: Some(device),
        group: Some(group.clone()),
        interrupt: None,
        machine: None,
        share_at_start: None,
    };
    match run(args, path, &mut progress, place, Some(rank)) {
        Ok(code) => code,
        Err(e) => {
            // This process's watchdog judged the run stuck and told the others, whose
            // leaving this thread saw first: the watchdog exits with its verdict.
            if flame::progress::stopping() {
                std::thread::sleep(std::time::Duration::from_secs(10));
                leave(STALLED);
            }
            let msg = format!("rank {rank}: {}", failure(&e).1);
            group.fail(&e.to_string());
            if let Some(p) = progress.as_mut() {
                p.quiet = false;
                p.line(&msg);
            } else {
                eprintln!("{msg}");
            }
            // Stopped by another rank's failure (seen in a collective before the watchdog
            // saw it): the launcher names that rank, not this one.
            match e {
                flame::Error::PeerFailed(_) => ExitCode::from(STOPPED_BY_PEER as u8),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

/// Trains in this process on `place`; `rank` is this process's rank in a data-parallel run
/// (only rank 0 prints).
fn run(
    args: &Args,
    path: &std::path::Path,
    progress: &mut Option<Progress>,
    place: Placement,
    rank: Option<usize>,
) -> flame::Result<ExitCode> {
    let started = std::time::Instant::now();
    let quiet = rank.is_some_and(|r| r > 0);
    let config = read_config(path)?;
    if !quiet {
        for note in &config.notes {
            eprintln!("note: {note}");
        }
    }
    let out = config.train.output_dir.clone();
    let every = config.train.log_every;
    let prepare = match args.plan {
        true => Prepare::DryRun,
        false => Prepare::Encode,
    };
    let world = place.group.as_ref().map(|g| g.describe());
    let ranks = place.group.as_ref().map_or(1, |g| g.world());
    let opts = run_options(args);
    // The paths and the output folder first: a missing one, or an occupied folder, is
    // refused before any data is cached.
    if !quiet {
        config.validate()?;
        config.check_paths()?;
        flame::train::plan_folder(&config, ranks, &opts)?;
    }
    // Ctrl-C, SIGTERM, SIGHUP: stop caching at once, or finish the current step, save a
    // checkpoint and exit; a second signal exits at once.
    let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if !args.plan {
        let f = flag.clone();
        ctrlc::set_handler(move || {
            if f.swap(true, Ordering::Relaxed) {
                std::process::exit(INTERRUPTED as i32);
            }
            eprintln!("\ninterrupted: stopping at the next safe point (again to quit now)");
        })
        .map_err(|e| flame::Error::Io {
            path: "signal handler".into(),
            source: std::io::Error::other(e.to_string()),
        })?;
    }
    // A resumed run plans with the machine it recorded, so it chooses the plan it started
    // with (a folder with no readable record plans with this machine).
    let machine = match args.resume {
        true => flame::train::recorded_machine(&out).ok().flatten(),
        false => None,
    };
    // And within no more memory than it planned its caching and samples in without a budget.
    let share_at_start = match args.resume {
        true => flame::train::recorded_share_at_start(&out).ok().flatten(),
        false => None,
    };
    let place = Placement {
        interrupt: Some(flag.clone()),
        machine,
        share_at_start,
        ..place
    };
    let mut trainer = Trainer::open_in(config, prepare, place, &mut |e| {
        if let (Event::Note(m), false) = (e, quiet) {
            eprintln!("{m}");
        }
    })?;
    if flag.load(Ordering::Relaxed) {
        return Err(flame::Error::Interrupted(
            "while loading the model (nothing of the run was written)".into(),
        ));
    }

    let p = progress.insert(Progress {
        quiet,
        tty: std::io::stderr().is_terminal(),
        every,
        mid_line: false,
        start: std::time::Instant::now(),
        first: None,
        device: trainer.device().clone(),
    });
    let adapters = trainer.adapters.layers()?;
    let adapter_params: usize = trainer
        .adapters
        .params()?
        .iter()
        .map(|(_, t)| t.elem_count())
        .sum();
    p.line(&format!(
        "{} ({}) on {}: {} adapters ({:.2} M parameters), {}, output in {}",
        trainer.config.model.arch,
        trainer.config.model.path.display(),
        trainer.device(),
        adapters.len(),
        adapter_params as f64 / 1e6,
        trainer.data().describe(),
        out.display()
    ));
    p.line(&trainer.memory.describe());
    if let (Some(w), Some(g)) = (&world, trainer.group()) {
        p.line(&format!(
            "data-parallel: {w}; {} ranks x batch {} x {} micro-batches = {} samples a step",
            g.world(),
            trainer.config.train.batch_size,
            trainer.config.train.grad_accum,
            g.world() * trainer.config.train.batch_size * trainer.config.train.grad_accum
        ));
    }
    if args.plan {
        let what = match &trainer.plan(&opts)? {
            FolderAction::New => "start a new run".to_string(),
            FolderAction::Overwrite(files) => {
                format!(
                    "delete the earlier run's {} and start a new run",
                    files.join(", ")
                )
            }
            FolderAction::Resume(0, _) => "resume from step 0 (no checkpoint yet)".into(),
            FolderAction::Resume(s, dir) => {
                format!("resume after step {s} from {}", dir.display())
            }
            FolderAction::AlreadyFinished(s) => {
                format!(
                    "nothing: the run finished at step {s} (the final LoRA is written if missing)"
                )
            }
        };
        if let Some(t) = trainer.memory.peak_terms() {
            p.line(&format!("the step's predicted peak: {t}"));
        }
        if let Some(r) = trainer
            .memory
            .rivals_line(trainer.config.memory.trial_steps)
        {
            p.line(&r);
        }
        p.line("phases:");
        for ph in trainer.phase_plans() {
            p.line(&format!("  {}", ph.describe()));
        }
        p.line(&format!(
            "plan: {what}; {} steps of {} x {} samples; nothing was written",
            trainer.config.train.steps,
            trainer.config.train.batch_size,
            trainer.config.train.grad_accum,
        ));
        return Ok(ExitCode::SUCCESS);
    }
    let end = trainer.run(&opts, &mut |e| match e {
        Event::Note(m) => p.line(&m),
        Event::Step(r) => p.step(&r),
        Event::Validation { step, loss } => {
            p.line(&format!("step {step}: validation loss {loss:.5}"))
        }
        Event::Samples(paths) => {
            let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
            p.line(&format!("samples: {}", names.join(", ")))
        }
        Event::Saved(_) => {}
    })?;
    for line in trainer.memory_lines() {
        p.line(&line);
    }
    p.line(&flame::progress::time_line(
        &trainer.phase_seconds(),
        started.elapsed().as_secs_f64(),
        "start-up, planning and the final writes",
    ));
    if let Ok(Some(r)) = trainer.stream_report() {
        p.line(&format!("streamed blocks: {}", r.host_summary()));
    }
    // The driver compiles the kernels' PTX for this GPU at a machine's first run (tens of
    // seconds), then reads them from its disk cache: say what it took.
    if let Some((n, secs)) = trainer.device().kernel_loads() {
        p.line(&format!(
            "kernels: {n} modules loaded in {secs:.1} s (compiled for this GPU on a machine's first run, cached by the driver after)"
        ));
    }
    match end {
        RunEnd::Interrupted(step, dir) => {
            p.line(&format!(
                "stopped after step {step}; checkpoint saved in {}; continue with --resume",
                dir.display()
            ));
            Ok(ExitCode::from(130))
        }
        RunEnd::Finished(fin) => {
            p.line(&format!("done: {}", fin.display()));
            Ok(ExitCode::SUCCESS)
        }
        RunEnd::Stopped(step) => {
            p.line(&format!("stopped after step {step}"));
            Ok(ExitCode::SUCCESS)
        }
    }
}
