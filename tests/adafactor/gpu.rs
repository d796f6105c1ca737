//! Adafactor's fused step on CUDA against the CPU reference: the same steps on parameters of
//! odd sizes and mixed dtypes (f32, bf16, f16; 1-D, 1x1, 37x53, 4-D, several chunks), every
//! option combination, both optimizers given the same gradients each step. The kernels take
//! the CPU's sums in the same order and use the round-to-nearest intrinsics for their f32 and
//! f64 operations (cuda/multi_tensor.cu): the parameters equal the CPU's bit for bit every
//! step (all 80 steps on an H200), the state within f32 rounding of the CPU's (the bounds of
//! the fused-against-composite tests, doubled), and after a GPU state file resumes on the
//! CPU. Needs a GPU:
//! ignored elsewhere; run with --include-ignored on the GPU machine (it skips if no GPU opens).
#![cfg(feature = "cuda")]

use super::{bits, copies, odd_params, option_cases, state_of, TempFile};
use flame::optim::{Adafactor, Optimizer};
use flame::{Device, Grads, Tensor};

/// The parameters on `dev`, made from the same host values.
fn on(params: &[(String, Tensor)], dev: &Device) -> Vec<(String, Tensor)> {
    params
        .iter()
        .map(|(n, t)| {
            let c = Tensor::from_host(t.to_host().unwrap(), t.dims().to_vec(), dev).unwrap();
            c.set_requires_grad(true).unwrap();
            (n.clone(), c)
        })
        .collect()
}

/// Gradients of step `k` for `params` (on any device) from `from`'s values on the CPU.
fn grads_from(from: &[(String, Tensor)], params: &[(String, Tensor)], k: u64) -> Grads {
    let src = super::grads_at(from, k);
    let mut g = Grads::new();
    for ((_, f), (_, p)) in from.iter().zip(params) {
        let v = src.get(f).unwrap();
        g.insert(
            p,
            Tensor::from_host(v.to_host().unwrap(), p.dims().to_vec(), p.device()).unwrap(),
        );
    }
    g
}

/// Every parameter and state of the CUDA optimizer within rounding of the CPU's: parameters
/// by their dtype's bound, state within 4e-5 (twice the bounds of the composite tests).
fn assert_in_step(
    what: &str,
    (oc, pc): (&Adafactor, &[(String, Tensor)]),
    (og, pg): (&Adafactor, &[(String, Tensor)]),
) {
    for ((name, a), (_, b)) in pg.iter().zip(pc) {
        let tol = match b.dtype() {
            flame::DType::F32 => 4e-6,
            flame::DType::BF16 => 2f64.powi(-6),
            _ => 2f64.powi(-9),
        };
        super::assert_close(
            &format!("{what} {name}"),
            &a.to_vec_f64().unwrap(),
            &b.to_vec_f64().unwrap(),
            tol,
        );
        for (k, (x, y)) in state_of(og, name)
            .iter()
            .zip(state_of(oc, name))
            .enumerate()
        {
            super::assert_close(&format!("{what} {name} state {k}"), x, &y, 4e-5);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_adafactor_steps_match_the_cpu_bit_for_bit() {
    let gpu = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping: no CUDA device ({e})");
            return;
        }
    };
    for c in option_cases() {
        let pc = odd_params(&Device::Cpu);
        let pg = on(&pc, &gpu);
        let mut oc = Adafactor::new(pc.clone(), c).unwrap();
        let mut og = Adafactor::new(pg.clone(), c).unwrap();
        for k in 0..4 {
            let scale = if k == 2 { 0.25 } else { 1.0 };
            // Both gradients from the parameters before either step (they pull towards 0.5).
            let (gc, gg) = (grads_from(&pc, &pc, k), grads_from(&pc, &pg, k));
            oc.step_scaled(&gc, scale).unwrap();
            og.step_scaled(&gg, scale).unwrap();
            assert_in_step(&format!("{c:?}: step {k}"), (&oc, &pc), (&og, &pg));
            for ((name, a), (_, b)) in pg.iter().zip(&pc) {
                assert_eq!(bits(a), bits(b), "{c:?}: step {k}: {name} on CUDA");
            }
        }
        // A GPU state file resumes on the CPU, still in step.
        let f = TempFile::new("adafactor-gpu");
        og.save_state(f.path()).unwrap();
        let pc2 = copies(&pc);
        let mut oc2 = Adafactor::new(pc2.clone(), c).unwrap();
        oc2.load_state(f.path()).unwrap();
        for k in 4..6 {
            let (gc, gg) = (grads_from(&pc2, &pc2, k), grads_from(&pc2, &pg, k));
            oc2.step(&gc).unwrap();
            og.step(&gg).unwrap();
        }
        assert_in_step(&format!("{c:?}: resumed"), (&oc2, &pc2), (&og, &pg));
    }
}

/// The fused CUDA step within f32 rounding of the composite one on the GPU (the CPU's twin
/// test holds the reference to the composite; this one holds the device's composite ops).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_fused_step_equals_the_cuda_composite() {
    let gpu = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping: no CUDA device ({e})");
            return;
        }
    };
    for c in option_cases() {
        let base = odd_params(&Device::Cpu);
        let (pa, pb) = (on(&base, &gpu), on(&base, &gpu));
        let mut oa = Adafactor::new(pa.clone(), c).unwrap();
        let mut ob = Adafactor::new(pb.clone(), c).unwrap();
        for k in 0..4 {
            oa.step_scaled(&grads_from(&base, &pa, k), 1.0).unwrap();
            ob.step_composite(&grads_from(&base, &pb, k), 1.0).unwrap();
        }
        for ((name, a), (_, b)) in pa.iter().zip(&pb) {
            let tol = match a.dtype() {
                flame::DType::F32 => 2e-6,
                flame::DType::BF16 => 2f64.powi(-7),
                _ => 2f64.powi(-10),
            };
            super::assert_close(
                &format!("{c:?} {name}"),
                &a.to_vec_f64().unwrap(),
                &b.to_vec_f64().unwrap(),
                tol,
            );
        }
    }
}
