//! A small MLP learns a synthetic task on the CPU: classifying points of three interleaved
//! spirals (the classic toy problem of Stanford's CS231n notes), trained with AdamW.
//!
//!     cargo run --release --example mlp -- --steps 300
//!
//! Exits with an error if the loss did not fall to a tenth of its start.

use anyhow::{bail, Context};
use argh::FromArgs;
use flame::optim::{AdamConfig, AdamW, Optimizer};
use flame::{DType, Device, Tensor};

#[derive(FromArgs)]
/// Train a 2-64-64-3 MLP on three spirals.
struct Args {
    /// training steps (full batch)
    #[argh(option, default = "300")]
    steps: usize,
    /// learning rate of AdamW
    #[argh(option, default = "1e-2")]
    lr: f64,
    /// points per class
    #[argh(option, default = "100")]
    points: usize,
    /// seed of the data jitter and of the initial weights
    #[argh(option, default = "0")]
    seed: u64,
}

/// Three spirals of `n` points each: (3n, 2) coordinates and (3n,) u32 labels.
fn spirals(n: usize, seed: u64, dev: &Device) -> flame::Result<(Tensor, Tensor)> {
    let noise = Tensor::randn(3 * n, DType::F64, dev, seed)?.to_vec::<f64>()?;
    let (mut xy, mut labels) = (vec![], vec![]);
    for class in 0..3 {
        for i in 0..n {
            let r = i as f64 / n as f64;
            let theta = class as f64 * 4.0 + 4.0 * r + 0.2 * noise[class * n + i];
            xy.extend_from_slice(&[(r * theta.sin()) as f32, (r * theta.cos()) as f32]);
            labels.push(class as u32);
        }
    }
    Ok((
        Tensor::from_vec(xy, (3 * n, 2), dev)?,
        Tensor::from_vec(labels, 3 * n, dev)?,
    ))
}

struct Linear {
    weight: Tensor,
    bias: Tensor,
}

impl Linear {
    /// Kaiming-normal weights (He et al., 2015: std sqrt(2 / fan_in)), zero bias.
    fn new(fan_in: usize, fan_out: usize, dev: &Device, seed: u64) -> flame::Result<Self> {
        let std = (2.0 / fan_in as f64).sqrt();
        let weight = Tensor::randn_normal(0.0, std, (fan_in, fan_out), DType::F32, dev, seed)?
            .requires_grad_()?;
        let bias = Tensor::zeros(fan_out, DType::F32, dev)?.requires_grad_()?;
        Ok(Linear { weight, bias })
    }

    fn forward(&self, x: &Tensor) -> flame::Result<Tensor> {
        x.matmul(&self.weight)?.add(&self.bias)
    }
}

fn main() -> anyhow::Result<()> {
    let args: Args = argh::from_env();
    let dev = Device::Cpu;
    let (x, y) = spirals(args.points, args.seed, &dev)?;
    let layers = [
        Linear::new(2, 64, &dev, args.seed + 1)?,
        Linear::new(64, 64, &dev, args.seed + 2)?,
        Linear::new(64, 3, &dev, args.seed + 3)?,
    ];
    let forward = |x: &Tensor| -> flame::Result<Tensor> {
        let h = layers[0].forward(x)?.gelu()?;
        let h = layers[1].forward(&h)?.gelu()?;
        layers[2].forward(&h)
    };
    let params = layers
        .iter()
        .enumerate()
        .flat_map(|(i, l)| {
            [
                (format!("l{i}.weight"), l.weight.clone()),
                (format!("l{i}.bias"), l.bias.clone()),
            ]
        })
        .collect();
    let mut opt = AdamW::new(
        params,
        AdamConfig {
            lr: args.lr,
            weight_decay: 1e-4,
            ..Default::default()
        },
    )?;

    let start = std::time::Instant::now();
    let mut first = None;
    let mut last = f64::NAN;
    for step in 0..args.steps {
        let loss = forward(&x)?.cross_entropy(&y)?;
        last = loss.to_scalar_f64()?;
        first.get_or_insert(last);
        let grads = loss.backward()?;
        opt.step(&grads)?;
        if step % 25 == 0 || step + 1 == args.steps {
            println!("step {step:4}  loss {last:.4}");
        }
    }
    let accuracy = {
        let _g = flame::no_grad();
        let pred = forward(&x)?.argmax(1)?.to_vec::<u32>()?;
        let labels = y.to_vec::<u32>()?;
        pred.iter().zip(&labels).filter(|(a, b)| a == b).count() as f64 / labels.len() as f64
    };
    let first = first.context("no steps were run")?;
    println!(
        "loss {first:.4} -> {last:.4}, train accuracy {:.1}%, {:.2}s for {} steps",
        100.0 * accuracy,
        start.elapsed().as_secs_f64(),
        args.steps
    );
    if last.is_nan() || last >= first / 10.0 {
        bail!("the loss did not fall to a tenth of its start ({first:.4} -> {last:.4})");
    }
    Ok(())
}
