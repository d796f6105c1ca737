//! How far 8-bit products (`model.compute = "fp8"` and "int8") land from bf16 ones at
//! Flux-dev's Linear shapes. For each frozen Linear of a block, the relative error (the
//! Frobenius norm of the difference over that of the bf16 product) of the forward `y = x W^T`
//! and of the backward's input gradient `dx = dy W`, computed as the Linear computes them: x
//! and dy quantized to FP8 E4M3 or int8 a token at a time (`Tensor::quant_rows8`), W an
//! output channel at a time, the weight's row scales folded into dy's columns in the
//! backward, the codes multiplied with one rounding (`flame::product8`); int8 also with its
//! outlier treatment (the inner axis rotated by a block Hadamard matrix, `hadamard_rows`). The bf16 product takes the same bf16 operands and sums in
//! f32 (a tensor core's bf16 GEMM); its own distance from the f32 product is printed beside it
//! for scale.
//!
//! Weights are N(0, 1/in). Activations are normal with a log-normal spread of channel scales
//! (e^N(0, 1/2)), and with `--outliers K` K channels 50 times larger, as transformer
//! activations carry a few massive channels; output gradients have a log-normal spread of
//! token scales. On the CPU the quantization is bit for bit the CUDA kernels' and the products
//! differ from cuBLASLt's only in the order of their f32 sums.
//!
//!     cargo run --release --example fp8_error -- --tokens 512 --outliers 8

use anyhow::Context;
use argh::FromArgs;
use flame::backend::fp8::Code8;
use flame::{DType, Device, Tensor};

#[derive(FromArgs)]
/// Relative error of FP8 and int8 products against bf16 ones at Flux-dev's Linear shapes.
struct Args {
    /// tokens (rows of the activations)
    #[argh(option, default = "512")]
    tokens: usize,
    /// channels of the activations made 50 times larger
    #[argh(option, default = "0")]
    outliers: usize,
    /// cpu (default) or cuda
    #[argh(option, default = "String::from(\"cpu\")")]
    device: String,
    /// seed of the weights and activations
    #[argh(option, default = "0")]
    seed: u64,
}

/// `||a - b|| / ||b||` over two tensors of one shape.
fn rel(a: &Tensor, b: &Tensor) -> flame::Result<f64> {
    let (a, b) = (a.to_vec_f64()?, b.to_vec_f64()?);
    let (mut d, mut n) = (0.0, 0.0);
    for (x, y) in a.iter().zip(&b) {
        d += (x - y) * (x - y);
        n += y * y;
    }
    Ok((d / n.max(f64::MIN_POSITIVE)).sqrt())
}

/// Normal (rows, cols) f32 values, each column (or row, `by_row`) scaled by e^N(0, 1/2), and
/// the first `outliers` columns by 50 more.
fn spread(
    rows: usize,
    cols: usize,
    by_row: bool,
    outliers: usize,
    dev: &Device,
    seed: u64,
) -> flame::Result<Tensor> {
    let x = Tensor::randn((rows, cols), DType::F32, dev, seed)?;
    let n = if by_row { rows } else { cols };
    let mut s = Tensor::randn_normal(0.0, 0.5_f64.sqrt(), n, DType::F32, dev, seed + 1)?
        .exp()?
        .to_vec::<f32>()?;
    for v in s.iter_mut().take(if by_row { 0 } else { outliers }) {
        *v *= 50.0;
    }
    let s = match by_row {
        true => Tensor::from_vec(s, (rows, 1), dev)?,
        false => Tensor::from_vec(s, (1, cols), dev)?,
    };
    x.mul(&s)
}

/// The forward's and the backward's relative errors of the FP8 and the int8 products against
/// the bf16 ones, and the bf16 ones' against f32, for a Linear `inp` -> `out` over `tokens`
/// rows.
fn layer(inp: usize, out: usize, a: &Args, dev: &Device, seed: u64) -> flame::Result<[f64; 8]> {
    let _g = flame::no_grad();
    let w = Tensor::randn_normal(
        0.0,
        (1.0 / inp as f64).sqrt(),
        (out, inp),
        DType::F32,
        dev,
        seed,
    )?;
    let x = spread(a.tokens, inp, false, a.outliers, dev, seed + 2)?;
    let dy = spread(a.tokens, out, true, 0, dev, seed + 4)?;
    // The bf16 operands, multiplied in f32.
    let bf = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
    let (wb, xb, dyb) = (bf(&w)?, bf(&x)?, bf(&dy)?);
    let y32 = x.matmul(&w.t()?)?;
    let y16 = xb.matmul(&wb.t()?)?;
    let dx32 = dy.matmul(&w)?;
    let dx16 = dyb.matmul(&wb)?;
    let ones = Tensor::ones(inp, DType::F32, dev)?;
    // With `block`, the inner axis rotated first (int8's outlier treatment: x H and W H,
    // dx rotated back).
    let eight = |code: Code8, block: Option<usize>| -> flame::Result<[f64; 2]> {
        let rot = |t: Tensor| match block {
            Some(b) => t.hadamard_rows(b),
            None => Ok(t),
        };
        // The 8-bit forward: x and W quantized a row at a time.
        let (qx, sx) = rot(xb.to_dtype(DType::BF16)?)?.quant_rows8(code, None)?;
        let (qw, sw) = rot(wb.to_dtype(DType::BF16)?)?.quant_rows8(code, None)?;
        let y8 = flame::product8(code, &qx, &sx, &qw, &sw, DType::F32)?;
        // The 8-bit backward: W's row scales folded into dy's columns, dy quantized a row at
        // a time, multiplied by the codes transposed.
        let (qg, sg) = dyb.to_dtype(DType::BF16)?.quant_rows8(code, Some(&sw))?;
        let dx8 = flame::product8(code, &qg, &sg, &qw.transpose_fp8()?, &ones, DType::F32)?;
        Ok([rel(&y8, &y16)?, rel(&rot(dx8)?, &dx16)?])
    };
    let block = flame::backend::int8::rotation_block(inp);
    let (f, i) = (eight(Code8::E4m3, None)?, eight(Code8::Int8, None)?);
    let r = eight(Code8::Int8, block)?;
    Ok([
        f[0],
        f[1],
        i[0],
        i[1],
        r[0],
        r[1],
        rel(&y16, &y32)?,
        rel(&dx16, &dx32)?,
    ])
}

fn main() -> anyhow::Result<()> {
    let a: Args = argh::from_env();
    let dev = Device::by_name(&a.device).context("--device")?;
    // Flux-dev's frozen Linears in a block (BFL names), width 3072, MLP 12288.
    let shapes = [
        ("double img_attn.qkv", 3072, 9216),
        ("double img_attn.proj", 3072, 3072),
        ("double img_mlp.0", 3072, 12288),
        ("double img_mlp.2", 12288, 3072),
        ("single linear1", 3072, 21504),
        ("single linear2", 15360, 3072),
    ];
    println!(
        "{} tokens, {} outlier channels, {}: relative error of the 8-bit products against the \
         bf16 one (the bf16 one against f32 beside it)",
        a.tokens, a.outliers, a.device
    );
    println!(
        "layer | in | out | FP8 forward | FP8 backward (dx) | int8 forward | int8 backward (dx) \
         | int8 rotated forward | int8 rotated backward | bf16 forward | bf16 backward"
    );
    println!("---|---|---|---|---|---|---|---|---|---|---");
    for (i, (name, inp, out)) in shapes.into_iter().enumerate() {
        let e = layer(inp, out, &a, &dev, a.seed + 10 * i as u64)
            .with_context(|| format!("{name} ({inp} -> {out})"))?;
        println!(
            "{name} | {inp} | {out} | {:.2e} | {:.2e} | {:.2e} | {:.2e} | {:.2e} | {:.2e} | {:.2e} \
             | {:.2e}",
            e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]
        );
    }
    Ok(())
}
