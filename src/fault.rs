//! Fault injection for the crash-safety tests: the environment variable `FLAME_FAULT` names
//! a point in the code that writes files and what happens there.
//! - `kill:<point>` aborts the process at that point (no destructors, no flushing, as
//!   `kill -9` would);
//! - `enospc:<point>` makes the write there fail with "No space left on device";
//! - `hang:<point>` stops the thread there for good, the process alive and its connections
//!   open (a rank stuck in a kernel, a dead file system or a deadlock);
//! - `oom:<point>` makes the work there fail as out of GPU memory ([`out_of_memory`]).
//!
//! `<point>@<n>` acts on the n-th time the point is reached (default the first). Points are
//! `write:<file name>` (a file written atomically, before its rename into place),
//! `checkpoint:<step>` (a checkpoint folder filled, before its rename), `rotation`, `clear`,
//! `log-append`, `step` (the start of each training step), `decode` (an autoencoder's decode of
//! sample images, with `oom`) and `announce` (a worker bringing
//! an announced conditioning input to the host for its products ahead,
//! `BlockStreamer::prepare_products`: a failure there leaves the forward to compute its own). With `FLAME_FAULT_RANK` set,
//! only the process whose `RANK` it names (data-parallel training) acts. Without the
//! variable this is a no-op.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

#[derive(PartialEq)]
enum Kind {
    Kill,
    Enospc,
    Hang,
    Oom,
}

struct Spec {
    kind: Kind,
    point: String,
    nth: usize,
    hits: AtomicUsize,
}

fn spec() -> Option<&'static Spec> {
    static SPEC: OnceLock<Option<Spec>> = OnceLock::new();
    SPEC.get_or_init(|| {
        let v = std::env::var("FLAME_FAULT").ok()?;
        if let Ok(r) = std::env::var("FLAME_FAULT_RANK") {
            if std::env::var("RANK").unwrap_or_else(|_| "0".into()) != r {
                return None;
            }
        }
        let (kind, rest) = v.split_once(':')?;
        let (point, nth) = match rest.rsplit_once('@') {
            Some((p, n)) => (p.to_string(), n.parse().ok()?),
            None => (rest.to_string(), 1),
        };
        let kind = match kind {
            "kill" => Kind::Kill,
            "hang" => Kind::Hang,
            "oom" => Kind::Oom,
            _ => Kind::Enospc,
        };
        Some(Spec {
            kind,
            point,
            nth,
            hits: AtomicUsize::new(0),
        })
    })
    .as_ref()
}

/// Reached `point`: aborts or fails here when `FLAME_FAULT` says so.
pub(crate) fn point(point: &str) -> std::io::Result<()> {
    let Some(s) = spec() else {
        return Ok(());
    };
    if s.point != point || s.hits.fetch_add(1, Ordering::Relaxed) + 1 != s.nth {
        return Ok(());
    }
    match s.kind {
        Kind::Kill => std::process::abort(),
        Kind::Hang => loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        },
        Kind::Enospc | Kind::Oom => {}
    }
    // ENOSPC on Linux and macOS.
    Err(std::io::Error::from_raw_os_error(28))
}

/// Reached `point` where work may run out of GPU memory: whether `FLAME_FAULT` (`oom:<point>`)
/// says it does here (the caller fails as the allocator would).
pub(crate) fn out_of_memory(point: &str) -> bool {
    let Some(s) = spec() else {
        return false;
    };
    s.kind == Kind::Oom && s.point == point && s.hits.fetch_add(1, Ordering::Relaxed) + 1 == s.nth
}
