//! Streamed blocks large enough for the cap's arena to fence (32 MiB and up): their uploads
//! wait only for the compute that last used the memory they land in (`memory::Fence`), and
//! the values must still be the resident ones bit for bit, with the wire code and without,
//! fences on and off. A chain of heavy products keeps the compute stream busy while the next
//! blocks upload into memory the chain freed a block or two before.
//!
//! Its own test binary: the cap's arena is made once a process, at the first request under a
//! cap.
#![cfg(feature = "cuda")]

use flame::memory::{BlockExec, BlockStreamer};
use flame::{DType, Device, Tensor};

/// Blocks in the chain, their width (a (D, D) bf16 weight is 37.9 MB, over the arena's 32 MiB
/// line), rows of the input.
const BLOCKS: usize = 6;
const D: usize = 4352;
const ROWS: usize = 4096;

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// One block: tanh(h W), W scaled to keep h in range.
fn block(h: &Tensor, w: &Tensor) -> flame::Result<Tensor> {
    h.matmul(w)?.tanh()
}

/// The output and the input's gradient of `passes` passes through the chain, every block
/// run through `exec` (streamed where it has a streamer).
fn chain(x: &Tensor, ws: &[Tensor], exec: &BlockExec, passes: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
    (0..passes)
        .map(|_| {
            let x = x.detach().requires_grad_().unwrap();
            let mut h = x.clone();
            for (i, w) in ws.iter().enumerate() {
                let w = w.clone();
                h = exec
                    .run(&format!("b{i}"), i, &[h], move |xs| {
                        Ok(vec![block(&xs[0], &w)?])
                    })
                    .unwrap()
                    .remove(0);
            }
            let grads = h.sum_all().unwrap().backward().unwrap();
            (bits(&h), bits(grads.get(&x).unwrap()))
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn large_blocks_streamed_under_a_cap_give_the_resident_values() {
    let dev = Device::cuda(0).expect("a CUDA GPU");
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    let scale = 1.0 / (D as f64).sqrt();
    let weights: Vec<Tensor> = (0..BLOCKS)
        .map(|i| {
            Tensor::randn((D, D), DType::BF16, &dev, 100 + i as u64)
                .unwrap()
                .affine(scale, 0.0)
                .unwrap()
        })
        .collect();
    let x = Tensor::randn((ROWS, D), DType::BF16, &dev, 7).unwrap();
    let want = chain(&x, &weights, &BlockExec::default(), 1).remove(0);
    cuda.synchronize().unwrap();
    cuda.empty_cache();
    // Room for three blocks in flight, the staging ring, the activations and their gradients:
    // the arena, cut from the top for the blocks.
    let before = cuda.memory();
    cuda.set_memory_limit(Some(before.in_use + (768 << 20)));
    for (code, fences) in [(true, true), (false, true), (true, false), (false, false)] {
        cuda.set_upload_fences(fences);
        let names: Vec<String> = (0..BLOCKS).map(|i| format!("b{i}")).collect();
        let s = BlockStreamer::new(&dev, names, 2);
        s.set_wire_code(code).unwrap();
        let handles: Vec<Tensor> = weights
            .iter()
            .enumerate()
            .map(|(i, w)| s.adopt(i, w).unwrap())
            .collect();
        let exec = BlockExec {
            streamer: Some(s.clone()),
            ..Default::default()
        };
        for (pass, got) in chain(&x, &handles, &exec, 3).into_iter().enumerate() {
            assert!(
                got == want,
                "wire code {code}, fences {fences}, pass {pass}: the streamed chain differs \
                 from the resident one"
            );
        }
        let report = s.report().unwrap();
        assert!(report.uploads >= 3 * BLOCKS as u64, "{report:?}");
        s.release_all().unwrap();
        cuda.synchronize().unwrap();
        assert_eq!(cuda.memory().overflows, before.overflows, "past the arena");
    }
    cuda.set_upload_fences(true);
    cuda.set_memory_limit(None);
}
