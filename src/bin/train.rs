//! `cargo run --release --bin train -- flux.toml`: trains a LoRA as the TOML file says (see
//! examples/flux-tiny.toml and `train --print-config`). `--resume` continues the run in the
//! output folder; `--overwrite` replaces it; `--plan` checks everything and says what would
//! happen, writing nothing.

use argh::FromArgs;
use flame::train::{
    Event, FolderAction, Prepare, RunEnd, RunOptions, StepReport, TrainConfig, Trainer,
};
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::atomic::Ordering;

/// Train a LoRA on Flux, SD3.5 or SDXL from pre-encoded latents and text embeddings.
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
    /// print the version
    #[argh(switch)]
    version: bool,
}

/// Progress on stderr: a bar redrawn in place on a terminal, else a line every
/// `train.log_every` steps. Knows whether the cursor is mid-line, so every other message
/// starts on its own line.
struct Progress {
    tty: bool,
    every: usize,
    mid_line: bool,
    start: std::time::Instant,
    first: Option<usize>,
    device: flame::Device,
}

impl Progress {
    fn line(&mut self, msg: &str) {
        if self.mid_line {
            eprintln!();
            self.mid_line = false;
        }
        eprintln!("{msg}");
    }

    fn step(&mut self, r: &StepReport) {
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
    let args: Args = argh::from_env();
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
        return ExitCode::from(2);
    };
    let mut progress: Option<Progress> = None;
    match run(&args, &path, &mut progress) {
        Ok(code) => code,
        Err(e) => {
            let msg = format!("error: {e}");
            match progress.as_mut() {
                Some(p) => p.line(&msg),
                None => eprintln!("{msg}"),
            }
            ExitCode::FAILURE
        }
    }
}

fn run(
    args: &Args,
    path: &std::path::Path,
    progress: &mut Option<Progress>,
) -> flame::Result<ExitCode> {
    let config = TrainConfig::from_file(path)?;
    let out = config.train.output_dir.clone();
    let every = config.train.log_every;
    let prepare = match args.plan {
        true => Prepare::DryRun,
        false => Prepare::Encode,
    };
    let mut trainer = Trainer::open(config, prepare, &mut |e| {
        if let Event::Note(m) = e {
            eprintln!("{m}");
        }
    })?;
    let opts = RunOptions {
        resume: args.resume,
        overwrite: args.overwrite,
        stop_at: None,
    };
    let p = progress.insert(Progress {
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
        p.line(&format!(
            "plan: {what}; {} steps of {} x {} samples; {}; nothing was written",
            trainer.config.train.steps,
            trainer.config.train.batch_size,
            trainer.config.train.grad_accum,
            trainer.memory.describe(),
        ));
        return Ok(ExitCode::SUCCESS);
    }
    // Ctrl-C, SIGTERM, SIGHUP: finish the current step, save a checkpoint, exit; a second
    // signal exits at once.
    let flag = trainer.interrupt_flag();
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::Relaxed) {
            std::process::exit(130);
        }
        eprintln!("\ninterrupted: saving a checkpoint after this step (again to quit now)");
    })
    .map_err(|e| flame::Error::Io {
        path: "signal handler".into(),
        source: std::io::Error::other(e.to_string()),
    })?;
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
