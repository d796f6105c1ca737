//! TensorBoard event files, written without TensorFlow: the TFRecord framing and the few
//! protobuf fields of `Event` and `Summary` that scalars and PNG images need, encoded by hand.
//!
//! A file is a sequence of records, each
//! `u64 length (LE) | u32 masked_crc32c(length bytes) | data | u32 masked_crc32c(data)`,
//! where `masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8` (TensorFlow's
//! `tensorflow/core/lib/hash/crc32c.h`, `Mask`) and CRC32C is the Castagnoli polynomial
//! (reflected 0x82F63B78). Each record's data is one `Event` message
//! (`tensorflow/core/util/event.proto`):
//!
//! ```text
//! Event      { double wall_time = 1; int64 step = 2; string file_version = 3;
//!              Summary summary = 5; SessionLog session_log = 7; }
//! SessionLog { SessionStatus status = 1; }            // START = 1
//! Summary    { repeated Value value = 1; }             // summary.proto
//! Value      { string tag = 1; float simple_value = 2; Image image = 4; }
//! Image      { int32 height = 1; int32 width = 2; int32 colorspace = 3;
//!              bytes encoded_image_string = 4; }
//! ```
//!
//! The first record of a file says `file_version = "brain.Event:2"`. A resumed run starts a
//! new file with a `SessionLog` START at the first step it will log: TensorBoard then drops
//! what earlier files logged at that step and after (its reader's purge of orphaned data),
//! so the steps a resume redoes appear once.

use crate::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The folder of a run's event files, inside its output folder.
pub const TENSORBOARD: &str = "tensorboard";

/// The prefix of an event file's name (TensorBoard reads files whose name holds `tfevents`).
pub const EVENTS_PREFIX: &str = "events.out.tfevents.";

/// CRC32C (Castagnoli) of `data`, bitwise-reflected with polynomial 0x82F63B78.
pub fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    0x82F6_3B78 ^ (c >> 1)
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut c = !0u32;
    for &b in data {
        c = TABLE[((c ^ b as u32) & 0xFF) as usize] ^ (c >> 8);
    }
    !c
}

/// TFRecord's masked CRC: the CRC rotated right by 15 bits plus 0xa282ead8.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xA282_EAD8)
}

/// One TFRecord: length, its masked CRC, the data, the data's masked CRC.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut v = Vec::with_capacity(data.len() + 16);
    v.extend_from_slice(&len);
    v.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    v.extend_from_slice(data);
    v.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    v
}

/// Protobuf wire encoding of the fields used here.
struct Proto(Vec<u8>);

impl Proto {
    fn new() -> Self {
        Proto(vec![])
    }
    fn varint(&mut self, mut x: u64) {
        while x >= 0x80 {
            self.0.push((x as u8) | 0x80);
            x >>= 7;
        }
        self.0.push(x as u8);
    }
    fn key(&mut self, field: u32, wire: u8) {
        self.varint(((field as u64) << 3) | wire as u64);
    }
    /// Wire type 0: int32 / int64 / enum (negative numbers as 10-byte two's complement).
    fn int(&mut self, field: u32, x: i64) {
        self.key(field, 0);
        self.varint(x as u64);
    }
    /// Wire type 1: double.
    fn double(&mut self, field: u32, x: f64) {
        self.key(field, 1);
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    /// Wire type 5: float.
    fn float(&mut self, field: u32, x: f32) {
        self.key(field, 5);
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    /// Wire type 2: string, bytes or an embedded message.
    fn bytes(&mut self, field: u32, b: &[u8]) {
        self.key(field, 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }
}

/// An `Event` with its wall time and step; `body` adds its other fields.
fn event(wall_time: f64, step: i64, body: impl FnOnce(&mut Proto)) -> Vec<u8> {
    let mut e = Proto::new();
    e.double(1, wall_time);
    if step != 0 {
        e.int(2, step);
    }
    body(&mut e);
    e.0
}

/// A `Summary` holding one `Value` with `tag`; `value` adds the value's other fields.
fn summary(tag: &str, value: impl FnOnce(&mut Proto)) -> Vec<u8> {
    let mut v = Proto::new();
    v.bytes(1, tag.as_bytes());
    value(&mut v);
    let mut s = Proto::new();
    s.bytes(1, &v.0);
    s.0
}

/// The width and height a PNG's IHDR chunk gives (the first chunk, at bytes 16..24).
pub fn png_size(png: &[u8]) -> Option<(u32, u32)> {
    const SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];
    if png.len() < 24 || png[..8] != SIGNATURE || &png[12..16] != b"IHDR" {
        return None;
    }
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    Some((be(&png[16..20]), be(&png[20..24])))
}

/// The current time in seconds since the Unix epoch, as event files record it.
pub fn wall_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// This machine's name for event file names ("localhost" when it cannot be read).
fn host_name() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let clean: String = name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    match clean.is_empty() {
        true => "localhost".into(),
        false => clean,
    }
}

/// Whether `name` is an event file's name as [`EventWriter::create`] makes them.
pub fn is_event_file_name(name: &str) -> bool {
    name.strip_prefix(EVENTS_PREFIX).is_some_and(|rest| {
        !rest.is_empty()
            && rest
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    })
}

/// An event file being appended to. Every event is written as one `write` of its whole
/// record and flushed, so a kill leaves at most a torn last record, which TensorBoard's
/// reader skips.
pub struct EventWriter {
    file: std::fs::File,
    /// The file's path.
    pub path: PathBuf,
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.<unix seconds>.<host>` (TensorFlow's name; `.1`, `.2`,
    /// ... appended if a file of that name exists) and writes its `file_version` record.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let now = wall_time();
        let base = format!("{EVENTS_PREFIX}{:010}.{}", now as u64, host_name());
        let mut n = 0;
        let (file, path) = loop {
            let name = match n {
                0 => base.clone(),
                _ => format!("{base}.{n}"),
            };
            let path = dir.join(name);
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(f) => break (f, path),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(source) => return Err(Error::Io { path, source }),
            }
        };
        let mut w = EventWriter { file, path };
        w.write(&event(now, 0, |e| e.bytes(3, b"brain.Event:2")))?;
        Ok(w)
    }

    fn write(&mut self, data: &[u8]) -> Result<()> {
        self.file
            .write_all(&record(data))
            .and_then(|()| self.file.flush())
            .map_err(|source| Error::Io {
                path: self.path.clone(),
                source,
            })
    }

    /// Marks a restart at `step`: TensorBoard drops the events earlier files hold at this
    /// step and after.
    pub fn restart(&mut self, step: usize) -> Result<()> {
        self.write(&event(wall_time(), step as i64, |e| {
            let mut s = Proto::new();
            s.int(1, 1); // SessionLog.START
            e.bytes(7, &s.0);
        }))
    }

    /// A scalar (`simple_value`) under `tag` at `step`.
    pub fn scalar(&mut self, step: usize, tag: &str, value: f64) -> Result<()> {
        let s = summary(tag, |v| v.float(2, value as f32));
        self.write(&event(wall_time(), step as i64, |e| e.bytes(5, &s)))
    }

    /// A PNG image under `tag` at `step` (its size read from its header; colorspace 3, RGB).
    pub fn png(&mut self, step: usize, tag: &str, png: &[u8]) -> Result<()> {
        let (w, h) = png_size(png).ok_or_else(|| Error::Data {
            path: self.path.clone(),
            msg: format!("the image for {tag:?} at step {step} is not a PNG"),
        })?;
        let mut img = Proto::new();
        img.int(1, h as i64);
        img.int(2, w as i64);
        img.int(3, 3);
        img.bytes(4, png);
        let s = summary(tag, |v| v.bytes(4, &img.0));
        self.write(&event(wall_time(), step as i64, |e| e.bytes(5, &s)))
    }
}

/// Splits an event file's bytes into its records' data, checking each length and CRC; a
/// torn last record (shorter than its length says) ends the list, as TensorBoard reads it.
pub fn read_records(bytes: &[u8], path: &Path) -> Result<Vec<Vec<u8>>> {
    let bad = |at: usize, msg: &str| Error::Data {
        path: path.to_path_buf(),
        msg: format!("record at byte {at}: {msg}"),
    };
    let u32_at = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let mut v = vec![];
    let mut at = 0;
    while at < bytes.len() {
        if bytes.len() - at < 12 {
            break;
        }
        let len_bytes = &bytes[at..at + 8];
        if u32_at(&bytes[at + 8..at + 12]) != masked_crc32c(len_bytes) {
            return Err(bad(at, "the length's CRC does not match"));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap_or([0; 8])) as usize;
        let start = at + 12;
        let Some(end) = start.checked_add(len).filter(|e| e + 4 <= bytes.len()) else {
            break;
        };
        let data = &bytes[start..end];
        if u32_at(&bytes[end..end + 4]) != masked_crc32c(data) {
            return Err(bad(at, "the data's CRC does not match"));
        }
        v.push(data.to_vec());
        at = end + 4;
    }
    Ok(v)
}
