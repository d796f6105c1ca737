//! The schedule-free optimizers on CUDA against the CPU reference: the same steps, moves to
//! x and back and a resume, on parameters of odd sizes and mixed dtypes (one starting at
//! zero). The kernels do the CPU's operations in the same order with no fused multiply-add
//! and sum in the CPU's order (cuda/multi_tensor.cu), so parameters, state and d agree bit
//! for bit: the tolerance is zero. Needs a GPU: ignored elsewhere; run with
//! --include-ignored on the GPU machine (it skips if no GPU opens).
#![cfg(feature = "cuda")]

use super::{copies, grads_at, mixed_params, snap_adamw, snap_prodigy, TempFile};
use flame::optim::{
    AdamWScheduleFree, AdamWScheduleFreeConfig, Optimizer, ProdigyScheduleFree,
    ProdigyScheduleFreeConfig,
};
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

fn gpu() -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipping: no CUDA device ({e})");
            None
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_adamw_schedulefree_matches_the_cpu_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    let configs = [
        AdamWScheduleFreeConfig::default(),
        AdamWScheduleFreeConfig {
            weight_decay: 0.1,
            warmup_steps: 3,
            r: 0.5,
            weight_lr_power: 1.0,
            beta1: 0.95,
            ..Default::default()
        },
    ];
    for (ci, c) in configs.into_iter().enumerate() {
        let pc = mixed_params(&Device::Cpu);
        let pg = on(&pc, &gpu);
        let mut oc = AdamWScheduleFree::new(pc.clone(), c).unwrap();
        let mut og = AdamWScheduleFree::new(pg.clone(), c).unwrap();
        for k in 0..5 {
            oc.step(&grads_at(&pc, k)).unwrap();
            og.step(&grads_at(&pg, k)).unwrap();
        }
        assert_eq!(
            snap_adamw(&oc, &pc),
            snap_adamw(&og, &pg),
            "config {ci}, 5 steps"
        );
        oc.eval_mode().unwrap();
        og.eval_mode().unwrap();
        assert_eq!(snap_adamw(&oc, &pc), snap_adamw(&og, &pg), "config {ci}, x");
        // A GPU state file resumes on the CPU, still in step.
        let f = TempFile::new("sf-adamw-gpu");
        og.save_state(f.path()).unwrap();
        let pc2 = copies(&pc);
        let mut oc2 = AdamWScheduleFree::new(pc2.clone(), c).unwrap();
        oc2.load_state(f.path()).unwrap();
        oc2.train_mode().unwrap();
        og.train_mode().unwrap();
        for k in 5..8 {
            oc2.step_scaled(&grads_at(&pc2, k), 0.5).unwrap();
            og.step_scaled(&grads_at(&pg, k), 0.5).unwrap();
        }
        assert_eq!(
            snap_adamw(&oc2, &pc2),
            snap_adamw(&og, &pg),
            "config {ci}, resumed"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_prodigy_schedulefree_matches_the_cpu_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    let configs = [
        ProdigyScheduleFreeConfig::default(),
        ProdigyScheduleFreeConfig {
            weight_decay: 0.1,
            d_limiter: false,
            schedulefree_c: 8.0,
            beta3: Some(0.95),
            d_coef: 2.0,
            ..Default::default()
        },
    ];
    for (ci, c) in configs.into_iter().enumerate() {
        let pc = mixed_params(&Device::Cpu);
        let pg = on(&pc, &gpu);
        let mut oc = ProdigyScheduleFree::new(pc.clone(), c).unwrap();
        let mut og = ProdigyScheduleFree::new(pg.clone(), c).unwrap();
        for k in 0..5 {
            oc.step(&grads_at(&pc, k)).unwrap();
            og.step(&grads_at(&pg, k)).unwrap();
        }
        assert_eq!(
            snap_prodigy(&oc, &pc),
            snap_prodigy(&og, &pg),
            "config {ci}, 5 steps"
        );
        oc.eval_mode().unwrap();
        og.eval_mode().unwrap();
        assert_eq!(
            snap_prodigy(&oc, &pc),
            snap_prodigy(&og, &pg),
            "config {ci}, x"
        );
        let f = TempFile::new("sf-prodigy-gpu");
        og.save_state(f.path()).unwrap();
        let pc2 = copies(&pc);
        let mut oc2 = ProdigyScheduleFree::new(pc2.clone(), c).unwrap();
        oc2.load_state(f.path()).unwrap();
        oc2.train_mode().unwrap();
        og.train_mode().unwrap();
        for k in 5..8 {
            oc2.step_scaled(&grads_at(&pc2, k), 0.5).unwrap();
            og.step_scaled(&grads_at(&pg, k), 0.5).unwrap();
        }
        assert_eq!(
            snap_prodigy(&oc2, &pc2),
            snap_prodigy(&og, &pg),
            "config {ci}, resumed"
        );
    }
}
