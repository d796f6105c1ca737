//! The crate's layer order (docs/ARCHITECTURE.md, "The layers"): a module of `src/` uses
//! only modules of its own layer or below. Read from the sources' `crate::` paths (in `use`
//! lines and in code; comments are skipped), with the crate root's re-exports (`crate::Tensor`
//! is the `tensor` module's, read from lib.rs) resolved to their modules. A new top-level
//! module must be given its layer here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The layers, from the ground up; modules of one layer may use each other.
const LAYERS: &[&[&str]] = &[
    &["dtype", "shape", "error", "progress", "fault", "config"],
    &["backend", "device"],
    &["tensor", "autograd", "safetensors"],
    &["optim", "nn", "stream", "dist", "diffusion"],
    &["encoders", "models", "sample", "data"],
    &["train"],
    &["cli"],
];

/// What the crate root re-exports (`pub use module::{...}` in lib.rs) and the macros
/// exported at the root (`#[macro_export]`), by the module that defines each.
fn root_items(src: &Path, files: &[PathBuf]) -> BTreeMap<String, String> {
    let mut items = BTreeMap::new();
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    for line in lib.lines() {
        let Some(path) = line.trim().strip_prefix("pub use ") else {
            continue;
        };
        let path = path.trim_end_matches(';');
        let (module, rest) = path.split_once("::").unwrap_or((path, ""));
        let names = rest.trim_start_matches('{').trim_end_matches('}');
        for name in names.split(',') {
            let name = name.trim().rsplit("::").next().unwrap_or("").trim();
            if !name.is_empty() {
                items.insert(name.to_string(), module.to_string());
            }
        }
    }
    for f in files {
        let rel = f.strip_prefix(src).unwrap();
        let module = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = module.trim_end_matches(".rs").to_string();
        let text = std::fs::read_to_string(f).unwrap();
        let mut exported = false;
        for line in text.lines().map(str::trim) {
            if line == "#[macro_export]" {
                exported = true;
            } else if let Some(m) = line.strip_prefix("macro_rules! ").filter(|_| exported) {
                items.insert(ident(m).to_string(), module.clone());
                exported = false;
            } else if !line.starts_with("#[") {
                exported = false;
            }
        }
    }
    items
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first names of the `crate::` paths on one line of code: `crate::a::b` gives `a`,
/// `crate::{a, b::c, D}` gives `a`, `b` and `D`.
fn crate_paths(line: &str) -> Vec<String> {
    let mut out = vec![];
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The group's top-level names (nested groups skipped).
            let (mut depth, mut start) = (0usize, 0usize);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.push(ident(group[start..i].trim()).to_string());
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(ident(group[start..i].trim()).to_string());
                        start = i + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(ident(rest).to_string());
        }
    }
    out.into_iter().filter(|n| !n.is_empty()).collect()
}

#[test]
fn no_module_uses_a_layer_above_its_own() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    rust_files(&src, &mut files);
    let root = root_items(&src, &files);
    let mut upward = vec![];
    let mut unplaced = vec![];
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs").to_string();
        if module == "lib" || module == "bin" {
            continue;
        }
        let Some(own) = layer_of(&module) else {
            unplaced.push(module);
            continue;
        };
        let text = std::fs::read_to_string(f).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for name in crate_paths(code) {
                let target = root.get(&name).map_or(name.as_str(), String::as_str);
                if target == module {
                    continue;
                }
                match layer_of(target) {
                    Some(l) if l > own => upward.push(format!(
                        "{}:{}: {module} (layer {own}) uses {target} (layer {l})",
                        rel.display(),
                        n + 1
                    )),
                    Some(_) => {}
                    None if target.chars().next().is_some_and(|c| c.is_lowercase()) => {
                        unplaced.push(format!("{target} (used by {})", rel.display()))
                    }
                    // A root item this table does not know yet.
                    None => unplaced.push(format!("crate::{target} (in {})", rel.display())),
                }
            }
        }
    }
    unplaced.sort();
    unplaced.dedup();
    assert!(
        unplaced.is_empty(),
        "modules or root items without a layer: {unplaced:?}"
    );
    assert!(
        upward.is_empty(),
        "imports against the layer order:\n{}",
        upward.join("\n")
    );
}

#[test]
fn the_scanner_reads_paths_and_groups() {
    assert_eq!(crate_paths("use crate::nn::{a, b};"), ["nn"]);
    assert_eq!(
        crate_paths("use crate::{DType, nn::Linear, models::{x, y}, Tensor};"),
        ["DType", "nn", "models", "Tensor"]
    );
    assert_eq!(
        crate_paths("let x = crate::progress::tick(); crate::fault::point(p)"),
        ["progress", "fault"]
    );
}
