//! Settings declared once: each is a clap argument with its environment variable, default, unit (in its
//! name: `_MS`, `_SECS`, `_HOURS`, `_BYTES`) and doc, in a group (`clap::Args`) that binaries flatten into
//! their command line and that libraries read from the environment through the same declaration
//! ([`from_env`]), so that a binary and a library cannot read a setting differently, or one of them not at
//! all. The configuration page is rendered from the same declarations ([`documented`]).

use clap::{ArgAction, Args, Command, FromArgMatches};

use crate::config::ConfigProblem;

/// Parses the group `T` from the environment (its arguments' variables, else their defaults). A variable
/// that does not parse, or is not UTF-8 (which the binaries refuse too), is a [`ConfigProblem`] naming it;
/// every such variable is said.
pub fn from_env<T: Args + FromArgMatches>() -> Result<T, ConfigProblem> {
    from_os_vars(|name| std::env::var_os(name))
}

/// [`from_env`] over any source of variables as the environment holds them (not necessarily UTF-8).
fn from_os_vars<T: Args + FromArgMatches>(
    get: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Result<T, ConfigProblem> {
    let command = T::augment_args(Command::new("settings"));
    let mut problems: Vec<ConfigProblem> = command
        .get_arguments()
        .filter_map(|arg| arg.get_env())
        .filter(|env| get(&env.to_string_lossy()).is_some_and(|v| v.to_str().is_none()))
        .map(|env| {
            ConfigProblem::new(
                env.to_string_lossy(),
                "is not UTF-8",
                "set it to text (its value is not shown)",
            )
        })
        .collect();
    let parsed = from_vars(|name| get(name).and_then(|v| v.into_string().ok()));
    problems.extend(parsed.as_ref().err().cloned());
    match ConfigProblem::all(problems) {
        Some(problem) => Err(problem),
        None => parsed,
    }
}

/// The group `T` with every default, whatever the environment holds.
pub fn defaults<T: Args + FromArgMatches>() -> T {
    from_vars(|_| None).unwrap_or_else(|e| panic!("the defaults of a settings group parse: {e}"))
}

/// Parses the group `T` from the variables `get` gives (else the defaults).
pub fn from_vars<T: Args + FromArgMatches>(
    get: impl Fn(&str) -> Option<String>,
) -> Result<T, ConfigProblem> {
    let command = T::augment_args(Command::new("settings").no_binary_name(true));
    let mut argv: Vec<String> = Vec::new();
    let mut longs: Vec<(String, String)> = Vec::new();
    let mut problems = Vec::new();
    for arg in command.get_arguments() {
        let (Some(env), Some(long)) = (arg.get_env(), arg.get_long()) else {
            continue;
        };
        let env = env.to_string_lossy().into_owned();
        longs.push((long.to_owned(), env.clone()));
        let Some(value) = get(&env) else {
            continue;
        };
        match arg.get_action() {
            ArgAction::SetTrue => match boolish(&value) {
                Some(true) => argv.push(format!("--{long}")),
                Some(false) => {}
                None => problems.push(ConfigProblem::new(
                    env,
                    format!("{value:?} is not true or false"),
                    "set it to true or false",
                )),
            },
            // One argument: a value that starts with `-` is still the value.
            _ => argv.push(format!("--{long}={value}")),
        }
    }
    // The variables were turned into arguments: clap must not read them again.
    let command = command.mut_args(|a| a.env(None::<&str>));
    every_problem(&command, argv, problems, &longs, &get)
}

/// Parses `argv` with `command`, saying every variable that does not parse: clap stops at the first, so
/// each one found is taken out and the rest parsed again.
fn every_problem<T: FromArgMatches>(
    command: &Command,
    mut argv: Vec<String>,
    mut problems: Vec<ConfigProblem>,
    longs: &[(String, String)],
    get: &impl Fn(&str) -> Option<String>,
) -> Result<T, ConfigProblem> {
    let parsed = loop {
        let parsed = command
            .clone()
            .try_get_matches_from(&argv)
            .and_then(|matches| T::from_arg_matches(&matches));
        let error = match parsed {
            Ok(group) => break Some(group),
            Err(error) => error,
        };
        let (found, said) = problem(&error, longs, get);
        problems.push(said);
        let before = argv.len();
        if let Some(long) = found {
            argv.retain(|arg| {
                arg != &format!("--{long}") && !arg.starts_with(&format!("--{long}="))
            });
        }
        if argv.len() == before {
            // Not one of the variables (a missing required one, say): nothing more to take out.
            break None;
        }
    };
    match (ConfigProblem::all(problems), parsed) {
        (Some(problem), _) => Err(problem),
        (None, Some(group)) => Ok(group),
        (None, None) => Err(ConfigProblem::new(
            "settings",
            "do not parse",
            "fix the settings",
        )),
    }
}

/// The problems of `checks`, each a variable and the rule its value was checked by (a value set in code
/// goes through the rules its variable is parsed with): one per failed rule, naming the variable.
pub fn failed<T>(
    checks: impl IntoIterator<Item = (&'static str, Result<T, String>)>,
) -> Vec<ConfigProblem> {
    checks
        .into_iter()
        .filter_map(|(var, checked)| {
            checked
                .err()
                .map(|why| ConfigProblem::new(var, why, "fix its value"))
        })
        .collect()
}

/// A flag's variable as the binaries read it: clap reads a flag's variable with its `BoolValueParser`, which
/// takes `true` and `false` and nothing else (an empty value included).
fn boolish(value: &str) -> Option<bool> {
    match value {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

/// The variable clap's error is about (by its flag), as a one-line problem.
fn problem(
    error: &clap::Error,
    longs: &[(String, String)],
    get: &impl Fn(&str) -> Option<String>,
) -> (Option<String>, ConfigProblem) {
    let invalid = error
        .get(clap::error::ContextKind::InvalidArg)
        .map(ToString::to_string)
        .unwrap_or_default();
    let found = longs.iter().find(|(long, _)| {
        invalid.starts_with(&format!("--{long} "))
            || invalid.starts_with(&format!("--{long}="))
            || invalid == format!("--{long}")
    });
    let rendered = error.render().to_string();
    let reason = rendered
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("does not parse")
        .trim_start_matches("error: ")
        .to_owned();
    match found {
        Some((long, env)) => {
            // clap's "invalid value 'x' for '--flag <X>': why": the flag is the variable here; the why stays.
            let what = reason.split(" for '").next().unwrap_or(&reason);
            let why = reason
                .split_once("': ")
                .map(|(_, why)| format!(": {why}"))
                .unwrap_or_default();
            let said = ConfigProblem::new(
                env.clone(),
                format!(
                    "{:?} does not parse ({what}{why})",
                    get(env).unwrap_or_default()
                ),
                "fix its value",
            );
            (Some(long.clone()), said)
        }
        None => (
            None,
            ConfigProblem::new("settings", reason, "fix the settings"),
        ),
    }
}

/// One setting as the configuration page shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Documented {
    /// The environment variable.
    pub env: String,
    /// The flag of the binaries that take it (empty: the environment only).
    pub flag: String,
    /// The default, or `—` when there is none.
    pub default: String,
    /// Its doc: what it is and does.
    pub doc: String,
}

/// The settings of the group `T` (or of a whole command's arguments), in declaration order.
pub fn documented(command: &Command) -> Vec<Documented> {
    command
        .get_arguments()
        .filter_map(|arg| {
            let env = arg.get_env()?.to_string_lossy().into_owned();
            let default = arg
                .get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(",");
            let doc = arg
                .get_long_help()
                .or_else(|| arg.get_help())
                .map(|h| {
                    h.to_string()
                        .split_whitespace()
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default();
            Some(Documented {
                env,
                // A hidden argument is the environment's only (a secret kept off the command line).
                flag: arg
                    .get_long()
                    .filter(|_| !arg.is_hide_set())
                    .map(|l| format!("--{l}"))
                    .unwrap_or_default(),
                default: match (default.is_empty(), arg.get_action()) {
                    (true, ArgAction::SetTrue) => "false".to_owned(),
                    (true, _) => "—".to_owned(),
                    (false, _) => default,
                },
                doc,
            })
        })
        .collect()
}

/// The settings of the group `T`.
pub fn documented_group<T: Args>() -> Vec<Documented> {
    documented(&T::augment_args(Command::new("settings")))
}

/// Gives a settings group (a `clap::Args` struct whose every field declares its variable and default)
/// `from_env`, `from_vars` and a `Default` that read its declarations: the one place its settings live.
#[macro_export]
macro_rules! settings_group {
    ($group:ty) => {
        impl $group {
            /// This group from the environment (its variables, else their defaults); a variable that does
            /// not parse is a [`ConfigProblem`](saga_config::ConfigProblem) naming it.
            pub fn from_env() -> Result<Self, $crate::config::ConfigProblem> {
                $crate::settings::from_env()
            }

            /// This group from the variables `get` gives (else their defaults).
            pub fn from_vars(
                get: impl Fn(&str) -> Option<String>,
            ) -> Result<Self, $crate::config::ConfigProblem> {
                $crate::settings::from_vars(get)
            }
        }

        impl Default for $group {
            fn default() -> Self {
                $crate::settings::defaults()
            }
        }
    };
}

/// Typed values of settings: each parser turns a variable's text into the type the code takes, by a rule a
/// builder's setter applies to a value given in code, so that a binary's flag, a variable and a setter are
/// refused alike (and named: the variable).
pub mod value {
    use std::ops::RangeInclusive;
    use std::time::Duration;

    /// A whole number of milliseconds.
    pub fn millis(text: &str) -> Result<Duration, String> {
        text.parse::<u64>()
            .map(Duration::from_millis)
            .map_err(|e| format!("{e}: a whole number of milliseconds"))
    }

    /// A whole number of seconds.
    pub fn secs(text: &str) -> Result<Duration, String> {
        text.parse::<u64>()
            .map(Duration::from_secs)
            .map_err(|e| format!("{e}: a whole number of seconds"))
    }

    /// A positive number of milliseconds.
    pub fn positive_millis(text: &str) -> Result<Duration, String> {
        millis(text).and_then(positive)
    }

    /// A positive number of seconds.
    pub fn positive_secs(text: &str) -> Result<Duration, String> {
        secs(text).and_then(positive)
    }

    /// The rule of [`positive_millis`] and [`positive_secs`].
    pub fn positive(d: Duration) -> Result<Duration, String> {
        if d.is_zero() {
            Err("must be positive".to_owned())
        } else {
            Ok(d)
        }
    }

    /// At most `max` (said in seconds when it is a whole number of them).
    pub fn at_most(d: Duration, max: Duration) -> Result<Duration, String> {
        if d <= max {
            Ok(d)
        } else if max.subsec_nanos() == 0 && max.as_secs() > 0 {
            Err(format!("must be at most {} s", max.as_secs()))
        } else {
            Err(format!("must be at most {} ms", max.as_millis()))
        }
    }

    /// The rule of a count declared with `RangedU64ValueParser::range(range)`.
    pub fn within<T: Copy + TryInto<u64>>(n: T, range: &RangeInclusive<u64>) -> Result<T, String> {
        match n.try_into() {
            Ok(m) if range.contains(&m) => Ok(n),
            _ if *range.end() == u64::MAX => Err(format!("must be at least {}", range.start())),
            _ => Err(format!(
                "must be between {} and {}",
                range.start(),
                range.end()
            )),
        }
    }

    /// A name that is not blank.
    pub fn name(text: &str) -> Result<String, String> {
        if text.trim().is_empty() {
            Err("is empty".to_owned())
        } else {
            Ok(text.to_owned())
        }
    }

    /// The longest topic name Kafka accepts.
    pub const MAX_TOPIC_LEN: usize = 249;

    /// A Kafka topic name, by Kafka's own rule: 1 to 249 characters of `a-z A-Z 0-9 . _ -`, not `.` or
    /// `..`.
    pub fn topic(text: &str) -> Result<String, String> {
        let legal = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if text.is_empty() || text == "." || text == ".." {
            Err("is not a topic name".to_owned())
        } else if text.len() > MAX_TOPIC_LEN {
            Err(format!(
                "is {} characters long: a topic name has at most {MAX_TOPIC_LEN}",
                text.len()
            ))
        } else if let Some(c) = text.chars().find(|c| !legal(*c)) {
            Err(format!(
                "holds {c:?}: a topic name is letters, digits, '.', '_' and '-'"
            ))
        } else {
            Ok(text.to_owned())
        }
    }

    /// The longest consumer group name the framework takes (its tables key rows by it).
    pub const MAX_GROUP_LEN: usize = 249;

    /// A consumer group's name: not blank, at most [`MAX_GROUP_LEN`] bytes, no control characters.
    pub fn group(text: &str) -> Result<String, String> {
        let text = name(text)?;
        if text.len() > MAX_GROUP_LEN {
            Err(format!(
                "is {} bytes long: at most {MAX_GROUP_LEN}",
                text.len()
            ))
        } else if text.chars().any(char::is_control) {
            Err("holds a control character".to_owned())
        } else {
            Ok(text)
        }
    }

    /// A fraction, 0 to 1.
    pub fn fraction(text: &str) -> Result<f64, String> {
        let f: f64 = text.parse().map_err(|e| format!("{e}"))?;
        fraction_of(f)
    }

    /// The rule of [`fraction`].
    pub fn fraction_of(f: f64) -> Result<f64, String> {
        if (0.0..=1.0).contains(&f) {
            Ok(f)
        } else {
            Err("must be within 0 and 1".to_owned())
        }
    }

    /// A factor of at least 1.
    pub fn factor(text: &str) -> Result<f64, String> {
        let f: f64 = text.parse().map_err(|e| format!("{e}"))?;
        factor_of(f)
    }

    /// The rule of [`factor`].
    pub fn factor_of(f: f64) -> Result<f64, String> {
        if f >= 1.0 && f.is_finite() {
            Ok(f)
        } else {
            Err("must be a number of at least 1".to_owned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, clap::Args)]
    struct Example {
        /// Rows per batch.
        #[arg(long = "batch-size", env = "X_BATCH_SIZE", default_value_t = 10)]
        batch_size: u32,
        /// Delete when done.
        #[arg(long = "delete", env = "X_DELETE")]
        delete: bool,
        /// On by default.
        #[arg(long = "embedded", env = "X_EMBEDDED", default_value_t = true, action = ArgAction::Set)]
        embedded: bool,
        /// Where.
        #[arg(long = "name", env = "X_NAME")]
        name: Option<String>,
    }

    fn vars(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| {
            pairs
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[derive(Debug, Clone, clap::Args)]
    struct Three {
        /// One.
        #[arg(long = "one", env = "X_ONE", default_value_t = 1)]
        one: u32,
        /// Two.
        #[arg(long = "two", env = "X_TWO", default_value_t = 2)]
        two: u32,
        /// Flag.
        #[arg(long = "flag", env = "X_FLAG")]
        flag: bool,
    }

    #[test]
    fn topic_and_group_names_follow_kafkas_rule_and_the_tables_limit() {
        for good in ["orders", "saga.orders-v2_eu", &"t".repeat(249)] {
            assert_eq!(value::topic(good).as_deref(), Ok(good));
        }
        for bad in ["", ".", "..", "a b", "a:b", "a\0b", "é", &"t".repeat(250)] {
            assert!(value::topic(bad).is_err(), "{bad:?}");
        }
        assert!(value::group("orders:eu/1").is_ok());
        for bad in [" ", "a\0b", "a\nb", &"g".repeat(250)] {
            assert!(value::group(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn every_variable_that_does_not_parse_is_said_not_only_the_first() {
        let bad = from_vars::<Three>(vars(&[
            ("X_ONE", "many"),
            ("X_TWO", "-3"),
            ("X_FLAG", "perhaps"),
        ]))
        .unwrap_err();
        assert_eq!(bad.setting, "X_FLAG, X_ONE, X_TWO", "{bad}");
        assert!(
            bad.to_string().contains("\"many\"") && bad.to_string().contains("\"-3\""),
            "{bad}"
        );
        let one = from_vars::<Three>(vars(&[("X_TWO", "x"), ("X_ONE", "5")])).unwrap_err();
        assert_eq!(one.setting, "X_TWO", "{one}");
    }

    #[test]
    fn a_variable_that_is_not_utf8_is_refused_by_name_not_taken_as_unset() {
        use std::os::unix::ffi::OsStringExt;
        let bad = from_os_vars::<Three>(|name| {
            (name == "X_ONE").then(|| std::ffi::OsString::from_vec(b"7\xa0".to_vec()))
        })
        .unwrap_err();
        assert_eq!(bad.setting, "X_ONE", "{bad}");
        assert!(bad.problem.contains("UTF-8"), "{bad}");
    }

    #[test]
    fn a_group_is_read_from_variables_through_its_declaration() {
        let d: Example = defaults();
        assert_eq!(
            (d.batch_size, d.delete, d.embedded, d.name),
            (10, false, true, None)
        );
        let e: Example = from_vars(vars(&[
            ("X_BATCH_SIZE", "7"),
            ("X_DELETE", "true"),
            ("X_EMBEDDED", "false"),
            ("X_NAME", "n"),
        ]))
        .unwrap();
        assert_eq!(
            (e.batch_size, e.delete, e.embedded, e.name.as_deref()),
            (7, true, false, Some("n"))
        );
        let bad = from_vars::<Example>(vars(&[("X_BATCH_SIZE", "many")])).unwrap_err();
        assert_eq!(bad.setting, "X_BATCH_SIZE", "{bad}");
        assert!(bad.to_string().contains("\"many\""), "{bad}");
        let bad = from_vars::<Example>(vars(&[("X_DELETE", "perhaps")])).unwrap_err();
        assert_eq!(bad.setting, "X_DELETE");
        let bad = from_vars::<Example>(vars(&[("X_EMBEDDED", "perhaps")])).unwrap_err();
        assert_eq!(bad.setting, "X_EMBEDDED", "{bad}");
        // A value that starts with `-` is a value; a flag reads what clap's reads (`true`, `false`).
        let e: Example = from_vars(vars(&[("X_NAME", "-n"), ("X_DELETE", "true")])).unwrap();
        assert_eq!((e.name.as_deref(), e.delete), (Some("-n"), true));
        let e: Example = from_vars(vars(&[("X_DELETE", "false")])).unwrap();
        assert!(!e.delete);
        for value in ["y", "off", "1", "TRUE", ""] {
            let get = |name: &str| (name == "X_DELETE").then(|| value.to_owned());
            let bad = from_vars::<Example>(get).unwrap_err();
            assert_eq!(bad.setting, "X_DELETE", "{value:?}: {bad}");
        }
        let bad = from_vars::<Example>(vars(&[("X_BATCH_SIZE", "-1")])).unwrap_err();
        assert_eq!(bad.setting, "X_BATCH_SIZE", "{bad}");
    }

    #[test]
    fn a_group_documents_each_setting_once() {
        let docs = documented_group::<Example>();
        let envs: Vec<&str> = docs.iter().map(|d| d.env.as_str()).collect();
        assert_eq!(envs, ["X_BATCH_SIZE", "X_DELETE", "X_EMBEDDED", "X_NAME"]);
        assert_eq!(docs[0].default, "10");
        assert_eq!(docs[1].default, "false");
        assert_eq!(docs[3].default, "—");
        assert_eq!(docs[0].doc, "Rows per batch");
    }
}
