//! Compiles every `cuda/*.cu` to PTX with nvcc, the files in parallel, and embeds it (see
//! `ptx` in `src/backend/cuda/mod.rs`).
//!
//! nvcc is looked up through $NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, then PATH. The target is
//! $FLAME_CUDA_ARCH (default compute_80: PTX that the driver JITs on Ampere, Ada and Hopper);
//! $FLAME_CUDA_SASS (SM numbers, "90" or "86,89,90") embeds those GPUs' machine code beside it.
//! With the `cuda` feature on and no nvcc, the build succeeds with a warning and creating a
//! CUDA device returns an error that says how to get nvcc. A kernel that fails to compile
//! fails the build.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Kernel files compiled a second time for compute_90 (see below).
const HOPPER_VARIANTS: &[&str] = &["attention", "fp8", "group_norm", "norm_bulk"];

/// Kernel files compiled for compute_90a only (wgmma), whatever $FLAME_CUDA_ARCH says: their
/// launchers use them on compute capability 9.0 and fall back to other kernels elsewhere.
const SM90A_ONLY: &[&str] = &["attention_wgmma"];

fn find_nvcc() -> Option<PathBuf> {
    let exe = if cfg!(windows) { "nvcc.exe" } else { "nvcc" };
    if let Some(p) = std::env::var_os("NVCC") {
        return Some(PathBuf::from(p));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            let p = Path::new(&home).join("bin").join(exe);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join(exe))
        .find(|p| p.is_file())
}

fn main() {
    for var in [
        "NVCC",
        "CUDA_HOME",
        "CUDA_PATH",
        "FLAME_CUDA_ARCH",
        "FLAME_CUDA_SASS",
        "PATH",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-changed=build.rs");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let manifest = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    );
    let mut sources: Vec<PathBuf> = std::fs::read_dir(manifest.join("cuda"))
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    sources.retain(|p| p.extension().is_some_and(|e| e == "cu"));
    sources.sort();
    for s in &sources {
        println!("cargo:rerun-if-changed={}", s.display());
    }

    let cuda = std::env::var_os("CARGO_FEATURE_CUDA").is_some();
    let nvcc = if cuda { find_nvcc() } else { None };
    let arch = std::env::var("FLAME_CUDA_ARCH").unwrap_or_else(|_| "compute_80".into());
    let mut entries = String::new();
    let missing = match (&nvcc, cuda) {
        (_, false) => "the crate was built without the `cuda` feature".to_string(),
        (None, true) => {
            println!(
                "cargo:warning=flame: nvcc not found ($NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH); \
                 building without CUDA kernels. Creating a CUDA device will fail until nvcc is installed."
            );
            "nvcc was not found when FLAME was built, so no CUDA kernels were compiled".to_string()
        }
        (Some(nvcc), true) => {
            // Kernel files with Hopper-only paths (`__CUDA_ARCH__ >= 900`) also get a
            // compute_90 module, `<stem>_sm90`, which launchers pick on such GPUs.
            let digits: String = arch.chars().filter(|c| c.is_ascii_digit()).collect();
            let below_90 = digits.parse::<u32>().map_or(true, |v| v < 90);
            let sass = sass_targets();
            let mut jobs = vec![];
            for src in &sources {
                let stem = src
                    .file_stem()
                    .and_then(|s| s.to_str())
                    .expect("utf-8 kernel file name");
                // Each job: the file, its module's name, the virtual architecture and the
                // machine codes to embed beside its PTX (`machine_codes`).
                let mut job = |name: String, virt: &str| {
                    jobs.push((src, name, virt.to_string(), machine_codes(virt, &sass)))
                };
                if SM90A_ONLY.contains(&stem) {
                    job(stem.to_string(), "compute_90a");
                    continue;
                }
                job(stem.to_string(), &arch);
                if HOPPER_VARIANTS.contains(&stem) && below_90 {
                    job(format!("{stem}_sm90"), "compute_90");
                }
            }
            // The jobs run in parallel (cargo's NUM_JOBS of them at most: nvcc is
            // single-threaded and the largest files take tens of seconds), their entries in
            // the jobs' order.
            let workers = std::env::var("NUM_JOBS")
                .ok()
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
                .clamp(1, jobs.len().max(1));
            let next = std::sync::atomic::AtomicUsize::new(0);
            let failures = std::sync::Mutex::new(Vec::<(usize, String)>::new());
            std::thread::scope(|scope| {
                for _ in 0..workers {
                    scope.spawn(|| loop {
                        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((src, stem, arch, codes)) = jobs.get(k) else {
                            break;
                        };
                        let mut cmd = Command::new(nvcc);
                        if codes.is_empty() {
                            cmd.args(["--ptx", "-O3", "-std=c++17", &format!("-arch={arch}")]);
                        } else {
                            // The PTX, for GPUs the list leaves out, and each GPU's code.
                            cmd.args(["--fatbin", "-O3", "-std=c++17", "-gencode"])
                                .arg(format!("arch={arch},code={arch}"));
                            for code in codes {
                                cmd.arg("-gencode").arg(format!("arch={arch},code={code}"));
                            }
                        }
                        let out_file = out_dir.join(image_name(stem, !codes.is_empty()));
                        let failed = match cmd
                            .arg(format!("-I{}", manifest.join("cuda").display()))
                            .arg("-o")
                            .arg(&out_file)
                            .arg(src)
                            .output()
                        {
                            Err(e) => Some(format!("running {} failed: {e}", nvcc.display())),
                            Ok(out) if !out.status.success() => Some(format!(
                                "nvcc failed on {}:\n{}{}",
                                src.display(),
                                String::from_utf8_lossy(&out.stdout),
                                String::from_utf8_lossy(&out.stderr)
                            )),
                            Ok(_) => None,
                        };
                        if let Some(msg) = failed {
                            failures
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push((k, msg));
                        }
                    });
                }
            });
            let mut failures = failures.into_inner().unwrap_or_else(|e| e.into_inner());
            failures.sort();
            if let Some((_, msg)) = failures.first() {
                panic!("flame: {msg}");
            }
            for (_, stem, _, codes) in &jobs {
                let fatbin = !codes.is_empty();
                let file = out_dir.join(image_name(stem, fatbin)).display().to_string();
                entries.push_str(&if fatbin {
                    format!("    ({stem:?}, Image::Fatbin(include_bytes!({file:?}))),\n")
                } else {
                    format!("    ({stem:?}, Image::Ptx(include_str!({file:?}))),\n")
                });
            }
            String::new()
        }
    };
    let generated = format!(
        "/// (module name, image) for every kernel file, compiled for {arch:?}: a static, one\n\
         /// copy of the images in the binary (a const's bytes are laid out again where\n\
         /// each codegen unit reads it).\n\
         pub static MODULES: &[(&str, Image)] = &[\n{entries}];\n\
         /// Why no kernels are embedded (empty when they are).\n\
         pub const MISSING: &str = {missing:?};\n\
         /// The virtual architecture of the main modules.\n\
         pub const ARCH: &str = {arch:?};\n"
    );
    std::fs::write(out_dir.join("ptx.rs"), generated).expect("write OUT_DIR/ptx.rs");
}

/// The GPUs whose machine code `$FLAME_CUDA_SASS` asks to embed beside the PTX: SM numbers,
/// comma-separated ("90" for H100 and H200, "86,89,90" for RTX 30x0, RTX 40x0 and Hopper).
/// Empty (the default): PTX alone, which the driver compiles at a machine's first run.
fn sass_targets() -> Vec<u32> {
    let list = std::env::var("FLAME_CUDA_SASS").unwrap_or_default();
    let mut v: Vec<u32> = list
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.trim_start_matches("sm_")
                .parse()
                .unwrap_or_else(|_| panic!("flame: FLAME_CUDA_SASS holds {t:?}, not an SM number"))
        })
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The machine codes to embed for a module compiled for the virtual architecture `arch`:
/// `sm_N` for each listed GPU that PTX for `arch` runs on (N at least its number; an
/// architecture-specific target, `compute_90a`, only on its own GPU, as `sm_90a`).
fn machine_codes(arch: &str, sass: &[u32]) -> Vec<String> {
    let digits: String = arch.chars().filter(|c| c.is_ascii_digit()).collect();
    let Ok(v) = digits.parse::<u32>() else {
        return vec![];
    };
    let specific = arch.ends_with('a');
    sass.iter()
        .filter(|&&n| if specific { n == v } else { n >= v })
        .map(|&n| format!("sm_{n}{}", if specific { "a" } else { "" }))
        .collect()
}

/// The file a module's image is written to: its PTX, or the fat binary of its PTX and
/// machine code.
fn image_name(stem: &str, fatbin: bool) -> String {
    format!("{stem}.{}", if fatbin { "fatbin" } else { "ptx" })
}
