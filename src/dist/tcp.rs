//! The process group over TCP: the rendezvous every run of several processes starts with,
//! the control plane (small host sums, barriers, failure reports) of every group, and the
//! whole group on the CPU (tensors travel through the host, so it also works, slowly, for
//! any device).
//!
//! Rank 0 listens on `MASTER_ADDR:MASTER_PORT`; every other rank opens two connections to it:
//! one for collectives, one for the watchdog. Collectives are a star through rank 0, which
//! adds the ranks' values in rank order, in f64, and sends the one result back: every rank
//! ends with the same bits, and the same bits run after run.

use super::{Pending, ProcessGroup};
use crate::progress::{self, Snapshot};
use crate::{Device, Error, Result, Tensor};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const DATA: u8 = 1;
const ABORT: u8 = 2;
const FAILED: u8 = 3;
const BYE: u8 = 4;
/// A heartbeat: the sender's [`progress::Snapshot`].
const BEAT: u8 = 5;
/// "FLME": the first word of every connection, so a stray client is refused by name.
const MAGIC: u32 = 0x464C_4D45;
const KIND_DATA: u32 = 0;
const KIND_WATCH: u32 = 1;
/// The largest frame read (a bigger length is a corrupt or foreign stream).
const MAX_FRAME: u64 = 1 << 36;

/// Why the watchdog stops this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortCause {
    /// Another rank failed, exited or stopped the run: its process reports why.
    Peer,
    /// This process's watchdog judged the run stuck (rank 0: a rank made no progress, or
    /// went silent; another rank: rank 0 went silent): this process reports it.
    Stalled,
}

/// What a rank does when the watchdog learns that another rank failed or vanished, or judges
/// the run stuck: the message names the rank and why. The `train` binary exits the process
/// (a collective in flight on a GPU cannot be cancelled from the host any other way).
pub type OnAbort = Arc<dyn Fn(&str, AbortCause) + Send + Sync>;

/// A process group whose connections are TCP sockets; see the module documentation.
pub struct TcpGroup {
    rank: usize,
    world: usize,
    /// Rank 0: the data connection of rank r at r - 1; the others: the one to rank 0.
    data: Mutex<Vec<TcpStream>>,
    /// The watch connections, the same way (writer handles; the watchdog reads clones).
    watch: Arc<Mutex<Vec<TcpStream>>>,
    /// Set when the group is dropped: a closed watch connection then means a clean exit.
    done: Arc<AtomicBool>,
    /// How long a rank may make no progress, or rank 0 hear nothing from it, before the
    /// watchdog stops the run ([`TcpGroup::stall_after`]); `None`: never.
    stall: Option<Duration>,
}

fn dist(msg: impl Into<String>) -> Error {
    Error::Dist(msg.into())
}

/// Another rank failed or left: this one stops because of it.
fn peer(msg: impl Into<String>) -> Error {
    Error::PeerFailed(msg.into())
}

fn send(s: &mut TcpStream, tag: u8, payload: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; 9];
    head[0] = tag;
    head[1..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    s.write_all(&head)?;
    s.write_all(payload)?;
    s.flush()
}

fn recv(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head)?;
    let mut len = [0u8; 8];
    len.copy_from_slice(&head[1..]);
    let len = u64::from_le_bytes(len);
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!(
            "a frame of {len} bytes: not a FLAME peer"
        )));
    }
    let mut p = vec![0u8; len as usize];
    s.read_exact(&mut p)?;
    Ok((head[0], p))
}

fn f64s(bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(8)
        .map(|c| {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            f64::from_le_bytes(b)
        })
        .collect()
}

fn bytes(values: &[f64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn word(s: &mut TcpStream) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

impl TcpGroup {
    /// Joins the group as `rank` of `world`: rank 0 listens on `addr:port` (see
    /// [`TcpGroup::host`]), the others connect to it, retrying until `timeout` (rank 0 may
    /// start later). An error names the address and what went wrong.
    pub fn connect(
        addr: &str,
        port: u16,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<TcpGroup> {
        if world == 0 || rank >= world {
            return Err(dist(format!("rank {rank} of a world of {world}")));
        }
        if rank == 0 {
            let l = TcpListener::bind((addr, port)).map_err(|e| {
                dist(format!(
                    "rank 0 cannot listen on {addr}:{port} (MASTER_ADDR:MASTER_PORT): {e}"
                ))
            })?;
            return Self::host(l, world, timeout);
        }
        let deadline = Instant::now() + timeout;
        let open = |kind: u32| -> Result<TcpStream> {
            loop {
                match TcpStream::connect((addr, port)) {
                    Ok(mut s) => {
                        let _ = s.set_nodelay(true);
                        let mut hello = vec![];
                        for w in [MAGIC, rank as u32, world as u32, kind] {
                            hello.extend(w.to_le_bytes());
                        }
                        s.write_all(&hello).map_err(|e| {
                            dist(format!(
                                "rank {rank}: greeting rank 0 at {addr}:{port}: {e}"
                            ))
                        })?;
                        return Ok(s);
                    }
                    Err(e) if Instant::now() >= deadline => {
                        return Err(dist(format!(
                            "rank {rank}: no rank 0 at {addr}:{port} (MASTER_ADDR:MASTER_PORT) \
                             after {} s: {e}",
                            timeout.as_secs()
                        )))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        };
        let data = open(KIND_DATA)?;
        let watch = open(KIND_WATCH)?;
        let g = TcpGroup {
            rank,
            world,
            data: Mutex::new(vec![data]),
            watch: Arc::new(Mutex::new(vec![watch])),
            done: Arc::new(AtomicBool::new(false)),
            stall: None,
        };
        // Rank 0 answers once every rank has joined: a wrong world size or a duplicate rank
        // fails here, by name, on every rank.
        let mut ok = [0.0];
        g.sum_host(&mut ok)?;
        Ok(g)
    }

    /// Rank 0 of a group of `world` on a listener already bound (tests bind port 0 and
    /// pass the port to the other ranks): waits up to `timeout` for every rank.
    pub fn host(listener: TcpListener, world: usize, timeout: Duration) -> Result<TcpGroup> {
        let at = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        listener
            .set_nonblocking(true)
            .map_err(|e| dist(format!("listening on {at}: {e}")))?;
        let n = world.saturating_sub(1);
        let mut data: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        let mut watch: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        let deadline = Instant::now() + timeout;
        let missing = |d: &[Option<TcpStream>], w: &[Option<TcpStream>]| -> Vec<usize> {
            (0..n)
                .filter(|&i| d[i].is_none() || w[i].is_none())
                .map(|i| i + 1)
                .collect()
        };
        while !missing(&data, &watch).is_empty() {
            match listener.accept() {
                Ok((mut s, peer)) => {
                    let _ = s.set_nonblocking(false);
                    let _ = s.set_nodelay(true);
                    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
                    let hello: std::io::Result<[u32; 4]> =
                        (|| Ok([word(&mut s)?, word(&mut s)?, word(&mut s)?, word(&mut s)?]))();
                    let _ = s.set_read_timeout(None);
                    let [magic, r, w, kind] = match hello {
                        Ok(h) => h,
                        Err(_) => continue,
                    };
                    if magic != MAGIC {
                        // Not one of ours (a port scanner, a stale client): ignore it.
                        continue;
                    }
                    let (r, w) = (r as usize, w as usize);
                    let refuse = if w != world {
                        Some(format!(
                            "rank {r} (from {peer}) says the world has {w} ranks; rank 0 has \
                             {world} (WORLD_SIZE must agree)"
                        ))
                    } else if r == 0 || r >= world {
                        Some(format!("a rank {r} (from {peer}) in a world of {world}"))
                    } else {
                        let slot = if kind == KIND_WATCH {
                            &mut watch[r - 1]
                        } else {
                            &mut data[r - 1]
                        };
                        if slot.is_some() {
                            Some(format!("two processes (one from {peer}) claim rank {r}"))
                        } else {
                            *slot = Some(s.try_clone().map_err(|e| dist(e.to_string()))?);
                            None
                        }
                    };
                    if let Some(msg) = refuse {
                        let _ = send(&mut s, ABORT, msg.as_bytes());
                        for c in data.iter_mut().chain(watch.iter_mut()).flatten() {
                            let _ = send(c, ABORT, msg.as_bytes());
                        }
                        return Err(dist(msg));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(dist(format!(
                            "rank 0 at {at}: ranks {:?} did not join within {} s",
                            missing(&data, &watch),
                            timeout.as_secs()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(dist(format!("accepting on {at}: {e}"))),
            }
        }
        let g = TcpGroup {
            rank: 0,
            world,
            data: Mutex::new(data.into_iter().flatten().collect()),
            watch: Arc::new(Mutex::new(watch.into_iter().flatten().collect())),
            done: Arc::new(AtomicBool::new(false)),
            stall: None,
        };
        let mut ok = [0.0];
        g.sum_host(&mut ok)?;
        Ok(g)
    }

    /// The group with a stall limit: once the watchdog runs, a rank that makes no progress
    /// for `stall` while another waits for it (or every rank, inside one collective), or
    /// that sends no heartbeat for `stall`, stops the run with a message naming it.
    pub fn stall_after(mut self, stall: Option<Duration>) -> TcpGroup {
        self.stall = stall.filter(|d| !d.is_zero());
        self
    }

    /// Starts the watchdog: when another rank fails (says so, exits or is killed), every
    /// rank's `on_abort` runs with a message naming it, even while its main thread is
    /// blocked in a collective. Every rank sends its [`progress`] to rank 0 as a heartbeat,
    /// and rank 0 its own to every rank; with a stall limit ([`TcpGroup::stall_after`])
    /// rank 0 judges from them whether a rank is stuck (the rule is `stuck`'s, below), and a rank that
    /// hears nothing from rank 0 for twice that long stops.
    pub fn start_watchdog(&self, on_abort: OnAbort) -> Result<()> {
        let readers: Vec<TcpStream> = self
            .watch
            .lock()
            .map_err(|_| Error::Poisoned("watch connections"))?
            .iter()
            .map(|s| s.try_clone())
            .collect::<std::io::Result<_>>()
            .map_err(|e| dist(format!("the watchdog's connections: {e}")))?;
        let root = self.rank == 0;
        let n = readers.len();
        // What rank 0 heard of each rank (index 0: itself), and when rank 0 was last heard.
        let table: Arc<Mutex<Vec<Heard>>> =
            Arc::new(Mutex::new((0..=n).map(|_| Heard::new()).collect()));
        // Set once `on_abort` ran: the watchdog acts once.
        let fired = Arc::new(AtomicBool::new(false));
        let fire = {
            let (on, fired) = (on_abort.clone(), fired.clone());
            Arc::new(move |msg: &str, cause: AbortCause| {
                if !fired.swap(true, Ordering::SeqCst) {
                    on(msg, cause);
                }
            })
        };
        for (i, mut r) in readers.into_iter().enumerate() {
            let (done, on, writers) = (self.done.clone(), fire.clone(), self.watch.clone());
            let table = table.clone();
            let other = if root { i + 1 } else { 0 };
            std::thread::spawn(move || {
                let msg = loop {
                    match recv(&mut r) {
                        Ok((BEAT, p)) => {
                            if let (Some(snap), Ok(mut t)) =
                                (Snapshot::from_bytes(&p), table.lock())
                            {
                                t[if root { other } else { 0 }].heard(snap);
                            }
                        }
                        Ok((BYE, _)) => {
                            // A clean exit: nothing more to hear from that rank.
                            if let Ok(mut t) = table.lock() {
                                t[if root { other } else { 0 }].left = true;
                            }
                            return;
                        }
                        Ok((FAILED, p)) | Ok((ABORT, p)) if !root => {
                            break String::from_utf8_lossy(&p).into_owned()
                        }
                        Ok((FAILED, p)) => {
                            break format!("rank {other} failed: {}", String::from_utf8_lossy(&p))
                        }
                        _ if done.load(Ordering::Relaxed) => return,
                        _ => {
                            break format!(
                                "rank {other} exited without saying why (killed, crashed, or \
                                 its machine went away)"
                            )
                        }
                    }
                };
                // This process's watchdog is stopping the run and told the others: a rank
                // leaving now is that, and the watchdog gives the verdict (set before any
                // rank was told, so before this thread can see one leave).
                if progress::stopping() {
                    return;
                }
                if root {
                    // Tell every other rank before acting.
                    if let Ok(mut ws) = writers.lock() {
                        for (j, w) in ws.iter_mut().enumerate() {
                            if j != i {
                                let _ = send(w, ABORT, msg.as_bytes());
                            }
                        }
                    }
                }
                on(&msg, AbortCause::Peer);
            });
        }
        // The heartbeat: this rank's progress to rank 0 (rank 0's to every rank), and on
        // rank 0 the stall judgement.
        let (done, writers, stall, rank) =
            (self.done.clone(), self.watch.clone(), self.stall, self.rank);
        let every = stall.map_or(Duration::from_secs(5), |s| {
            (s / 8).clamp(Duration::from_millis(50), Duration::from_secs(5))
        });
        std::thread::spawn(move || loop {
            std::thread::sleep(every);
            if done.load(Ordering::Relaxed) || fired.load(Ordering::Relaxed) {
                return;
            }
            let own = progress::snapshot();
            let beat = own.to_bytes();
            match writers.lock() {
                // To every rank, whatever one send does: a failed send is the reader's to
                // report (the connection closed).
                Ok(mut ws) => ws.iter_mut().for_each(|w| {
                    let _ = send(w, BEAT, &beat);
                }),
                Err(_) => return,
            }
            let Some(limit) = stall else { continue };
            let verdict = match table.lock() {
                Ok(mut t) => {
                    if root {
                        t[0].heard(own);
                        stuck(&t, limit)
                    } else {
                        // Twice the limit: while rank 0 lives, its own verdict (at the
                        // limit) comes first, even when a loaded machine delays its beats.
                        let quiet = t[0].last_heard.elapsed();
                        (quiet > 2 * limit && !t[0].left).then(|| {
                            format!(
                                "rank {rank}: no heartbeat from rank 0 for {} s: its process is \
                                 frozen, or its machine or the network went away",
                                quiet.as_secs()
                            )
                        })
                    }
                }
                Err(_) => return,
            };
            if let Some(msg) = verdict {
                // Before anyone hears of it: the ranks told to stop close their
                // connections, which this process's main thread may see first.
                progress::set_stopping();
                if root {
                    if let Ok(mut ws) = writers.lock() {
                        for w in ws.iter_mut() {
                            let _ = send(w, ABORT, msg.as_bytes());
                        }
                    }
                }
                fire(&msg, AbortCause::Stalled);
                return;
            }
        });
        Ok(())
    }

    fn abort_data(conns: &mut [TcpStream], msg: &str) {
        for c in conns.iter_mut() {
            let _ = send(c, ABORT, msg.as_bytes());
        }
    }

    /// Sums `values` over the ranks: rank 0 adds them in rank order.
    fn sum_f64(&self, values: &mut [f64]) -> Result<()> {
        progress::entered_collective();
        let _waiting = progress::waiting();
        let mut conns = self
            .data
            .lock()
            .map_err(|_| Error::Poisoned("group connections"))?;
        let n = values.len();
        if self.rank == 0 {
            let mut acc = values.to_vec();
            for r in 1..self.world {
                let got = recv(&mut conns[r - 1]);
                // The message sent to the other ranks, and the error it is here: a broken
                // collective (`Error::Dist`) or another rank's failure (`Error::PeerFailed`).
                type Kind = fn(String) -> Error;
                let fail: Option<(String, Kind)> = match got {
                    Ok((DATA, p)) if p.len() == 8 * n => {
                        for (a, v) in acc.iter_mut().zip(f64s(&p)) {
                            *a += v;
                        }
                        None
                    }
                    Ok((DATA, p)) => Some((
                        format!(
                            "rank {r} sent {} values to a collective of {n}: the ranks are out \
                             of step (a different config or data on that rank?)",
                            p.len() / 8
                        ),
                        Error::Dist,
                    )),
                    Ok((FAILED, p)) | Ok((ABORT, p)) => Some((
                        format!("rank {r} failed: {}", String::from_utf8_lossy(&p)),
                        Error::PeerFailed,
                    )),
                    Ok((t, _)) => {
                        Some((format!("rank {r} sent an unknown frame {t}"), Error::Dist))
                    }
                    Err(e) => Some((
                        format!(
                            "rank {r} closed its connection ({e}): it failed, was killed, or \
                             its machine went away"
                        ),
                        Error::PeerFailed,
                    )),
                };
                if let Some((msg, kind)) = fail {
                    Self::abort_data(&mut conns, &msg);
                    return Err(kind(msg));
                }
            }
            let out = bytes(&acc);
            for (i, c) in conns.iter_mut().enumerate() {
                send(c, DATA, &out)
                    .map_err(|e| peer(format!("sending a sum to rank {}: {e}", i + 1)))?;
            }
            values.copy_from_slice(&acc);
        } else {
            let c = &mut conns[0];
            send(c, DATA, &bytes(values)).map_err(|e| {
                peer(format!(
                    "rank {}: rank 0 closed its connection ({e}): it failed or was stopped",
                    self.rank
                ))
            })?;
            match recv(c) {
                Ok((DATA, p)) if p.len() == 8 * n => values.copy_from_slice(&f64s(&p)),
                Ok((ABORT, p)) => return Err(peer(String::from_utf8_lossy(&p).into_owned())),
                Ok((t, p)) => {
                    return Err(dist(format!(
                        "rank {}: an unexpected frame {t} of {} bytes from rank 0",
                        self.rank,
                        p.len()
                    )))
                }
                Err(e) => {
                    return Err(peer(format!(
                        "rank {}: rank 0 closed its connection ({e}): it failed or was stopped",
                        self.rank
                    )))
                }
            }
        }
        Ok(())
    }

    /// Rank 0's `values` on every rank.
    fn broadcast_f64(&self, values: &mut [f64]) -> Result<()> {
        // A sum where every other rank contributes zeros: rank 0's values, exactly.
        if self.rank != 0 {
            values.iter_mut().for_each(|v| *v = 0.0);
        }
        self.sum_f64(values)
    }
}

/// What rank 0 knows of one rank: its last heartbeat, when its progress last moved, when
/// it was last heard.
struct Heard {
    snap: Option<Snapshot>,
    moved: Instant,
    last_heard: Instant,
    /// It said goodbye (its group closed): the run is ending.
    left: bool,
}

impl Heard {
    fn new() -> Heard {
        Heard {
            snap: None,
            moved: Instant::now(),
            last_heard: Instant::now(),
            left: false,
        }
    }

    fn heard(&mut self, snap: Snapshot) {
        let now = Instant::now();
        let moved = match &self.snap {
            None => true,
            Some(s) => {
                s.ticks != snap.ticks
                    || s.collectives != snap.collectives
                    || s.waiting != snap.waiting
            }
        };
        if moved {
            self.moved = now;
        }
        self.last_heard = now;
        self.snap = Some(snap);
    }
}

/// Rank 0's judgement over the ranks' heartbeats (index = rank): a message when the run is
/// stuck, naming the rank. A rank is *idle* when it is not waiting in a host collective and
/// its progress has not moved for `limit`. Every rank enters the same collectives in the
/// same order, so an idle rank that has entered fewer than another is the one the others
/// wait for (a rank idle *ahead* of the others waits for them on the device, NCCL's way,
/// and is not stuck while they work). Every rank idle in the same collective is a
/// collective that does not finish. A rank unheard for `limit` is frozen or gone.
fn stuck(t: &[Heard], limit: Duration) -> Option<String> {
    let secs = limit.as_secs_f64();
    if t.iter().any(|h| h.left) {
        return None;
    }
    for (r, h) in t.iter().enumerate().skip(1) {
        let quiet = h.last_heard.elapsed();
        if quiet > limit {
            return Some(format!(
                "rank {r} sent no heartbeat for {:.0} s (FLAME_STALL_TIMEOUT = {secs:.0}): its \
                 process is frozen, or its machine or the network went away; every rank stops",
                quiet.as_secs_f64()
            ));
        }
    }
    let snaps: Vec<&Snapshot> = t.iter().filter_map(|h| h.snap.as_ref()).collect();
    if snaps.len() < t.len() {
        return None;
    }
    let most = snaps.iter().map(|s| s.collectives).max().unwrap_or(0);
    let idle: Vec<usize> = (0..t.len())
        .filter(|&r| !snaps[r].waiting && t[r].moved.elapsed() > limit)
        .collect();
    let behind: Vec<usize> = idle
        .iter()
        .copied()
        .filter(|&r| snaps[r].collectives < most)
        .collect();
    let name = |r: usize| {
        let phase = &snaps[r].phase;
        match phase.is_empty() {
            true => format!("rank {r}"),
            false => format!("rank {r} (last: {phase})"),
        }
    };
    if !behind.is_empty() {
        let who: Vec<String> = behind.iter().map(|&r| name(r)).collect();
        return Some(format!(
            "{} made no progress for {secs:.0} s while the other ranks wait for it in a \
             collective: stuck (a kernel that does not return, a file system that does not \
             answer, a deadlock); every rank stops (FLAME_STALL_TIMEOUT sets the limit)",
            who.join(", ")
        ));
    }
    if idle.len() == t.len() {
        return Some(format!(
            "no rank made progress for {secs:.0} s, every one in collective {most}: the \
             collective does not finish (NCCL or the network between the ranks); every rank \
             stops (FLAME_STALL_TIMEOUT sets the limit; NCCL_DEBUG=INFO says more)"
        ));
    }
    None
}

/// The tensors' elements, one after the other, as f64 (exact for every float dtype).
fn gather(tensors: &[&Tensor]) -> Result<Vec<f64>> {
    let mut all = vec![];
    for t in tensors {
        all.extend(t.to_vec_f64()?);
    }
    Ok(all)
}

/// Writes `values` back into the tensors (rounded once to each one's dtype).
fn scatter(tensors: &[&Tensor], values: &[f64]) -> Result<()> {
    let mut at = 0;
    for t in tensors {
        let n = t.elem_count();
        let host = Tensor::from_vec(
            values[at..at + n].to_vec(),
            t.shape().clone(),
            &host_device()?,
        )?;
        t.assign(&host.to_dtype(t.dtype())?.to_device(t.device())?)?;
        at += n;
    }
    Ok(())
}

#[cfg(feature = "cpu-ref")]
fn host_device() -> Result<Device> {
    Ok(Device::Cpu)
}

#[cfg(not(feature = "cpu-ref"))]
fn host_device() -> Result<Device> {
    Err(Error::NoBackend(
        "a TCP process group's tensors (they pass through the host)",
    ))
}

impl ProcessGroup for TcpGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_reduce_sum(&self, tensors: &[&Tensor]) -> Result<Pending> {
        let mut v = gather(tensors)?;
        self.sum_f64(&mut v)?;
        scatter(tensors, &v)?;
        Ok(Pending::done())
    }
    fn asynchronous(&self) -> bool {
        false
    }
    fn broadcast(&self, tensors: &[&Tensor]) -> Result<()> {
        let mut v = gather(tensors)?;
        self.broadcast_f64(&mut v)?;
        scatter(tensors, &v)
    }
    fn sum_host(&self, values: &mut [f64]) -> Result<()> {
        self.sum_f64(values)
    }
    fn fail(&self, why: &str) {
        // First: the others exit when told, and their closing connections are expected.
        self.done.store(true, Ordering::Relaxed);
        let Ok(mut ws) = self.watch.lock() else {
            return;
        };
        if self.rank == 0 {
            let msg = format!("rank 0 failed: {why}");
            for w in ws.iter_mut() {
                let _ = send(w, ABORT, msg.as_bytes());
            }
        } else if let Some(w) = ws.first_mut() {
            let _ = send(w, FAILED, why.as_bytes());
        }
    }
    fn watch(&self, on_abort: OnAbort) -> Result<()> {
        self.start_watchdog(on_abort)
    }
    fn describe(&self) -> String {
        format!("rank {} of {} (TCP)", self.rank, self.world)
    }
}

impl Drop for TcpGroup {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Ok(mut ws) = self.watch.lock() {
            for w in ws.iter_mut() {
                let _ = send(w, BYE, &[]);
                let _ = w.shutdown(Shutdown::Both);
            }
        }
    }
}

/// A free TCP port on this machine (bound and released; a launcher passes it to its
/// workers as `MASTER_PORT`).
pub fn free_port() -> Result<u16> {
    let l =
        TcpListener::bind(("127.0.0.1", 0)).map_err(|e| dist(format!("finding a port: {e}")))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| dist(format!("finding a port: {e}")))
}
