//! One layer of an adapter file being merged into a model's weights ([`MergeLayer`]): the
//! view each kind's `merge` reads its tensors through, whatever made the file (kohya,
//! LyCORIS, PEFT, diffusers, FLAME). The file's layout (which names, which parts of a fused
//! layer) is `crate::nn::LoraMerge`'s; the change the tensors stand for is the kind's, by the
//! same function as its [`super::Adapter::delta_weight`].

use crate::safetensors::SafeTensorsFile;
use crate::{DType, Device, Error, Result, Tensor};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Mutex;

/// Values a merge changes at a time in a tensor's own storage ([`rows_in_place`]): 16 MiB of
/// f32, under the GPU allocator's threshold for large buffers, so the rows' copies come from
/// the small buffers' end of its arena.
pub(crate) const MERGE_CHUNK_VALUES: usize = 4 << 20;

/// Rewrites `t` (a tensor no other tensor shares, or rows of one) in its own storage,
/// [`MERGE_CHUNK_VALUES`] at a time along its first axis: `f(first row, rows)` gives the new
/// values of the rows `t.narrow(0, first row, n)` it is handed, in `t`'s dtype. No copy of
/// `t`'s size is made.
pub(crate) fn rows_in_place(
    t: &Tensor,
    mut f: impl FnMut(usize, &Tensor) -> Result<Tensor>,
) -> Result<()> {
    let _g = crate::no_grad();
    let rows = t.dims().first().copied().unwrap_or(1).max(1);
    let per_row = (t.elem_count() / rows).max(1);
    let chunk = (MERGE_CHUNK_VALUES / per_row).clamp(1, rows);
    let mut r = 0;
    while r < rows {
        let n = chunk.min(rows - r);
        let part = t.narrow(0, r, n)?;
        part.assign(&f(r, &part)?)?;
        r += n;
    }
    Ok(())
}

/// The tensors `<name>.<tensor>` of one layer (or one diffusers part of a fused layer) in a
/// file being merged.
pub struct MergeLayer<'a> {
    file: &'a SafeTensorsFile,
    used: &'a Mutex<BTreeSet<String>>,
    name: String,
    weight: &'a Tensor,
    default_scale: f64,
}

impl<'a> MergeLayer<'a> {
    /// The tensors under `name` in `file`, for a layer whose frozen weight is `weight` (f32,
    /// (out, in) or (out, in, kh, kw)); `default_scale` scales a kind's change when the file
    /// stores no alpha for it (PEFT's scale of the module, else 1). Tensors read are added to
    /// `used`.
    pub(crate) fn new(
        file: &'a SafeTensorsFile,
        used: &'a Mutex<BTreeSet<String>>,
        name: String,
        weight: &'a Tensor,
        default_scale: f64,
    ) -> Self {
        MergeLayer {
            file,
            used,
            name,
            weight,
            default_scale,
        }
    }

    /// The tensors' common name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the file was written for ComfyUI's reading (`Adapters::save_comfyui`).
    pub fn for_comfyui(&self) -> bool {
        self.file
            .metadata()
            .get(super::io::LAYOUT_KEY)
            .map(String::as_str)
            == Some(super::io::COMFYUI_LAYOUT)
    }

    /// The full name of tensor `t`.
    pub fn full(&self, t: &str) -> String {
        format!("{}.{t}", self.name)
    }

    /// Output rows of the layer.
    pub fn out(&self) -> usize {
        self.weight.dims().first().copied().unwrap_or(0)
    }

    /// The weight's columns: in, or in · kh · kw.
    pub fn cols(&self) -> usize {
        self.weight.dims().iter().skip(1).product()
    }

    /// The frozen weight as the matrix (out, cols), f32.
    pub fn weight(&self) -> Result<Tensor> {
        self.weight
            .to_dtype(DType::F32)?
            .reshape((self.out(), self.cols()))
    }

    /// The weight's shape.
    pub fn dims(&self) -> &[usize] {
        self.weight.dims()
    }

    /// Where the change is computed.
    pub fn device(&self) -> &Device {
        self.weight.device()
    }

    /// Whether the file holds tensor `t` of this layer.
    pub fn has(&self, t: &str) -> bool {
        self.file.contains(&self.full(t))
    }

    /// Tensor `t` as f32, marked used; `None` when absent.
    pub fn take(&self, t: &str) -> Result<Option<Tensor>> {
        let k = self.full(t);
        if !self.file.contains(&k) {
            return Ok(None);
        }
        self.used
            .lock()
            .map_err(|_| Error::Poisoned("adapter merge"))?
            .insert(k.clone());
        self.file.load_as(&k, self.device(), DType::F32).map(Some)
    }

    /// Tensor `t`, which the kind needs beside the ones it found.
    pub fn need(&self, t: &str, kind: &str) -> Result<Tensor> {
        self.take(t)?
            .ok_or_else(|| self.error(t, format!("missing (a {kind} needs it)")))
    }

    /// Tensor `t`'s value `v` (rows, ...) as the matrix (rows, the rest): a convolution
    /// factor's kernel joins its columns.
    pub fn matrix(&self, t: &str, v: Tensor) -> Result<Tensor> {
        match v.dims() {
            [r, rest @ ..] if !rest.is_empty() => {
                let (r, cols) = (*r, rest.iter().product::<usize>());
                v.reshape((r, cols))
            }
            _ => Err(self.bad(t, &v, "a matrix")),
        }
    }

    /// The stored `alpha`, if any (marked used): an error unless one finite value.
    pub fn alpha(&self) -> Result<Option<f64>> {
        match self.take("alpha")? {
            None => Ok(None),
            Some(a) => match a.to_vec_f64()?.as_slice() {
                [x] if x.is_finite() => Ok(Some(*x)),
                v => Err(self.error("alpha", format!("alpha {v:?}"))),
            },
        }
    }

    /// The scale of a change of rank `r`: alpha / r where the file stores alpha, else the
    /// default (PEFT's scale of the module, else 1).
    pub fn scale(&self, r: usize) -> Result<f64> {
        Ok(match self.alpha()? {
            Some(a) => a / r as f64,
            None => self.default_scale,
        })
    }

    /// The scale where the file stores no alpha.
    pub fn default_scale(&self) -> f64 {
        self.default_scale
    }

    /// An error about tensor `t`.
    pub fn error(&self, t: &str, msg: impl Into<String>) -> Error {
        Error::SafeTensors {
            path: self.file.path().to_path_buf(),
            tensor: Some(self.full(t)),
            msg: msg.into(),
        }
    }

    /// A shape error for tensor `t` of value `v`.
    pub fn bad(&self, t: &str, v: &Tensor, want: &str) -> Error {
        self.error(
            t,
            format!("shape {:?}: expected {want} for this layer", v.dims()),
        )
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        self.file.path()
    }
}
