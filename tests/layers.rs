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
    &["tensor", "autograd", "safetensors", "gguf"],
    &["optim", "nn", "memory", "dist", "diffusion"],
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

/// The first names after `prefix` on one line of code: `super::a::b` gives `a`,
/// `super::{a, b::c}` gives `a` and `b` (as `crate_paths` reads `crate::`).
fn paths_after(line: &str, prefix: &str) -> Vec<String> {
    crate_paths(
        &line
            .replace(prefix, "crate::")
            .replace("crate::crate::", "crate::"),
    )
}

/// The sibling files (or folders) of a module folder's file that one of its statements
/// names: `super::x` and `crate::<the folder's path>::x`, where `x` is a sibling, or an item
/// the folder's `mod.rs` re-exports from a sibling (`reexports`: item -> sibling).
fn sibling_uses(
    line: &str,
    folder_path: &str,
    siblings: &[String],
    reexports: &BTreeMap<String, String>,
) -> Vec<String> {
    let code = code_of(line);
    // Only `super::` and the folder's own `crate::` path count; other `crate::` paths are the
    // layer test's business.
    let mut names: Vec<String> = vec![];
    let mut rest = code.as_str();
    while let Some(at) = rest.find("super::") {
        let tail = &rest[at..];
        names.extend(paths_after(
            tail.split(';').next().unwrap_or(tail),
            "super::",
        ));
        rest = &rest[at + "super::".len()..];
    }
    let own = format!("crate::{folder_path}::");
    let mut rest = code.as_str();
    while let Some(at) = rest.find(&own) {
        let tail = &rest[at + own.len()..];
        names.extend(crate_paths(&format!(
            "crate::{}",
            tail.split(';').next().unwrap_or(tail)
        )));
        rest = &rest[at + own.len()..];
    }
    let mut out: Vec<String> = names
        .into_iter()
        .filter_map(|n| {
            if siblings.contains(&n) {
                Some(n)
            } else {
                reexports.get(&n).cloned()
            }
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// A line without its comment (`//` outside string literals).
fn code_of(line: &str) -> String {
    let mut in_str = false;
    let b = line.as_bytes();
    for i in 0..b.len() {
        match b[i] {
            b'"' if i == 0 || b[i - 1] != b'\\' => in_str = !in_str,
            b'/' if !in_str && b.get(i + 1) == Some(&b'/') => return line[..i].to_string(),
            _ => {}
        }
    }
    line.to_string()
}

/// A file's text as statements: a `use` declaration spread over lines joined into one, every
/// other line as it is.
fn statements(text: &str) -> Vec<String> {
    let mut out = vec![];
    let mut open: Option<String> = None;
    for line in text.lines() {
        let code = code_of(line);
        match open.as_mut() {
            Some(u) => {
                u.push(' ');
                u.push_str(code.trim());
            }
            None => {
                let t = code.trim_start();
                let is_use = t.starts_with("use ")
                    || t.starts_with("pub use ")
                    || (t.starts_with("pub(") && t.contains(") use "));
                if !is_use {
                    out.push(code);
                    continue;
                }
                open = Some(code.trim().to_string());
            }
        }
        if open.as_ref().is_some_and(|u| u.contains(';')) {
            out.extend(open.take());
        }
    }
    out.extend(open);
    out
}

/// The items a folder's `mod.rs` re-exports from its files: `pub use x::{A, b::C}` gives
/// A -> x and C -> x.
fn reexports_of(mod_rs: &str, siblings: &[String]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for st in statements(mod_rs) {
        let t = st.trim();
        let Some(at) = t.find("use ") else { continue };
        if !t.starts_with("pub") {
            continue;
        }
        let path = t[at + 4..].trim_end_matches(';').trim();
        let (first, rest) = path.split_once("::").unwrap_or((path, ""));
        if !siblings.iter().any(|s| s == first) {
            continue;
        }
        let rest = rest.trim_start_matches('{').trim_end_matches('}');
        for item in rest.split(',') {
            let name = item.rsplit("::").next().unwrap_or("").trim();
            let name = name.rsplit(" as ").next().unwrap_or(name).trim();
            let name = name.trim_start_matches('{').trim_end_matches('}').trim();
            if !name.is_empty() && name != "self" {
                out.insert(name.to_string(), first.to_string());
            }
        }
    }
    out
}

/// Within each module folder, the files (and sub-folders) other than `mod.rs` form no
/// circle of uses: one that a sibling uses does not use it back, directly or around a loop
/// (`backend/cuda/`: the op files use `storage.rs`, and `dispatch.rs` uses the op files).
#[test]
fn no_files_of_a_module_use_each_other_in_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut folders = vec![];
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.push(p.clone());
                walk(&p, out);
            }
        }
    }
    walk(&src, &mut folders);
    let mut circles = vec![];
    for folder in folders {
        let rel = folder.strip_prefix(&src).unwrap();
        if rel.starts_with("bin") {
            continue;
        }
        let folder_path = rel.to_string_lossy().replace('/', "::");
        let mut siblings: Vec<String> = vec![];
        for e in std::fs::read_dir(&folder).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_stem().unwrap().to_string_lossy().to_string();
            if name != "mod" && (p.is_dir() || p.extension().is_some_and(|x| x == "rs")) {
                siblings.push(name);
            }
        }
        siblings.sort();
        let reexports = std::fs::read_to_string(folder.join("mod.rs"))
            .map(|t| reexports_of(&t, &siblings))
            .unwrap_or_default();
        // Each sibling's uses of the others (a folder: every file in it).
        let mut uses: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for s in &siblings {
            let path = folder.join(s);
            let mut files = vec![];
            if path.is_dir() {
                // A sub-folder's files name the folder's siblings through `super::super::`
                // or the full path; its own `super::` is the sub-folder.
                rust_files(&path, &mut files);
            } else {
                files.push(folder.join(format!("{s}.rs")));
            }
            let mut named = vec![];
            for f in files {
                let text = std::fs::read_to_string(&f).unwrap();
                let nested = f.parent() != Some(folder.as_path());
                for line in statements(&text) {
                    // One level down, `super::super::x` names a sibling `x` and `super::`
                    // the sub-folder's own items; one level up is outside the folder.
                    let line = if nested {
                        line.replace("super::super::", "\u{1}")
                            .replace("super::", "self::")
                            .replace('\u{1}', "super::")
                    } else {
                        line.replace("super::super::", "")
                    };
                    named.extend(sibling_uses(&line, &folder_path, &siblings, &reexports));
                }
            }
            named.retain(|n| n != s);
            named.sort();
            named.dedup();
            uses.insert(s.clone(), named);
        }
        // A circle: a path of uses back to where it began.
        for start in &siblings {
            let mut stack = vec![(start.clone(), vec![start.clone()])];
            let mut seen = std::collections::BTreeSet::new();
            while let Some((at, path)) = stack.pop() {
                for next in &uses[&at] {
                    if next == start {
                        let mut c = path.clone();
                        c.push(start.clone());
                        circles.push(format!("{}: {}", rel.display(), c.join(" -> ")));
                    } else if seen.insert(next.clone()) {
                        let mut p = path.clone();
                        p.push(next.clone());
                        stack.push((next.clone(), p));
                    }
                }
            }
        }
    }
    circles.sort();
    circles.dedup();
    assert!(
        circles.is_empty(),
        "files of a module using each other in a circle:\n{}",
        circles.join("\n")
    );
}

#[test]
fn the_circle_scanner_reads_super_and_own_paths() {
    let sib = vec!["a".to_string(), "b".to_string(), "c".to_string()];
    let re = reexports_of(
        "pub use a::{Thing, x::Other as O};\npub(crate) use c::Z;",
        &sib,
    );
    assert_eq!(re.get("Thing").map(String::as_str), Some("a"));
    assert_eq!(re.get("O").map(String::as_str), Some("a"));
    assert_eq!(re.get("Z").map(String::as_str), Some("c"));
    let u = |l: &str| sibling_uses(l, "m", &sib, &re);
    assert_eq!(u("use super::a::X;"), ["a"]);
    assert_eq!(u("use super::{b::Y, c, W};"), ["b", "c"]);
    assert_eq!(u("let x = crate::m::c::f(); // super::a"), ["c"]);
    assert_eq!(u("fn f(d: &super::Thing) {}"), ["a"]);
    assert_eq!(u("let s = \"https://x\"; super::Z::new()"), ["c"]);
    assert!(u("use super::cuda_err;").is_empty());
    // A `use` group over several lines is one statement.
    let st = statements("use super::{\n    b::Y,\n    c,\n};\nfn g() {}");
    assert_eq!(u(&st[0]), ["b", "c"]);
}
