//! `cargo run --release --bin train -- flux.toml`: trains a LoRA as the TOML file says
//! (see examples/flux-tiny.toml). With --resume, continues from the latest checkpoint in the
//! output folder.

use argh::FromArgs;
use flame::train::{RunEnd, TrainConfig, Trainer};
use std::sync::atomic::Ordering;

/// Train a LoRA on Flux, SD3.5 or SDXL from pre-encoded latents and text embeddings.
#[derive(FromArgs)]
struct Args {
    /// the TOML config
    #[argh(positional)]
    config: std::path::PathBuf,
    /// continue from the latest checkpoint in the output folder
    #[argh(switch)]
    resume: bool,
}

fn main() -> anyhow::Result<()> {
    let args: Args = argh::from_env();
    let config = TrainConfig::from_file(&args.config)?;
    let out = config.train.output_dir.clone();
    let mut trainer = Trainer::new(config)?;
    eprintln!(
        "training {} adapters on {}, output in {}",
        trainer.adapters.layers()?.len(),
        trainer.device(),
        out.display()
    );
    // Ctrl-C: finish the current step, save a checkpoint, exit; a second one exits at once.
    let flag = trainer.interrupt_flag();
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::Relaxed) {
            std::process::exit(130);
        }
        eprintln!("\ninterrupted: saving a checkpoint after this step (Ctrl-C again to quit now)");
    })?;
    match trainer.run(args.resume, None, true)? {
        RunEnd::Interrupted(step) => {
            eprintln!(
                "stopped after step {step}; checkpoint saved in {}; continue with --resume",
                out.display()
            );
            std::process::exit(130);
        }
        _ => eprintln!("done: {}", out.join("lora.safetensors").display()),
    }
    Ok(())
}
