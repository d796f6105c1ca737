//! NCCL communicators (the data plane of `dist::NcclGroup`): in-place sums and broadcasts of
//! whole tensors on the device's collectives stream, ordered after the compute stream's work
//! so far by an event, and returning the event the compute stream must wait on before it
//! reads the results. NCCL is loaded at run time (`libnccl.so`), like the rest of CUDA.

use crate::backend::cuda::{cuda_err, CudaDevice};
use crate::device::Storage;
use crate::{DType, Error, Result, Tensor};
use cudarc::driver::CudaEvent;
use cudarc::nccl::{result, sys};
use std::sync::Mutex;

/// Whether `libnccl.so` can be loaded.
pub fn nccl_available() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

fn nccl_err(what: &str) -> impl Fn(result::NcclError) -> Error + '_ {
    move |e| {
        let hint = match e.0 {
            // NCCL's CUDA calls failing: most often its buffers finding no device memory.
            cudarc::nccl::sys::ncclResult_t::ncclUnhandledCudaError => {
                " (a CUDA call inside NCCL failed, most often an allocation of its buffers: \
                 too little device memory outside FLAME's allocator; NCCL_DEBUG=WARN says which)"
            }
            _ => "",
        };
        Error::Dist(format!("NCCL {what}: {:?}{hint}", e.0))
    }
}

/// A fresh NCCL unique id (rank 0 makes it; the others receive it over the control plane).
pub fn nccl_unique_id() -> Result<[u8; 128]> {
    if !nccl_available() {
        return Err(Error::Dist(
            "libnccl.so cannot be loaded: install NCCL (libnccl2 and libnccl-dev, or the \
             nvidia-nccl wheel) and put its folder on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let id = result::get_uniqueid().map_err(nccl_err("making a unique id"))?;
    Ok(id.internal.map(|c| c as u8))
}

/// One rank's NCCL communicator on one GPU.
pub struct NcclComm {
    raw: sys::ncclComm_t,
    dev: CudaDevice,
    /// NCCL calls on one communicator are not thread-safe: one at a time.
    lock: Mutex<()>,
}

// SAFETY: the communicator handle is used under `lock` only, from whichever thread holds it.
unsafe impl Send for NcclComm {}
// SAFETY: as above.
unsafe impl Sync for NcclComm {}

fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::U32 => sys::ncclDataType_t::ncclUint32,
    }
}

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `world` on `dev` (blocks until every rank
    /// has joined).
    pub fn new(dev: &CudaDevice, id: [u8; 128], rank: usize, world: usize) -> Result<NcclComm> {
        if !nccl_available() {
            return Err(Error::Dist("libnccl.so cannot be loaded".into()));
        }
        dev.context()
            .bind_to_thread()
            .map_err(cuda_err("binding the context for NCCL"))?;
        let uid = sys::ncclUniqueId {
            internal: id.map(|b| b as ::core::ffi::c_char),
        };
        let mut raw = std::mem::MaybeUninit::uninit();
        // SAFETY: `raw` is written by NCCL on success; the id came from get_uniqueid.
        unsafe { result::comm_init_rank(raw.as_mut_ptr(), world as i32, uid, rank as i32) }
            .map_err(nccl_err("joining the communicator"))?;
        Ok(NcclComm {
            // SAFETY: initialised by the successful call above.
            raw: unsafe { raw.assume_init() },
            dev: dev.clone(),
            lock: Mutex::new(()),
        })
    }

    /// Runs `each` for every tensor (pointer, count, dtype) inside one NCCL group on the
    /// collectives stream, after the compute stream's work so far; returns the event after.
    fn on_comm_stream(
        &self,
        what: &str,
        tensors: &[&Tensor],
        each: &dyn Fn(u64, usize, sys::ncclDataType_t, sys::cudaStream_t) -> Result<()>,
    ) -> Result<CudaEvent> {
        let _g = self.lock.lock().map_err(|_| Error::Poisoned("NCCL"))?;
        let compute = self.dev.stream();
        let comm = self.dev.comm_stream()?;
        let ready = compute
            .record_event(None)
            .map_err(cuda_err("recording the collective's start"))?;
        comm.wait(&ready)
            .map_err(cuda_err("ordering the collective"))?;
        let guards = tensors
            .iter()
            .map(|t| t.storage())
            .collect::<Result<Vec<_>>>()?;
        result::group_start().map_err(nccl_err("group start"))?;
        let mut failed = None;
        for (t, g) in tensors.iter().zip(&guards) {
            let r = (|| {
                if !t.layout().is_contiguous() {
                    return Err(Error::Dist(format!(
                        "{what} of a non-contiguous tensor (shape {})",
                        t.shape()
                    )));
                }
                #[allow(irrefutable_let_patterns)]
                let Storage::Cuda(cs) = &**g
                else {
                    return Err(Error::Dist(format!("{what} of a tensor not on a GPU")));
                };
                if cs.dev != self.dev {
                    return Err(Error::Dist(format!(
                        "{what} of a tensor on {:?}, the communicator is on {:?}",
                        cs.dev, self.dev
                    )));
                }
                let ptr =
                    cs.buf.raw_ptr(comm) + (t.layout().offset() * t.dtype().size_in_bytes()) as u64;
                each(
                    ptr,
                    t.elem_count(),
                    nccl_dtype(t.dtype()),
                    comm.cu_stream() as _,
                )
            })();
            if let Err(e) = r {
                failed = Some(e);
                break;
            }
        }
        let end = result::group_end().map_err(nccl_err("group end"));
        if let Some(e) = failed {
            return Err(e);
        }
        end?;
        comm.record_event(None)
            .map_err(cuda_err("recording the collective's end"))
    }

    /// Sums each tensor over the ranks, in place; the compute stream must wait on the
    /// returned event before reading them (or freeing them).
    pub fn all_reduce_sum(&self, tensors: &[&Tensor]) -> Result<CudaEvent> {
        let raw = self.raw;
        self.on_comm_stream("all-reduce", tensors, &|p, n, dt, s| {
            // SAFETY: `p` holds `n` elements of `dt` on this communicator's GPU, alive until
            // the compute stream has waited on the returned event (the caller's contract).
            unsafe {
                result::all_reduce(
                    p as *const _,
                    p as *mut _,
                    n,
                    dt,
                    sys::ncclRedOp_t::ncclSum,
                    raw,
                    s,
                )
            }
            .map(|_| ())
            .map_err(nccl_err("all-reduce"))
        })
    }

    /// Rank 0's values of each tensor on every rank, in place (event as above).
    pub fn broadcast(&self, tensors: &[&Tensor]) -> Result<CudaEvent> {
        let raw = self.raw;
        self.on_comm_stream("broadcast", tensors, &|p, n, dt, s| {
            // SAFETY: as in all_reduce_sum.
            unsafe { result::broadcast(p as *const _, p as *mut _, n, dt, 0, raw, s) }
                .map(|_| ())
                .map_err(nccl_err("broadcast"))
        })
    }

    /// The compute stream waits on `e` (no host wait).
    pub fn wait(&self, e: &CudaEvent) -> Result<()> {
        self.dev
            .stream()
            .wait(e)
            .map_err(cuda_err("waiting for a collective"))
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Abort rather than destroy: destroy waits for outstanding work, which never ends
        // when a peer is gone.
        // SAFETY: the handle is valid and not used after this.
        let _ = unsafe { result::comm_abort(self.raw) };
    }
}
