//! Gradient checks (f64, CPU, central differences) of every differentiable op, on contiguous
//! inputs and on views, plus the autograd semantics: accumulation, no_grad, detach, freeing.
#![cfg(feature = "cpu-ref")]

use flame::autograd::differentiable_ops;
use flame::autograd::gradcheck::{gradcheck, GradcheckConfig, GradcheckReport};
use flame::{DType, Device, Error, Grads, Result, Shape, Tensor};
use std::collections::BTreeSet;

#[path = "gradcheck/attention.rs"]
mod attention;

type Func = Box<dyn Fn(&[Tensor]) -> Result<Tensor>>;

struct Case {
    name: String,
    inputs: Vec<Tensor>,
    f: Func,
    cfg: GradcheckConfig,
    /// Op names that must appear in the recorded graph.
    expect: Vec<&'static str>,
    /// Op names that must not appear (e.g. "copy" where a view is promised).
    forbid: Vec<&'static str>,
}

impl Case {
    fn new(
        name: impl Into<String>,
        inputs: Vec<Tensor>,
        f: impl Fn(&[Tensor]) -> Result<Tensor> + 'static,
    ) -> Case {
        Case {
            name: name.into(),
            inputs,
            f: Box::new(f),
            cfg: GradcheckConfig::default(),
            expect: vec![],
            forbid: vec![],
        }
    }
    fn expect(mut self, ops: &[&'static str]) -> Case {
        self.expect.extend_from_slice(ops);
        self
    }
    fn forbid(mut self, ops: &[&'static str]) -> Case {
        self.forbid.extend_from_slice(ops);
        self
    }
    fn cfg(mut self, cfg: GradcheckConfig) -> Case {
        self.cfg = cfg;
        self
    }
}

const CPU: Device = Device::Cpu;

/// Seeded input factory: every call gets a fresh seed.
struct Inputs(u64);

impl Inputs {
    /// Standard normal f64.
    fn n(&mut self, shape: impl Into<Shape>) -> Tensor {
        self.0 += 1;
        Tensor::randn(shape, DType::F64, &CPU, self.0).unwrap()
    }
    /// Uniform in [0.5, 2): for log, sqrt, recip, powf and denominators.
    fn pos(&mut self, shape: impl Into<Shape>) -> Tensor {
        self.0 += 1;
        Tensor::rand_uniform(0.5, 2.0, shape, DType::F64, &CPU, self.0).unwrap()
    }
}

fn ids(v: &[u32], shape: impl Into<Shape>) -> Tensor {
    Tensor::from_slice(v, shape, &CPU).unwrap()
}

/// Indices moved to `x`'s device, so a case runs on any backend.
fn on(ids: &Tensor, x: &Tensor) -> Result<Tensor> {
    ids.to_device(x.device())
}

/// Runs every case; returns the union of recorded ops and a description of each failure.
fn run(cases: &[Case]) -> (BTreeSet<&'static str>, Vec<String>) {
    let mut ops = BTreeSet::new();
    let mut failures = vec![];
    for c in cases {
        let n_elems: usize = c.inputs.iter().map(|t| t.elem_count()).sum();
        match gradcheck(&c.f, &c.inputs, c.cfg) {
            Ok(GradcheckReport {
                ops: got, checked, ..
            }) => {
                if checked != n_elems {
                    failures.push(format!("{}: checked {checked} of {n_elems}", c.name));
                }
                if got.is_empty() {
                    failures.push(format!("{}: nothing was recorded", c.name));
                }
                for e in &c.expect {
                    if !got.contains(e) {
                        failures.push(format!("{}: op {e} not recorded ({got:?})", c.name));
                    }
                }
                for e in &c.forbid {
                    if got.contains(e) {
                        failures.push(format!("{}: op {e} recorded ({got:?})", c.name));
                    }
                }
                ops.extend(got);
            }
            Err(e) => failures.push(format!("{}: {e}", c.name)),
        }
    }
    (ops, failures)
}

fn assert_all_pass(cases: &[Case]) {
    assert!(!cases.is_empty());
    let (_, failures) = run(cases);
    assert!(
        failures.is_empty(),
        "{} of {} gradchecks failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

// ----- the case tables ------------------------------------------------------------------------

type UnaryFn = fn(&Tensor) -> Result<Tensor>;
type BinaryFn = fn(&Tensor, &Tensor) -> Result<Tensor>;
/// (name, lhs shape, rhs shape, lhs view, rhs view)
type BinaryShapes = (
    &'static str,
    &'static [usize],
    &'static [usize],
    UnaryFn,
    UnaryFn,
);

/// (name, op, needs a positive input)
fn un(name: &'static str, f: UnaryFn, positive: bool) -> (&'static str, UnaryFn, bool) {
    (name, f, positive)
}

fn bin(name: &'static str, f: BinaryFn) -> (&'static str, BinaryFn) {
    (name, f)
}

/// Views a unary op is applied through: (name, input shape, view).
const UNARY_VIEWS: [(&str, [usize; 3], UnaryFn); 5] = [
    ("contiguous", [1, 3, 5], |x| Ok(x.clone())),
    ("t()", [1, 3, 5], |x| x.t()),
    ("narrow", [1, 3, 7], |x| x.narrow(2, 2, 4)),
    ("permute", [2, 3, 5], |x| x.permute(&[2, 0, 1])),
    ("broadcast", [1, 3, 1], |x| x.broadcast_as((2, 3, 5))),
];

fn unary_cases() -> Vec<Case> {
    let ops = [
        un("neg", |x| x.neg(), false),
        un("recip", |x| x.recip(), true),
        un("exp", |x| x.exp(), false),
        un("log", |x| x.log(), true),
        un("sqrt", |x| x.sqrt(), true),
        un("sin", |x| x.sin(), false),
        un("cos", |x| x.cos(), false),
        un("tanh", |x| x.tanh(), false),
        un("erf", |x| x.erf(), false),
        un("abs", |x| x.abs(), false),
        un("affine", |x| x.affine(-1.5, 0.25), false),
        un("powf", |x| x.powf(2.5), true),
        un("powf", |x| x.powf(-0.5), true),
        // An integral exponent is defined for negative bases.
        un("powf", |x| x.powf(3.0), false),
    ];
    let mut g = Inputs(1000);
    let mut v = vec![];
    for (name, op, positive) in ops {
        for (view, shape, f) in UNARY_VIEWS {
            let x = if positive { g.pos(shape) } else { g.n(shape) };
            let c = Case::new(format!("{name} of {view}"), vec![x], move |x| {
                op(&f(&x[0])?)
            });
            v.push(c.expect(&[name]));
        }
    }
    v
}

fn binary_cases() -> Vec<Case> {
    let ops = [
        bin("add", |a, b| a.add(b)),
        bin("sub", |a, b| a.sub(b)),
        bin("mul", |a, b| a.mul(b)),
        bin("div", |a, b| a.div(b)),
        bin("maximum", |a, b| a.maximum(b)),
        bin("minimum", |a, b| a.minimum(b)),
    ];
    let id: UnaryFn = |x| Ok(x.clone());
    let shapes: [BinaryShapes; 8] = [
        ("same shape", &[3, 5], &[3, 5], id, id),
        ("(3,1,5) with (4,1)", &[3, 1, 5], &[4, 1], id, id),
        ("(4,1) with (3,1,5)", &[4, 1], &[3, 1, 5], id, id),
        ("with (1,)", &[3, 5], &[1], id, id),
        ("() with", &[], &[3, 5], id, id),
        ("with ()", &[2, 3], &[], id, id),
        ("with a transposed rhs", &[3, 5], &[5, 3], id, |x| x.t()),
        (
            "of t() and narrow, broadcast",
            &[5, 3],
            &[3, 7],
            |x| x.t()?.unsqueeze(0),
            |x| x.narrow(1, 1, 5)?.unsqueeze(1)?.narrow(0, 0, 2),
        ),
    ];
    let mut g = Inputs(2000);
    let mut v = vec![];
    for (name, op) in ops {
        for (what, sa, sb, fa, fb) in shapes {
            // The rhs is a denominator for div: keep it away from 0.
            let b = if name == "div" { g.pos(sb) } else { g.n(sb) };
            let inputs = vec![g.n(sa), b];
            let f = move |x: &[Tensor]| op(&fa(&x[0])?, &fb(&x[1])?);
            v.push(Case::new(format!("{name} {what}"), inputs, f).expect(&[name]));
        }
    }
    v
}

fn where_cases() -> Vec<Case> {
    let mut g = Inputs(3000);
    vec![
        Case::new("where(a > b, a, b)", vec![g.n([3, 5]), g.n([3, 5])], |x| {
            x[0].gt(&x[1])?.where_cond(&x[0], &x[1])
        })
        .expect(&["where"]),
        Case::new(
            "where broadcast (3,1,5) (4,1)",
            vec![g.n([3, 1, 5]), g.n([4, 1])],
            |x| x[0].gt(&x[1])?.where_cond(&x[0].sin()?, &x[1].exp()?),
        )
        .expect(&["where", "broadcast"]),
        Case::new(
            "where of views, scalar branch",
            vec![g.n([5, 3]), g.n(())],
            |x| {
                let a = x[0].t()?;
                a.lt(&a.zeros_like()?)?.where_cond(&x[1], &a)
            },
        )
        .expect(&["where", "permute"]),
    ]
}

fn reduce_cases() -> Vec<Case> {
    let mut g = Inputs(4000);
    vec![
        Case::new("sum dim 1", vec![g.n([3, 5])], |x| x[0].sum(&[1])).expect(&["sum"]),
        Case::new("sum dim -1 of t()", vec![g.n([3, 5])], |x| {
            x[0].t()?.sum(&[-1])
        })
        .expect(&["sum"]),
        Case::new("sum dims 0,2", vec![g.n([2, 3, 5])], |x| x[0].sum(&[0, 2])),
        Case::new("sum_keepdim 2,0 of permute", vec![g.n([2, 3, 5])], |x| {
            x[0].permute(&[1, 2, 0])?.sum_keepdim(&[2, 0])
        }),
        Case::new("sum_all", vec![g.n([3, 5])], |x| x[0].sum_all()),
        Case::new("sum_all of narrow", vec![g.n([3, 7])], |x| {
            x[0].narrow(1, 3, 3)?.sum_all()
        }),
        Case::new("max_keepdim 1", vec![g.n([3, 5])], |x| x[0].max_keepdim(1)).expect(&["max"]),
        Case::new("max 0 of t()", vec![g.n([3, 5])], |x| x[0].t()?.max(0)).expect(&["max"]),
        Case::new("max 2 of permute", vec![g.n([2, 3, 5])], |x| {
            x[0].permute(&[2, 0, 1])?.max(2)
        }),
        Case::new("min 1", vec![g.n([3, 5])], |x| x[0].min(1)).expect(&["min"]),
        Case::new("min_keepdim 0 of t()", vec![g.n([3, 5])], |x| {
            x[0].t()?.min_keepdim(0)
        })
        .expect(&["min"]),
        Case::new("max_all", vec![g.n([3, 5])], |x| x[0].max_all()).expect(&["max"]),
        Case::new("max_all of permute narrow", vec![g.n([2, 3, 5])], |x| {
            x[0].permute(&[2, 1, 0])?.narrow(0, 1, 3)?.max_all()
        }),
        Case::new("mean over dims", vec![g.n([2, 3, 5])], |x| {
            x[0].mean(&[0, 2])
        })
        .expect(&["sum", "affine"]),
        Case::new("mean_all of t()", vec![g.n([3, 5])], |x| {
            x[0].t()?.mean_all()
        }),
        Case::new("var_keepdim", vec![g.n([3, 5])], |x| x[0].var_keepdim(&[1])),
        Case::new("var_keepdim dims 0,2", vec![g.n([2, 3, 5])], |x| {
            x[0].var_keepdim(&[0, 2])
        }),
    ]
}

fn cast_cases() -> Vec<Case> {
    // f64 -> f32 -> f64 rounds to f32 precision: a central difference with eps 1e-6 would see
    // only rounding noise, so this check uses a larger eps and looser tolerances.
    let loose = GradcheckConfig {
        eps: 1e-3,
        atol: 1e-3,
        rtol: 1e-2,
        ..GradcheckConfig::default()
    };
    let mut g = Inputs(5000);
    vec![
        Case::new("cast f64->f32->f64", vec![g.n([3, 5])], |x| {
            x[0].to_dtype(DType::F32)?.to_dtype(DType::F64)
        })
        .cfg(loose)
        .expect(&["cast"]),
        Case::new("cast of t(), computing in f32", vec![g.n([3, 5])], |x| {
            x[0].t()?.to_dtype(DType::F32)?.sin()?.to_dtype(DType::F64)
        })
        .cfg(loose)
        .expect(&["cast", "sin"]),
    ]
}

fn view_cases() -> Vec<Case> {
    let mut g = Inputs(6000);
    vec![
        Case::new("reshape", vec![g.n([3, 5])], |x| {
            x[0].reshape((5, 3))?.sin()
        })
        .expect(&["reshape"]),
        Case::new("reshape of t() (copies)", vec![g.n([3, 5])], |x| {
            x[0].t()?.reshape(15)?.sin()
        })
        .expect(&["reshape", "copy", "permute"]),
        Case::new("permute", vec![g.n([2, 3, 5])], |x| {
            x[0].permute(&[1, 2, 0])?.cos()
        })
        .expect(&["permute"]),
        Case::new("transpose", vec![g.n([2, 3, 5])], |x| {
            x[0].transpose(0, 2)?.exp()
        })
        .expect(&["permute"]),
        Case::new("narrow", vec![g.n([3, 7])], |x| x[0].narrow(1, 2, 3)?.sin()).expect(&["narrow"]),
        Case::new("narrow at the start and end", vec![g.n([5, 3])], |x| {
            x[0].narrow(0, 0, 2)?.mul(&x[0].narrow(0, 3, 2)?)
        }),
        Case::new("broadcast_as", vec![g.n([3, 1])], |x| {
            x[0].broadcast_as((2, 3, 5))?.sin()
        })
        .expect(&["broadcast"]),
        Case::new("expand of t()", vec![g.n([1, 3])], |x| {
            x[0].t()?.expand((3, 5))?.exp()
        }),
        Case::new("squeeze / unsqueeze", vec![g.n([3, 1, 5])], |x| {
            x[0].squeeze(1)?.unsqueeze(0)?.unsqueeze(-1)?.sin()
        })
        .expect(&["reshape"]),
        Case::new("unsqueeze of t()", vec![g.n([3, 5])], |x| {
            x[0].t()?.unsqueeze(1)?.exp()
        })
        .forbid(&["copy"]),
        Case::new("flatten of permute", vec![g.n([2, 3, 5])], |x| {
            x[0].permute(&[2, 0, 1])?.flatten(0, 1)?.slice(1, 1..3)
        }),
        Case::new("chunk", vec![g.n([3, 7])], |x| {
            let c = x[0].chunk(3, 1)?;
            assert_eq!(c.len(), 3);
            Tensor::cat(&[&c[2].exp()?, &c[0].sin()?, &c[1]], 1)
        })
        .expect(&["narrow", "cat"]),
        Case::new("cat dim 0", vec![g.n([3, 5]), g.n([2, 5])], |x| {
            Tensor::cat(&[&x[0], &x[1]], 0)
        })
        .expect(&["cat"]),
        Case::new("cat dim 1 of views", vec![g.n([5, 3]), g.n([3, 7])], |x| {
            Tensor::cat(&[&x[0].t()?, &x[1].narrow(1, 2, 4)?, &x[0].t()?], 1)
        }),
        Case::new(
            "cat dim 2 of broadcast",
            vec![g.n([2, 3, 1]), g.n([3, 4])],
            |x| {
                Tensor::cat(
                    &[
                        &x[0].broadcast_as((2, 3, 2))?,
                        &x[1].broadcast_as((2, 3, 4))?,
                    ],
                    2,
                )
            },
        ),
        Case::new("cat dim -1 of one tensor twice", vec![g.n([3, 5])], |x| {
            Tensor::cat(&[&x[0], &x[0].sin()?], -1)
        }),
        Case::new("stack dim 0", vec![g.n([3, 5]), g.n([3, 5])], |x| {
            Tensor::stack(&[&x[0], &x[1]], 0)
        }),
        Case::new(
            "stack dim -1 of views",
            vec![g.n([5, 3]), g.n([3, 7])],
            |x| Tensor::stack(&[&x[0].t()?, &x[1].narrow(1, 0, 5)?], -1),
        ),
        Case::new("contiguous of t()", vec![g.n([3, 5])], |x| {
            x[0].t()?.contiguous()
        })
        .expect(&["copy"]),
        Case::new("contiguous of narrow", vec![g.n([3, 7])], |x| {
            x[0].narrow(1, 2, 3)?.contiguous()?.exp()
        })
        .expect(&["copy"]),
        Case::new("view of a view of a view", vec![g.n([2, 3, 5])], |x| {
            x[0].transpose(1, 2)?
                .narrow(1, 1, 3)?
                .t()?
                .reshape((2, 9))?
                .sin()
        }),
    ]
}

fn index_cases() -> Vec<Case> {
    let mut g = Inputs(7000);
    let rep = || ids(&[2, 0, 2, 1], 4);
    // (3, 4) indices into a dim of size 5, with repeats.
    let g1 = || ids(&[0, 4, 4, 1, 2, 2, 0, 3, 1, 0, 4, 4], (3, 4));
    // (2, 5) indices into a dim of size 3.
    let g0 = || ids(&[2, 0, 1, 1, 2, 2, 2, 0, 1, 0], (2, 5));
    let (i0, i1, i2) = (rep(), rep(), rep());
    let (j0, j1, j2, j3) = (g1(), g0(), g1(), g0());
    let (k0, k1, k2) = (g1(), g0(), g1());
    vec![
        Case::new("index_select dim 0", vec![g.n([3, 5])], move |x| {
            x[0].index_select(&on(&i0, &x[0])?, 0)
        })
        .expect(&["index_select"]),
        Case::new("index_select dim 1", vec![g.n([3, 5])], move |x| {
            x[0].index_select(&on(&i1, &x[0])?, 1)
        }),
        Case::new("index_select of t()", vec![g.n([5, 3])], move |x| {
            x[0].t()?.index_select(&on(&i2, &x[0])?, 0)
        }),
        Case::new("gather dim 1", vec![g.n([3, 5])], move |x| {
            x[0].gather(&on(&j0, &x[0])?, 1)
        })
        .expect(&["gather"]),
        Case::new("gather dim 0", vec![g.n([3, 5])], move |x| {
            x[0].gather(&on(&j1, &x[0])?, 0)
        }),
        Case::new("gather of t()", vec![g.n([5, 3])], move |x| {
            x[0].t()?.gather(&on(&j2, &x[0])?, 1)
        }),
        Case::new("gather with t() ids", vec![g.n([5, 3])], move |x| {
            x[0].gather(&on(&j3, &x[0])?.t()?, 1)
        }),
        Case::new(
            "scatter_add dim 1",
            vec![g.n([3, 5]), g.n([3, 4])],
            move |x| x[0].scatter_add(&on(&k0, &x[0])?, &x[1], 1),
        )
        .expect(&["scatter_add"]),
        Case::new(
            "scatter_add dim 0",
            vec![g.n([3, 5]), g.n([2, 5])],
            move |x| x[0].sin()?.scatter_add(&on(&k1, &x[0])?, &x[1].exp()?, 0),
        ),
        Case::new(
            "scatter_add of views",
            vec![g.n([5, 3]), g.n([4, 3])],
            move |x| x[0].t()?.scatter_add(&on(&k2, &x[0])?, &x[1].t()?, 1),
        ),
    ]
}

fn matmul_cases() -> Vec<Case> {
    let mut g = Inputs(8000);
    vec![
        Case::new("matmul 2D", vec![g.n([3, 4]), g.n([4, 5])], |x| {
            x[0].matmul(&x[1])
        })
        .expect(&["matmul"]),
        Case::new(
            "matmul batched 3D",
            vec![g.n([2, 3, 4]), g.n([2, 4, 5])],
            |x| x[0].matmul(&x[1]),
        ),
        Case::new(
            "matmul (2,3,4) @ (4,5)",
            vec![g.n([2, 3, 4]), g.n([4, 5])],
            |x| x[0].matmul(&x[1]),
        )
        .expect(&["broadcast"]),
        Case::new(
            "matmul (2,1,3,4) @ (3,4,2)",
            vec![g.n([2, 1, 3, 4]), g.n([3, 4, 2])],
            |x| x[0].matmul(&x[1]),
        ),
        Case::new("matmul a.t() @ b", vec![g.n([4, 3]), g.n([4, 5])], |x| {
            x[0].t()?.matmul(&x[1])
        })
        .forbid(&["copy"]),
        Case::new("matmul a @ b.t()", vec![g.n([3, 4]), g.n([5, 4])], |x| {
            x[0].matmul(&x[1].t()?)
        })
        .forbid(&["copy"]),
        Case::new(
            "matmul batched, both transposed",
            vec![g.n([2, 4, 3]), g.n([2, 5, 4])],
            |x| x[0].transpose(1, 2)?.matmul(&x[1].transpose(1, 2)?),
        ),
        Case::new("matmul of one tensor with itself", vec![g.n([3, 3])], |x| {
            x[0].matmul(&x[0].t()?)
        }),
        Case::new("matmul of narrow", vec![g.n([3, 7]), g.n([5, 2])], |x| {
            x[0].narrow(1, 1, 5)?.matmul(&x[1])
        }),
        // The linear layer's ops: the bias in the GEMM, an adapter's product added into the
        // base output's buffer (in place when nothing else holds it, else into a copy).
        Case::new(
            "matmul_bias (2,3,4) @ (4,5) + (5)",
            vec![g.n([2, 3, 4]), g.n([4, 5]), g.n([5])],
            |x| x[0].matmul_bias(&x[1], &x[2]),
        )
        .expect(&["matmul"])
        .forbid(&["add", "broadcast"]),
        Case::new(
            "matmul_bias with a transposed weight",
            vec![g.n([3, 4]), g.n([5, 4]), g.n([5])],
            |x| x[0].matmul_bias(&x[1].t()?, &x[2]),
        )
        .forbid(&["add", "copy"]),
        Case::new(
            "add_matmul into a fresh GEMM output (in place)",
            vec![g.n([3, 4]), g.n([4, 5]), g.n([3, 2]), g.n([2, 5])],
            |x| x[0].matmul(&x[1])?.add_matmul(&x[2], &x[3]),
        )
        .expect(&["matmul"])
        .forbid(&["add"]),
        Case::new(
            "add_matmul_bias: the product and a bias into a fresh GEMM output",
            vec![g.n([3, 4]), g.n([4, 5]), g.n([3, 2]), g.n([2, 5]), g.n([5])],
            |x| {
                x[0].matmul(&x[1])?
                    .add_matmul_bias(&x[2], &x[3], Some(&x[4]))
            },
        )
        .expect(&["matmul"])
        .forbid(&["add", "broadcast"]),
        Case::new(
            "add_matmul_bias with leading dims, a transposed factor, a shared output",
            vec![g.n([2, 3, 5]), g.n([2, 3, 4]), g.n([5, 4]), g.n([5])],
            |x| {
                let c = x[0].affine(2.0, 0.0)?;
                c.clone()
                    .add_matmul_bias(&x[1], &x[2].t()?, Some(&x[3]))?
                    .mul(&c)
            },
        ),
        Case::new(
            "add_matmul with leading dims and a transposed factor",
            vec![g.n([2, 3, 5]), g.n([2, 3, 4]), g.n([5, 4])],
            |x| x[0].affine(2.0, 0.0)?.add_matmul(&x[1], &x[2].t()?),
        ),
        Case::new(
            "add_matmul onto an output its op's backward reads (exp)",
            vec![g.n([3, 5]), g.n([3, 2]), g.n([2, 5])],
            |x| x[0].exp()?.add_matmul(&x[1], &x[2]),
        ),
        // An adapter's x A (inner dim r <= a quarter of x's width): x's gradient through it
        // is added into the base layer's by one GEMM, also through the reshapes of 2-d rows,
        // broadcast weights of a batch, either order of arrival, and formed when alone.
        Case::new(
            "low-rank input gradient into the base's (3-d x)",
            vec![
                g.n([2, 3, 8]),
                g.n([8, 5]),
                g.n([5]),
                g.n([8, 2]),
                g.n([2, 5]),
            ],
            |x| {
                x[0].matmul_bias(&x[1], &x[2])?
                    .add_matmul(&x[0].matmul(&x[3])?, &x[4])
            },
        ),
        Case::new(
            "low-rank input gradient into the base's (2-d x, reshapes)",
            vec![g.n([6, 8]), g.n([8, 5]), g.n([5]), g.n([8, 2]), g.n([2, 5])],
            |x| {
                x[0].matmul_bias(&x[1], &x[2])?
                    .add_matmul(&x[0].matmul(&x[3])?, &x[4])
            },
        ),
        Case::new(
            "low-rank input gradient arriving last",
            vec![g.n([6, 8]), g.n([8, 5]), g.n([8, 2]), g.n([2, 5])],
            |x| {
                let h = x[0].matmul(&x[2])?;
                x[0].matmul(&x[1])?.add_matmul(&h, &x[3])
            },
        ),
        Case::new(
            "low-rank input gradient alone, with two further uses",
            vec![g.n([2, 3, 8]), g.n([8, 2]), g.n([2, 3, 8])],
            |x| {
                let y = x[0].matmul(&x[1])?;
                let z = x[2].matmul(&x[1])?;
                y.mul(&z)?.add(&x[0].narrow(2, 0, 2)?)
            },
        ),
        Case::new(
            "add_matmul onto a tensor used again afterwards",
            vec![g.n([3, 4]), g.n([4, 5]), g.n([3, 2]), g.n([2, 5])],
            |x| {
                let c = x[0].matmul(&x[1])?;
                c.clone().add_matmul(&x[2], &x[3])?.mul(&c)
            },
        ),
    ]
}

fn composite_cases() -> Vec<Case> {
    let mut g = Inputs(9000);
    let targets = ids(&[1, 4, 0], 3);
    let x35 = |g: &mut Inputs| g.n([3, 5]);
    vec![
        Case::new("sqr", vec![x35(&mut g)], |x| x[0].sqr()).expect(&["mul"]),
        Case::new("softmax dim 1", vec![x35(&mut g)], |x| x[0].softmax(1)).expect(&["softmax"]),
        Case::new("softmax_composite dim 1", vec![x35(&mut g)], |x| {
            x[0].softmax_composite(1)
        })
        .expect(&["exp", "div"]),
        Case::new("softmax dim 0 of t()", vec![x35(&mut g)], |x| {
            x[0].t()?.softmax(0)
        }),
        Case::new("log_softmax", vec![x35(&mut g)], |x| x[0].log_softmax(-1)).expect(&["log"]),
        Case::new("log_softmax of permute", vec![g.n([2, 3, 5])], |x| {
            x[0].permute(&[0, 2, 1])?.log_softmax(1)
        }),
        Case::new("sigmoid", vec![x35(&mut g)], |x| x[0].sigmoid()).expect(&["tanh"]),
        Case::new("silu", vec![x35(&mut g)], |x| x[0].silu()).expect(&["silu"]),
        Case::new("gelu", vec![x35(&mut g)], |x| x[0].gelu()).expect(&["gelu"]),
        Case::new("gelu_tanh", vec![x35(&mut g)], |x| x[0].gelu_tanh()).expect(&["gelu_tanh"]),
        Case::new("gelu of t()", vec![x35(&mut g)], |x| x[0].t()?.gelu()),
        Case::new(
            "cat_gelu_tanh: a beside GELU of a slice of a wider tensor's rows",
            vec![g.n([2, 3, 4]), g.n([2, 3, 16])],
            |x| x[0].cat_gelu_tanh(&x[1].narrow(2, 4, 8)?),
        )
        .expect(&["cat_gelu_tanh"])
        .forbid(&["cat", "gelu_tanh"]),
        Case::new(
            "cat_gelu_tanh: attention's heads merged as they are read, beside GELU",
            vec![g.n([1, 2, 3, 4]), g.n([1, 3, 8])],
            |x| x[0].transpose(1, 2)?.cat_gelu_tanh(&x[1]),
        )
        .expect(&["cat_gelu_tanh"])
        .forbid(&["cat", "copy"]),
        Case::new("silu_composite", vec![x35(&mut g)], |x| {
            x[0].silu_composite()
        })
        .expect(&["tanh"]),
        Case::new("gelu_composite", vec![x35(&mut g)], |x| {
            x[0].gelu_composite()
        })
        .expect(&["erf"]),
        Case::new("gelu_tanh_composite", vec![x35(&mut g)], |x| {
            x[0].gelu_tanh_composite()
        })
        .expect(&["powf", "tanh"]),
        Case::new("relu", vec![x35(&mut g)], |x| x[0].relu()).expect(&["maximum"]),
        Case::new("clamp", vec![x35(&mut g)], |x| x[0].clamp(-0.5, 0.5))
            .expect(&["maximum", "minimum"]),
        Case::new("layer_norm", vec![x35(&mut g)], |x| {
            x[0].layer_norm(None, None, 1e-5)
        }),
        Case::new(
            "layer_norm weight bias",
            vec![x35(&mut g), g.n([5]), g.n([5])],
            |x| x[0].layer_norm(Some(&x[1]), Some(&x[2]), 1e-5),
        ),
        Case::new("layer_norm of t()", vec![g.n([5, 3]), g.n([5])], |x| {
            x[0].t()?.layer_norm(Some(&x[1]), None, 1e-5)
        }),
        Case::new(
            "layer_norm, weight and bias narrowed from longer vectors",
            vec![x35(&mut g), g.n([7]), g.n([6])],
            |x| {
                x[0].layer_norm(
                    Some(&x[1].narrow(0, 2, 5)?),
                    Some(&x[2].narrow(0, 1, 5)?),
                    1e-5,
                )
            },
        ),
        {
            // A frozen input with trainable parameters: the column sweep alone (dx, dw and db
            // together take the one-pass backward).
            let frozen = x35(&mut g).detach();
            Case::new(
                "layer_norm weight bias of a frozen input",
                vec![g.n([5]), g.n([5])],
                move |x| frozen.layer_norm(Some(&x[0]), Some(&x[1]), 1e-5),
            )
        },
        Case::new("rms_norm", vec![x35(&mut g)], |x| x[0].rms_norm(None, 1e-6)),
        Case::new("rms_norm weight", vec![x35(&mut g), g.n([5])], |x| {
            x[0].rms_norm(Some(&x[1]), 1e-6)
        }),
        Case::new(
            "group_norm",
            vec![g.n([2, 4, 3]), g.n([4]), g.n([4])],
            |x| x[0].group_norm(2, Some(&x[1]), Some(&x[2]), 1e-5),
        ),
        Case::new("group_norm no params", vec![g.n([2, 4, 3])], |x| {
            x[0].group_norm(2, None, None, 1e-5)
        })
        .expect(&["group_norm"]),
        Case::new(
            "group_norm (N, C, H, W) weight only, of a permuted view",
            vec![g.n([2, 3, 6, 2]), g.n([6])],
            |x| {
                x[0].permute(&[0, 2, 1, 3])?
                    .group_norm(3, Some(&x[1]), None, 1e-5)
            },
        )
        .expect(&["group_norm"]),
        Case::new(
            "group_norm_composite",
            vec![g.n([2, 4, 3]), g.n([4]), g.n([4])],
            |x| x[0].group_norm_composite(2, Some(&x[1]), Some(&x[2]), 1e-5),
        )
        .expect(&["sum", "powf"]),
        Case::new(
            "modulate (B, L, D) by (B, 1, D)",
            vec![g.n([2, 3, 5]), g.n([2, 1, 5]), g.n([2, 1, 5])],
            |x| x[0].modulate(&x[1], &x[2]),
        )
        .expect(&["modulate"]),
        Case::new(
            "modulate shared (D) shift, (1, 1, D) scale, rank 4",
            vec![g.n([2, 2, 3, 5]), g.n([5]), g.n([1, 1, 1, 5])],
            |x| x[0].modulate(&x[1], &x[2]),
        )
        .expect(&["modulate"]),
        Case::new(
            "modulate (L, D) of t()",
            vec![g.n([5, 3]), g.n([1, 5]), g.n([5])],
            |x| x[0].t()?.modulate(&x[1], &x[2]),
        )
        .expect(&["modulate"]),
        Case::new("modulate, frozen shift and scale", vec![g.n([2, 3, 5])], {
            let (sh, sc) = (g.n([2, 1, 5]), g.n([2, 1, 5]));
            move |x| x[0].modulate(&sh, &sc)
        })
        .expect(&["modulate"]),
        Case::new("swiglu (B, L, 2 M)", vec![g.n([2, 3, 10])], |x| {
            x[0].swiglu()
        })
        .expect(&["swiglu"]),
        Case::new(
            "swiglu of a projection's narrow (rows of pitch 13)",
            vec![g.n([2, 3, 13])],
            |x| x[0].narrow(2, 5, 8)?.swiglu(),
        )
        .expect(&["swiglu"]),
        Case::new(
            "swiglu (2 M) of a transposed view",
            vec![g.n([6, 4])],
            |x| x[0].t()?.swiglu(),
        )
        .expect(&["swiglu"]),
        Case::new(
            "modulate per-token (composite)",
            vec![g.n([2, 3, 5]), g.n([2, 3, 5]), g.n([2, 1, 5])],
            |x| x[0].modulate(&x[1], &x[2]),
        )
        .expect(&["mul", "add"]),
        Case::new("apply_rope", vec![g.n([2, 3, 4, 6])], {
            let pos = Tensor::rand_uniform(0.0, 8.0, (2, 4), DType::F64, &CPU, 77).unwrap();
            let f = flame::nn::rope(&pos, 6, 10_000.0)
                .unwrap()
                .unsqueeze(1)
                .unwrap();
            move |x| x[0].apply_rope(&on(&f, &x[0])?)
        })
        .expect(&["rope"]),
        Case::new(
            "apply_rope shared rotations, of a permuted view",
            vec![g.n([2, 4, 3, 8])],
            {
                let pos = Tensor::arange(0.0, 4.0, DType::F64, &CPU)
                    .unwrap()
                    .reshape((1, 4))
                    .unwrap();
                let f = flame::nn::rope(&pos, 8, 10_000.0)
                    .unwrap()
                    .unsqueeze(1)
                    .unwrap();
                move |x| x[0].permute(&[0, 2, 1, 3])?.apply_rope(&on(&f, &x[0])?)
            },
        )
        .expect(&["rope"]),
        Case::new(
            "apply_rope, trainable rotations (composite)",
            vec![g.n([1, 2, 3, 4]), g.n([1, 1, 3, 2, 2, 2])],
            |x| x[0].apply_rope(&x[1]),
        )
        .expect(&["mul", "narrow"]),
        Case::new("mse_loss", vec![x35(&mut g), x35(&mut g)], |x| {
            x[0].mse_loss(&x[1])
        }),
        Case::new("cross_entropy", vec![x35(&mut g)], move |x| {
            x[0].cross_entropy(&on(&targets, &x[0])?)
        })
        .expect(&["gather", "neg"]),
    ]
}

// ----- random expressions ---------------------------------------------------------------------

/// Knuth's MMIX LCG; the high bits are used.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// A random expression over inputs of shape (3, 5), rebuilt identically for each seed. Every
/// step keeps values bounded (exp and division only of bounded or positive arguments).
fn random_expr(seed: u64, xs: &[Tensor]) -> Result<Tensor> {
    let mut rng = Lcg(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xda3e_39cb_94b9_5bdb);
    let mut pool: Vec<Tensor> = xs.to_vec();
    let rows = ids(&[2, 0, 1], 3);
    let steps = 4 + rng.next(4);
    for _ in 0..steps {
        // Chain from the newest node so that every step reaches the output.
        let a = pool[pool.len() - 1 - rng.next(2)].clone();
        let b = pool[rng.next(pool.len())].clone();
        let y = match rng.next(24) {
            0 => a.sin()?,
            1 => a.cos()?.neg()?,
            2 => a.tanh()?.exp()?,
            3 => a.erf()?.affine(0.7, 0.1)?,
            4 => a.sqr()?.add_scalar(1.0)?.log()?,
            5 => a.sqr()?.add_scalar(0.5)?.sqrt()?,
            6 => a.sqr()?.add_scalar(1.0)?.recip()?,
            7 => a.abs()?.add_scalar(0.5)?.powf(1.5)?,
            8 => a.add(&b)?,
            9 => a.sub(&b)?.mul_scalar(0.5)?,
            10 => a.mul(&b.tanh()?)?,
            11 => a.div(&b.sqr()?.add_scalar(1.0)?)?,
            12 => a.maximum(&b)?,
            13 => a.minimum(&b)?,
            14 => a.gt(&b)?.where_cond(&a, &b.sin()?)?,
            15 => a.t()?.contiguous()?.sin()?.t()?,
            16 => a.t()?.mul(&b.t()?)?.t()?,
            17 => a.reshape(15)?.tanh()?.reshape((3, 5))?,
            18 => Tensor::cat(&[&a.narrow(1, 3, 2)?, &b.narrow(1, 0, 3)?], 1)?,
            19 => a
                .sum_keepdim(&[1])?
                .mul_scalar(0.2)?
                .broadcast_as((3, 5))?
                .mul(&b)?,
            20 => a.index_select(&on(&rows, &a)?, 0)?.add(&b)?,
            21 => a.softmax(1)?.add(&b.log_softmax(0)?)?,
            22 => a.layer_norm(None, None, 1e-5)?.silu()?,
            _ => a.matmul(&b.t()?)?.matmul(&a)?.mul_scalar(0.3)?.tanh()?,
        };
        pool.push(y);
    }
    // Keep both inputs in the result so that both get a gradient.
    let last = pool.pop().unwrap_or_else(|| xs[0].clone());
    last.add(&xs[0].mul(&xs[1])?.mul_scalar(0.1)?)
}

const N_RANDOM: u64 = 40;

fn random_cases() -> Vec<Case> {
    let mut g = Inputs(10_000);
    (0..N_RANDOM)
        .map(|seed| {
            Case::new(
                format!("random expression {seed}"),
                vec![g.n([3, 5]), g.n([3, 5])],
                move |x| random_expr(seed, x),
            )
        })
        .collect()
}

/// Sliding windows: unfold2d / fold2d and what is built on them (conv2d, pooling).
fn window_cases() -> Vec<Case> {
    use flame::nn::{adaptive_avg_pool2d, avg_pool2d, conv2d, max_pool2d, pad2d};
    use flame::Window2d;
    let mut g = Inputs(11000);
    let win = |k, s, p, d| Window2d {
        kernel: (k, k),
        stride: (s, s),
        padding: (p, p),
        dilation: (d, d),
    };
    vec![
        Case::new("unfold2d 3x3 pad 1", vec![g.n([2, 2, 5, 4])], move |x| {
            x[0].unfold2d(win(3, 1, 1, 1))
        })
        .expect(&["unfold2d"]),
        Case::new(
            "unfold2d stride 2 dilation 2 of t()",
            vec![g.n([1, 2, 4, 7])],
            move |x| x[0].transpose(2, 3)?.unfold2d(win(2, 2, 1, 2)),
        ),
        Case::new("fold2d 3x3 pad 1", vec![g.n([2, 2 * 9, 5 * 4])], move |x| {
            x[0].fold2d(win(3, 1, 1, 1), (5, 4))
        })
        .expect(&["fold2d"]),
        Case::new("fold2d stride 2", vec![g.n([1, 3 * 4, 2 * 3])], move |x| {
            x[0].fold2d(win(2, 2, 0, 1), (4, 6))
        }),
        Case::new(
            "conv2d stride 2 pad 1 bias",
            vec![g.n([2, 3, 5, 6]), g.n([4, 3, 3, 3]), g.n([4])],
            |x| conv2d(&x[0], &x[1], Some(&x[2]), (2, 2), (1, 1), (1, 1), 1),
        ),
        Case::new(
            "conv2d groups 2 dilation 2",
            vec![g.n([1, 4, 6, 5]), g.n([6, 2, 2, 2])],
            |x| conv2d(&x[0], &x[1], None, (1, 1), (1, 1), (2, 2), 2),
        ),
        Case::new("avg_pool2d", vec![g.n([2, 2, 5, 5])], |x| {
            avg_pool2d(&x[0], (2, 2), (2, 2), (1, 1))
        }),
        Case::new("max_pool2d pad 1", vec![g.n([1, 2, 5, 4])], |x| {
            max_pool2d(&x[0], (3, 3), (2, 2), (1, 1))
        }),
        Case::new(
            "adaptive_avg_pool2d 5x7 -> 2x3",
            vec![g.n([1, 2, 5, 7])],
            |x| adaptive_avg_pool2d(&x[0], (2, 3)),
        ),
        Case::new("pad2d", vec![g.n([1, 2, 3, 2])], |x| {
            pad2d(&x[0], (1, 2), 0.5)
        }),
    ]
}

fn all_cases() -> Vec<Case> {
    let mut v = unary_cases();
    v.extend(binary_cases());
    v.extend(where_cases());
    v.extend(reduce_cases());
    v.extend(cast_cases());
    v.extend(view_cases());
    v.extend(index_cases());
    v.extend(matmul_cases());
    v.extend(composite_cases());
    v.extend(random_cases());
    v.extend(window_cases());
    v.extend(attention::cases(&mut Inputs(9000)));
    v.extend(checkpoint_cases());
    v
}

/// Checkpointed functions (a custom node and its outputs): the backward re-runs them.
fn checkpoint_cases() -> Vec<Case> {
    use flame::autograd::checkpoint;
    let mut g = Inputs(12000);
    vec![Case::new(
        "checkpoint of two outputs over two inputs",
        vec![g.n([3, 4]), g.n([4, 2])],
        |x| {
            let out = checkpoint(&[x[0].clone(), x[1].clone()], |xs| {
                let h = xs[0].matmul(&xs[1])?.tanh()?;
                Ok(vec![h.mul(&h)?, xs[0].sin()?])
            })?;
            out[0].sum_all()?.add(&out[1].mul(&x[0])?.sum_all()?)
        },
    )
    .expect(&["checkpoint", "custom_output"])]
}

// ----- tests ----------------------------------------------------------------------------------

#[test]
fn every_differentiable_op_is_gradchecked() {
    let cases = all_cases();
    let (covered, failures) = run(&cases);
    let ops = differentiable_ops();
    let missing: Vec<&str> = ops
        .iter()
        .copied()
        .filter(|op| !covered.contains(op))
        .collect();
    assert!(
        missing.is_empty(),
        "differentiable ops without a passing gradcheck case: {missing:?}"
    );
    // Recorded names outside the list would mean the list is stale.
    let unknown: Vec<&str> = covered
        .iter()
        .copied()
        .filter(|op| !ops.contains(op))
        .collect();
    assert!(
        unknown.is_empty(),
        "recorded ops missing from the differentiable ops: {unknown:?}"
    );
    assert!(
        failures.is_empty(),
        "{} gradchecks failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// One test per table, so that a failure names its group.
macro_rules! gradcheck_tests {
    ($($test:ident: $cases:ident),* $(,)?) => {
        $(#[test]
        fn $test() {
            assert_all_pass(&$cases());
        })*
    };
}

gradcheck_tests! {
    gradcheck_unary: unary_cases,
    gradcheck_binary_broadcast: binary_cases,
    gradcheck_where: where_cases,
    gradcheck_reductions: reduce_cases,
    gradcheck_cast: cast_cases,
    gradcheck_views: view_cases,
    gradcheck_indexing: index_cases,
    gradcheck_matmul: matmul_cases,
    gradcheck_composites: composite_cases,
    gradcheck_windows: window_cases,
}

#[test]
fn gradcheck_random_expressions() {
    let cases = random_cases();
    assert!(cases.len() >= 20);
    assert_all_pass(&cases);
}

/// The checker has teeth: a function whose recorded graph misses a path must fail.
#[test]
fn gradcheck_rejects_a_wrong_gradient() {
    let x = Inputs(1).n([3, 5]);
    // d/dx (x * stopgrad(x)) is x analytically here, but 2x numerically.
    let cfg = GradcheckConfig::default();
    let r = gradcheck(|x| x[0].mul(&x[0].detach()), std::slice::from_ref(&x), cfg);
    assert!(matches!(r, Err(Error::Autograd(_))), "{r:?}");
    let x32 = x.to_dtype(DType::F32).unwrap();
    let r = gradcheck(|x| x[0].sin(), &[x32], cfg);
    assert!(r.is_err(), "f32 inputs must be rejected");
}

// ----- autograd semantics ---------------------------------------------------------------------

fn leaf(t: Tensor) -> Tensor {
    t.requires_grad_().unwrap()
}

/// A trainable f64 vector.
fn var(v: &[f64]) -> Tensor {
    leaf(Tensor::from_slice(v, v.len(), &CPU).unwrap())
}

/// The gradient of `x` in `g`, as f64.
fn grad(g: &Grads, x: &Tensor) -> Vec<f64> {
    g.get(x).expect("a gradient").to_vec_f64().unwrap()
}

fn close(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len());
    let ok = a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-12);
    assert!(ok, "{a:?} vs {b:?}");
}

#[test]
fn gradient_through_a_view_of_a_view() -> Result<()> {
    // x is (3, 4) holding 0..12; z = x.t().narrow(0, 1, 2) is x[:, 1..3] transposed.
    let x = leaf(Tensor::arange(0.0, 12.0, DType::F64, &CPU)?.reshape((3, 4))?);
    let w = Tensor::arange(1.0, 7.0, DType::F64, &CPU)?.reshape((2, 3))?;
    let z = x.t()?.narrow(0, 1, 2)?;
    assert_eq!(z.to_vec_f64()?, vec![1., 5., 9., 2., 6., 10.]);
    // d/dx[i][j] = w[j-1][i] for j in 1..3, else 0.
    let g = z.mul(&w)?.sum_all()?.backward()?;
    assert_eq!(
        grad(&g, &x),
        vec![0., 1., 4., 0., 0., 2., 5., 0., 0., 3., 6., 0.]
    );
    Ok(())
}

#[test]
fn gradients_accumulate_across_backward_calls() -> Result<()> {
    let x = var(&[1.0, -2.0, 3.0]);
    let mut grads = Grads::new();
    for _ in 0..2 {
        // A fresh graph each time: d/dx sum(x^2) = 2x, twice.
        x.sqr()?.sum_all()?.backward_into(&mut grads)?;
    }
    assert_eq!(grads.len(), 1);
    assert_eq!(grad(&grads, &x), vec![4.0, -8.0, 12.0]);
    // A leaf used twice in one graph sums its paths: d/dx (3x + x) = 4.
    let g = x.mul_scalar(3.0)?.add(&x)?.sum_all()?.backward()?;
    assert_eq!(grad(&g, &x), vec![4.0; 3]);
    Ok(())
}

#[test]
fn no_grad_records_nothing() -> Result<()> {
    let x = var(&[0.5, -1.0, 2.0]);
    assert!(flame::grad_enabled());
    {
        let _g = flame::no_grad();
        let inner = flame::no_grad();
        let y = x.exp()?.add(&x)?;
        assert!(!y.requires_grad() && !flame::grad_enabled());
        drop(inner);
        // Still inside the outer guard.
        assert!(!x.sin()?.requires_grad());
        assert!(y.backward().is_err());
    }
    assert!(flame::grad_enabled());
    assert!(x.exp()?.requires_grad());
    Ok(())
}

#[test]
fn detach_stops_gradients() -> Result<()> {
    let x = var(&[1.0, 2.0, -3.0]);
    let d = x.detach();
    assert!(!d.requires_grad() && !d.is_var() && d.same_storage(&x));
    // d/dx sum(x * stopgrad(x)) = stopgrad(x).
    let g = x.mul(&d)?.sum_all()?.backward()?;
    assert_eq!(grad(&g, &x), vec![1.0, 2.0, -3.0]);
    // A detached intermediate cuts the whole path behind it: d/dx (stopgrad(e^x) x) = e^x.
    let g = x.exp()?.detach().mul(&x)?.sum_all()?.backward()?;
    close(&grad(&g, &x), &[1f64.exp(), 2f64.exp(), (-3f64).exp()]);
    Ok(())
}

#[test]
fn backward_twice_needs_retain_graph() -> Result<()> {
    let x = var(&[0.5, 1.5]);
    let loss = x.sin()?.mul(&x)?.sum_all()?;
    let (mut g1, mut g2) = (Grads::new(), Grads::new());
    loss.backward_retain_graph(&mut g1)?;
    loss.backward_retain_graph(&mut g2)?;
    assert_eq!(grad(&g1, &x), grad(&g2, &x));
    // d/dx x sin x = sin x + x cos x
    let want = [0.5f64, 1.5].map(|v| v.sin() + v * v.cos());
    close(&grad(&g1, &x), &want);
    // A plain backward frees the graph: the next one fails.
    loss.backward()?;
    let Err(err) = loss.backward() else {
        panic!("backward through a freed graph succeeded")
    };
    assert!(matches!(err, Error::Autograd(_)), "{err}");
    assert!(err.to_string().contains("freed"), "{err}");
    Ok(())
}

#[test]
fn backward_and_set_requires_grad_errors() -> Result<()> {
    let c = Tensor::ones(3, DType::F64, &CPU)?;
    assert!(matches!(c.sum_all()?.backward(), Err(Error::Autograd(_))));
    let x = var(&[1.0, 1.0, 1.0]);
    let y = x.exp()?;
    // Not a single element.
    assert!(y.backward().is_err());
    // set_requires_grad on a computed tensor, either way, and on an integer tensor.
    assert!(matches!(y.set_requires_grad(true), Err(Error::Autograd(_))));
    assert!(matches!(
        y.set_requires_grad(false),
        Err(Error::Autograd(_))
    ));
    let r = ids(&[1, 2], 2).set_requires_grad(true);
    assert!(matches!(r, Err(Error::UnsupportedDType { .. })));
    // backward_with_grad checks the seed's shape and otherwise works from any shape.
    let mut g = Grads::new();
    let bad = Tensor::ones(2, DType::F64, &CPU)?;
    assert!(y.backward_with_grad(&bad, &mut g, false).is_err());
    let seed = Tensor::from_vec(vec![1.0f64, 2.0, 3.0], 3, &CPU)?;
    y.backward_with_grad(&seed, &mut g, false)?;
    let e = std::f64::consts::E;
    close(&grad(&g, &x), &[e, 2.0 * e, 3.0 * e]);
    Ok(())
}

#[test]
fn zero_grad_clears_and_frozen_leaves_get_nothing() -> Result<()> {
    let a = leaf(Tensor::randn((2, 3), DType::F64, &CPU, 11)?);
    let b = var(&[0.5, -1.5, 2.0]);
    let mut grads = Grads::new();
    a.mul(&b)?.sum_all()?.backward_into(&mut grads)?;
    assert_eq!(grads.len(), 2);
    grads.zero_grad();
    assert!(grads.is_empty() && grads.get(&a).is_none() && grads.get(&b).is_none());
    // After clearing, a new backward starts from zero rather than adding to old values.
    a.sum_all()?.backward_into(&mut grads)?;
    assert_eq!(grad(&grads, &a), vec![1.0; 6]);
    assert!(grads.get(&b).is_none());
    // A frozen leaf records nothing and gets no gradient.
    b.set_requires_grad(false)?;
    assert!(!b.exp()?.requires_grad());
    let g = a.mul(&b)?.sum_all()?.backward()?;
    assert!(g.get(&b).is_none());
    assert_eq!(grad(&g, &a), [b.to_vec_f64()?, b.to_vec_f64()?].concat());
    Ok(())
}

#[test]
fn gradients_at_ties_and_kinks_follow_the_documented_rules() -> Result<()> {
    // max over [1, 3, 3]: the tied maxima share the gradient.
    let x = var(&[1.0, 3.0, 3.0]);
    assert_eq!(grad(&x.max_all()?.backward()?, &x), vec![0.0, 0.5, 0.5]);
    let g = x.min_keepdim(0)?.sum_all()?.backward()?;
    assert_eq!(grad(&g, &x), vec![1.0, 0.0, 0.0]);
    // maximum/minimum of equal values: the left operand takes the gradient.
    let (a, b) = (var(&[2.0]), var(&[2.0]));
    let g = a.maximum(&b)?.sum_all()?.backward()?;
    assert_eq!((grad(&g, &a), grad(&g, &b)), (vec![1.0], vec![0.0]));
    let g = b.minimum(&a)?.sum_all()?.backward()?;
    assert_eq!((grad(&g, &a), grad(&g, &b)), (vec![0.0], vec![1.0]));
    // relu and abs have derivative 0 at 0.
    let z = var(&[0.0, -1.0, 2.0]);
    assert_eq!(
        grad(&z.relu()?.sum_all()?.backward()?, &z),
        vec![0.0, 0.0, 1.0]
    );
    assert_eq!(
        grad(&z.abs()?.sum_all()?.backward()?, &z),
        vec![0.0, -1.0, 1.0]
    );
    Ok(())
}

#[test]
fn deep_chain_backward_is_iterative() -> Result<()> {
    // The tape is built and walked without recursion: a 100k-op chain must not overflow.
    let x = var(&[1.0; 3]);
    let mut y = x.clone();
    for _ in 0..100_000 {
        y = y.affine(1.0, 0.5)?;
    }
    assert_eq!(y.to_vec_f64()?, vec![50_001.0; 3]);
    let g = y.sum_all()?.backward()?;
    assert_eq!(grad(&g, &x), vec![1.0; 3]);
    Ok(())
}

#[test]
fn deep_chain_drop_without_backward() -> Result<()> {
    let x = var(&[1.0; 3]);
    let mut y = x.clone();
    for _ in 0..200_000 {
        y = y.affine(1.0, 0.0)?;
    }
    drop(y);
    Ok(())
}

#[test]
fn gradients_have_the_leaf_dtype() -> Result<()> {
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let x = leaf(Tensor::from_vec(vec![1.0f64, 2.0, 4.0], 3, &CPU)?.to_dtype(dt)?);
        // Computed in f64 through a cast: the gradient comes back in the leaf's dtype.
        let g = x.to_dtype(DType::F64)?.sqr()?.sum_all()?.backward()?;
        assert_eq!(g.get(&x).unwrap().dtype(), dt);
        assert_eq!(grad(&g, &x), vec![2.0, 4.0, 8.0]);
    }
    Ok(())
}

/// Every case's analytic gradients on CUDA (f64) against the CPU's: agreement to 1e-10 of the
/// largest gradient (1e-6 where a case computes in f32). A case that builds CPU tensors inside
/// cannot move and is listed; the ones that run must cover every recorded op kind.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn every_case_backward_on_cuda_matches_the_cpu() {
    use flame::autograd::gradcheck::graph_ops;
    let gpu = Device::cuda(0).expect("a CUDA GPU");
    let grads_on = |case: &Case, dev: &Device| -> Result<(Vec<Vec<f64>>, BTreeSet<&'static str>)> {
        let leaves = case
            .inputs
            .iter()
            .map(|x| {
                let t = x.to_device(dev)?.detach();
                t.set_requires_grad(true)?;
                Ok(t)
            })
            .collect::<Result<Vec<_>>>()?;
        let y = (case.f)(&leaves)?;
        let r = Tensor::rand_uniform(0.5, 1.5, y.shape().clone(), DType::F64, &CPU, 7)?
            .to_device(dev)?;
        let loss = y.mul(&r)?.sum_all()?;
        let ops = graph_ops(&loss)?;
        let g = loss.backward()?;
        let grads = leaves
            .iter()
            .map(|l| match g.get(l) {
                Some(t) => t.to_vec_f64(),
                None => Ok(vec![0.0; l.elem_count()]),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((grads, ops))
    };
    let (mut covered, mut skipped, mut failures, mut ran) = (BTreeSet::new(), vec![], vec![], 0);
    for case in all_cases() {
        let (cpu, _) = grads_on(&case, &CPU).expect("the CPU pass");
        match grads_on(&case, &gpu) {
            Err(Error::DeviceMismatch { .. }) => skipped.push(case.name.clone()),
            // The flash kernels take bf16/f16 only; tests/attention/flash.rs checks them
            // against the composite reference.
            Err(Error::UnsupportedDType {
                op: "attention", ..
            }) => skipped.push(case.name.clone()),
            Err(e) => failures.push(format!("{}: {e}", case.name)),
            Ok((cuda, ops)) => {
                ran += 1;
                // A case that casts to f32 computes in f32 on both backends.
                let rel = if ops.contains("cast") { 1e-6 } else { 1e-10 };
                covered.extend(ops);
                for (i, (a, b)) in cuda.iter().zip(&cpu).enumerate() {
                    let scale = b.iter().fold(1f64, |m, v| m.max(v.abs()));
                    if let Some((j, (x, y))) = a
                        .iter()
                        .zip(b)
                        .enumerate()
                        .find(|(_, (x, y))| (*x - *y).abs() > rel * scale)
                    {
                        failures.push(format!(
                            "{} input {i} element {j}: cuda {x} vs cpu {y}",
                            case.name
                        ));
                    }
                }
            }
        }
    }
    println!(
        "{ran} cases ran on CUDA; {} built CPU tensors inside and stayed on the CPU: {skipped:?}",
        skipped.len()
    );
    assert!(
        failures.is_empty(),
        "{} cases differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let missing: Vec<_> = differentiable_ops()
        .into_iter()
        .filter(|k| !covered.contains(k) && *k != "attention")
        .collect();
    assert!(
        missing.is_empty(),
        "ops never run backward on CUDA: {missing:?}"
    );
}

/// `graph_op_counts` counts each recorded op reachable from the root once, by kind (a
/// shared subgraph once, not once per path), and `graph_ops` names the same kinds.
#[test]
fn recorded_ops_are_counted_by_kind() {
    let x = Tensor::randn((3, 4), DType::F64, &CPU, 1)
        .unwrap()
        .requires_grad_()
        .unwrap();
    let w = Tensor::randn((4, 4), DType::F64, &CPU, 2).unwrap();
    let h = x.matmul(&w).unwrap();
    // `h` feeds both matmuls: it is counted once.
    let y = h.matmul(&w).unwrap().add(&h.matmul(&w).unwrap()).unwrap();
    let counts = flame::autograd::gradcheck::graph_op_counts(&y).unwrap();
    assert_eq!(counts.get("matmul"), Some(&3), "{counts:?}");
    assert_eq!(counts.get("add"), Some(&1), "{counts:?}");
    let kinds = flame::autograd::gradcheck::graph_ops(&y).unwrap();
    assert_eq!(kinds, counts.keys().copied().collect::<BTreeSet<_>>());
    // Nothing recorded without a leaf that needs a gradient.
    let z = w.matmul(&w).unwrap();
    assert!(flame::autograd::gradcheck::graph_op_counts(&z)
        .unwrap()
        .is_empty());
}
