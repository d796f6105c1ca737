//! Config sections declared once: the `section!` macro makes a section's struct, a reader
//! whose keys are all optional (a missing required key is an error naming it), and the
//! reference of its keys from the fields' doc comments, types and defaults; [`Problem`]s
//! name the key, [`line_of`] finds its line. The `train` config and the `[data]` section use
//! it.

use serde::Serialize;

/// One key of the config reference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyDoc {
    /// `section.key`.
    pub key: &'static str,
    /// Its TOML type, in words.
    pub ty: &'static str,
    /// Its default as TOML, `None` when the key is required.
    pub default: Option<String>,
    /// What it means.
    pub doc: String,
}

/// A config section: its name and the reference of its keys.
pub trait Section {
    /// The section's name (`[model]` is "model").
    const NAME: &'static str;
    /// One entry per key, in declaration order.
    fn reference() -> Vec<KeyDoc>;
}

/// The TOML type of a Rust field type, in words.
pub(crate) fn toml_type(rust: &str) -> &'static str {
    match rust.replace(' ', "").as_str() {
        "usize" | "u64" => "integer >= 0",
        "f64" => "float",
        "bool" => "bool",
        "PathBuf" => "path",
        "Option<PathBuf>" => "path (optional)",
        "Option<String>" => "string (optional)",
        "Vec<String>" => "list of strings",
        "Vec<PathBuf>" => "list of paths",
        "Vec<DirEntry>" => "tables [[...]] of path, repeats",
        "[usize;2]" => "[integer, integer]",
        "[f64;2]" => "[float, float]",
        "Gpus" => "list of integers, or \"all\"",
        _ => "string",
    }
}

/// A value as TOML text ("none" for an absent optional value, which TOML cannot write).
pub(crate) fn show<T: Serialize>(v: &T) -> String {
    match toml::Value::try_from(v) {
        Ok(v) => v.to_string(),
        Err(_) => "none".into(),
    }
}

macro_rules! field_value {
    ($raw:expr, $key:expr) => {
        $raw.ok_or_else(|| format!("missing key `{}`", $key))?
    };
    ($raw:expr, $key:expr, $default:expr) => {
        $raw.unwrap_or_else(|| ($default).into())
    };
}

/// Whether a field declared without a default is required (`required!()`) or not.
macro_rules! required {
    () => {
        true
    };
    ($default:expr) => {
        false
    };
}

macro_rules! field_default {
    ($ty:ty) => {
        None
    };
    ($ty:ty, $default:expr) => {{
        let v: $ty = ($default).into();
        Some($crate::config::show(&v))
    }};
}

/// Declares a config section: the public struct, a reader with every key optional (so a
/// missing required key is an error naming it, and a missing section of defaults is fine),
/// and the reference of its keys from the fields' doc comments, types and defaults.
macro_rules! section {
    (
        $(#[doc = $sdoc:literal])*
        $name:ident / $raw:ident = $key:literal {
            $(
                $(#[doc = $doc:literal])*
                $field:ident : $ty:ty $(= $default:expr)? ,
            )*
        }
    ) => {
        $(#[doc = $sdoc])*
        #[derive(Clone, Debug, PartialEq, serde::Serialize)]
        pub struct $name {
            $( $(#[doc = $doc])* pub $field: $ty, )*
        }

        #[derive(Debug, Default, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        pub(crate) struct $raw {
            $( #[serde(default)] $field: Option<$ty>, )*
        }

        impl $raw {
            /// The required keys this section lacks.
            pub(crate) fn missing(&self) -> Vec<&'static str> {
                let mut v = vec![];
                $(
                    if $crate::config::required!($($default)?) && self.$field.is_none() {
                        v.push(concat!($key, ".", stringify!($field)));
                    }
                )*
                v
            }

            pub(crate) fn finish(self) -> std::result::Result<$name, String> {
                Ok($name {
                    $( $field: $crate::config::field_value!(
                        self.$field,
                        concat!($key, ".", stringify!($field))
                        $(, $default)?
                    ), )*
                })
            }
        }

        impl $crate::config::Section for $name {
            const NAME: &'static str = $key;
            fn reference() -> Vec<$crate::config::KeyDoc> {
                vec![$($crate::config::KeyDoc {
                    key: concat!($key, ".", stringify!($field)),
                    ty: $crate::config::toml_type(stringify!($ty)),
                    default: $crate::config::field_default!($ty $(, $default)?),
                    doc: [$($doc),*].iter().map(|l| l.trim()).collect::<Vec<_>>().join(" "),
                },)*]
            }
        }
    };
}

pub(crate) use {field_default, field_value, required, section};

/// One failed check: the key and what is wrong with its value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// `section.key`.
    pub key: &'static str,
    /// What is wrong.
    pub msg: String,
}

/// The 1-based line of `key` (`section.name`) in a TOML text: under its `[section]` header,
/// or as a dotted key; `None` when the key is not written (a default).
pub fn line_of(text: &str, key: &str) -> Option<usize> {
    let (section, name) = key.split_once('.')?;
    let mut current = String::new();
    for (i, line) in text.lines().enumerate() {
        let l = line.trim();
        if let Some(h) = l.strip_prefix('[') {
            current = h.trim_end_matches(']').trim().to_string();
            continue;
        }
        let Some((k, _)) = l.split_once('=') else {
            continue;
        };
        let k = k.trim().trim_matches('"');
        let full = if current.is_empty() {
            k.to_string()
        } else {
            format!("{current}.{k}")
        };
        if full == format!("{section}.{name}") {
            return Some(i + 1);
        }
    }
    None
}

/// A problem when `v` is not one of `list`.
pub(crate) fn in_list(key: &'static str, v: &str, list: &[&str]) -> Option<Problem> {
    (!list.contains(&v)).then(|| Problem {
        key,
        msg: format!("\"{v}\": expected {}", list.join(", ")),
    })
}
