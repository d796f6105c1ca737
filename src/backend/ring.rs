//! The staging ring's bookkeeping (`cuda::Staging`), apart from the device: where each piece
//! of a coded upload lands in the ring, which decode's read the copy into that range must wait
//! for, and the uploads crossed ahead of their decode. `E` is the event a copy or a decode
//! records (a CUDA event on the GPU; anything in the tests).
//!
//! Pieces go one after another from the head, each at the next 256-byte step, back to the
//! start where one would pass the end. A copy into a range waits for the last decode that
//! read it (the decode stream runs in order: every earlier read is done then). A crossing
//! (`begin_crossing`, `cross`) copies an upload's first pieces ahead of the memory they decode
//! into: its ranges are written and not yet read, so no other copy may wait for them. A
//! crossing takes only ranges no crossing holds, its own included; a copy of another upload
//! that would overwrite one drops that crossing instead (the copy stream runs in order, so
//! the range is written again only after the crossing's copy, and a dropped crossing is never
//! decoded): its upload then brings every piece itself (`land` finds nothing).

use std::collections::VecDeque;

/// The ring of `cap` bytes (see the module docs).
pub(crate) struct Ring<E> {
    cap: usize,
    align: usize,
    /// The next free byte.
    head: usize,
    /// Ranges (start, length) the decode stream may still read, oldest first, with its event
    /// after the read.
    pending: VecDeque<(usize, usize, E)>,
    /// Uploads whose first pieces crossed ahead of their decode, oldest first.
    crossed: Vec<Crossing<E>>,
    /// The id of the next crossing.
    next: u64,
}

/// The first pieces of an upload crossed ahead of their decode: each piece's start, length
/// and copy's event.
struct Crossing<E> {
    id: u64,
    pieces: Vec<(usize, usize, E)>,
}

/// Whether ranges `[s, s + l)` and `[at, at + len)` share a byte.
fn overlap(s: usize, l: usize, at: usize, len: usize) -> bool {
    s < at + len && at < s + l
}

impl<E> Crossing<E> {
    fn overlaps(&self, at: usize, len: usize) -> bool {
        self.pieces.iter().any(|&(s, l, _)| overlap(s, l, at, len))
    }
}

impl<E: Clone> Ring<E> {
    /// An empty ring of `cap` bytes whose pieces start at multiples of `align`.
    pub(crate) fn new(cap: usize, align: usize) -> Self {
        Ring {
            cap,
            align: align.max(1),
            head: 0,
            pending: VecDeque::new(),
            crossed: Vec::new(),
            next: 0,
        }
    }

    /// Where a piece of `len` bytes would go: at the head, or at the start where it would
    /// pass the end.
    fn place(&self, len: usize) -> usize {
        // Callers hold every piece to the ring's size (`staging_ring_bytes`).
        debug_assert!(
            len <= self.cap,
            "a piece of {len} bytes in a ring of {}",
            self.cap
        );
        if self.head + len > self.cap {
            0
        } else {
            self.head
        }
    }

    /// Takes `[at, at + len)` for a copy: the head moves past it, and the last decode that
    /// read it (the event the copy must wait for) leaves `pending` with every read before it.
    fn take(&mut self, at: usize, len: usize) -> Option<E> {
        self.head = (at + len).div_ceil(self.align) * self.align;
        let last = self
            .pending
            .iter()
            .rposition(|&(s, l, _)| overlap(s, l, at, len))?;
        let (_, _, e) = self.pending[last].clone();
        self.pending.drain(..=last);
        Some(e)
    }

    /// Places the next piece of `len` bytes of an upload's copy: its start and the read the
    /// copy waits for. Crossings it overlaps are dropped.
    pub(crate) fn copy(&mut self, len: usize) -> (usize, Option<E>) {
        let at = self.place(len);
        self.crossed.retain(|c| !c.overlaps(at, len));
        (at, self.take(at, len))
    }

    /// Starts a crossing (`cross` places its pieces): its id.
    pub(crate) fn begin_crossing(&mut self) -> u64 {
        let id = self.next;
        self.next += 1;
        self.crossed.push(Crossing {
            id,
            pieces: Vec::new(),
        });
        id
    }

    /// Places the next piece of `len` bytes of crossing `id`: its start and the read the copy
    /// waits for; None where the piece would overlap a crossing (its own pieces included) or
    /// the crossing is gone: the crossing ends there. `crossed` records the copy's event.
    pub(crate) fn cross(&mut self, id: u64, len: usize) -> Option<(usize, Option<E>)> {
        let at = self.place(len);
        if self.crossed.iter().any(|c| c.overlaps(at, len)) || !self.holds(id) {
            return None;
        }
        Some((at, self.take(at, len)))
    }

    /// Records the copy of crossing `id`'s piece `[at, at + len)`, ending at `copied`.
    pub(crate) fn crossed(&mut self, id: u64, at: usize, len: usize, copied: E) {
        if let Some(c) = self.crossed.iter_mut().find(|c| c.id == id) {
            c.pieces.push((at, len, copied));
        }
    }

    /// Ends crossing `id`'s placing: the number of its pieces (an empty crossing is dropped).
    pub(crate) fn end_crossing(&mut self, id: u64) -> usize {
        let n = self
            .crossed
            .iter()
            .find(|c| c.id == id)
            .map_or(0, |c| c.pieces.len());
        if n == 0 {
            self.crossed.retain(|c| c.id != id);
        }
        n
    }

    /// Whether crossing `id` is still in the ring.
    pub(crate) fn holds(&self, id: u64) -> bool {
        self.crossed.iter().any(|c| c.id == id)
    }

    /// Takes crossing `id` for its upload, whose pieces are `lens` long: the crossed pieces
    /// (start, length, copy's event), the upload's first; nothing where the crossing is gone
    /// or its pieces are not the upload's (it is dropped).
    pub(crate) fn land(&mut self, id: u64, lens: &[usize]) -> Vec<(usize, usize, E)> {
        let Some(k) = self.crossed.iter().position(|c| c.id == id) else {
            return Vec::new();
        };
        let c = self.crossed.remove(k);
        let same = c.pieces.len() <= lens.len()
            && c.pieces
                .iter()
                .zip(lens)
                .all(|(&(_, l, _), &want)| l == want);
        if same {
            c.pieces
        } else {
            Vec::new()
        }
    }

    /// Records a decode's read of `[at, at + len)`, ending at `read`.
    pub(crate) fn read(&mut self, at: usize, len: usize, read: E) {
        self.pending.push_back((at, len, read));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upload of pieces `lens` copied and read (decoded) at once: each piece's start.
    fn upload(r: &mut Ring<u32>, lens: &[usize], event: &mut u32) -> Vec<usize> {
        lens.iter()
            .map(|&len| {
                let (at, _) = r.copy(len);
                *event += 1;
                r.read(at, len, *event);
                at
            })
            .collect()
    }

    /// Crosses pieces `lens` ahead: the crossing's id and the pieces that crossed.
    fn cross(r: &mut Ring<u32>, lens: &[usize], event: &mut u32) -> (u64, usize) {
        let id = r.begin_crossing();
        for &len in lens {
            let Some((at, _)) = r.cross(id, len) else {
                break;
            };
            *event += 1;
            r.crossed(id, at, len, *event);
        }
        (id, r.end_crossing(id))
    }

    #[test]
    fn pieces_go_from_the_head_and_wait_for_the_last_read_of_their_range() {
        let mut r: Ring<u32> = Ring::new(1000, 100);
        let mut e = 0;
        assert_eq!(upload(&mut r, &[250, 250], &mut e), vec![0, 300]);
        // A third would pass the end: back to the start, over both ranges: after the last
        // read of them (the decode stream runs in order, so the first's is done then).
        let (at, wait) = r.copy(450);
        assert_eq!((at, wait), (0, Some(2)));
        r.read(0, 450, 3);
        // The next from the head (500: past 450 at the 100-byte step), over nothing read.
        let (at, wait) = r.copy(300);
        assert_eq!((at, wait), (500, None));
        // Past the end again: over the third's range, after its read.
        let (at, wait) = r.copy(600);
        assert_eq!((at, wait), (0, Some(3)));
    }

    #[test]
    fn a_crossing_takes_free_ranges_only_and_lands_whole() {
        let mut r: Ring<u32> = Ring::new(1000, 100);
        let mut e = 0;
        upload(&mut r, &[300], &mut e);
        // Three pieces of 300 cross ahead (300, 600; the third would wrap onto nothing
        // crossed: 0, past the read of the upload before).
        let (a, n) = cross(&mut r, &[300, 300, 300], &mut e);
        assert_eq!(n, 3);
        // A second crossing finds no range its first piece may take (the ring is all
        // crossed): dropped.
        let (b, m) = cross(&mut r, &[300], &mut e);
        assert_eq!(m, 0);
        assert!(!r.holds(b));
        // The upload lands the crossing's pieces as they lie, with their copies' events.
        let landed = r.land(a, &[300, 300, 300]);
        assert_eq!(
            landed.iter().map(|&(s, l, _)| (s, l)).collect::<Vec<_>>(),
            vec![(300, 300), (600, 300), (0, 300)]
        );
        assert!(!r.holds(a));
        // Landed once.
        assert!(r.land(a, &[300, 300, 300]).is_empty());
    }

    #[test]
    fn a_crossing_never_wraps_onto_its_own_pieces() {
        let mut r: Ring<u32> = Ring::new(1000, 100);
        let mut e = 0;
        let (a, n) = cross(&mut r, &[400, 400, 400, 400], &mut e);
        // 0 and 400 fit; the third goes back to 0, its own.
        assert_eq!(n, 2);
        // The upload brings its other pieces after the crossed ones.
        let landed = r.land(a, &[400, 400, 400, 400]);
        assert_eq!(landed.len(), 2);
        for &(at, len, ev) in &landed {
            r.read(at, len, ev + 100);
        }
        let (at, wait) = r.copy(400);
        // Back to the start, after the first crossed piece's decode.
        assert_eq!((at, wait), (0, Some(101)));
    }

    #[test]
    fn a_copy_over_a_crossing_drops_it_and_its_upload_brings_every_piece() {
        let mut r: Ring<u32> = Ring::new(1000, 100);
        let mut e = 0;
        let (a, n) = cross(&mut r, &[300, 300], &mut e);
        assert_eq!(n, 2);
        let (b, m) = cross(&mut r, &[300], &mut e);
        assert_eq!(m, 1);
        // Another upload (a block the backward did not leave after all) takes the ring from
        // the head: past `b`'s range, back to the start over `a`'s first piece.
        let at = upload(&mut r, &[300], &mut e);
        assert_eq!(at, vec![0]);
        assert!(!r.holds(a) && r.holds(b));
        assert!(r.land(a, &[300, 300]).is_empty());
        // `b` lies untouched and lands.
        assert_eq!(r.land(b, &[300]).len(), 1);
    }

    #[test]
    fn a_crossing_of_other_pieces_than_the_upload_is_not_landed() {
        let mut r: Ring<u32> = Ring::new(1000, 100);
        let mut e = 0;
        let (a, _) = cross(&mut r, &[200, 200], &mut e);
        assert!(r.land(a, &[200, 300]).is_empty());
        assert!(!r.holds(a));
        // A crossing of the first pieces only lands as the upload's first.
        let (b, n) = cross(&mut r, &[200], &mut e);
        assert_eq!(n, 1);
        assert_eq!(r.land(b, &[200, 200]).len(), 1);
    }
}
