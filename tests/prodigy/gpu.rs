//! Prodigy on CUDA against the CPU reference: the same steps on parameters of odd sizes and
//! mixed dtypes (one starting at zero), with and without a first moment. The kernels do the
//! CPU's operations in the same order with no fused multiply-add and sum in the CPU's order
//! (cuda/multi_tensor.cu), so parameters, state and d agree bit for bit: the tolerance is
//! zero. Needs a GPU: ignored elsewhere; run with --include-ignored on the GPU machine (it
//! skips if no GPU opens).
#![cfg(feature = "cuda")]

use super::{copies, grads_at, mixed_params, snapshot, TempFile};
use flame::optim::{Optimizer, Prodigy, ProdigyConfig};
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
fn cuda_steps_match_the_cpu_bit_for_bit() {
    let gpu = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping: no CUDA device ({e})");
            return;
        }
    };
    let configs = [
        ProdigyConfig::default(),
        ProdigyConfig {
            beta1: 0.0,
            decouple: false,
            weight_decay: 0.01,
            use_bias_correction: true,
            growth_rate: 1.1,
            ..Default::default()
        },
        ProdigyConfig {
            safeguard_warmup: true,
            weight_decay: 0.1,
            beta3: Some(0.95),
            ..Default::default()
        },
    ];
    for (ci, c) in configs.into_iter().enumerate() {
        let pc = mixed_params(&Device::Cpu);
        let pg = on(&pc, &gpu);
        let mut oc = Prodigy::new(pc.clone(), c).unwrap();
        let mut og = Prodigy::new(pg.clone(), c).unwrap();
        for k in 0..5 {
            oc.step(&grads_at(&pc, k)).unwrap();
            og.step(&grads_at(&pg, k)).unwrap();
        }
        assert_eq!(
            snapshot(&oc, &pc),
            snapshot(&og, &pg),
            "config {ci}, 5 steps"
        );
        // A GPU state file resumes on the CPU, still in step.
        let f = TempFile::new("prodigy-gpu");
        og.save_state(f.path()).unwrap();
        let pc2 = copies(&pc);
        let mut oc2 = Prodigy::new(pc2.clone(), c).unwrap();
        oc2.load_state(f.path()).unwrap();
        for k in 5..8 {
            oc2.step_scaled(&grads_at(&pc2, k), 0.5).unwrap();
            og.step_scaled(&grads_at(&pg, k), 0.5).unwrap();
        }
        assert_eq!(
            snapshot(&oc2, &pc2),
            snapshot(&og, &pg),
            "config {ci}, resumed"
        );
    }
}
