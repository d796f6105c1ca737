//! Convolution and pooling values on the CPU against direct loops over f64, for every float
//! dtype, and the adjoint identity that makes fold2d the gradient of unfold2d.
#![cfg(feature = "cpu-ref")]

use flame::nn::{adaptive_avg_pool2d, avg_pool2d, conv2d, conv2d_banded, max_pool2d, COLUMN_BYTES};
use flame::{DType, Device, Result, Tensor, Window2d};

#[path = "common/tolerance.rs"]
mod tolerance;

const CPU: Device = Device::Cpu;

/// The tolerance of one rounding of a sum of |terms| `mag` in `dt`: the one tolerance
/// table's against an f64 reference (`Against::F64`).
fn tol(dt: DType) -> f64 {
    tolerance::tolerance(tolerance::Against::F64, dt).1
}

/// Direct convolution: out[n][o][y][x] = b[o] + sum_{c, i, j} x[n][g*cin+c][y*s+i*d-p][x*s+j*d-p] w[o][c][i][j].
#[allow(clippy::too_many_arguments)]
fn conv_ref(
    x: &[f64],
    xd: [usize; 4],
    w: &[f64],
    wd: [usize; 4],
    b: &[f64],
    s: usize,
    p: usize,
    d: usize,
    groups: usize,
) -> (Vec<f64>, [usize; 4]) {
    let [n, cin, h, wi] = xd;
    let [cout, cg, kh, kw] = wd;
    let ho = (h + 2 * p - d * (kh - 1) - 1) / s + 1;
    let wo = (wi + 2 * p - d * (kw - 1) - 1) / s + 1;
    let og = cout / groups;
    let mut out = vec![0.0; n * cout * ho * wo];
    for ni in 0..n {
        for o in 0..cout {
            let g = o / og;
            for y in 0..ho {
                for xx in 0..wo {
                    let mut acc = b.get(o).copied().unwrap_or(0.0);
                    for c in 0..cg {
                        for i in 0..kh {
                            for j in 0..kw {
                                let (yy, xi) = (
                                    (y * s + i * d) as isize - p as isize,
                                    (xx * s + j * d) as isize - p as isize,
                                );
                                if yy < 0 || xi < 0 || yy as usize >= h || xi as usize >= wi {
                                    continue;
                                }
                                let ci = g * cg + c;
                                acc += x[((ni * cin + ci) * h + yy as usize) * wi + xi as usize]
                                    * w[((o * cg + c) * kh + i) * kw + j];
                            }
                        }
                    }
                    out[((ni * cout + o) * ho + y) * wo + xx] = acc;
                }
            }
        }
    }
    (out, [n, cout, ho, wo])
}

fn close(what: &str, got: &Tensor, want: &[f64], dt: DType, mag: f64) {
    let g = got.to_vec_f64().unwrap();
    assert_eq!(g.len(), want.len(), "{what}: length");
    for (i, (a, b)) in g.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol(dt) * mag.max(b.abs()).max(1.0),
            "{what} [{dt}] element {i}: {a} vs {b}"
        );
    }
}

#[test]
fn conv2d_matches_direct_loops() -> Result<()> {
    // (x dims, w dims, stride, padding, dilation, groups, bias)
    let configs = [
        ([1, 1, 1, 1], [1, 1, 1, 1], 1, 0, 1, 1, true),
        ([2, 3, 7, 5], [4, 3, 3, 3], 1, 1, 1, 1, true),
        ([1, 4, 9, 8], [6, 2, 3, 3], 2, 1, 1, 2, false),
        ([2, 2, 8, 7], [3, 2, 2, 3], 1, 2, 2, 1, true),
        ([1, 6, 5, 5], [6, 1, 3, 3], 1, 1, 1, 6, true),
    ];
    for dt in [DType::F64, DType::F32, DType::BF16, DType::F16] {
        for (k, (xd, wd, s, p, d, groups, bias)) in configs.into_iter().enumerate() {
            let x = Tensor::randn(xd.to_vec(), DType::F64, &CPU, k as u64)?.to_dtype(dt)?;
            let w = Tensor::randn(wd.to_vec(), DType::F64, &CPU, 100 + k as u64)?.to_dtype(dt)?;
            let b = Tensor::randn(wd[0], DType::F64, &CPU, 200 + k as u64)?.to_dtype(dt)?;
            let got = conv2d(&x, &w, bias.then_some(&b), (s, s), (p, p), (d, d), groups)?;
            let bv = if bias { b.to_vec_f64()? } else { vec![] };
            let (want, od) = conv_ref(
                &x.to_vec_f64()?,
                xd,
                &w.to_vec_f64()?,
                wd,
                &bv,
                s,
                p,
                d,
                groups,
            );
            assert_eq!(got.dims(), od, "config {k}");
            close(
                &format!("conv2d config {k}"),
                &got,
                &want,
                dt,
                (wd[1] * wd[2] * wd[3]) as f64,
            );
        }
    }
    Ok(())
}

/// A convolution made a band of output rows at a time (as `conv2d` runs one whose column
/// buffer would pass `COLUMN_BYTES` where nothing is recorded) gives the whole one's values:
/// bands of one row, of a few, of rows reaching into both paddings, with strides, dilations,
/// groups, padding wider than the kernel reaches, and a band budget under one row.
#[test]
fn banded_convolutions_equal_the_whole_one() -> Result<()> {
    // (x dims, w dims, stride, padding, dilation, groups)
    let configs = [
        ([2, 3, 11, 7], [4, 3, 3, 3], 1, 1, 1, 1),
        ([1, 4, 13, 9], [6, 2, 3, 3], 2, 1, 1, 2),
        ([2, 2, 10, 7], [3, 2, 2, 3], 1, 2, 2, 1),
        ([1, 3, 6, 5], [2, 3, 3, 3], 1, 4, 1, 1),
        ([1, 2, 9, 4], [2, 2, 5, 1], 3, 2, 1, 1),
    ];
    for (k, (xd, wd, s, p, d, groups)) in configs.into_iter().enumerate() {
        let x = Tensor::randn(xd.to_vec(), DType::F64, &CPU, 300 + k as u64)?;
        let w = Tensor::randn(wd.to_vec(), DType::F64, &CPU, 400 + k as u64)?;
        let b = Tensor::randn(wd[0], DType::F64, &CPU, 500 + k as u64)?;
        let whole = conv2d(&x, &w, Some(&b), (s, s), (p, p), (d, d), groups)?;
        let row = xd[0] * xd[1] * wd[2] * wd[3] * whole.dims()[3] * 8;
        for rows in [0, 1, 2, 3, 1000] {
            let got = conv2d_banded(&x, &w, Some(&b), (s, s), (p, p), (d, d), groups, rows * row)?;
            assert_eq!(got.dims(), whole.dims(), "config {k}, {rows} rows a band");
            close(
                &format!("config {k}, {rows} rows a band"),
                &got,
                &whole.to_vec_f64()?,
                DType::F64,
                (wd[1] * wd[2] * wd[3]) as f64,
            );
        }
    }
    // Inside no_grad, `conv2d` bands a convolution past the bound by itself: 3x3 over 64
    // channels of 256 x 256 in f32 wants 576 columns a position, 151 MB: under the bound
    // whole; at 512 x 256, 302 MB, banded, with the same values as its rows run whole.
    let x = Tensor::randn((1, 64, 512, 256), DType::F32, &CPU, 600)?;
    let w = Tensor::randn((2, 64, 3, 3), DType::F32, &CPU, 601)?;
    assert!(x.elem_count() * 9 * 4 > COLUMN_BYTES);
    let _g = flame::no_grad();
    let got = conv2d(&x, &w, None, (1, 1), (1, 1), (1, 1), 1)?;
    let want = conv2d_banded(&x, &w, None, (1, 1), (1, 1), (1, 1), 1, usize::MAX)?;
    close(
        "no_grad banding",
        &got,
        &want.to_vec_f64()?,
        DType::F32,
        576.0,
    );
    Ok(())
}

#[test]
fn pools_match_direct_loops() -> Result<()> {
    let x = Tensor::randn((2, 3, 7, 6), DType::F64, &CPU, 9)?;
    let v = x.to_vec_f64()?;
    let at = |n: usize, c: usize, y: isize, xx: isize| -> Option<f64> {
        (y >= 0 && xx >= 0 && y < 7 && xx < 6)
            .then(|| v[((n * 3 + c) * 7 + y as usize) * 6 + xx as usize])
    };
    // 3x3, stride 2, padding 1: (7 + 2 - 3) / 2 + 1 = 4 rows, (6 + 2 - 3) / 2 + 1 = 3 columns.
    let (mut avg, mut max) = (vec![], vec![]);
    for n in 0..2 {
        for c in 0..3 {
            for oy in 0..4isize {
                for ox in 0..3isize {
                    let cells: Vec<Option<f64>> = (0..3)
                        .flat_map(|i| (0..3).map(move |j| (i, j)))
                        .map(|(i, j)| at(n, c, oy * 2 + i - 1, ox * 2 + j - 1))
                        .collect();
                    avg.push(cells.iter().map(|c| c.unwrap_or(0.0)).sum::<f64>() / 9.0);
                    max.push(
                        cells
                            .iter()
                            .flatten()
                            .fold(f64::NEG_INFINITY, |m, &c| m.max(c)),
                    );
                }
            }
        }
    }
    close(
        "avg_pool2d",
        &avg_pool2d(&x, (3, 3), (2, 2), (1, 1))?,
        &avg,
        DType::F64,
        1.0,
    );
    close(
        "max_pool2d",
        &max_pool2d(&x, (3, 3), (2, 2), (1, 1))?,
        &max,
        DType::F64,
        1.0,
    );
    // Adaptive 7x6 -> 3x4: rows [0,3) [2,5) [4,7), columns [0,2) [1,3) [3,5) [4,6).
    let rows = [(0, 3), (2, 5), (4, 7)];
    let cols = [(0, 2), (1, 3), (3, 5), (4, 6)];
    let mut ada = vec![];
    for n in 0..2 {
        for c in 0..3 {
            for &(r0, r1) in &rows {
                for &(c0, c1) in &cols {
                    let cells: Vec<f64> = (r0..r1)
                        .flat_map(|y| (c0..c1).map(move |xx| (y, xx)))
                        .map(|(y, xx)| at(n, c, y, xx).unwrap_or(f64::NAN))
                        .collect();
                    ada.push(cells.iter().sum::<f64>() / cells.len() as f64);
                }
            }
        }
    }
    close(
        "adaptive_avg_pool2d",
        &adaptive_avg_pool2d(&x, (3, 4))?,
        &ada,
        DType::F64,
        1.0,
    );
    Ok(())
}

#[test]
fn fold_is_the_adjoint_of_unfold() -> Result<()> {
    // <unfold(x), y> = <x, fold(y)> for every window shape: what makes each the other's VJP.
    for (k, (kernel, stride, padding, dilation)) in [
        ((3, 3), (1, 1), (1, 1), (1, 1)),
        ((2, 3), (2, 1), (0, 2), (1, 2)),
        ((1, 1), (3, 3), (0, 0), (1, 1)),
    ]
    .into_iter()
    .enumerate()
    {
        let win = Window2d {
            kernel,
            stride,
            padding,
            dilation,
        };
        let x = Tensor::randn((2, 3, 7, 8), DType::F64, &CPU, k as u64)?;
        let cols = x.unfold2d(win)?;
        let y = Tensor::randn(cols.dims().to_vec(), DType::F64, &CPU, 50 + k as u64)?;
        let lhs = cols.mul(&y)?.sum_all()?.to_scalar_f64()?;
        let rhs = x.mul(&y.fold2d(win, (7, 8))?)?.sum_all()?.to_scalar_f64()?;
        assert!(
            (lhs - rhs).abs() < 1e-9 * lhs.abs().max(1.0),
            "window {k}: {lhs} vs {rhs}"
        );
    }
    // A window that does not fit is an error, not a panic.
    let small = Tensor::ones((1, 1, 2, 2), DType::F32, &CPU)?;
    let big = Window2d {
        kernel: (5, 5),
        stride: (1, 1),
        padding: (0, 0),
        dilation: (1, 1),
    };
    assert!(small.unfold2d(big).is_err());
    Ok(())
}
