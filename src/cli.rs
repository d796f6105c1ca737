//! What the `train` and `sample` binaries share: one command-line convention. `-h` /
//! `--help` print the usage on stdout and exit 0; a usage error (an unknown flag, a missing
//! argument) names `--help` on stderr and exits 2; a failed run prints one `error:` line
//! (with what to do next where something can be done) and exits 1; a run stopped by a
//! signal exits 130.

use std::process::ExitCode;

/// The usage-error exit status.
pub const USAGE: u8 = 2;
/// The exit status of a run stopped by a signal.
pub const INTERRUPTED: u8 = 130;

/// The arguments of this process, or the exit for `--help` (0) and usage errors (2).
pub fn parse_args<A: argh::FromArgs>() -> Result<A, ExitCode> {
    let all: Vec<String> = std::env::args().collect();
    let name = all
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .map_or("flame".into(), |n| n.to_string_lossy().into_owned());
    let rest: Vec<&str> = all.iter().skip(1).map(String::as_str).collect();
    parse_from(&name, &rest)
}

/// The arguments `rest` of the command `name` (a binary, or a binary and its subcommand:
/// "train init"), as [`parse_args`].
pub fn parse_from<A: argh::FromArgs>(name: &str, rest: &[&str]) -> Result<A, ExitCode> {
    match A::from_args(&[name], rest) {
        Ok(a) => Ok(a),
        Err(argh::EarlyExit { output, status }) => match status {
            Ok(()) => {
                print!("{output}");
                Err(ExitCode::SUCCESS)
            }
            Err(()) => {
                eprint!("error: {output}");
                eprintln!("(see {name} --help)");
                Err(ExitCode::from(USAGE))
            }
        },
    }
}

/// A usage error: `msg` and the pointer to `--help` on stderr, exit 2.
pub fn usage(name: &str, msg: &str) -> ExitCode {
    eprintln!("error: {msg} (see {name} --help)");
    ExitCode::from(USAGE)
}

/// What to do next after `e`, where something can be done.
pub fn next_step(e: &crate::Error) -> Option<&'static str> {
    if let crate::Error::Context { error, .. } = e {
        return next_step(error);
    }
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(x) = cur {
        if let Some(io) = x.downcast_ref::<std::io::Error>() {
            // ENOSPC on Linux and macOS.
            if io.raw_os_error() == Some(28) {
                return Some(
                    "the disk is full: free space on it, then continue with --resume (the \
                     last checkpoint and everything before it are intact)",
                );
            }
        }
        cur = x.source();
    }
    match e {
        crate::Error::HostMemory { .. } => Some(
            "the host has not that much memory: lower the image size or resolution, decode \
             in tiles (--vae-tile, encoders.vae_tile), or run on a GPU",
        ),
        crate::Error::OutOfMemory { .. } | crate::Error::PlanExceeded { .. } => Some(
            "after changing what the message says, run again (a training run: with --resume; \
             everything up to its last checkpoint is saved)",
        ),
        _ => None,
    }
}

/// The exit status and the message of a failed run.
pub fn failure(e: &crate::Error) -> (ExitCode, String) {
    let mut msg = format!("error: {e}");
    if let Some(next) = next_step(e) {
        msg.push_str(&format!("\n  next: {next}"));
    }
    let code = match e {
        crate::Error::Interrupted(_) => ExitCode::from(INTERRUPTED),
        crate::Error::Context { error, .. } => return (failure(error).0, msg),
        _ => ExitCode::FAILURE,
    };
    (code, msg)
}
