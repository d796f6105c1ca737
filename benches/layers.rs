//! Layer throughput at Flux and SDXL shapes, bf16, forward and forward+backward (run on the GPU
//! machine; benches/torch_layers.py times PyTorch eager on the same shapes in the same call).
//! GB/s counts the fewest bytes each pass must move: forward reads x (and small parameters)
//! and writes y; backward also reads dy and writes dx. Conv2d reports TFLOP/s.

mod common;

use flame::nn::{apply_rope, conv2d, modulate};
use flame::{DType, Device, Grads, Result, Tensor};

const ITERS: usize = 100;

fn time<R>(dev: &flame::cuda::CudaDevice, f: impl FnMut() -> Result<R>) -> Result<f64> {
    common::time(dev, 5, ITERS, f)
}

/// Times y = op(x) and y = op(x); dx = backward(dy), and prints both.
fn layer(
    cuda: &flame::cuda::CudaDevice,
    name: &str,
    x: &Tensor,
    op: impl Fn(&Tensor) -> Result<Tensor>,
    copy: f64,
) -> Result<()> {
    layer_p(cuda, name, x, &[], |x, _| op(x), copy)
}

/// Like `layer`, with parameters whose gradients the backward also computes (the full
/// fine-tuning case).
fn layer_p(
    cuda: &flame::cuda::CudaDevice,
    name: &str,
    x: &Tensor,
    params: &[&Tensor],
    op: impl Fn(&Tensor, &[Tensor]) -> Result<Tensor>,
    copy: f64,
) -> Result<()> {
    let bytes = (x.elem_count() * 2) as f64; // bf16
    let frozen: Vec<Tensor> = params.iter().map(|p| p.detach()).collect();
    let fwd = time(cuda, || op(x, &frozen).map(|_| ()))?;
    let xv = x.detach().requires_grad_()?;
    let pv = params
        .iter()
        .map(|p| p.detach().requires_grad_())
        .collect::<Result<Vec<_>>>()?;
    let dy = op(x, &frozen)?.ones_like()?.affine(0.5, 0.0)?;
    let both = time(cuda, || {
        let mut g = Grads::new();
        op(&xv, &pv)?.backward_with_grad(&dy, &mut g, false)
    })?;
    let (f_gbs, b_gbs) = (2.0 * bytes / fwd / 1e9, 5.0 * bytes / both / 1e9);
    println!(
        "flame {name:<32} fwd {:7.3} ms {f_gbs:7.0} GB/s {:5.1}% | fwd+bwd {:7.3} ms {b_gbs:7.0} GB/s {:5.1}%",
        fwd * 1e3,
        100.0 * f_gbs / copy,
        both * 1e3,
        100.0 * b_gbs / copy
    );
    Ok(())
}

fn main() -> Result<()> {
    let dev = Device::cuda(0)?;
    let Device::Cuda(cuda) = &dev else {
        return Ok(());
    };
    // The copy ceiling: a bf16 copy of the Flux activation through FLAME's own copy kernel
    // would measure FLAME; use the driver's memcpy like benches/kernels.rs.
    let stream = cuda.stream();
    let n = 4608 * 3072;
    let src = stream
        .alloc_zeros::<u16>(n)
        .map_err(|e| flame::Error::Cuda(format!("{e:?}")))?;
    let mut dst = stream
        .alloc_zeros::<u16>(n)
        .map_err(|e| flame::Error::Cuda(format!("{e:?}")))?;
    let copy_s = time(cuda, || {
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| flame::Error::Cuda(format!("{e:?}")))
    })?;
    let copy = 2.0 * (2 * n) as f64 / copy_s / 1e9;
    println!("flame copy_d2d (4608x3072 bf16)          {copy:7.0} GB/s");

    let x = Tensor::randn((4608, 3072), DType::BF16, &dev, 1)?;
    let w = Tensor::randn(3072, DType::BF16, &dev, 2)?;
    let shift = Tensor::randn((1, 3072), DType::BF16, &dev, 3)?;
    let scale = Tensor::randn((1, 3072), DType::BF16, &dev, 4)?;
    layer(
        cuda,
        "layer_norm (no affine)",
        &x,
        |x| x.layer_norm(None, None, 1e-6),
        copy,
    )?;
    layer(
        cuda,
        "layer_norm (affine)",
        &x,
        |x| x.layer_norm(Some(&w), Some(&w), 1e-6),
        copy,
    )?;
    layer_p(
        cuda,
        "layer_norm (affine, dw db)",
        &x,
        &[&w, &w],
        |x, p| x.layer_norm(Some(&p[0]), Some(&p[1]), 1e-6),
        copy,
    )?;
    layer(cuda, "softmax (4608x3072)", &x, |x| x.softmax(-1), copy)?;
    layer(cuda, "gelu_tanh", &x, |x| x.gelu_tanh(), copy)?;
    layer(cuda, "silu", &x, |x| x.silu(), copy)?;
    layer(cuda, "modulate", &x, |x| modulate(x, &shift, &scale), copy)?;
    layer_p(
        cuda,
        "modulate (dshift dscale)",
        &x,
        &[&shift, &scale],
        |x, p| modulate(x, &p[0], &p[1]),
        copy,
    )?;
    let q = Tensor::randn((1, 24, 4608, 128), DType::BF16, &dev, 5)?;
    let qw = Tensor::randn(128, DType::BF16, &dev, 6)?;
    layer(
        cuda,
        "rms_norm (head dim 128)",
        &q,
        |x| x.rms_norm(Some(&qw), 1e-6),
        copy,
    )?;
    layer_p(
        cuda,
        "rms_norm (head dim 128, dw)",
        &q,
        &[&qw],
        |x, p| x.rms_norm(Some(&p[0]), 1e-6),
        copy,
    )?;
    let pos = Tensor::arange(0.0, 4608.0, DType::F32, &dev)?.reshape((1, 4608))?;
    let freqs = flame::nn::rope(&pos, 128, 10_000.0)?.unsqueeze(1)?;
    layer(
        cuda,
        "apply_rope (1,24,4608,128)",
        &q,
        |x| apply_rope(x, &freqs),
        copy,
    )?;
    let g = Tensor::randn((2, 320, 128, 128), DType::BF16, &dev, 7)?;
    let gw = Tensor::randn(320, DType::BF16, &dev, 8)?;
    layer(
        cuda,
        "group_norm SDXL (2,320,128,128)",
        &g,
        |x| x.group_norm(32, Some(&gw), Some(&gw), 1e-5),
        copy,
    )?;
    layer_p(
        cuda,
        "group_norm SDXL (dw db)",
        &g,
        &[&gw, &gw],
        |x, p| x.group_norm(32, Some(&p[0]), Some(&p[1]), 1e-5),
        copy,
    )?;

    // Conv2d 3x3, 320 -> 320 at 128x128, batch 2: 2 * N * Cout * Ho * Wo * Cin * 9 FLOPs.
    let cw = Tensor::randn((320, 320, 3, 3), DType::BF16, &dev, 9)?.affine(0.02, 0.0)?;
    let flops = 2.0 * 2.0 * 320.0 * 128.0 * 128.0 * 320.0 * 9.0;
    let fwd = time(cuda, || {
        conv2d(&g, &cw, None, (1, 1), (1, 1), (1, 1), 1).map(|_| ())
    })?;
    let gv = g.detach().requires_grad_()?;
    let wv = cw.detach().requires_grad_()?;
    let dy = conv2d(&g, &cw, None, (1, 1), (1, 1), (1, 1), 1)?.ones_like()?;
    let both = time(cuda, || {
        let mut grads = Grads::new();
        conv2d(&gv, &wv, None, (1, 1), (1, 1), (1, 1), 1)?
            .backward_with_grad(&dy, &mut grads, false)
    })?;
    println!(
        "flame conv2d 3x3 320->320 128x128 b2   fwd {:7.3} ms {:6.1} TFLOP/s | fwd+bwd {:7.3} ms {:6.1} TFLOP/s",
        fwd * 1e3,
        flops / fwd / 1e12,
        both * 1e3,
        3.0 * flops / both / 1e12
    );
    // Where the convolution's time goes: the im2col pass and the GEMM on its columns.
    let win = flame::Window2d {
        kernel: (3, 3),
        stride: (1, 1),
        padding: (1, 1),
        dilation: (1, 1),
    };
    let im2col = time(cuda, || g.unfold2d(win).map(|_| ()))?;
    let cols = g.unfold2d(win)?.reshape((2, 1, 2880, 128 * 128))?;
    let w2 = cw.reshape((1, 320, 2880))?;
    let gemm = time(cuda, || w2.matmul(&cols).map(|_| ()))?;
    let flat = cols.reshape((2, 2880, 128 * 128))?;
    let col2im = time(cuda, || flat.fold2d(win, (128, 128)).map(|_| ()))?;
    let moved = (cols.elem_count() * 2 + g.elem_count() * 2) as f64;
    println!(
        "flame conv2d parts: im2col {:7.3} ms ({:6.0} GB/s) | GEMM {:7.3} ms ({:6.1} TFLOP/s) | col2im {:7.3} ms ({:6.0} GB/s)",
        im2col * 1e3,
        moved / im2col / 1e9,
        gemm * 1e3,
        flops / gemm / 1e12,
        col2im * 1e3,
        moved / col2im / 1e9
    );
    // The cost of a call when the GPU work is negligible: the host's share (tensor layer,
    // allocation, launch), which the figures above hide only while it stays under the kernel.
    let small = Tensor::randn((8, 3072), DType::BF16, &dev, 10)?;
    let host_ln = time(cuda, || {
        small.layer_norm(Some(&w), Some(&w), 1e-6).map(|_| ())
    })?;
    let host_gelu = time(cuda, || small.gelu_tanh().map(|_| ()))?;
    let sq = Tensor::randn((1, 24, 8, 128), DType::BF16, &dev, 11)?;
    let sf = freqs.narrow(2, 0, 8)?;
    let host_rope = time(cuda, || apply_rope(&sq, &sf).map(|_| ()))?;
    println!(
        "flame per-call time at tiny sizes: layer_norm {:.1} us | gelu_tanh {:.1} us | apply_rope {:.1} us",
        host_ln * 1e6,
        host_gelu * 1e6,
        host_rope * 1e6
    );
    let m = cuda.memory();
    println!("flame memory: peak {} MiB", m.peak >> 20);
    Ok(())
}
