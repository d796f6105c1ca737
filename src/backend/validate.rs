//! Argument checks every backend runs before touching memory (the Backend traits are public,
//! so a caller may pass anything). One copy here, called by each backend.

use super::ReduceOp;
use crate::{DType, Error, Layout, Result};

pub(crate) fn same_shape(op: &'static str, a: &Layout, b: &Layout) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: a.shape().clone(),
            rhs: b.shape().clone(),
        });
    }
    Ok(())
}

pub(crate) fn dim_in_range(op: &'static str, l: &Layout, dim: usize) -> Result<()> {
    if dim >= l.dims().len() {
        return Err(Error::DimOutOfRange {
            op,
            dim: dim as i64,
            shape: l.shape().clone(),
        });
    }
    Ok(())
}

/// gather / scatter_add: indices of the source's rank and sizes outside `dim`.
pub(crate) fn gather_shapes(op: &'static str, l: &Layout, il: &Layout, dim: usize) -> Result<()> {
    dim_in_range(op, l, dim)?;
    let ok = l.dims().len() == il.dims().len()
        && l.dims()
            .iter()
            .zip(il.dims())
            .enumerate()
            .all(|(d, (a, b))| d == dim || a == b);
    if !ok {
        return Err(Error::ShapeMismatch {
            op,
            lhs: l.shape().clone(),
            rhs: il.shape().clone(),
        });
    }
    Ok(())
}

/// Distinct dims in range; arg ops reduce exactly one; only sums reduce an empty dim; u32
/// only has argmax/argmin.
pub(crate) fn reduction(op: ReduceOp, l: &Layout, dims: &[usize], dtype: DType) -> Result<()> {
    let rank = l.dims().len();
    let mut seen = vec![false; rank];
    for &d in dims {
        if d >= rank || std::mem::replace(&mut seen[d], true) {
            return Err(Error::invalid(
                op.name(),
                format!("bad reduction dims {dims:?}"),
                l.shape(),
            ));
        }
    }
    let arg = matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin);
    if arg && dims.len() != 1 {
        return Err(Error::invalid(
            op.name(),
            "reduces exactly one dim",
            l.shape(),
        ));
    }
    if !matches!(op, ReduceOp::Sum) && dims.iter().any(|&d| l.dims()[d] == 0) {
        return Err(Error::invalid(
            op.name(),
            "cannot reduce an empty dim",
            l.shape(),
        ));
    }
    if dtype == DType::U32 && !arg {
        return Err(Error::UnsupportedDType {
            op: op.name(),
            dtype,
        });
    }
    Ok(())
}

/// The operands of a fused kernel as its check reads them (`backend::Kernel::check`): the
/// count, the first's float dtype, each one's dtype and dims.
pub(crate) struct Operands<'a> {
    name: &'static str,
    args: &'a [(DType, &'a Layout)],
}

impl<'a> Operands<'a> {
    /// `count` operands, the first of a float dtype.
    pub(crate) fn new(
        name: &'static str,
        args: &'a [(DType, &'a Layout)],
        count: usize,
    ) -> Result<Self> {
        let Some(&(dt, x)) = args.first() else {
            return Err(Error::invalid(name, "no operands", &crate::Shape::from(())));
        };
        if args.len() != count {
            return Err(Error::invalid(
                name,
                format!("{} operands, expected {count}", args.len()),
                x.shape(),
            ));
        }
        if !dt.is_float() {
            return Err(Error::UnsupportedDType {
                op: name,
                dtype: dt,
            });
        }
        Ok(Operands { name, args })
    }

    /// The first operand's dtype.
    pub(crate) fn dtype(&self) -> DType {
        self.args[0].0
    }

    /// The first operand's dims, which must be `r` of them, none zero (`what` names them).
    pub(crate) fn dims(&self, r: usize, what: &str) -> Result<&'a [usize]> {
        let x = self.args[0].1;
        let d = x.dims();
        if d.len() != r || d.contains(&0) {
            return Err(self.invalid(format!("needs a non-empty {what} tensor")));
        }
        Ok(d)
    }

    /// (rows, cols) of the first operand as rows of its last dim, which must not be empty
    /// (rows may be 0).
    pub(crate) fn rows(&self) -> Result<(usize, usize)> {
        let d = self.args[0].1.dims();
        match d.last() {
            Some(&cols) if cols > 0 => Ok((d.iter().product::<usize>() / cols, cols)),
            _ => Err(self.invalid("needs a non-empty last dim")),
        }
    }

    /// Operand `i` must have dtype `d` and dims `dims`.
    pub(crate) fn expect(&self, i: usize, d: DType, dims: &[usize]) -> Result<()> {
        let (adt, l) = self.args[i];
        if adt != d {
            return Err(Error::DTypeMismatch {
                op: self.name,
                lhs: d,
                rhs: adt,
            });
        }
        if l.dims() != dims {
            return Err(Error::ShapeMismatch {
                op: self.name,
                lhs: crate::Shape::from(dims),
                rhs: l.shape().clone(),
            });
        }
        Ok(())
    }

    /// Operand `i`'s dims.
    pub(crate) fn dims_of(&self, i: usize) -> &'a [usize] {
        self.args[i].1.dims()
    }

    /// An invalid-argument error on the first operand's shape.
    pub(crate) fn invalid(&self, msg: impl Into<String>) -> Error {
        Error::invalid(self.name, msg, self.args[0].1.shape())
    }
}

/// A multi-tensor Adam step (`BackendStorage::adam_multi`): every parameter f32, bf16 or f16
/// and of one dtype, each gradient of its parameter's dtype, every item with the same kind of
/// moments, each view inside its buffer, and the maps with 8-bit moments. `info` gives a
/// buffer's dtype and length.
pub(crate) fn adam_multi<S>(
    items: &[super::multi::AdamItem<'_, S>],
    maps: Option<&S>,
    info: impl Fn(&S) -> (DType, usize),
) -> Result<()> {
    use super::multi::AdamMoments as M;
    const OP: &str = "adam_multi";
    let Some(first) = items.first() else {
        return Ok(());
    };
    let dtype = info(first.p).0;
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::UnsupportedDType { op: OP, dtype });
    }
    let quantized = matches!(first.moments, M::Quantized { .. });
    let fits = |s: &S, want: DType, offset: usize, len: usize, what: &str, k: usize| {
        item_fits(OP, info(s), Some(want), offset, len, what, k)
    };
    for (k, it) in items.iter().enumerate() {
        fits(it.p, dtype, it.p_offset, it.n, "the parameter", k)?;
        fits(it.g, dtype, it.g_offset, it.n, "the gradient", k)?;
        let nb = super::quant8::blocks(it.n);
        let words = nb * super::quant8::WORDS_PER_BLOCK;
        match (&it.moments, quantized) {
            (M::Full { m, v }, false) => {
                fits(m, DType::F32, 0, it.n, "the first moment", k)?;
                fits(v, DType::F32, 0, it.n, "the second moment", k)?;
            }
            (
                M::Quantized {
                    m_codes,
                    m_absmax,
                    v_codes,
                    v_absmax,
                },
                true,
            ) => {
                fits(m_codes, DType::U32, 0, words, "the first moment's codes", k)?;
                fits(m_absmax, DType::F32, 0, nb, "the first moment's maxima", k)?;
                fits(
                    v_codes,
                    DType::U32,
                    0,
                    words,
                    "the second moment's codes",
                    k,
                )?;
                fits(v_absmax, DType::F32, 0, nb, "the second moment's maxima", k)?;
            }
            _ => {
                return Err(Error::invalid(
                    OP,
                    format!("item {k}: f32 and 8-bit moments in one call"),
                    &crate::Shape::from(it.n),
                ))
            }
        }
    }
    if quantized {
        match maps {
            Some(q) => fits(q, DType::F32, 0, 512, "the maps", 0)?,
            None => {
                return Err(Error::invalid(
                    OP,
                    "8-bit moments without the (2, 256) maps",
                    &crate::Shape::from(()),
                ))
            }
        }
    }
    Ok(())
}

/// Item `k`'s `what` in a buffer of `(dtype, length)`: of dtype `want` (`None`: f32, bf16 or
/// f16), and `len` values from `offset` inside the buffer.
fn item_fits(
    op: &'static str,
    (dt, have): (DType, usize),
    want: Option<DType>,
    offset: usize,
    len: usize,
    what: &str,
    k: usize,
) -> Result<()> {
    let dtype_ok = match want {
        Some(w) => dt == w,
        None => matches!(dt, DType::F32 | DType::BF16 | DType::F16),
    };
    if !dtype_ok {
        let expected = want.map_or("f32, bf16 or f16".to_string(), |w| format!("{w:?}"));
        return Err(Error::invalid(
            op,
            format!("item {k}: {what} is {dt:?}, expected {expected}"),
            &crate::Shape::from(len),
        ));
    }
    if offset.checked_add(len).is_none_or(|end| end > have) {
        return Err(Error::invalid(
            op,
            format!(
                "item {k}: {what} of {len} values from offset {offset} exceeds its buffer of \
                 {have}"
            ),
            &crate::Shape::from(len),
        ));
    }
    Ok(())
}

/// A multi-tensor sum of squares: float buffers, each view inside its buffer.
pub(crate) fn sum_sq_multi<S>(
    items: &[super::multi::MultiRef<'_, S>],
    info: impl Fn(&S) -> (DType, usize),
) -> Result<()> {
    for (k, it) in items.iter().enumerate() {
        let (dtype, have) = info(it.s);
        if dtype == DType::U32 {
            return Err(Error::UnsupportedDType {
                op: "sum_sq_multi",
                dtype,
            });
        }
        if it.offset.checked_add(it.n).is_none_or(|end| end > have) {
            return Err(Error::invalid(
                "sum_sq_multi",
                format!(
                    "item {k}: {} values from offset {} exceed its buffer of {have}",
                    it.n, it.offset
                ),
                &crate::Shape::from(it.n),
            ));
        }
    }
    Ok(())
}

/// A multi-tensor Prodigy step (`BackendStorage::prodigy_multi`): every parameter f32, bf16
/// or f16, each gradient of its parameter's dtype, f32 state of the parameter's size (a first
/// moment on every item or on none), an f64 scalar state of `PRODIGY_SCALARS` values, each
/// view inside its buffer. `info` gives a buffer's dtype and length.
pub(crate) fn prodigy_multi<S>(
    items: &[super::multi::ProdigyItem<'_, S>],
    scalars: &S,
    info: impl Fn(&S) -> (DType, usize),
) -> Result<()> {
    const OP: &str = "prodigy_multi";
    let fits = |s: &S, want: Option<DType>, offset: usize, len: usize, what: &str, k: usize| {
        item_fits(OP, info(s), want, offset, len, what, k)
    };
    fits(
        scalars,
        Some(DType::F64),
        0,
        super::multi::PRODIGY_SCALARS,
        "the scalar state",
        0,
    )?;
    let has_m = items.first().is_some_and(|i| i.m.is_some());
    for (k, it) in items.iter().enumerate() {
        fits(it.p, None, it.p_offset, it.n, "the parameter", k)?;
        let dtype = info(it.p).0;
        fits(it.g, Some(dtype), it.g_offset, it.n, "the gradient", k)?;
        match (&it.m, has_m) {
            (Some(m), true) => fits(m, Some(DType::F32), 0, it.n, "the first moment", k)?,
            (None, false) => {}
            _ => {
                return Err(Error::invalid(
                    OP,
                    format!("item {k}: a first moment on some items only"),
                    &crate::Shape::from(it.n),
                ))
            }
        }
        fits(it.v, Some(DType::F32), 0, it.n, "the second moment", k)?;
        fits(it.s, Some(DType::F32), 0, it.n, "s", k)?;
        if let Some(p0) = it.p0 {
            fits(p0, Some(DType::F32), 0, it.n, "p0", k)?;
        }
    }
    Ok(())
}

/// A multi-tensor schedule-free call (`BackendStorage::schedulefree_multi`): every parameter
/// f32, bf16 or f16 within its buffer; a gradient of its dtype, f32 v and z of its size
/// where `op` needs them; bf16 s and p0 of `prodigy_sf_sliced(n)` values and the f64 scalar
/// state for Prodigy.
pub(crate) fn schedulefree_multi<S>(
    op: &super::multi_sf::SfOp,
    items: &[super::multi_sf::SfItem<'_, S>],
    scalars: Option<&S>,
    info: impl Fn(&S) -> (DType, usize),
) -> Result<()> {
    use super::multi_sf::{prodigy_sf_sliced, SfOp, PRODIGY_SF_SCALARS};
    const OP: &str = "schedulefree_multi";
    let fits = |s: &S, want: Option<DType>, offset: usize, len: usize, what: &str, k: usize| {
        item_fits(OP, info(s), want, offset, len, what, k)
    };
    let missing = |k: usize, what: &str, n: usize| {
        Err(Error::invalid(
            OP,
            format!("item {k}: {what} is missing or not expected for {op:?}"),
            &crate::Shape::from(n),
        ))
    };
    let (stepping, prodigy) = match op {
        SfOp::Lerp(_) => (false, false),
        SfOp::AdamW(_) => (true, false),
        SfOp::Prodigy(_) => (true, true),
    };
    match (scalars, prodigy) {
        (Some(st), true) => fits(
            st,
            Some(DType::F64),
            0,
            PRODIGY_SF_SCALARS,
            "the scalar state",
            0,
        )?,
        (None, false) => {}
        _ => return missing(0, "the scalar state", 0),
    }
    for (k, it) in items.iter().enumerate() {
        fits(it.p, None, it.p_offset, it.n, "the parameter", k)?;
        let dtype = info(it.p).0;
        fits(it.z, Some(DType::F32), 0, it.n, "z", k)?;
        match (it.g, &it.v, stepping) {
            (Some(g), Some(v), true) => {
                fits(g, Some(dtype), it.g_offset, it.n, "the gradient", k)?;
                fits(v, Some(DType::F32), 0, it.n, "the second moment", k)?;
            }
            (None, None, false) => {}
            _ => return missing(k, "the gradient or second moment", it.n),
        }
        match (&it.s, prodigy) {
            (Some(s), true) => fits(s, Some(DType::BF16), 0, prodigy_sf_sliced(it.n), "s", k)?,
            (None, false) => {}
            _ => return missing(k, "s", it.n),
        }
        match (it.p0, prodigy) {
            (Some(p0), true) => fits(p0, Some(DType::BF16), 0, prodigy_sf_sliced(it.n), "p0", k)?,
            (Some(_), false) => return missing(k, "p0", it.n),
            _ => {}
        }
    }
    Ok(())
}

/// A multi-tensor Lion step (`BackendStorage::lion_multi`): every parameter f32, bf16 or f16
/// and of one dtype, each gradient of its parameter's dtype, every item with the same kind of
/// momentum, each view inside its buffer, and the maps with 8-bit momenta.
pub(crate) fn lion_multi<S>(
    items: &[super::lion::LionItem<'_, S>],
    maps: Option<&S>,
    info: impl Fn(&S) -> (DType, usize),
) -> Result<()> {
    use super::lion::LionMoment as M;
    const OP: &str = "lion_multi";
    let Some(first) = items.first() else {
        return Ok(());
    };
    let dtype = info(first.p).0;
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::UnsupportedDType { op: OP, dtype });
    }
    let quantized = matches!(first.m, M::Quantized { .. });
    let fits = |s: &S, want: DType, offset: usize, len: usize, what: &str, k: usize| {
        item_fits(OP, info(s), Some(want), offset, len, what, k)
    };
    for (k, it) in items.iter().enumerate() {
        fits(it.p, dtype, it.p_offset, it.n, "the parameter", k)?;
        fits(it.g, dtype, it.g_offset, it.n, "the gradient", k)?;
        let nb = super::quant8::blocks(it.n);
        match (&it.m, quantized) {
            (M::Full(m), false) => fits(m, DType::F32, 0, it.n, "the momentum", k)?,
            (M::Quantized { codes, absmax }, true) => {
                let words = nb * super::quant8::WORDS_PER_BLOCK;
                fits(codes, DType::U32, 0, words, "the momentum's codes", k)?;
                fits(absmax, DType::F32, 0, nb, "the momentum's maxima", k)?;
            }
            _ => {
                return Err(Error::invalid(
                    OP,
                    format!("item {k}: f32 and 8-bit momenta in one call"),
                    &crate::Shape::from(it.n),
                ))
            }
        }
    }
    if quantized {
        match maps {
            Some(q) => fits(q, DType::F32, 0, 256, "the signed map", 0)?,
            None => {
                return Err(Error::invalid(
                    OP,
                    "8-bit momenta without the (256) signed map",
                    &crate::Shape::from(()),
                ))
            }
        }
    }
    Ok(())
}

/// A multi-tensor Adafactor step (`BackendStorage::adafactor_multi`): every parameter f32,
/// bf16 or f16 within its buffer, each gradient of its parameter's dtype, a first moment of
/// its size on every item when `has_m` and on none otherwise, factored moments of (B, rows)
/// and (B, cols) values for B = n / (rows * cols) whole matrices, or a full one of n values,
/// all f32 from offset 0.
pub(crate) fn adafactor_multi<S>(
    items: &[super::adafactor::AdafactorItem<'_, S>],
    has_m: bool,
    info: impl Fn(&S) -> (DType, usize),
) -> Result<()> {
    use super::adafactor::AdafactorMoment as M;
    const OP: &str = "adafactor_multi";
    let fits = |s: &S, want: Option<DType>, offset: usize, len: usize, what: &str, k: usize| {
        item_fits(OP, info(s), want, offset, len, what, k)
    };
    for (k, it) in items.iter().enumerate() {
        fits(it.p, None, it.p_offset, it.n, "the parameter", k)?;
        let dtype = info(it.p).0;
        fits(it.g, Some(dtype), it.g_offset, it.n, "the gradient", k)?;
        match (&it.m, has_m) {
            (Some(m), true) => fits(m, Some(DType::F32), 0, it.n, "the first moment", k)?,
            (None, false) => {}
            _ => {
                return Err(Error::invalid(
                    OP,
                    format!("item {k}: a first moment where beta1 is unset, or none where set"),
                    &crate::Shape::from(it.n),
                ))
            }
        }
        match &it.v {
            M::Factored {
                row,
                col,
                rows,
                cols,
            } => {
                let mat = rows.checked_mul(*cols).unwrap_or(0);
                if mat == 0 || it.n % mat != 0 {
                    return Err(Error::invalid(
                        OP,
                        format!(
                            "item {k}: {} values are not whole ({rows}, {cols}) matrices",
                            it.n
                        ),
                        &crate::Shape::from(it.n),
                    ));
                }
                let b = it.n / mat;
                fits(row, Some(DType::F32), 0, b * rows, "the row moments", k)?;
                fits(col, Some(DType::F32), 0, b * cols, "the column moments", k)?;
            }
            M::Full(v) => fits(v, Some(DType::F32), 0, it.n, "the second moment", k)?,
        }
    }
    Ok(())
}

/// A multi-tensor EMA update (`BackendStorage::ema_multi`): an f32 shadow holding every
/// item's values one after another, each item f32, bf16 or f16 within its buffer.
pub(crate) fn ema_multi<S>(
    shadow: &S,
    items: &[super::multi::MultiRef<'_, S>],
    info: impl Fn(&S) -> (DType, usize),
) -> Result<()> {
    const OP: &str = "ema_multi";
    let mut total = 0usize;
    for (k, it) in items.iter().enumerate() {
        item_fits(OP, info(it.s), None, it.offset, it.n, "the weight", k)?;
        total = total.checked_add(it.n).ok_or_else(|| {
            Error::invalid(OP, "the weights' sizes overflow", &crate::Shape::from(()))
        })?;
    }
    item_fits(
        OP,
        info(shadow),
        Some(DType::F32),
        0,
        total,
        "the shadow",
        0,
    )
}

/// A grouped copy into a compute dtype (`BackendStorage::cast_multi`): `out` of f32, bf16
/// or f16 holding every item's values one after another, each item f32, bf16 or f16.
pub(crate) fn cast_multi<S>(
    out: &S,
    items: &[super::multi::CastItem<'_, S>],
    info: impl Fn(&S) -> (DType, usize),
) -> Result<()> {
    const OP: &str = "cast_multi";
    let mut total = 0usize;
    for (k, it) in items.iter().enumerate() {
        item_fits(
            OP,
            info(it.src.s),
            None,
            it.src.offset,
            it.src.n,
            "the weight",
            k,
        )?;
        if !it.scale.is_finite() {
            return Err(Error::invalid(
                OP,
                format!("item {k}: the factor {} is not finite", it.scale),
                &crate::Shape::from(it.src.n),
            ));
        }
        total = total.checked_add(it.src.n).ok_or_else(|| {
            Error::invalid(OP, "the weights' sizes overflow", &crate::Shape::from(()))
        })?;
    }
    item_fits(OP, info(out), None, 0, total, "the copies", 0)
}

/// A grouped fold of gradients into f32 (`BackendStorage::fold_multi`): `out` f32 holding
/// every item's values one after another, each gradient f32, bf16 or f16, each earlier
/// gradient f32 of the same size.
pub(crate) fn fold_multi<S>(
    out: &S,
    items: &[super::multi::FoldItem<'_, S>],
    info: impl Fn(&S) -> (DType, usize),
) -> Result<()> {
    const OP: &str = "fold_multi";
    let mut total = 0usize;
    for (k, it) in items.iter().enumerate() {
        item_fits(
            OP,
            info(it.g.s),
            None,
            it.g.offset,
            it.g.n,
            "the gradient",
            k,
        )?;
        if let Some(p) = &it.prev {
            if p.n != it.g.n {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "item {k}: an earlier gradient of {} values for {}",
                        p.n, it.g.n
                    ),
                    &crate::Shape::from(it.g.n),
                ));
            }
            item_fits(
                OP,
                info(p.s),
                Some(DType::F32),
                p.offset,
                p.n,
                "the earlier gradient",
                k,
            )?;
        }
        if !it.scale.is_finite() {
            return Err(Error::invalid(
                OP,
                format!("item {k}: the factor {} is not finite", it.scale),
                &crate::Shape::from(it.g.n),
            ));
        }
        total = total.checked_add(it.g.n).ok_or_else(|| {
            Error::invalid(OP, "the gradients' sizes overflow", &crate::Shape::from(()))
        })?;
    }
    item_fits(
        OP,
        info(out),
        Some(DType::F32),
        0,
        total,
        "the folded gradients",
        0,
    )
}
