//! A run's output folder and the files in it, written so that a kill or a full disk at any
//! moment leaves a state `--resume` can continue from.
//!
//! The folder holds `run.json` (the run's id and the config values a resume must share),
//! `loss.jsonl` (one line per step), `checkpoint-<step>/` folders (adapter, optimizer state,
//! `state.json` with each file's size and hash, and the loss log up to its step) and, at
//! the end, `lora.safetensors`. A run owns its folder and nothing else in it: `run.json`
//! records every file the run wrote outside its checkpoints (size, hash, and the step that
//! made it), each checkpoint's `state.json` names its run and lists its files, and only what
//! these records prove the run wrote is ever deleted or replaced ([`RunDir::clear`],
//! rotation). A file at a name the run would write that no record covers (a user's own
//! `loss.png`, another run's checkpoint) makes a new run refuse the folder, naming it.
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
/// The final adapter's moving average (`[ema]`), in the final adapter's layout.
pub const FINAL_EMA: &str = "lora_ema.safetensors";
pub use super::tensorboard::TENSORBOARD;
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
        crate::progress::tick();
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
    let len = std::fs::metadata(path).map_err(io(path))?.len();
    prefix_hash(path, len)
}

/// [`file_hash`] of the first `len` bytes of the file at `path` (the whole hash of a file of
/// `len` bytes); an error when the file is shorter.
pub fn prefix_hash(path: &Path, len: u64) -> Result<u64> {
    use std::io::Read;
    const P: u64 = 0x9E37_79B9_7F4A_7C15;
    let f = std::fs::File::open(path).map_err(io(path))?;
    let mut f = f.take(len);
    let mut h = len ^ P;
    let mut seen = 0u64;
    // Read in blocks of whole words; only the last block may end with a partial one.
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let mut n = 0;
        while n < buf.len() {
            match f.read(&mut buf[n..]).map_err(io(path))? {
                0 => break,
                k => n += k,
            }
        }
        seen += n as u64;
        let mut words = buf[..n].chunks_exact(8);
        for c in &mut words {
            let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            h = (h ^ w).wrapping_mul(P).rotate_left(29);
        }
        for &b in words.remainder() {
            h = (h ^ b as u64).wrapping_mul(P).rotate_left(29);
        }
        if n < buf.len() {
            if seen < len {
                return Err(Error::Io {
                    path: path.to_path_buf(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("{seen} bytes, {len} expected"),
                    ),
                });
            }
            return Ok(h ^ (h >> 32));
        }
    }
}

/// What `run.json` records of a file the run wrote (outside its checkpoints).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Its size in bytes when recorded.
    pub bytes: u64,
    /// [`file_hash`] of those bytes.
    pub hash: u64,
    /// The step whose state it holds (the final adapter, a sample image), if any.
    pub step: Option<usize>,
    /// An append-only file (the loss log): the record covers its first `bytes` bytes.
    pub prefix: bool,
}

impl Record {
    /// Whether the file at `path` is still what was recorded (its recorded prefix, for an
    /// append-only file).
    pub fn matches(&self, path: &Path) -> bool {
        let Ok(meta) = std::fs::metadata(path) else {
            return false;
        };
        let size_ok = match self.prefix {
            true => meta.len() >= self.bytes,
            false => meta.len() == self.bytes,
        };
        meta.is_file() && size_ok && prefix_hash(path, self.bytes).ok() == Some(self.hash)
    }
}

/// What `run.json` records.
#[derive(Clone, Debug, PartialEq)]
pub struct Manifest {
    /// A random id, also written into each of the run's checkpoints.
    pub run_id: String,
    /// The config values a resume must share, by key (TOML text).
    pub keys: BTreeMap<String, String>,
    /// The files the run wrote outside its checkpoints, by path relative to the folder.
    pub files: BTreeMap<String, Record>,
    /// The machine the planner's time model played when the run chose its memory plan
    /// (`memory::measure_machine`): a resume plans with it, so it chooses the same plan.
    /// `None` where no plan was chosen by the time model (no budget, a plan by hand).
    pub machine: Option<crate::memory::Machine>,
    /// The plan the run kept after timing the planner's pick and its rivals
    /// (`memory.trial_steps`), in words (`Plan`'s `Display`): a resume keeps the plan of
    /// those it works out again (from `machine`) that reads the same. `None` where no plans
    /// were timed.
    pub timed_plan: Option<String>,
    /// The allocator's share of the default budget the run planned its phases within
    /// (`memory::split_at_start`, bytes; a GPU): a resume plans within no more, so that it
    /// chooses as the run did where it has as much memory (the encode tile keys the latent
    /// cache). `None` on the CPU.
    pub share_at_start: Option<u64>,
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
            files: BTreeMap::new(),
            machine: None,
            timed_plan: None,
            share_at_start: None,
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
                v.push((
                    k.clone(),
                    was.clone(),
                    "(a key this config does not compare)".into(),
                ));
            }
        }
        v
    }

    fn to_json(&self) -> String {
        let files: BTreeMap<&String, serde_json::Value> = self
            .files
            .iter()
            .map(|(k, r)| {
                let mut v =
                    serde_json::json!({ "bytes": r.bytes, "hash": format!("{:016x}", r.hash) });
                if let Some(s) = r.step {
                    v["step"] = s.into();
                }
                if r.prefix {
                    v["prefix"] = true.into();
                }
                (k, v)
            })
            .collect();
        let mut v =
            serde_json::json!({ "run_id": self.run_id, "config": self.keys, "files": files });
        if let Some(m) = &self.machine {
            // As TOML text, as the machine cache keeps it: JSON has no infinite rate (a
            // machine that decoded nothing). Plain numbers always have a TOML form.
            if let Ok(m) = toml::to_string(m) {
                v["machine"] = m.into();
            }
        }
        if let Some(k) = &self.timed_plan {
            v["timed_plan"] = k.clone().into();
        }
        if let Some(b) = self.share_at_start {
            v["share_at_start"] = b.into();
        }
        v.to_string()
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
        let mut files = BTreeMap::new();
        if let Some(list) = v.get("files") {
            let list = list
                .as_object()
                .ok_or_else(|| damaged("files is not an object"))?;
            for (name, r) in list {
                let bytes = r["bytes"].as_u64();
                let hash = r["hash"]
                    .as_str()
                    .and_then(|h| u64::from_str_radix(h, 16).ok());
                let (Some(bytes), Some(hash)) = (bytes, hash) else {
                    return Err(damaged(&format!("a bad record for {name}")));
                };
                let rec = Record {
                    bytes,
                    hash,
                    step: r["step"].as_u64().map(|s| s as usize),
                    prefix: r["prefix"].as_bool().unwrap_or(false),
                };
                files.insert(name.clone(), rec);
            }
        }
        let machine = match v.get("machine") {
            None => None,
            Some(m) => {
                let text = m.as_str().ok_or_else(|| damaged("machine is not text"))?;
                let m: crate::memory::Machine =
                    toml::from_str(text).map_err(|e| damaged(&format!("machine: {e}")))?;
                m.check().map_err(|e| damaged(&format!("machine: {e}")))?;
                Some(m)
            }
        };
        let timed_plan = match v.get("timed_plan") {
            None => None,
            Some(k) => Some(
                k.as_str()
                    .ok_or_else(|| damaged("timed_plan is not text"))?
                    .to_string(),
            ),
        };
        let share_at_start = match v.get("share_at_start") {
            None => None,
            Some(b) => Some(
                b.as_u64()
                    .ok_or_else(|| damaged("share_at_start is not a byte count"))?,
            ),
        };
        Ok(Manifest {
            run_id: run_id.to_string(),
            keys,
            files,
            machine,
            timed_plan,
            share_at_start,
        })
    }
}

/// The machine the run in `output_dir` recorded in its manifest (`Manifest::machine`), for a
/// resume to plan with ([`crate::train::Placement::machine`]); `None` where there is no run
/// there or it recorded none.
pub fn recorded_machine(output_dir: &Path) -> Result<Option<crate::memory::Machine>> {
    Ok(RunDir::new(output_dir).manifest()?.and_then(|m| m.machine))
}

/// The allocator's share of the default budget the run in `output_dir` recorded in its
/// manifest (`Manifest::share_at_start`), for a resume to plan within
/// ([`crate::train::Placement::share_at_start`]); `None` where there is no run there or it
/// recorded none.
pub fn recorded_share_at_start(output_dir: &Path) -> Result<Option<u64>> {
    Ok(RunDir::new(output_dir)
        .manifest()?
        .and_then(|m| m.share_at_start))
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

    /// What the folder holds, as far as runs go: the manifest, what its records prove the
    /// run wrote, and what sits at a run's names without such proof.
    pub fn survey(&self) -> Result<Survey> {
        let manifest = self.manifest()?;
        let mut sv = Survey {
            manifest: None,
            owned: vec![],
            foreign: vec![],
            checkpoints: vec![],
        };
        let Ok(entries) = std::fs::read_dir(&self.path) else {
            return Ok(sv);
        };
        let ours = |name: &str| {
            let rec = manifest.as_ref().and_then(|m| m.files.get(name));
            rec.is_some_and(|r| r.matches(&self.path.join(name)))
        };
        let mut names: Vec<(String, bool)> = entries
            .filter_map(|e| e.ok())
            .map(|e| {
                (
                    e.file_name().to_string_lossy().into_owned(),
                    e.path().is_dir(),
                )
            })
            .collect();
        names.sort();
        for (n, is_dir) in names {
            if n == MANIFEST {
                if manifest.is_some() {
                    sv.owned.push(n);
                }
            } else if n == LOG || n == FINAL || n == PLOT || n == FINAL_EMA {
                match ours(&n) {
                    true => sv.owned.push(n),
                    false => sv.foreign.push(n),
                }
            } else if let Some(step) = checkpoint_step(&n).filter(|_| is_dir) {
                let run = run_id_of(&self.path.join(&n));
                let mine = run.is_some() && run == manifest.as_ref().map(|m| m.run_id.clone());
                if mine {
                    sv.owned.push(n.clone());
                    // Files someone added to the run's checkpoint stay, and so would the folder.
                    for extra in checkpoint_extras(&self.path.join(&n)) {
                        sv.foreign.push(format!("{n}/{extra}"));
                    }
                }
                sv.checkpoints.push((step, self.path.join(&n), run));
            } else if is_temp_name(&n, is_dir) {
                // A write of a run killed before its rename: the run's own hidden names.
                sv.owned.push(n);
            } else if n == TENSORBOARD && is_dir {
                let dir = self.path.join(TENSORBOARD);
                let mut files: Vec<String> = std::fs::read_dir(&dir)
                    .map_err(io(&dir))?
                    .filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|f| super::tensorboard::is_event_file_name(f))
                    .collect();
                files.sort();
                for f in files {
                    let rel = format!("{TENSORBOARD}/{f}");
                    match ours(&rel) {
                        true => sv.owned.push(rel),
                        false => sv.foreign.push(rel),
                    }
                }
            } else if n == SAMPLES && is_dir {
                let dir = self.path.join(SAMPLES);
                let mut files: Vec<String> = std::fs::read_dir(&dir)
                    .map_err(io(&dir))?
                    .filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|f| is_sample_name(f))
                    .collect();
                files.sort();
                for f in files {
                    let rel = format!("{SAMPLES}/{f}");
                    match ours(&rel) {
                        true => sv.owned.push(rel),
                        false => sv.foreign.push(rel),
                    }
                }
            }
        }
        sv.manifest = manifest;
        Ok(sv)
    }

    /// Deletes what `survey` proves the recorded run wrote, and nothing else: its recorded
    /// files, the files its checkpoints' `state.json` lists, its interrupted writes; a
    /// folder is removed only once empty. The manifest goes last, so a kill midway leaves
    /// a folder whose remaining files are still proven (and a new run still refused
    /// without `--overwrite`).
    pub fn clear(&self, survey: &Survey) -> Result<()> {
        let mut names = survey.owned.clone();
        names.sort_by_key(|n| n == MANIFEST);
        for (i, n) in names.iter().enumerate() {
            if i == 1 {
                crate::fault::point("clear").map_err(io(&self.path))?;
            }
            let p = self.path.join(n);
            if checkpoint_step(n).is_some() {
                remove_checkpoint(&p)?;
            } else if p.is_dir() {
                // An interrupted checkpoint write: only the names a checkpoint holds.
                remove_known(&p, &CHECKPOINT_FILES)?;
            } else {
                remove_file(&p)?;
            }
        }
        for sub in [SAMPLES, TENSORBOARD] {
            let dir = self.path.join(sub);
            if dir.is_dir() {
                let _ = std::fs::remove_dir(&dir);
            }
        }
        sync_dir(&self.path);
        Ok(())
    }

    /// Records the file at `name` (relative to the folder) in the manifest as written by
    /// this run (for `step`; `prefix`: append-only, its present bytes), rewriting
    /// `run.json` atomically. A folder without a manifest is no run: nothing is recorded.
    pub fn record(&self, name: &str, step: Option<usize>, prefix: bool) -> Result<()> {
        self.update(|m| {
            let p = self.path.join(name);
            let bytes = std::fs::metadata(&p).map_err(io(&p))?.len();
            let rec = Record {
                bytes,
                hash: prefix_hash(&p, bytes)?,
                step,
                prefix,
            };
            m.files.insert(name.to_string(), rec);
            Ok(())
        })
    }

    /// Records in the manifest which plan the run kept after timing plans
    /// (`Manifest::timed_plan`); nothing where there is no manifest.
    pub fn record_timed_plan(&self, plan: &str) -> Result<()> {
        self.update(|m| {
            m.timed_plan = Some(plan.to_string());
            Ok(())
        })
    }

    /// The manifest changed by `change` and written again in place (atomically); nothing
    /// where there is none.
    fn update(&self, change: impl FnOnce(&mut Manifest) -> Result<()>) -> Result<()> {
        let Some(mut m) = self.manifest()? else {
            return Ok(());
        };
        change(&mut m)?;
        write_atomic(&self.path.join(MANIFEST), m.to_json().as_bytes())
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
                remove_known(&tmp, &CHECKPOINT_FILES)?;
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
                if run_id_of(&dir).as_deref() != Some(run_id) {
                    return Err(Error::Checkpoint {
                        path: dir.clone(),
                        msg: "is in the way of this run's checkpoint and was not written by \
                              this run: move it away, then continue with --resume"
                            .into(),
                    });
                }
                remove_checkpoint(&dir)?;
            }
            std::fs::rename(&tmp, &dir).map_err(io(&dir))?;
            sync_dir(&self.path);
            Ok(())
        })();
        if result.is_err() {
            let _ = remove_known(&tmp, &CHECKPOINT_FILES);
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
            remove_checkpoint(&old)?;
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

/// What [`RunDir::survey`] found.
#[derive(Clone, Debug, Default)]
pub struct Survey {
    /// The run's manifest, if the folder has one.
    pub manifest: Option<Manifest>,
    /// Names (relative to the folder) the manifest's run provably wrote: deletable.
    pub owned: Vec<String>,
    /// Names at which a run writes files (`loss.jsonl`, `lora.safetensors`,
    /// `lora_ema.safetensors`, `loss.png`, `samples/step-*.png`,
    /// `tensorboard/events.out.tfevents.*`) that no record proves the recorded run wrote, and files
    /// someone added to the run's checkpoint folders.
    pub foreign: Vec<String>,
    /// Every checkpoint folder: step, path and the run its `state.json` names (`None`:
    /// unreadable).
    pub checkpoints: Vec<(usize, PathBuf, Option<String>)>,
}

/// The files a checkpoint folder holds (besides `state.json`'s list).
const CHECKPOINT_FILES: [&str; 5] = [
    "adapter.safetensors",
    "optimizer.safetensors",
    "state.json",
    LOG,
    EMA_STATE,
];

/// The moving average's state in a checkpoint (`[ema]`).
pub const EMA_STATE: &str = "ema.safetensors";

/// The step of a `checkpoint-<step>` name.
fn checkpoint_step(name: &str) -> Option<usize> {
    let digits = name.strip_prefix(CHECKPOINT_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A sample image's name: `step-<7 digits>-<i>.png`.
fn is_sample_name(name: &str) -> bool {
    let Some(rest) = name
        .strip_prefix("step-")
        .and_then(|r| r.strip_suffix(".png"))
    else {
        return false;
    };
    match rest.split_once('-') {
        Some((s, i)) => {
            s.len() == 7
                && s.bytes().all(|b| b.is_ascii_digit())
                && !i.is_empty()
                && i.bytes().all(|b| b.is_ascii_digit())
        }
        None => false,
    }
}

/// Whether `name` is one of a run's interrupted writes: a `.tmp-checkpoint-<7 digits>`
/// folder or a `.<run file>.tmp-<pid>` file.
pub fn is_temp_name(name: &str, is_dir: bool) -> bool {
    if is_dir {
        return name
            .strip_prefix(".tmp-checkpoint-")
            .is_some_and(|d| d.len() == 7 && d.bytes().all(|b| b.is_ascii_digit()));
    }
    [MANIFEST, LOG, FINAL, PLOT, FINAL_EMA].iter().any(|f| {
        name.strip_prefix(&format!(".{f}.tmp-"))
            .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
    })
}

fn remove_file(p: &Path) -> Result<()> {
    match std::fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(p)(e)),
        _ => Ok(()),
    }
}

/// Deletes the entries of `dir` named in `names` (and their interrupted writes,
/// `.<name>.tmp-<pid>`), then `dir` itself if nothing else is left in it.
fn remove_known(dir: &Path, names: &[&str]) -> Result<()> {
    let entries: Vec<String> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    for n in entries {
        let known = names.iter().any(|k| {
            n == *k
                || n.strip_prefix(&format!(".{k}.tmp-"))
                    .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        });
        if known {
            remove_file(&dir.join(&n))?;
        }
    }
    // Something not ours left in it keeps the folder.
    let _ = std::fs::remove_dir(dir);
    Ok(())
}

/// The names in a run's checkpoint folder that are neither a checkpoint's files nor listed
/// by its `state.json`.
fn checkpoint_extras(dir: &Path) -> Vec<String> {
    let listed: Vec<String> = std::fs::read_to_string(dir.join("state.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v["files"].as_object().map(|f| f.keys().cloned().collect()))
        .unwrap_or_default();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return vec![];
    };
    let mut v: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !CHECKPOINT_FILES.contains(&n.as_str()) && !listed.contains(n))
        .filter(|n| !n.starts_with('.') || !n.contains(".tmp-"))
        .collect();
    v.sort();
    v
}

/// Deletes a checkpoint folder of a run: the files its `state.json` lists, `state.json`,
/// and the folder once empty (a file someone added stays, and so does the folder).
fn remove_checkpoint(dir: &Path) -> Result<()> {
    let mut names: Vec<String> = CHECKPOINT_FILES.iter().map(|s| s.to_string()).collect();
    if let Some(v) = std::fs::read_to_string(dir.join("state.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
    {
        if let Some(files) = v["files"].as_object() {
            // Plain names only: a listed path never leaves the folder.
            names.extend(
                files
                    .keys()
                    .filter(|k| !k.contains(['/', '\\']) && *k != ".." && *k != ".")
                    .cloned(),
            );
        }
    }
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    remove_known(dir, &refs)
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
