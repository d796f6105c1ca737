//! Multi-tensor ops over tensors (`backend::multi`): the optimizers' fused Adam step and the
//! global gradient norm, one kernel launch per group of tensors of one device and dtype
//! instead of a dozen per tensor.

use super::Tensor;
use crate::backend::multi::{AdamBias, AdamHyper, AdamItem, AdamMoments, MultiRef};
use crate::device::Storage;
use crate::{DType, Error, Result};
use std::collections::HashSet;
use std::sync::{RwLockReadGuard, RwLockWriteGuard};

/// The moments of one parameter, updated in place (dense tensors the optimizer owns).
pub(crate) enum Moments<'a> {
    /// f32 moments of the parameter's shape.
    Full {
        /// First moment.
        m: &'a Tensor,
        /// Second moment.
        v: &'a Tensor,
    },
    /// Block-wise 8-bit moments (`quant8`): (blocks, 64) u32 codes and (blocks) f32 maxima.
    Quantized {
        /// First moment's codes.
        m_codes: &'a Tensor,
        /// First moment's maxima.
        m_absmax: &'a Tensor,
        /// Second moment's codes.
        v_codes: &'a Tensor,
        /// Second moment's maxima.
        v_absmax: &'a Tensor,
    },
}

impl Moments<'_> {
    fn tensors(&self) -> Vec<&Tensor> {
        match self {
            Moments::Full { m, v } => vec![m, v],
            Moments::Quantized {
                m_codes,
                m_absmax,
                v_codes,
                v_absmax,
            } => vec![m_codes, m_absmax, v_codes, v_absmax],
        }
    }
}

/// One parameter of [`adam_multi`].
pub(crate) struct AdamSlot<'a> {
    /// The parameter (contiguous), written in place.
    pub p: &'a Tensor,
    /// Its gradient: the parameter's shape and dtype, contiguous.
    pub g: &'a Tensor,
    /// Its moments.
    pub moments: Moments<'a>,
    /// Its step's bias corrections.
    pub bias: AdamBias,
}

const OP: &str = "adam_multi";

fn lock_err() -> Error {
    Error::Poisoned("tensor storage")
}

/// One Adam step of every slot, in place: one backend call (one launch on CUDA) per group of
/// slots with the same device, parameter dtype and kind of moments. Everything is checked
/// before anything is written. `maps` is the (2, 256) f32 table of `quant8`'s signed and
/// unsigned maps on each device that has 8-bit moments (one per device, in any order).
pub(crate) fn adam_multi(h: &AdamHyper, maps: &[&Tensor], slots: &[AdamSlot<'_>]) -> Result<()> {
    // Checks on the tensors; the backend checks buffer sizes and dtypes again.
    let mut written = HashSet::new();
    for (k, s) in slots.iter().enumerate() {
        let bad = |msg: String| Err(Error::invalid(OP, format!("slot {k}: {msg}"), s.p.shape()));
        if s.p.shape() != s.g.shape() || s.p.dtype() != s.g.dtype() {
            return bad(format!(
                "gradient {:?} {} for a parameter {:?} {}",
                s.g.dtype(),
                s.g.shape(),
                s.p.dtype(),
                s.p.shape()
            ));
        }
        if s.p.device() != s.g.device() {
            return Err(Error::DeviceMismatch {
                op: OP,
                lhs: s.p.device().location(),
                rhs: s.g.device().location(),
            });
        }
        if !s.p.is_contiguous() || !s.g.is_contiguous() {
            return bad("the parameter and its gradient must be contiguous".into());
        }
        if s.p.0.grad_fn.is_some() && crate::autograd::grad_enabled() {
            return Err(Error::Autograd(
                "an optimizer step into a tensor recorded on the tape would corrupt its \
                 gradients"
                    .into(),
            ));
        }
        for t in std::iter::once(s.p).chain(s.moments.tensors()) {
            if !written.insert(t.storage_arc()?.as_ref() as *const _) {
                return bad("a parameter or moment shares storage with another".into());
            }
            if t.device() != s.p.device() {
                return bad("a moment on another device than its parameter".into());
            }
        }
        for t in s.moments.tensors() {
            if !t.is_contiguous() || t.layout().offset() != 0 {
                return bad("moments must be dense tensors".into());
            }
        }
    }
    for s in slots {
        if written.contains(&(s.g.storage_arc()?.as_ref() as *const _)) {
            return Err(Error::invalid(
                OP,
                "a gradient shares storage with a parameter or moment",
                s.g.shape(),
            ));
        }
    }
    // Groups, in first-seen order.
    let mut groups: Vec<(String, DType, bool, Vec<&AdamSlot<'_>>)> = vec![];
    for s in slots {
        let key = (
            s.p.device().location(),
            s.p.dtype(),
            matches!(s.moments, Moments::Quantized { .. }),
        );
        match groups
            .iter_mut()
            .find(|g| (&g.0, g.1, g.2) == (&key.0, key.1, key.2))
        {
            Some(g) => g.3.push(s),
            None => groups.push((key.0, key.1, key.2, vec![s])),
        }
    }
    for (loc, _, quantized, group) in groups {
        let map = match quantized {
            true => Some(
                maps.iter()
                    .find(|m| m.device().location() == loc)
                    .ok_or_else(|| {
                        Error::invalid(OP, format!("no maps on {loc}"), group[0].p.shape())
                    })?,
            ),
            false => None,
        };
        run_group(h, map.copied(), &group)?;
    }
    Ok(())
}

/// One backend call: the locks taken, the items built over the locked storages.
fn run_group(h: &AdamHyper, maps: Option<&Tensor>, slots: &[&AdamSlot<'_>]) -> Result<()> {
    let map_guard = maps.map(|m| m.storage()).transpose()?;
    let reads: Vec<RwLockReadGuard<'_, Storage>> =
        slots.iter().map(|s| s.g.storage()).collect::<Result<_>>()?;
    let mut writes: Vec<RwLockWriteGuard<'_, Storage>> = vec![];
    for s in slots {
        for t in std::iter::once(s.p).chain(s.moments.tensors()) {
            writes.push(t.storage_arc()?.write().map_err(|_| lock_err())?);
        }
    }
    let internal = || Error::invalid(OP, "internal: lock count", &crate::Shape::from(()));
    let mut w = writes.iter_mut();
    let mut items = Vec::with_capacity(slots.len());
    for (s, g) in slots.iter().zip(&reads) {
        let p = &mut **w.next().ok_or_else(internal)?;
        let moments = match s.moments {
            Moments::Full { .. } => AdamMoments::Full {
                m: &mut **w.next().ok_or_else(internal)?,
                v: &mut **w.next().ok_or_else(internal)?,
            },
            Moments::Quantized { .. } => AdamMoments::Quantized {
                m_codes: &mut **w.next().ok_or_else(internal)?,
                m_absmax: &mut **w.next().ok_or_else(internal)?,
                v_codes: &mut **w.next().ok_or_else(internal)?,
                v_absmax: &mut **w.next().ok_or_else(internal)?,
            },
        };
        items.push(AdamItem {
            p,
            p_offset: s.p.layout().offset(),
            n: s.p.elem_count(),
            g: &**g,
            g_offset: s.g.layout().offset(),
            moments,
            bias: s.bias,
        });
    }
    Storage::adam_multi(h, &mut items, map_guard.as_deref())
}

/// Contiguous tensors' values as views of their storages, read through `guards` (one a
/// tensor, in order: the caller holds them while the views are used).
fn views<'a, 'g>(
    tensors: impl Iterator<Item = &'a Tensor>,
    guards: &'g [RwLockReadGuard<'_, Storage>],
) -> Vec<MultiRef<'g, Storage>> {
    tensors
        .zip(guards)
        .map(|(t, g)| MultiRef {
            s: &**g,
            offset: t.layout().offset(),
            n: t.elem_count(),
        })
        .collect()
}

/// The sum of the squares of every value of `tensors`, in f64: one launch per device and
/// dtype on CUDA (a strided view is first copied dense). Deterministic: the same tensors give
/// the same bits. A NaN or an infinity anywhere makes the sum non-finite.
pub fn sum_sq_multi(tensors: &[&Tensor]) -> Result<f64> {
    let dense: Vec<Tensor> = tensors
        .iter()
        .map(|t| t.contiguous())
        .collect::<Result<_>>()?;
    let mut devices: Vec<crate::Device> = vec![];
    for t in &dense {
        if !devices.contains(t.device()) {
            devices.push(t.device().clone());
        }
    }
    let mut total = 0.0;
    for dev in devices {
        let on: Vec<&Tensor> = dense.iter().filter(|t| t.device() == &dev).collect();
        let guards: Vec<RwLockReadGuard<'_, Storage>> =
            on.iter().map(|t| t.storage()).collect::<Result<_>>()?;
        total += Storage::sum_sq_multi(&views(on.iter().copied(), &guards))?;
    }
    Ok(total)
}

/// One parameter of [`prodigy_multi`]: contiguous f32, bf16 or f16, with its gradient (same
/// shape and dtype, contiguous) and its dense f32 state tensors.
pub(crate) struct ProdigySlot<'a> {
    /// The parameter, written in place.
    pub p: &'a Tensor,
    /// Its gradient.
    pub g: &'a Tensor,
    /// First moment (absent when beta1 = 0).
    pub m: Option<&'a Tensor>,
    /// Second moment.
    pub v: &'a Tensor,
    /// The running s.
    pub s: &'a Tensor,
    /// The parameter's first value (absent: zeros).
    pub p0: Option<&'a Tensor>,
}

impl ProdigySlot<'_> {
    fn written(&self) -> Vec<&Tensor> {
        let mut v = vec![self.p];
        v.extend(self.m);
        v.extend([self.v, self.s]);
        v
    }
}

/// The storages written so far by a fused step (`check_slot`).
type Written = HashSet<*const std::sync::RwLock<Storage>>;

/// The checks a fused optimizer step makes of slot `k` before anything is written: its
/// gradient `g` (where it has one) matches `written[0]`, the parameter, in shape and dtype and
/// both are contiguous; the parameter is not recorded on the tape; every tensor it writes or
/// reads is on `device`; nothing it writes shares storage with anything written before
/// (`seen`, which it joins); its state (`written` after the parameter) and `dense` reads are
/// dense tensors.
fn check_slot(
    op: &'static str,
    k: usize,
    written: &[&Tensor],
    g: Option<&Tensor>,
    dense: Option<&Tensor>,
    device: &crate::Device,
    seen: &mut Written,
) -> Result<()> {
    let Some(&p) = written.first() else {
        return Ok(());
    };
    let bad = |msg: String| Err(Error::invalid(op, format!("slot {k}: {msg}"), p.shape()));
    if let Some(g) = g {
        if p.shape() != g.shape() || p.dtype() != g.dtype() {
            return bad(format!(
                "gradient {:?} {} for a parameter {:?} {}",
                g.dtype(),
                g.shape(),
                p.dtype(),
                p.shape()
            ));
        }
    }
    if !p.is_contiguous() || g.is_some_and(|g| !g.is_contiguous()) {
        return bad("the parameter and its gradient must be contiguous".into());
    }
    if p.0.grad_fn.is_some() && crate::autograd::grad_enabled() {
        return Err(Error::Autograd(
            "an optimizer step into a tensor recorded on the tape would corrupt its gradients"
                .into(),
        ));
    }
    for t in written.iter().copied().chain(g).chain(dense) {
        if t.device() != device {
            return Err(Error::DeviceMismatch {
                op,
                lhs: device.location(),
                rhs: t.device().location(),
            });
        }
    }
    for t in written {
        if !seen.insert(t.storage_arc()?.as_ref() as *const _) {
            return bad("a parameter or state tensor shares storage with another".into());
        }
    }
    for t in written.iter().skip(1).copied().chain(dense) {
        if !t.is_contiguous() || t.layout().offset() != 0 {
            return bad("state tensors must be dense".into());
        }
    }
    Ok(())
}

/// One Prodigy step of every slot, in place, with the global d estimate in `scalars` (an f64
/// tensor of `PRODIGY_SCALARS` values on the slots' device): one backend call, three launches
/// on CUDA and no host synchronization. Everything is checked before anything is written.
pub(crate) fn prodigy_multi(
    h: &crate::backend::multi::ProdigyHyper,
    scalars: &Tensor,
    slots: &[ProdigySlot<'_>],
) -> Result<()> {
    use crate::backend::multi::ProdigyItem;
    const OP: &str = "prodigy_multi";
    let mut written = HashSet::new();
    written.insert(scalars.storage_arc()?.as_ref() as *const _);
    if !scalars.is_contiguous() || scalars.layout().offset() != 0 {
        return Err(Error::invalid(
            OP,
            "the scalar state must be dense",
            scalars.shape(),
        ));
    }
    for (k, s) in slots.iter().enumerate() {
        let device = scalars.device();
        check_slot(OP, k, &s.written(), Some(s.g), s.p0, device, &mut written)?;
    }
    for s in slots {
        for t in std::iter::once(s.g).chain(s.p0) {
            if written.contains(&(t.storage_arc()?.as_ref() as *const _)) {
                return Err(Error::invalid(
                    OP,
                    "a gradient or p0 shares storage with a written tensor",
                    s.g.shape(),
                ));
            }
        }
    }
    let mut scalar_guard = scalars.storage_arc()?.write().map_err(|_| lock_err())?;
    let reads: Vec<(
        RwLockReadGuard<'_, Storage>,
        Option<RwLockReadGuard<'_, Storage>>,
    )> = slots
        .iter()
        .map(|s| Ok((s.g.storage()?, s.p0.map(|q| q.storage()).transpose()?)))
        .collect::<Result<_>>()?;
    let mut writes: Vec<RwLockWriteGuard<'_, Storage>> = vec![];
    for s in slots {
        for t in s.written() {
            writes.push(t.storage_arc()?.write().map_err(|_| lock_err())?);
        }
    }
    let internal = || Error::invalid(OP, "internal: lock count", &crate::Shape::from(()));
    let mut w = writes.iter_mut();
    let mut items = Vec::with_capacity(slots.len());
    for (s, (g, p0)) in slots.iter().zip(&reads) {
        let p = &mut **w.next().ok_or_else(internal)?;
        let m = match s.m {
            Some(_) => Some(&mut **w.next().ok_or_else(internal)?),
            None => None,
        };
        items.push(ProdigyItem {
            p,
            p_offset: s.p.layout().offset(),
            n: s.p.elem_count(),
            g: &**g,
            g_offset: s.g.layout().offset(),
            m,
            v: &mut **w.next().ok_or_else(internal)?,
            s: &mut **w.next().ok_or_else(internal)?,
            p0: p0.as_deref(),
        });
    }
    Storage::prodigy_multi(h, &mut items, &mut scalar_guard)
}

/// One parameter of [`schedulefree_multi`]: contiguous f32, bf16 or f16, its gradient (same
/// shape and dtype, contiguous; absent for a lerp) and its dense state tensors (f32 v and z
/// of its shape, Prodigy's bf16 s and p0 of `multi_sf::prodigy_sf_sliced` values).
pub(crate) struct SfSlot<'a> {
    /// The parameter, written in place.
    pub p: &'a Tensor,
    /// Its gradient.
    pub g: Option<&'a Tensor>,
    /// Second moment.
    pub v: Option<&'a Tensor>,
    /// The base sequence z.
    pub z: &'a Tensor,
    /// Prodigy's s.
    pub s: Option<&'a Tensor>,
    /// Prodigy's p0 (absent: zeros).
    pub p0: Option<&'a Tensor>,
}

impl SfSlot<'_> {
    fn written(&self) -> Vec<&Tensor> {
        let mut v = vec![self.p, self.z];
        v.extend(self.v);
        v.extend(self.s);
        v
    }
}

/// One schedule-free call (`backend::multi_sf::SfOp`) over every slot, in place, with
/// Prodigy's scalar state in `scalars` (an f64 tensor of `PRODIGY_SF_SCALARS` values on the
/// slots' device): one backend call, one launch per parameter dtype on CUDA (and one more
/// for Prodigy's reduction), no host synchronization. Everything is checked before anything
/// is written.
pub(crate) fn schedulefree_multi(
    op: &crate::backend::multi_sf::SfOp,
    scalars: Option<&Tensor>,
    slots: &[SfSlot<'_>],
) -> Result<()> {
    use crate::backend::multi_sf::SfItem;
    const OP: &str = "schedulefree_multi";
    let mut written = HashSet::new();
    if let Some(st) = scalars {
        written.insert(st.storage_arc()?.as_ref() as *const _);
        if !st.is_contiguous() || st.layout().offset() != 0 {
            return Err(Error::invalid(
                OP,
                "the scalar state must be dense",
                st.shape(),
            ));
        }
    }
    if let (Some(first), Some(st)) = (slots.first(), scalars) {
        if st.device() != first.p.device() {
            return Err(Error::DeviceMismatch {
                op: OP,
                lhs: first.p.device().location(),
                rhs: st.device().location(),
            });
        }
    }
    for (k, s) in slots.iter().enumerate() {
        let device = slots[0].p.device();
        check_slot(OP, k, &s.written(), s.g, s.p0, device, &mut written)?;
    }
    for s in slots {
        for t in s.g.into_iter().chain(s.p0) {
            if written.contains(&(t.storage_arc()?.as_ref() as *const _)) {
                return Err(Error::invalid(
                    OP,
                    "a gradient or p0 shares storage with a written tensor",
                    t.shape(),
                ));
            }
        }
    }
    let mut scalar_guard = match scalars {
        Some(st) => Some(st.storage_arc()?.write().map_err(|_| lock_err())?),
        None => None,
    };
    type Reads<'g> = (
        Option<RwLockReadGuard<'g, Storage>>,
        Option<RwLockReadGuard<'g, Storage>>,
    );
    let reads: Vec<Reads<'_>> = slots
        .iter()
        .map(|s| {
            Ok((
                s.g.map(|g| g.storage()).transpose()?,
                s.p0.map(|q| q.storage()).transpose()?,
            ))
        })
        .collect::<Result<_>>()?;
    let mut writes: Vec<RwLockWriteGuard<'_, Storage>> = vec![];
    for s in slots {
        for t in s.written() {
            writes.push(t.storage_arc()?.write().map_err(|_| lock_err())?);
        }
    }
    let internal = || Error::invalid(OP, "internal: lock count", &crate::Shape::from(()));
    let mut w = writes.iter_mut();
    let mut items = Vec::with_capacity(slots.len());
    for (s, (g, p0)) in slots.iter().zip(&reads) {
        let p = &mut **w.next().ok_or_else(internal)?;
        let z = &mut **w.next().ok_or_else(internal)?;
        let v = match s.v {
            Some(_) => Some(&mut **w.next().ok_or_else(internal)?),
            None => None,
        };
        let st = match s.s {
            Some(_) => Some(&mut **w.next().ok_or_else(internal)?),
            None => None,
        };
        items.push(SfItem {
            p,
            p_offset: s.p.layout().offset(),
            n: s.p.elem_count(),
            g: g.as_deref(),
            g_offset: s.g.map_or(0, |g| g.layout().offset()),
            v,
            z,
            s: st,
            p0: p0.as_deref(),
        });
    }
    Storage::schedulefree_multi(op, &mut items, scalar_guard.as_deref_mut())
}

/// The momentum of one parameter of [`lion_multi`] (dense tensors the optimizer owns).
pub(crate) enum LionMomentum<'a> {
    /// f32 of the parameter's shape.
    Full(&'a Tensor),
    /// Block-wise 8-bit (`quant8`): (blocks, 64) u32 codes and (blocks) f32 maxima.
    Quantized {
        /// The packed codes.
        codes: &'a Tensor,
        /// The block maxima.
        absmax: &'a Tensor,
    },
}

/// One parameter of [`lion_multi`].
pub(crate) struct LionSlot<'a> {
    /// The parameter (contiguous), written in place.
    pub p: &'a Tensor,
    /// Its gradient: the parameter's shape and dtype, contiguous.
    pub g: &'a Tensor,
    /// Its momentum.
    pub m: LionMomentum<'a>,
}

impl LionSlot<'_> {
    fn written(&self) -> Vec<&Tensor> {
        match self.m {
            LionMomentum::Full(m) => vec![self.p, m],
            LionMomentum::Quantized { codes, absmax } => vec![self.p, codes, absmax],
        }
    }
}

/// One Lion step of every slot, in place: one backend call (one launch on CUDA) per group of
/// slots with the same device, parameter dtype and kind of momentum. Everything is checked
/// before anything is written. `maps` is the (256) f32 signed `quant8` map on each device that
/// has 8-bit momenta.
pub(crate) fn lion_multi(
    h: &crate::backend::lion::LionHyper,
    maps: &[&Tensor],
    slots: &[LionSlot<'_>],
) -> Result<()> {
    use crate::backend::lion::{LionItem, LionMoment};
    const OP: &str = "lion_multi";
    let mut written = HashSet::new();
    for (k, s) in slots.iter().enumerate() {
        check_slot(
            OP,
            k,
            &s.written(),
            Some(s.g),
            None,
            s.p.device(),
            &mut written,
        )?;
    }
    for s in slots {
        if written.contains(&(s.g.storage_arc()?.as_ref() as *const _)) {
            return Err(Error::invalid(
                OP,
                "a gradient shares storage with a parameter or momentum",
                s.g.shape(),
            ));
        }
    }
    // Groups, in first-seen order.
    let mut groups: Vec<(String, DType, bool, Vec<&LionSlot<'_>>)> = vec![];
    for s in slots {
        let q = matches!(s.m, LionMomentum::Quantized { .. });
        let (loc, dt) = (s.p.device().location(), s.p.dtype());
        match groups
            .iter_mut()
            .find(|g| g.0 == loc && g.1 == dt && g.2 == q)
        {
            Some(g) => g.3.push(s),
            None => groups.push((loc, dt, q, vec![s])),
        }
    }
    for (loc, _, quantized, group) in groups {
        let map = match quantized {
            true => Some(
                *maps
                    .iter()
                    .find(|m| m.device().location() == loc)
                    .ok_or_else(|| {
                        Error::invalid(OP, format!("no map on {loc}"), group[0].p.shape())
                    })?,
            ),
            false => None,
        };
        let map_guard = map.map(|m| m.storage()).transpose()?;
        let reads: Vec<RwLockReadGuard<'_, Storage>> =
            group.iter().map(|s| s.g.storage()).collect::<Result<_>>()?;
        let mut writes: Vec<RwLockWriteGuard<'_, Storage>> = vec![];
        for s in &group {
            for t in s.written() {
                writes.push(t.storage_arc()?.write().map_err(|_| lock_err())?);
            }
        }
        let internal = || Error::invalid(OP, "internal: lock count", &crate::Shape::from(()));
        let mut w = writes.iter_mut();
        let mut items = Vec::with_capacity(group.len());
        for (s, g) in group.iter().zip(&reads) {
            let p = &mut **w.next().ok_or_else(internal)?;
            let m = match s.m {
                LionMomentum::Full(_) => LionMoment::Full(&mut **w.next().ok_or_else(internal)?),
                LionMomentum::Quantized { .. } => LionMoment::Quantized {
                    codes: &mut **w.next().ok_or_else(internal)?,
                    absmax: &mut **w.next().ok_or_else(internal)?,
                },
            };
            items.push(LionItem {
                p,
                p_offset: s.p.layout().offset(),
                n: s.p.elem_count(),
                g: &**g,
                g_offset: s.g.layout().offset(),
                m,
            });
        }
        Storage::lion_multi(h, &mut items, map_guard.as_deref())?;
    }
    Ok(())
}

/// The second moments of one parameter of [`adafactor_multi`] (dense f32 tensors the
/// optimizer owns).
pub(crate) enum AdafactorMoments<'a> {
    /// A parameter of two or more dims: the row means (its dims but the last) and the column
    /// means (its dims but the second to last).
    Factored {
        /// Row means.
        row: &'a Tensor,
        /// Column means.
        col: &'a Tensor,
    },
    /// The full second moment, of the parameter's shape.
    Full(&'a Tensor),
}

/// One parameter of [`adafactor_multi`]: contiguous f32, bf16 or f16, its gradient (same
/// shape and dtype, contiguous), its dense f32 state and its step's scalars.
pub(crate) struct AdafactorSlot<'a> {
    /// The parameter, written in place.
    pub p: &'a Tensor,
    /// Its gradient.
    pub g: &'a Tensor,
    /// The first moment (with beta1).
    pub m: Option<&'a Tensor>,
    /// The second moments.
    pub v: AdafactorMoments<'a>,
    /// The step's scalars.
    pub step: crate::backend::adafactor::AdafactorStep,
}

impl AdafactorSlot<'_> {
    fn written(&self) -> Vec<&Tensor> {
        let mut v = vec![self.p];
        v.extend(self.m);
        match self.v {
            AdafactorMoments::Factored { row, col } => v.extend([row, col]),
            AdafactorMoments::Full(f) => v.push(f),
        }
        v
    }
}

/// One Adafactor step of every slot, in place (`backend::adafactor`): one backend call, five
/// launches on CUDA whatever the number of slots, no host synchronization. Every slot is on
/// one device; parameter dtypes may mix. Everything is checked before anything is written.
pub(crate) fn adafactor_multi(
    h: &crate::backend::adafactor::AdafactorHyper,
    slots: &[AdafactorSlot<'_>],
) -> Result<()> {
    use crate::backend::adafactor::{AdafactorItem, AdafactorMoment};
    const OP: &str = "adafactor_multi";
    let Some(first) = slots.first() else {
        return Ok(());
    };
    let device = first.p.device().clone();
    let mut written = HashSet::new();
    for (k, s) in slots.iter().enumerate() {
        check_slot(OP, k, &s.written(), Some(s.g), None, &device, &mut written)?;
        if matches!(s.v, AdafactorMoments::Factored { .. }) && s.p.rank() < 2 {
            return Err(Error::invalid(
                OP,
                format!("slot {k}: factored moments for a parameter of fewer than 2 dims"),
                s.p.shape(),
            ));
        }
    }
    for s in slots {
        if written.contains(&(s.g.storage_arc()?.as_ref() as *const _)) {
            return Err(Error::invalid(
                OP,
                "a gradient shares storage with a parameter or state tensor",
                s.g.shape(),
            ));
        }
    }
    let reads: Vec<RwLockReadGuard<'_, Storage>> =
        slots.iter().map(|s| s.g.storage()).collect::<Result<_>>()?;
    let mut writes: Vec<RwLockWriteGuard<'_, Storage>> = vec![];
    for s in slots {
        for t in s.written() {
            writes.push(t.storage_arc()?.write().map_err(|_| lock_err())?);
        }
    }
    let internal = || Error::invalid(OP, "internal: lock count", &crate::Shape::from(()));
    let mut w = writes.iter_mut();
    let mut items = Vec::with_capacity(slots.len());
    for (s, g) in slots.iter().zip(&reads) {
        let p = &mut **w.next().ok_or_else(internal)?;
        let m = match s.m {
            Some(_) => Some(&mut **w.next().ok_or_else(internal)?),
            None => None,
        };
        let v = match s.v {
            AdafactorMoments::Factored { .. } => {
                let d = s.p.dims();
                AdafactorMoment::Factored {
                    row: &mut **w.next().ok_or_else(internal)?,
                    col: &mut **w.next().ok_or_else(internal)?,
                    rows: d[d.len() - 2],
                    cols: d[d.len() - 1],
                }
            }
            AdafactorMoments::Full(_) => {
                AdafactorMoment::Full(&mut **w.next().ok_or_else(internal)?)
            }
        };
        items.push(AdafactorItem {
            p,
            p_offset: s.p.layout().offset(),
            n: s.p.elem_count(),
            g: &**g,
            g_offset: s.g.layout().offset(),
            m,
            v,
            step: s.step,
        });
    }
    Storage::adafactor_multi(h, &mut items)
}

/// The moving average `s = s - k (s - p)` (`backend::multi::ema_value`) of every weight of
/// `params` into `shadow`, a dense f32 vector holding their values one after another: one
/// backend call, one launch on CUDA. The weights are contiguous, f32, bf16 or f16, on the
/// shadow's device.
pub(crate) fn ema_multi(k: f32, shadow: &Tensor, params: &[&Tensor]) -> Result<()> {
    const OP: &str = "ema_multi";
    if shadow.dtype() != DType::F32
        || shadow.rank() != 1
        || !shadow.is_contiguous()
        || shadow.layout().offset() != 0
    {
        return Err(Error::invalid(
            OP,
            format!(
                "the shadow is {:?}; expected a dense f32 vector",
                shadow.dtype()
            ),
            shadow.shape(),
        ));
    }
    let total: usize = params.iter().map(|p| p.elem_count()).sum();
    if total != shadow.elem_count() {
        return Err(Error::invalid(
            OP,
            format!(
                "the weights hold {total} values, the shadow {}",
                shadow.elem_count()
            ),
            shadow.shape(),
        ));
    }
    let sp = shadow.storage_arc()?.as_ref() as *const _;
    for (k, p) in params.iter().enumerate() {
        if p.device() != shadow.device() {
            return Err(Error::DeviceMismatch {
                op: OP,
                lhs: shadow.device().location(),
                rhs: p.device().location(),
            });
        }
        if !p.is_contiguous() || !matches!(p.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::invalid(
                OP,
                format!(
                    "weight {k}: {:?}, contiguous f32, bf16 or f16 expected",
                    p.dtype()
                ),
                p.shape(),
            ));
        }
        if std::ptr::eq(p.storage_arc()?.as_ref(), sp) {
            return Err(Error::invalid(
                OP,
                format!("weight {k} shares storage with the shadow"),
                p.shape(),
            ));
        }
    }
    let reads: Vec<RwLockReadGuard<'_, Storage>> =
        params.iter().map(|p| p.storage()).collect::<Result<_>>()?;
    let items = views(params.iter().copied(), &reads);
    let arc = shadow.storage_arc()?;
    let mut sw = arc.write().map_err(|_| lock_err())?;
    Storage::ema_multi(k, &mut sw, &items)
}

/// The device every tensor of `ts` is on (the first's), or an error naming `op`.
fn one_device<'a>(
    op: &'static str,
    ts: impl Iterator<Item = &'a Tensor>,
) -> Result<Option<crate::Device>> {
    let mut dev: Option<crate::Device> = None;
    for t in ts {
        match &dev {
            None => dev = Some(t.device().clone()),
            Some(d) if d != t.device() => {
                return Err(Error::DeviceMismatch {
                    op,
                    lhs: d.location(),
                    rhs: t.device().location(),
                })
            }
            Some(_) => {}
        }
    }
    Ok(dev)
}

/// The copies of `weights` (each with the factor it is scaled by first) in `dtype`, one
/// after another in one dense vector (`backend::multi::copy_value`, each value rounded once
/// to `dtype`): one backend call, one launch on CUDA. The weights are f32, bf16 or f16, on
/// one device (strided ones are first copied dense); not recorded. `None` for no weights.
pub(crate) fn cast_multi(weights: &[(&Tensor, f32)], dtype: DType) -> Result<Option<Tensor>> {
    use crate::backend::multi::CastItem;
    const OP: &str = "cast_multi";
    let Some(dev) = one_device(OP, weights.iter().map(|(t, _)| *t))? else {
        return Ok(None);
    };
    let dense: Vec<Tensor> = weights
        .iter()
        .map(|(t, _)| t.contiguous())
        .collect::<Result<_>>()?;
    let total: usize = dense.iter().map(Tensor::elem_count).sum();
    // Every value of the output is written: no fill first.
    let mut out = dev.uninit(&crate::Shape::from(total), dtype)?;
    {
        let guards: Vec<RwLockReadGuard<'_, Storage>> =
            dense.iter().map(|t| t.storage()).collect::<Result<_>>()?;
        let items: Vec<CastItem<'_, Storage>> = views(dense.iter(), &guards)
            .into_iter()
            .zip(weights)
            .map(|(src, (_, scale))| CastItem { src, scale: *scale })
            .collect();
        Storage::cast_multi(&mut out, &items)?;
    }
    Ok(Some(Tensor::from_storage(out, total.into(), dev, None)))
}

/// One gradient of [`fold_multi`].
pub(crate) struct FoldSlot<'a> {
    /// The gradient of a copy (f32, bf16 or f16).
    pub g: &'a Tensor,
    /// The weight's f32 gradient so far (the same number of values), if any.
    pub prev: Option<&'a Tensor>,
    /// The copy's factor.
    pub scale: f32,
}

/// The f32 gradients `prev + copy_value(scale, g)` of every slot (`backend::multi::
/// fold_value`), one after another in one dense f32 vector: one backend call, one launch on
/// CUDA. Everything on one device; not recorded. `None` for no slots.
pub(crate) fn fold_multi(slots: &[FoldSlot<'_>]) -> Result<Option<Tensor>> {
    use crate::backend::multi::FoldItem;
    const OP: &str = "fold_multi";
    let all = slots
        .iter()
        .flat_map(|s| std::iter::once(s.g).chain(s.prev));
    let Some(dev) = one_device(OP, all)? else {
        return Ok(None);
    };
    let gs: Vec<Tensor> = slots
        .iter()
        .map(|s| s.g.contiguous())
        .collect::<Result<_>>()?;
    let prevs: Vec<Tensor> = slots
        .iter()
        .filter_map(|s| s.prev.map(Tensor::contiguous))
        .collect::<Result<_>>()?;
    let total: usize = gs.iter().map(Tensor::elem_count).sum();
    let mut out = dev.uninit(&crate::Shape::from(total), DType::F32)?;
    {
        let g_guards: Vec<RwLockReadGuard<'_, Storage>> =
            gs.iter().map(|t| t.storage()).collect::<Result<_>>()?;
        let p_guards: Vec<RwLockReadGuard<'_, Storage>> =
            prevs.iter().map(|t| t.storage()).collect::<Result<_>>()?;
        let mut p_views = views(prevs.iter(), &p_guards).into_iter();
        let mut items = Vec::with_capacity(slots.len());
        for (g, s) in views(gs.iter(), &g_guards).into_iter().zip(slots) {
            let prev = match s.prev {
                Some(_) => Some(p_views.next().ok_or_else(|| {
                    Error::invalid(OP, "internal: earlier gradient count", s.g.shape())
                })?),
                None => None,
            };
            items.push(FoldItem {
                g,
                prev,
                scale: s.scale,
            });
        }
        Storage::fold_multi(&mut out, &items)?;
    }
    Ok(Some(Tensor::from_storage(out, total.into(), dev, None)))
}
