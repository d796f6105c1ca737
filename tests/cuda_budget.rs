//! A budget on a GPU (run with --include-ignored on a GPU machine): its split between FLAME's
//! allocator and what the process holds outside it is measured once a device, the cap's arena
//! counts as the allocator's whether its bytes are in buffers or not, and the process holds
//! no more than the budget as the driver counts it. A test binary of its own: the arena is
//! made once a process, at the first request under a cap.
#![cfg(feature = "cuda")]

use flame::{DType, Device, Tensor};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_budget_is_split_once_and_its_arena_is_the_allocators() {
    let dev = Device::cuda(0).expect("a CUDA GPU");
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    let held = cuda.held_for_budget().unwrap();
    let (alloc, outside) = flame::memory::hold_to_budget(&dev, 2.0).unwrap();
    let (alloc, outside) = (alloc.unwrap(), outside.unwrap());
    assert_eq!(outside, held + flame::memory::LATE_HEADROOM);
    assert_eq!(alloc + outside, 2 * GIB);
    assert_eq!(
        cuda.memory().limit,
        alloc,
        "the allocator is capped at its share"
    );

    // The first request under the cap makes the arena: the cap less what is in use.
    let in_use = cuda.memory().in_use;
    let t = Tensor::full(1.5, (64 * MIB / 4) as usize, DType::F32, &dev).unwrap();
    let r = cuda.memory();
    assert_eq!(r.overflows, 0);
    let arena = (alloc - in_use) / (2 * MIB) * (2 * MIB);
    assert_eq!(
        r.arena_free + 64 * MIB,
        arena,
        "the arena's free bytes: {r:?}"
    );
    // Its unused part is not outside the allocator: what is outside is what was before
    // (plus the fill kernel's module, loaded on first use).
    let now = cuda.memory_outside_allocator().unwrap();
    assert!(
        now.abs_diff(held) < 32 * MIB,
        "outside the allocator: {now} bytes with the arena, {held} before it"
    );
    // The process holds the budget or less, as the driver counts it.
    let process = cuda.process_memory().unwrap();
    assert!(process <= 2 * GIB, "the process holds {process} bytes");
    // A later split gets the first one's share.
    assert_eq!(cuda.held_for_budget().unwrap(), held);
    assert_eq!(
        flame::memory::split_budget(&dev, 2.0).unwrap(),
        (Some(alloc), Some(outside))
    );
    assert!(t.to_vec::<f32>().unwrap().iter().all(|&x| x == 1.5));
    drop(t);
    cuda.set_memory_limit(None);
}
