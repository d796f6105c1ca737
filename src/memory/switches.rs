//! The planner's switches: developer settings that turn one of its techniques off for every
//! plan it weighs, to measure what the technique gains or to rule it out while hunting a
//! fault. They are not config keys: a user's `[memory]` says how much memory a run may hold,
//! and the planner decides how. The `train` and `sample` binaries read them from the
//! environment variable [`Switches::VAR`] (`FLAME_PLANNER="wire_code=off,measure_machine=off"`).

use super::{MemoryProfile, Plan, Weighed};
use crate::{Error, Result};

/// Which of the planner's techniques it may use. Every one is on by default but
/// `offload_kept`, `raw_backward` and `ahead_products`, which did not pay for themselves on
/// the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Switches {
    /// Checkpointed blocks keep the outputs of Linears that see few rows
    /// (`autograd::Keep::few_rows`), whose weights streamed blocks then leave out of the
    /// backward's uploads.
    pub keep_few_rows: bool,
    /// Streamed bf16 weights cross the host link in its lossless code (`Plan::wire_code`).
    pub wire_code: bool,
    /// With the wire code, the blocks the backward leaves for the next forward cross uncoded
    /// (`Plan::uncoded_carry`).
    pub uncoded_carry: bool,
    /// With the wire code, the backward's uploads may cross uncoded (`Plan::raw_backward`).
    /// Off by default: the planner does not weigh them (a plan given by hand may still ask
    /// for it). Measured on an H200: 8.5% off SDXL's step within 4 GiB where the host paced
    /// it, nothing where the host was fast (docs/MEMORY.md), at twice the streamed blocks'
    /// pinned memory.
    pub raw_backward: bool,
    /// The backward may compute the products of the streamed blocks' Linears over the
    /// model's context for the next forward, whose uploads then leave their weights out
    /// (`Plan::ahead_products`). Off by default: the planner does not weigh such plans (a
    /// plan given by hand may still ask for it). Measured on an H200 (docs/MEMORY.md): SDXL's
    /// forward within 4 GiB 4 ms faster for 0.25 GiB less on the link, the step's time level
    /// within the spread of the host's pace.
    pub ahead_products: bool,
    /// With the wire code, the backward's end crosses the next forward's first coded uploads
    /// into the staging ring (`Plan::cross_ahead`).
    pub cross_ahead: bool,
    /// The forward fetches further ahead where memory allows (`Plan::deep_prefetch`).
    pub deep_prefetch: bool,
    /// Streamed blocks' Linears over the conditioning vector compute on the host
    /// (`Plan::host_products`).
    pub host_products: bool,
    /// Resident blocks' 8-bit weights may transpose their codes at each backward instead of
    /// keeping them transposed (`Plan::remake_transposes`).
    pub remake_transposes: bool,
    /// Checkpointed blocks' re-runs may be issued on a second host thread
    /// (`Plan::rerun_ahead`).
    pub rerun_ahead: bool,
    /// Plans that offload block inputs may also keep their kept outputs in host memory
    /// (`Plan::offload_kept`). Off by default: the planner does not weigh them (a plan given
    /// by hand may still ask for it).
    pub offload_kept: bool,
    /// The time model plays this machine's rates, measured before loading or read from the
    /// cache (`measure_machine`); off, it plays `Machine::REFERENCE`.
    pub measure_machine: bool,
}

impl Default for Switches {
    fn default() -> Self {
        Switches {
            keep_few_rows: true,
            wire_code: true,
            uncoded_carry: true,
            raw_backward: false,
            ahead_products: false,
            cross_ahead: true,
            deep_prefetch: true,
            host_products: true,
            remake_transposes: true,
            rerun_ahead: true,
            offload_kept: false,
            measure_machine: true,
        }
    }
}

impl Switches {
    /// The environment variable the binaries read the switches from: comma-separated
    /// `name=on|off` pairs, names as the fields'.
    pub const VAR: &'static str = "FLAME_PLANNER";

    /// The switches' names, as the fields'.
    pub const NAMES: [&'static str; 12] = [
        "keep_few_rows",
        "wire_code",
        "uncoded_carry",
        "raw_backward",
        "ahead_products",
        "cross_ahead",
        "deep_prefetch",
        "host_products",
        "remake_transposes",
        "rerun_ahead",
        "offload_kept",
        "measure_machine",
    ];

    /// The switch of `name` (one of [`Switches::NAMES`]).
    pub fn get(&self, name: &str) -> Option<bool> {
        let mut s = *self;
        s.get_mut(name).map(|b| *b)
    }

    /// The switch of `name` to set (one of [`Switches::NAMES`]).
    pub fn get_mut(&mut self, name: &str) -> Option<&mut bool> {
        Some(match name {
            "keep_few_rows" => &mut self.keep_few_rows,
            "wire_code" => &mut self.wire_code,
            "uncoded_carry" => &mut self.uncoded_carry,
            "raw_backward" => &mut self.raw_backward,
            "ahead_products" => &mut self.ahead_products,
            "cross_ahead" => &mut self.cross_ahead,
            "deep_prefetch" => &mut self.deep_prefetch,
            "host_products" => &mut self.host_products,
            "remake_transposes" => &mut self.remake_transposes,
            "rerun_ahead" => &mut self.rerun_ahead,
            "offload_kept" => &mut self.offload_kept,
            "measure_machine" => &mut self.measure_machine,
            _ => return None,
        })
    }

    /// The defaults with `text`'s pairs applied (`"wire_code=off, measure_machine=on"`; an
    /// empty text changes nothing). An unknown name or a value other than on/off/true/false
    /// is an error naming it.
    pub fn parse(text: &str) -> Result<Self> {
        Switches::default().with(text)
    }

    /// These switches with `text`'s pairs applied (as [`Switches::parse`] reads them).
    pub fn with(self, text: &str) -> Result<Self> {
        let mut s = self;
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad = |why: String| Error::Stream(format!("{}: \"{pair}\": {why}", Self::VAR));
            let (name, value) = pair
                .split_once('=')
                .ok_or_else(|| bad("expected name=on or name=off".into()))?;
            let on = match value.trim() {
                "on" | "true" => true,
                "off" | "false" => false,
                v => return Err(bad(format!("\"{v}\" is not on or off"))),
            };
            let name = name.trim();
            *s.get_mut(name).ok_or_else(|| {
                bad(format!(
                    "no switch \"{name}\" (there are {})",
                    Self::NAMES.join(", ")
                ))
            })? = on;
        }
        Ok(s)
    }

    /// These switches with the environment's pairs applied ([`Switches::VAR`]; unchanged
    /// where it is unset).
    pub fn with_env(self) -> Result<Self> {
        match std::env::var(Self::VAR) {
            Ok(v) => self.with(&v),
            Err(std::env::VarError::NotPresent) => Ok(self),
            Err(e) => Err(Error::Stream(format!("{}: {e}", Self::VAR))),
        }
    }

    /// The switches that differ from the defaults, as [`Switches::parse`] reads them (empty
    /// for the defaults).
    pub fn show(&self) -> String {
        let base = Switches::default();
        Self::NAMES
            .iter()
            .filter_map(|n| {
                let (a, b) = (self.get(n)?, base.get(n)?);
                (a != b).then(|| format!("{n}={}", if a { "on" } else { "off" }))
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `plan` as these switches allow it: `None` where it needs a technique switched off
    /// that it cannot do without (the wire code, uncoded carried blocks, remade transposes,
    /// re-runs issued ahead: the same plan without them is a candidate too); the deep
    /// prefetch, the crossing at the backward's end, host products and kept few-row outputs
    /// dropped where off.
    pub fn allow(&self, plan: Plan) -> Option<Plan> {
        if (plan.wire_code && !self.wire_code)
            || (plan.uncoded_carry && !self.uncoded_carry)
            || (plan.raw_backward && !self.raw_backward)
            || (plan.ahead_products && !self.ahead_products)
            || (plan.remake_transposes && !self.remake_transposes)
            || (plan.rerun_ahead && !self.rerun_ahead)
            || (plan.offload_kept && !self.offload_kept)
        {
            return None;
        }
        Some(self.bind(plan))
    }

    /// `plan` with every technique switched off dropped (a plan given by hand: the wire
    /// code and uncoded carried blocks turned off rather than refused). Kept outputs in host
    /// memory, the backward's uncoded uploads (but without the wire code) and the products
    /// computed ahead stay as asked: their switches (off by default) keep them from the
    /// planner's candidates only.
    pub fn bind(&self, plan: Plan) -> Plan {
        Plan {
            wire_code: plan.wire_code && self.wire_code,
            uncoded_carry: plan.uncoded_carry && self.uncoded_carry,
            raw_backward: plan.raw_backward && self.wire_code,
            cross_ahead: plan.cross_ahead && self.cross_ahead && self.wire_code,
            deep_prefetch: plan.deep_prefetch && self.deep_prefetch,
            host_products: plan.host_products && self.host_products,
            remake_transposes: plan.remake_transposes && self.remake_transposes,
            rerun_ahead: plan.rerun_ahead && self.rerun_ahead,
            keep: crate::autograd::Keep {
                few_rows: plan.keep.few_rows && self.keep_few_rows,
                ..plan.keep
            },
            ..plan
        }
    }

    /// `profile`'s candidates as these switches allow them: with kept outputs in host memory
    /// among them where `offload_kept` is on and the backward's uploads uncoded where
    /// `raw_backward` is (`MemoryProfile::candidates_among`), each through
    /// [`Switches::allow`].
    pub fn candidates(&self, profile: &MemoryProfile) -> Vec<Plan> {
        self.filter(profile.candidates_allowing(
            self.offload_kept,
            self.raw_backward,
            self.ahead_products,
        ))
    }

    /// [`Switches::candidates`] with each plan's weights, in the same order: a plan the
    /// switches change ([`Switches::bind`]) weighed again.
    pub fn weighed_candidates(&self, profile: &MemoryProfile) -> Vec<Weighed> {
        use rayon::prelude::*;
        let times = profile.block_times();
        profile
            .weighed_candidates(self.offload_kept, self.raw_backward, self.ahead_products)
            .into_par_iter()
            .filter_map(|mut w| {
                // The switches read and set flags only: the block names set aside, not
                // copied, while they look.
                let streamed = std::mem::take(&mut w.plan.streamed);
                let reach = std::mem::take(&mut w.plan.reach);
                let mut plan = self.allow(w.plan.clone())?;
                let unchanged = plan == w.plan;
                plan.streamed = streamed;
                plan.reach = reach;
                Some(if unchanged {
                    Weighed { plan, ..w }
                } else {
                    Weighed::with_times(profile, plan, &times)
                })
            })
            .collect()
    }

    /// The candidates these switches allow ([`Switches::allow`]), in their order.
    pub fn filter(&self, candidates: Vec<Plan>) -> Vec<Plan> {
        candidates
            .into_iter()
            .filter_map(|p| self.allow(p))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_read_pairs_and_refuse_what_they_do_not_know() {
        let s = Switches::parse(" wire_code=off , measure_machine=off ").unwrap();
        assert!(!s.wire_code && !s.measure_machine && s.deep_prefetch);
        assert_eq!(s.show(), "wire_code=off,measure_machine=off");
        assert_eq!(Switches::parse(&s.show()).unwrap(), s);
        assert_eq!(Switches::parse("").unwrap(), Switches::default());
        assert_eq!(Switches::default().show(), "");
        for bad in ["wire_code", "wire_code=maybe", "warp_drive=on"] {
            let e = Switches::parse(bad).unwrap_err().to_string();
            assert!(e.contains(Switches::VAR) && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn switched_off_techniques_leave_the_plans() {
        let plan = Plan {
            checkpointing: super::super::Checkpointing::All,
            streamed: vec!["b0".into()],
            prefetch: 2,
            keep: crate::autograd::Keep {
                attention: true,
                down_projections: false,
                few_rows: true,
            },
            offload_inputs: false,
            offload_kept: false,
            wire_code: true,
            uncoded_carry: true,
            raw_backward: false,
            ahead_products: false,
            cross_ahead: true,
            deep_prefetch: true,
            host_products: true,
            remake_transposes: false,
            rerun_ahead: true,
            reach: vec![],
            uncoded_first: 0,
        };
        let all = Switches::default();
        assert_eq!(all.allow(plan.clone()), Some(plan.clone()));
        let off = Switches::parse("uncoded_carry=off").unwrap();
        assert_eq!(off.allow(plan.clone()), None);
        let bound = off.bind(plan.clone());
        assert!(!bound.uncoded_carry && bound.wire_code);
        let few = Switches::parse("keep_few_rows=off,host_products=off").unwrap();
        let p = few.allow(plan.clone()).unwrap();
        assert!(!p.keep.few_rows && p.keep.attention && !p.host_products && p.deep_prefetch);
        let crossing = Switches::parse("cross_ahead=off").unwrap();
        let p = crossing.allow(plan.clone()).unwrap();
        assert!(!p.cross_ahead && p.wire_code && p.uncoded_carry);
        // Nothing crosses uncoded.
        let raw = Switches::parse("wire_code=off").unwrap().bind(plan.clone());
        assert!(!raw.wire_code && !raw.cross_ahead);
        let serial = Switches::parse("rerun_ahead=off").unwrap();
        assert_eq!(serial.allow(plan.clone()), None);
        assert!(!serial.bind(plan).rerun_ahead);
    }
}
