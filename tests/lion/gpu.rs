//! Lion and Lion8bit on CUDA against the CPU reference: the same steps on parameters of odd
//! sizes and mixed dtypes (f32, bf16, f16; under and over min_8bit_size). The kernels do the
//! CPU's f32 operations in the same order with no fused multiply-add, and quantize with the
//! same map and search (cuda/multi_tensor.cu), so parameters and momenta agree bit for bit:
//! the tolerance is zero. Needs a GPU: ignored elsewhere; run with --include-ignored on the
//! GPU machine (it skips if no GPU opens).
#![cfg(feature = "cuda")]

use super::{copies, grads_at, mixed_params, snapshot, TempFile};
use flame::optim::{Lion, Lion8bit, Lion8bitConfig, LionConfig, Optimizer};
use flame::{Device, Tensor};

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

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_lion_steps_match_the_cpu_bit_for_bit() {
    let gpu = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping: no CUDA device ({e})");
            return;
        }
    };
    let c = LionConfig {
        lr: 1e-3,
        weight_decay: 0.1,
        ..Default::default()
    };
    let c8 = Lion8bitConfig {
        lion: c,
        ..Default::default()
    };
    let pc = mixed_params(&Device::Cpu);
    let pg = on(&pc, &gpu);
    let (pc8, pg8) = (copies(&pc), on(&pc, &gpu));
    let mut oc = Lion::new(pc.clone(), c).unwrap();
    let mut og = Lion::new(pg.clone(), c).unwrap();
    let mut oc8 = Lion8bit::new(pc8.clone(), c8).unwrap();
    let mut og8 = Lion8bit::new(pg8.clone(), c8).unwrap();
    for k in 0..5 {
        oc.step(&grads_at(&pc, k)).unwrap();
        og.step(&grads_at(&pg, k)).unwrap();
        oc8.step_scaled(&grads_at(&pc8, k), 0.5).unwrap();
        og8.step_scaled(&grads_at(&pg8, k), 0.5).unwrap();
    }
    assert_eq!(
        snapshot(&|n| oc.momentum(n).unwrap(), &pc),
        snapshot(&|n| og.momentum(n).unwrap(), &pg),
        "Lion"
    );
    assert_eq!(
        snapshot(&|n| oc8.momentum(n).unwrap(), &pc8),
        snapshot(&|n| og8.momentum(n).unwrap(), &pg8),
        "Lion8bit"
    );
    // A GPU state file resumes on the CPU, still in step.
    let f = TempFile::new("lion8bit-gpu");
    og8.save_state(f.path()).unwrap();
    let pc2 = copies(&pc8);
    let mut oc2 = Lion8bit::new(pc2.clone(), c8).unwrap();
    oc2.load_state(f.path()).unwrap();
    for k in 5..8 {
        oc2.step(&grads_at(&pc2, k)).unwrap();
        og8.step(&grads_at(&pg8, k)).unwrap();
    }
    assert_eq!(
        snapshot(&|n| oc2.momentum(n).unwrap(), &pc2),
        snapshot(&|n| og8.momentum(n).unwrap(), &pg8),
        "Lion8bit resumed"
    );
}
