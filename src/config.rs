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
        "Option<f64>" => "float (optional)",
        "Option<bool>" => "bool (optional)",
        "Vec<String>" => "list of strings",
        "Vec<PathBuf>" => "list of paths",
        "Vec<DirEntry>" => "tables [[...]] of path, repeats, references",
        "Vec<SamplePrompt>" => "list of strings or tables of prompt, references",
        "Vec<AdapterBlock>" => "tables [[...]] of pattern, lr, rank, alpha",
        "[usize;2]" => "[integer, integer]",
        "[f64;2]" => "[float, float]",
        "Option<[f64;2]>" => "[float, float] (optional)",
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
            $( #[serde(default)] $field: Option<$crate::config::Lenient<$ty>>, )*
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

            /// The section's values. A value of the wrong type or out of its choices is a
            /// problem pushed to `problems`: the key's default stands in for it, so that the
            /// other checks still run; a required key's, or a required key missing, makes the
            /// section fail (`None`) after every key was read.
            pub(crate) fn finish(
                self,
                problems: &mut Vec<$crate::config::Problem>,
            ) -> std::result::Result<Option<$name>, String> {
                let mut whole = true;
                $(
                    let $field = match self.$field {
                        Some($crate::config::Lenient::Bad { shown, why }) => {
                            problems.push($crate::config::Problem {
                                key: concat!($key, ".", stringify!($field)),
                                msg: format!("{shown}: {why}"),
                            });
                            whole &= !$crate::config::required!($($default)?);
                            None
                        }
                        Some($crate::config::Lenient::Good(v)) => Some(v),
                        None => {
                            if $crate::config::required!($($default)?) {
                                problems.push($crate::config::Problem {
                                    key: concat!($key, ".", stringify!($field)),
                                    msg: $crate::config::MISSING.into(),
                                });
                                whole = false;
                            }
                            None
                        }
                    };
                )*
                if !whole {
                    return Ok(None);
                }
                Ok(Some($name {
                    $( $field: $crate::config::field_value!(
                        $field,
                        concat!($key, ".", stringify!($field))
                        $(, $default)?
                    ), )*
                }))
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

/// A config value as read: of its type (`Good`), or not (`Bad`: the value as TOML and why it
/// does not fit, from its type's own reading, e.g. the choices of an enum), so that every bad
/// key is reported at once, each with its line, not only the first one TOML's reader meets.
#[derive(Debug)]
pub(crate) enum Lenient<T> {
    Good(T),
    Bad { shown: String, why: String },
}

impl<'de, T: serde::de::DeserializeOwned> serde::Deserialize<'de> for Lenient<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let v = toml::Value::deserialize(d)?;
        match v.clone().try_into::<T>() {
            Ok(t) => Ok(Lenient::Good(t)),
            Err(e) => Ok(Lenient::Bad {
                shown: v.to_string(),
                why: e.message().trim().to_string(),
            }),
        }
    }
}

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

/// The line of a key written as a table of arrays (`[[data.dirs]]`): its first header.
fn table_line(text: &str, key: &str) -> Option<usize> {
    let header = format!("[[{key}]]");
    text.lines()
        .position(|l| l.trim().replace(' ', "") == header)
        .map(|i| i + 1)
}

/// The message of a [`Problem`] whose required key is not written.
pub(crate) const MISSING: &str = "missing";

/// `problems` as lines of a message, each naming its key with its line in `text` (`line_of`,
/// or the header of a table of arrays), or "(default)" where the key is not written.
pub(crate) fn problem_lines(text: &str, problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| {
            if p.msg == MISSING {
                return format!("missing key `{}`", p.key);
            }
            match line_of(text, p.key).or_else(|| table_line(text, p.key)) {
                Some(n) => format!("line {n}: {} = {}", p.key, p.msg),
                None => format!("{} (default) = {}", p.key, p.msg),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A problem when `v` is not one of `list`.
pub(crate) fn in_list(key: &'static str, v: &str, list: &[&str]) -> Option<Problem> {
    (!list.contains(&v)).then(|| Problem {
        key,
        msg: format!("\"{v}\": expected {}", list.join(", ")),
    })
}
