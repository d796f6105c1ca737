//! The optimizer's parameter groups of a run: the adapters' tensors split by the learning
//! rate they train at, from `[[adapter.blocks]]` (a block's `lr`) and
//! `adapter.loraplus_lr_ratio` (LoRA+: the factor that starts at zero, `Kind::loraplus_up`,
//! at the ratio times its block's rate). Without either, one group of every tensor in the
//! order of `Adapters::params`, the optimizer as it always was.

use super::config::TrainConfig;
use crate::nn::Adapters;
use crate::optim::ParamGroup;
use crate::Result;

/// The parameter groups of `adapters` under `config`: one per (block with an `lr`, or none)
/// and (LoRA+ factor, or not) that holds a tensor, in the order of their first tensor, each
/// at its rate over `optimizer.lr`.
pub fn param_groups(config: &TrainConfig, adapters: &Adapters) -> Result<Vec<ParamGroup>> {
    let kind = adapters.kind()?;
    let ratio = config.adapter.loraplus_lr_ratio;
    let base = config.optimizer.lr();
    let blocks = adapters.blocks();
    let mut groups: Vec<((Option<usize>, bool), ParamGroup)> = vec![];
    for l in adapters.layers()? {
        // The block whose lr this layer's adapter trains at (the first that matches, if it
        // sets one).
        let block = adapters
            .block_of(l.path())
            .filter(|&i| blocks.get(i).is_some_and(|b| b.lr.is_some()));
        let block_lr = block.and_then(|i| blocks.get(i)).and_then(|b| b.lr);
        // The names in the set (a fused layer adapted per projection names each projection's
        // tensors apart), beside the tensor names the kind's LoRA+ rule reads.
        let short = l.params().into_iter().map(|(n, _)| n);
        for (n, (name, t)) in short.zip(l.named_params()) {
            let up = ratio != 1.0 && kind.loraplus_up.contains(&n);
            let key = (block, up);
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, g)) => g.params.push((name, t)),
                None => {
                    let lr = block_lr.unwrap_or(base) * if up { ratio } else { 1.0 };
                    let group = match block {
                        Some(i) => format!("block{}", i + 1),
                        None => "default".to_string(),
                    };
                    groups.push((
                        key,
                        ParamGroup {
                            name: if up {
                                format!("{group}.loraplus")
                            } else {
                                group
                            },
                            lr_scale: lr / base,
                            weight_decay: None,
                            params: vec![(name, t)],
                        },
                    ));
                }
            }
        }
    }
    Ok(groups.into_iter().map(|(_, g)| g).collect())
}

/// One line per `[[adapter.blocks]]` entry: its pattern, how many targeted layers it decides
/// (the first matching entry decides a layer; a rank-0 entry's layers are left without an
/// adapter) and its settings.
pub fn block_report(config: &TrainConfig, adapters: &Adapters) -> Result<Vec<String>> {
    let blocks = adapters.blocks();
    let mut counts = vec![0usize; blocks.len()];
    let paths = adapters
        .layers()?
        .iter()
        .map(|l| l.path().to_string())
        .collect::<Vec<_>>();
    for p in paths.iter().chain(&adapters.left_out()?) {
        if let Some(c) = adapters.block_of(p).and_then(|i| counts.get_mut(i)) {
            *c += 1;
        }
    }
    Ok(blocks
        .iter()
        .zip(counts)
        .map(|(b, n)| {
            let mut what = vec![];
            if let Some(lr) = b.lr {
                what.push(format!("lr {lr}"));
            }
            if let Some(r) = b.rank {
                what.push(format!("rank {r}"));
            }
            if let Some(a) = b.alpha {
                what.push(format!("alpha {a}"));
            }
            let settings = match what.is_empty() {
                true => "no settings".to_string(),
                false => what.join(", "),
            };
            let s = if n == 1 { "" } else { "s" };
            match (n, b.rank) {
                (0, _) => format!(
                    "adapter.blocks {:?} matched no targeted layer (none matches it, or an \
                     earlier pattern takes them) ({settings})",
                    b.pattern
                ),
                (n, Some(0)) => format!(
                    "adapter.blocks {:?} matched {n} targeted layer{s}: rank 0, left without \
                     an adapter",
                    b.pattern
                ),
                (n, _) => format!(
                    "adapter.blocks {:?} matched {n} targeted layer{s} ({settings}{})",
                    b.pattern,
                    match config.adapter.loraplus_lr_ratio {
                        r if r != 1.0 => format!("; LoRA+ ratio {r}"),
                        _ => String::new(),
                    }
                ),
            }
        })
        .collect())
}
