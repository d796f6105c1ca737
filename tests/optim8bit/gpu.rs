//! AdamW8bit on CUDA against the CPU reference: the same steps on random parameters and
//! gradients of odd sizes (one value, a partial block, just past one block, just past the
//! 4096 threshold, a large prime-ish size), for f32, bf16 and f16. The kernel does the CPU's
//! f32 operations in the same order with no fused multiply-add (cuda/adam8bit.cu), so codes,
//! absmax and parameters must agree bit for bit: the tolerance is zero. Needs a GPU: ignored
//! elsewhere; run with --include-ignored on the GPU machine (it skips if no GPU opens).
#![cfg(feature = "cuda")]

use super::{bits, cfg8, copies, grads_at, param_on, state_tensors, Lcg, TempFile};
use flame::optim::{AdamW8bit, Optimizer};
use flame::{DType, Device, Tensor};

const SIZES: [usize; 5] = [1, 255, 257, 4097, 100_003];

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

fn assert_same(
    what: &str,
    cpu: &AdamW8bit,
    gpu: &AdamW8bit,
    pc: &[(String, Tensor)],
    pg: &[(String, Tensor)],
) {
    for ((name, a), (_, b)) in pc.iter().zip(pg) {
        assert!(b.device().is_cuda() && !a.device().is_cuda());
        assert_eq!(bits(a), bits(b), "{what}: parameter {name}");
        let (sa, sb) = (cpu.state(name).unwrap(), gpu.state(name).unwrap());
        assert_eq!(sa.step(), sb.step());
        assert!(sa.is_quantized() && sb.is_quantized(), "{name}: quantized");
        for (i, (ta, tb)) in state_tensors(sa)
            .iter()
            .zip(state_tensors(sb).iter())
            .enumerate()
        {
            assert_eq!(bits(ta), bits(tb), "{what}: state tensor {i} of {name}");
        }
    }
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
    let cpu = Device::Cpu;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let mut r = Lcg(17);
        let pc: Vec<(String, Tensor)> = SIZES
            .iter()
            .map(|&n| (format!("p{n}"), param_on(r.vec(n), &[n], dtype, &cpu)))
            .collect();
        let pg = on(&pc, &gpu);
        // min_8bit_size 1: every size takes the 8-bit kernel.
        let c = cfg8(1e-3, 0.01, 1);
        let mut oc = AdamW8bit::new(pc.clone(), c).unwrap();
        let mut og = AdamW8bit::new(pg.clone(), c).unwrap();
        for k in 0..5 {
            oc.step(&grads_at(&pc, k)).unwrap();
            og.step(&grads_at(&pg, k)).unwrap();
        }
        assert_same(&format!("{dtype} after 5 steps"), &oc, &og, &pc, &pg);

        // A GPU state file resumes on the CPU (and the other way), still in step.
        let f = TempFile::new("gpu");
        og.save_state(f.path()).unwrap();
        let pc2 = copies(&pc);
        let mut oc2 = AdamW8bit::new(pc2.clone(), c).unwrap();
        oc2.load_state(f.path()).unwrap();
        for k in 5..7 {
            oc2.step(&grads_at(&pc2, k)).unwrap();
            og.step(&grads_at(&pg, k)).unwrap();
        }
        assert_same(&format!("{dtype} resumed"), &oc2, &og, &pc2, &pg);
    }
}

/// The multi-tensor f32-moment step (AdamW and Adam's L2 form, scaled gradients) and the
/// multi-tensor sum of squares on CUDA against the CPU: parameters of three dtypes and odd
/// sizes in one optimizer (one launch per dtype), bit for bit; the sums within f64 rounding
/// (the reduction order differs).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_multi_tensor_adam_and_sum_sq_match_the_cpu() {
    use super::{adam, grads_times, mixed_params};
    use flame::optim::{Adam, AdamW};
    let gpu = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping: no CUDA device ({e})");
            return;
        }
    };
    for decoupled in [true, false] {
        let pc = mixed_params(&Device::Cpu);
        let pg = on(&pc, &gpu);
        let make = |p: Vec<(String, Tensor)>| -> Box<dyn Optimizer> {
            if decoupled {
                Box::new(AdamW::new(p, adam(1e-3, 0.05)).unwrap())
            } else {
                Box::new(Adam::new(p, adam(1e-3, 0.05)).unwrap())
            }
        };
        let (mut oc, mut og) = (make(pc.clone()), make(pg.clone()));
        for k in 0..4 {
            oc.step_scaled(&grads_times(&pc, k, 8.0), 0.125).unwrap();
            og.step_scaled(&grads_times(&pg, k, 8.0), 0.125).unwrap();
        }
        for ((name, a), (_, b)) in pc.iter().zip(&pg) {
            assert_eq!(bits(a), bits(b), "decoupled {decoupled}: {name}");
        }
        let (tc, tg): (Vec<&Tensor>, Vec<&Tensor>) =
            pc.iter().zip(&pg).map(|((_, a), (_, b))| (a, b)).unzip();
        let (sc, sg) = (
            flame::sum_sq_multi(&tc).unwrap(),
            flame::sum_sq_multi(&tg).unwrap(),
        );
        assert!((sc - sg).abs() <= 1e-12 * sc, "sum of squares {sc} vs {sg}");
        assert_eq!(sg, flame::sum_sq_multi(&tg).unwrap(), "deterministic");
    }
    let bad = Tensor::from_vec(vec![1f32, f32::INFINITY, 2.0], 3, &gpu).unwrap();
    assert!(!flame::sum_sq_multi(&[&bad]).unwrap().is_finite());
}
