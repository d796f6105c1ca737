//! A run's output folder and the files in it, written so that a kill or a full disk at any
//! moment leaves a state `--resume` can continue from.
//!
//! The folder holds `run.json` (the run's id and the config values a resume must share),
//! `loss.jsonl` (one line per step), `checkpoint-<step>/` folders (adapter, optimizer state,
//! `state.json` with each file's size and hash) and, at the end, `lora.safetensors`. A run
//! owns its folder: a new run refuses one holding another run's files unless told to
//! overwrite them, and rotation only deletes the current run's older checkpoints.
//!
//! Every file is written to a temporary name, synced and renamed into place (a checkpoint
//! folder as a whole), so a reader sees the old version or the new one, never a mix.

use crate::{Error, Result};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The manifest's file name.
pub const MANIFEST: &str = "run.json";
/// The loss log's file name.
pub const LOG: &str = "loss.jsonl";
/// The final adapter's file name.
pub const FINAL: &str = "lora.safetensors";
/// The folder of sample images (`[sample]`).
pub const SAMPLES: &str = "samples";
/// The loss plot's file name.
pub const PLOT: &str = "loss.png";
/// The prefix of checkpoint folders (`checkpoint-0000100`).
pub const CHECKPOINT_PREFIX: &str = "checkpoint-";

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Flushes a folder's entries (a rename inside it) to disk; best effort where folders cannot
/// be opened (not on Unix).
fn sync_dir(dir: &Path) {
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, synced, renamed over.
/// The file gets the usual permissions (0666 less the umask). On error nothing is left
/// behind and the old file, if any, is intact.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(bytes).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        crate::fault::point(&format!("write:{name}")).map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io(path))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    } else {
        sync_dir(dir);
    }
    result
}

/// A 64-bit hash of a file's bytes (8-byte words, multiply-rotate mixing): detects a
/// truncated or damaged checkpoint file, not tampering.
pub fn file_hash(path: &Path) -> Result<u64> {
    use std::io::Read;
    const P: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    let len = f.metadata().map_err(io(path))?.len();
    let mut h = len ^ P;
    // Read in blocks of whole words; only the file's last block may end with a partial one.
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let mut n = 0;
        while n < buf.len() {
            match f.read(&mut buf[n..]).map_err(io(path))? {
                0 => break,
                k => n += k,
            }
        }
        let mut words = buf[..n].chunks_exact(8);
        for c in &mut words {
            let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            h = (h ^ w).wrapping_mul(P).rotate_left(29);
        }
        for &b in words.remainder() {
            h = (h ^ b as u64).wrapping_mul(P).rotate_left(29);
        }
        if n < buf.len() {
            return Ok(h ^ (h >> 32));
        }
    }
}

/// What `run.json` records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    /// A random id, also written into each of the run's checkpoints.
    pub run_id: String,
    /// The config values a resume must share, by key (TOML text).
    pub keys: BTreeMap<String, String>,
}

impl Manifest {
    /// A new run's manifest.
    pub fn new(keys: Vec<(&'static str, String)>) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let id = crate::nn::mix64(nanos ^ ((std::process::id() as u64) << 32));
        Manifest {
            run_id: format!("{id:016x}"),
            keys: keys.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        }
    }

    /// The keys whose values differ from `keys`, with (recorded, now).
    pub fn differences(&self, keys: &[(&'static str, String)]) -> Vec<(String, String, String)> {
        let mut v = vec![];
        for (k, now) in keys {
            let was = self
                .keys
                .get(*k)
                .cloned()
                .unwrap_or_else(|| "(absent)".into());
            if &was != now {
                v.push((k.to_string(), was, now.clone()));
            }
        }
        for (k, was) in &self.keys {
            if !keys.iter().any(|(n, _)| n == k) {
                v.push((k.clone(), was.clone(), "(absent)".into()));
            }
        }
        v
    }

    fn to_json(&self) -> String {
        serde_json::json!({ "run_id": self.run_id, "config": self.keys }).to_string()
    }

    fn from_json(path: &Path, text: &str) -> Result<Self> {
        let damaged = |msg: &str| Error::Checkpoint {
            path: path.to_path_buf(),
            msg: format!("damaged run manifest: {msg}"),
        };
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| damaged(&e.to_string()))?;
        let run_id = v["run_id"].as_str().ok_or_else(|| damaged("no run_id"))?;
        let keys = v["config"]
            .as_object()
            .ok_or_else(|| damaged("no config"))?
            .iter()
            .map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
            .collect::<Option<BTreeMap<_, _>>>()
            .ok_or_else(|| damaged("config values must be strings"))?;
        Ok(Manifest {
            run_id: run_id.to_string(),
            keys,
        })
    }
}

/// What a checkpoint's `state.json` records.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointState {
    /// Steps done.
    pub step: usize,
    /// The seed of the run.
    pub seed: u64,
    /// The run that wrote it.
    pub run_id: String,
    /// Skipped (non-finite) steps in a row up to `step`.
    pub skipped_in_row: usize,
    /// The dynamic loss scale and its clean-step count after `step`, when the run scales.
    pub loss_scale: Option<(f64, usize)>,
    /// Each file with its size and hash.
    pub files: BTreeMap<String, (u64, u64)>,
}

impl CheckpointState {
    /// Records `names` in `dir` with their sizes and hashes.
    pub fn new(
        dir: &Path,
        step: usize,
        seed: u64,
        run_id: &str,
        (skipped_in_row, loss_scale): (usize, Option<(f64, usize)>),
        names: &[&str],
    ) -> Result<Self> {
        let mut files = BTreeMap::new();
        for n in names {
            let p = dir.join(n);
            let len = std::fs::metadata(&p).map_err(io(&p))?.len();
            files.insert(n.to_string(), (len, file_hash(&p)?));
        }
        Ok(CheckpointState {
            step,
            seed,
            run_id: run_id.to_string(),
            skipped_in_row,
            loss_scale,
            files,
        })
    }

    fn to_json(&self) -> String {
        let files: BTreeMap<&String, serde_json::Value> = self
            .files
            .iter()
            .map(|(k, (len, h))| {
                (
                    k,
                    serde_json::json!({ "bytes": len, "hash": format!("{h:016x}") }),
                )
            })
            .collect();
        let mut v = serde_json::json!({
            "step": self.step,
            "seed": self.seed,
            "run_id": self.run_id,
            "skipped_in_row": self.skipped_in_row,
            "files": files,
        });
        if let Some((scale, clean)) = self.loss_scale {
            // Shortest round-trip form: the scale resumes exactly.
            v["loss_scale"] = serde_json::json!(scale.to_string());
            v["loss_scale_clean_steps"] = serde_json::json!(clean);
        }
        v.to_string()
    }

    /// Reads `dir/state.json` and checks every file it lists against its size and hash.
    pub fn read_verified(dir: &Path) -> Result<Self> {
        let path = dir.join("state.json");
        let damaged = |msg: String| Error::Checkpoint {
            path: dir.to_path_buf(),
            msg,
        };
        let text = std::fs::read_to_string(&path).map_err(io(&path))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| damaged(format!("state.json: {e}")))?;
        let field = |k: &str| {
            v[k].as_u64()
                .ok_or_else(|| damaged(format!("state.json has no {k}")))
        };
        let mut files = BTreeMap::new();
        let listed = v["files"]
            .as_object()
            .ok_or_else(|| damaged("state.json lists no files".into()))?;
        for (name, f) in listed {
            let len = f["bytes"].as_u64();
            let hash = f["hash"]
                .as_str()
                .and_then(|h| u64::from_str_radix(h, 16).ok());
            let (Some(len), Some(hash)) = (len, hash) else {
                return Err(damaged(format!("state.json: bad entry for {name}")));
            };
            let p = dir.join(name);
            let actual = std::fs::metadata(&p).map(|m| m.len()).ok();
            if actual != Some(len) {
                return Err(damaged(format!(
                    "{name} has {} bytes, {len} were written",
                    actual.map_or("no".into(), |a| a.to_string())
                )));
            }
            if file_hash(&p)? != hash {
                return Err(damaged(format!(
                    "{name} differs from what was written (hash)"
                )));
            }
            files.insert(name.clone(), (len, hash));
        }
        let loss_scale = match v.get("loss_scale") {
            None => None,
            Some(ls) => {
                let scale = ls.as_str().and_then(|x| x.parse::<f64>().ok());
                let clean = v["loss_scale_clean_steps"].as_u64();
                match (scale, clean) {
                    (Some(s), Some(c)) if s.is_finite() && s > 0.0 => Some((s, c as usize)),
                    _ => return Err(damaged("state.json: a bad loss_scale entry".into())),
                }
            }
        };
        Ok(CheckpointState {
            step: field("step")? as usize,
            seed: field("seed")?,
            run_id: v["run_id"].as_str().unwrap_or_default().to_string(),
            skipped_in_row: v["skipped_in_row"].as_u64().unwrap_or(0) as usize,
            loss_scale,
            files,
        })
    }
}

/// A run's output folder.
#[derive(Clone, Debug)]
pub struct RunDir {
    /// The folder.
    pub path: PathBuf,
}

impl RunDir {
    /// The folder at `path` (nothing is read or written yet).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        RunDir { path: path.into() }
    }

    /// `checkpoint-<step>` in this folder.
    pub fn checkpoint_dir(&self, step: usize) -> PathBuf {
        self.path.join(format!("{CHECKPOINT_PREFIX}{step:07}"))
    }

    /// The checkpoint folders, oldest first, with their steps.
    pub fn checkpoints(&self) -> Result<Vec<(usize, PathBuf)>> {
        checkpoints(&self.path)
    }

    /// The manifest, `None` when there is none.
    pub fn manifest(&self) -> Result<Option<Manifest>> {
        let p = self.path.join(MANIFEST);
        match std::fs::read_to_string(&p) {
            Ok(text) => Manifest::from_json(&p, &text).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(Error::Io { path: p, source }),
        }
    }

    /// The run files present (manifest, log, checkpoints, final adapter), by name.
    pub fn run_files(&self) -> Result<Vec<String>> {
        let Ok(entries) = std::fs::read_dir(&self.path) else {
            return Ok(vec![]);
        };
        let mut v: Vec<String> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| {
                n == MANIFEST
                    || n == LOG
                    || n == FINAL
                    || n == SAMPLES
                    || n == PLOT
                    || n.starts_with(CHECKPOINT_PREFIX)
                    || n.starts_with(".tmp-checkpoint-")
            })
            .collect();
        v.sort();
        Ok(v)
    }

    /// Deletes the run files (and nothing else): the manifest first, so a kill midway
    /// leaves a folder that is still refused without `--overwrite`.
    pub fn clear(&self) -> Result<()> {
        let mut names = self.run_files()?;
        names.sort_by_key(|n| n != MANIFEST);
        for (i, n) in names.into_iter().enumerate() {
            if i == 1 {
                crate::fault::point("clear").map_err(io(&self.path))?;
            }
            let p = self.path.join(&n);
            if p.is_dir() {
                std::fs::remove_dir_all(&p).map_err(io(&p))?;
            } else {
                std::fs::remove_file(&p).map_err(io(&p))?;
            }
        }
        sync_dir(&self.path);
        Ok(())
    }

    /// Creates the folder and writes the manifest.
    pub fn create(&self, manifest: &Manifest) -> Result<()> {
        std::fs::create_dir_all(&self.path).map_err(io(&self.path))?;
        write_atomic(&self.path.join(MANIFEST), manifest.to_json().as_bytes())
    }

    /// Writes a checkpoint: `write` fills a temporary folder, whose files are then hashed
    /// into `state.json`; the folder is renamed into place. Then deletes this run's
    /// checkpoints older than this one beyond the newest `keep`.
    pub fn save_checkpoint(
        &self,
        step: usize,
        state: (u64, &str, usize, Option<(f64, usize)>),
        keep: usize,
        write: impl FnOnce(&Path) -> Result<Vec<&'static str>>,
    ) -> Result<PathBuf> {
        let (seed, run_id, skipped, loss_scale) = state;
        let dir = self.checkpoint_dir(step);
        let tmp = self.path.join(format!(".tmp-checkpoint-{step:07}"));
        let result = (|| {
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
            }
            std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
            let names = write(&tmp)?;
            for n in &names {
                let p = tmp.join(n);
                std::fs::File::open(&p)
                    .and_then(|f| f.sync_all())
                    .map_err(io(&p))?;
            }
            let st = CheckpointState::new(&tmp, step, seed, run_id, (skipped, loss_scale), &names)?;
            write_atomic(&tmp.join("state.json"), st.to_json().as_bytes())?;
            crate::fault::point(&format!("checkpoint:{step}")).map_err(io(&tmp))?;
            if dir.exists() {
                std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
            }
            std::fs::rename(&tmp, &dir).map_err(io(&dir))?;
            sync_dir(&self.path);
            Ok(())
        })();
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        result?;
        // Rotation: only this run's checkpoints, only those older than the one just written.
        let ours: Vec<(usize, PathBuf)> = self
            .checkpoints()?
            .into_iter()
            .filter(|(s, p)| *s < step && run_id_of(p).as_deref() == Some(run_id))
            .collect();
        let surplus = (ours.len() + 1).saturating_sub(keep.max(1));
        if surplus > 0 {
            crate::fault::point("rotation").map_err(io(&self.path))?;
        }
        for (_, old) in ours.into_iter().take(surplus) {
            std::fs::remove_dir_all(&old).map_err(io(&old))?;
        }
        Ok(dir)
    }
}

/// The run id a checkpoint's state.json records (unverified: a cheap read for rotation).
fn run_id_of(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("state.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["run_id"].as_str().map(str::to_string)
}

/// The checkpoint folders in `out`, oldest first, with their steps.
pub fn checkpoints(out: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let Ok(entries) = std::fs::read_dir(out) else {
        return Ok(vec![]);
    };
    let mut v: Vec<(usize, PathBuf)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?.to_string();
            let step = name.strip_prefix(CHECKPOINT_PREFIX)?.parse().ok()?;
            Some((step, p))
        })
        .collect();
    v.sort();
    Ok(v)
}

/// The loss log's lines with their steps (missing file: none; a torn last line is skipped).
pub fn read_log(path: &Path) -> Result<Vec<(usize, String)>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(source) => {
            return Err(Error::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    Ok(text
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            Some((v["step"].as_u64()? as usize, l.to_string()))
        })
        .collect())
}
