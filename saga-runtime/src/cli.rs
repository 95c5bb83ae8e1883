//! What the framework's binaries share around `main`: arguments parsed with bad input answered in one
//! line, and errors reported in one line with an exit code a script can act on.
//!
//! - `0`: done.
//! - `1`: the process failed while running (an error after start-up).
//! - `2`: bad input: an argument that does not parse, a [`ConfigProblem`] (a setting that keeps the
//!   process from starting) or a [`BadInput`] (input a command cannot act on). Never a panic or a
//!   backtrace.

use std::process::ExitCode;

use crate::config::{BadInput, ConfigProblem};

/// The exit code for bad input and configuration problems.
pub const USAGE_ERROR: u8 = 2;

/// Parses the command line as `C`. `--help` and `--version` print as usual; anything else that does not
/// parse prints clap's first line (`error: ...`) and exits with code 2.
pub fn parse<C: clap::Parser>() -> C {
    parse_command(C::command())
}

/// Like [`parse`], for a command built or adjusted at run time (another name or description).
pub fn parse_command<C: clap::FromArgMatches>(command: clap::Command) -> C {
    let described = command.clone();
    match command
        .try_get_matches()
        .and_then(|matches| C::from_arg_matches(&matches))
    {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            let rendered = e.render().to_string();
            let first = rendered
                .lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("error: invalid arguments");
            match variable_of(&described, &e) {
                Some(var) => eprintln!("{first} (from {var}; see --help)"),
                None => eprintln!("{first} (see --help)"),
            }
            std::process::exit(i32::from(USAGE_ERROR));
        }
    }
}

/// The environment variable the value clap refuses came from, when it came from one (the argument's
/// variable is set, and the flag was not given).
fn variable_of(command: &clap::Command, error: &clap::Error) -> Option<String> {
    let invalid = error.get(clap::error::ContextKind::InvalidArg)?.to_string();
    let flag_given = |long: &str| {
        std::env::args().any(|a| a == format!("--{long}") || a.starts_with(&format!("--{long}=")))
    };
    fn all_args(command: &clap::Command) -> Vec<clap::Arg> {
        let mut args: Vec<clap::Arg> = command.get_arguments().cloned().collect();
        for sub in command.get_subcommands() {
            args.extend(all_args(sub));
        }
        args
    }
    all_args(command).into_iter().find_map(|arg| {
        let long = arg.get_long()?;
        let env = arg.get_env()?.to_string_lossy().into_owned();
        (invalid.starts_with(&format!("--{long} ")) || invalid == format!("--{long}"))
            .then_some(())
            .filter(|()| std::env::var_os(&env).is_some() && !flag_given(long))
            .map(|()| env)
    })
}

/// Reports `result` on stderr in one line and turns it into the process's exit code: 2 when a
/// [`ConfigProblem`] is among its causes, 1 for other errors.
pub fn exit_code(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Errors may quote input (a header, a key): never let it drive the terminal.
            if let Some(problem) = e.chain().find_map(|c| c.downcast_ref::<ConfigProblem>()) {
                eprintln!("error: {}", printable(&problem.to_string(), false));
                ExitCode::from(USAGE_ERROR)
            } else if let Some(bad) = e.chain().find_map(|c| c.downcast_ref::<BadInput>()) {
                eprintln!("error: {}", printable(&bad.to_string(), false));
                ExitCode::from(USAGE_ERROR)
            } else {
                // A wrapper that shows its cause as its own message (`#[error("{0}")]`, which keeps the
                // cause in the chain) is not said twice.
                let mut parts: Vec<String> = Vec::new();
                for cause in e.chain() {
                    let text = cause.to_string();
                    if !parts.last().is_some_and(|last| last.ends_with(&text)) {
                        parts.push(text);
                    }
                }
                let line = parts
                    .join(": ")
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ");
                eprintln!("error: {}", printable(&line, false));
                ExitCode::FAILURE
            }
        }
    }
}

/// `text` safe to print to a terminal: control characters (C0 but, with `keep_newlines`, the newline;
/// DEL; C1, such as the 8-bit CSI) and the invisible or direction-changing format characters (bidi
/// overrides and isolates, zero-width characters) are written as `\u{..}` escapes, so that a message's
/// key, header or payload cannot move the cursor, rewrite the screen, set the window title or reorder what
/// an operator reads. Everything else is left as it is.
pub fn printable(text: &str, keep_newlines: bool) -> std::borrow::Cow<'_, str> {
    let unsafe_char =
        |c: char| (c.is_control() && !(keep_newlines && c == '\n')) || is_invisible_format(c);
    if !text.chars().any(unsafe_char) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if unsafe_char(c) {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// `bytes` (a Kafka key, which may be anything) as text that tells every two byte strings apart: valid
/// UTF-8 as it is, but a backslash written `\\`, control and invisible format characters as `\u{..}`
/// (as [`printable`] does), and each byte that is not UTF-8 as `\x..`. Plain keys (`order-7`) read as they
/// are; two different keys never look the same.
pub fn printable_bytes(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    let plain = |c: char| !(c == '\\' || c.is_control() || is_invisible_format(c));
    if let Ok(text) = std::str::from_utf8(bytes)
        && text.chars().all(plain)
    {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(bytes.len() + 16);
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                c if plain(c) => out.push(c),
                c => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
            }
        }
        for byte in chunk.invalid() {
            out.push_str(&format!("\\x{byte:02x}"));
        }
    }
    std::borrow::Cow::Owned(out)
}

/// `bytes` in lowercase hexadecimal, two digits a byte (empty for none): a key's exact bytes, to act on.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes hexadecimal `text` (two digits a byte, either case) names; `None` for anything else.
pub fn parse_hex(text: &str) -> Option<Vec<u8>> {
    let text = text.trim();
    if !text.len().is_multiple_of(2) || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok())
        .collect()
}

/// JSON text (`serde_json`'s, which escapes C0 controls only) with DEL, C1 controls and invisible format
/// characters escaped as `\uXXXX` too: the same value for a parser, harmless on a terminal.
pub fn printable_json(json: &str) -> std::borrow::Cow<'_, str> {
    let escape = |c: char| (c.is_control() && c != '\n') || is_invisible_format(c);
    if !json.chars().any(escape) {
        return std::borrow::Cow::Borrowed(json);
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if escape(c) {
            // Only inside strings: JSON's own syntax is ASCII without controls but the newline.
            out.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Characters that show as nothing or as a plain space: zero-width and direction-changing format
/// characters (Trojan Source's bidi overrides among them), spaces other than U+0020, fillers, variation
/// selectors and tag characters. Two keys that differ only by one of them must not look the same.
fn is_invisible_format(c: char) -> bool {
    matches!(
        c,
        '\u{00a0}'
            | '\u{00ad}'
            | '\u{034f}'
            | '\u{061c}'
            | '\u{115f}'
            | '\u{1160}'
            | '\u{180b}'..='\u{180f}'
            | '\u{2000}'..='\u{200f}'
            | '\u{2028}'..='\u{202f}'
            | '\u{205f}'..='\u{2064}'
            | '\u{2066}'..='\u{206f}'
            | '\u{3000}'
            | '\u{3164}'
            | '\u{fe00}'..='\u{fe0f}'
            | '\u{feff}'
            | '\u{ffa0}'
            | '\u{fff9}'..='\u{fffb}'
            | '\u{e0000}'..='\u{e007f}'
            | '\u{e0100}'..='\u{e01ef}'
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_character_that_shows_as_nothing_or_a_space_is_escaped() {
        for c in [
            '\u{a0}',
            '\u{ad}',
            '\u{3164}',
            '\u{fe0f}',
            '\u{e0001}',
            '\u{2028}',
            '\u{202f}',
        ] {
            let key = format!("order-7{c}");
            let shown = printable_bytes(key.as_bytes());
            assert_eq!(shown, format!("order-7\\u{{{:x}}}", u32::from(c)), "{c:?}");
        }
    }

    #[test]
    fn printable_bytes_tells_every_two_keys_apart_and_leaves_plain_ones_as_they_are() {
        let keys: [&[u8]; 8] = [
            b"order-7",
            b"\\u{7}",
            b"\x07",
            b"\xff\x00k",
            b"\\xff\\x00k",
            "\u{fffd}".as_bytes(),
            b"\xef\xbf",
            b"",
        ];
        let shown: Vec<String> = keys
            .iter()
            .map(|k| printable_bytes(k).into_owned())
            .collect();
        for (i, a) in shown.iter().enumerate() {
            assert!(!a.chars().any(char::is_control), "{a:?}");
            for b in &shown[i + 1..] {
                assert_ne!(a, b, "two keys look the same");
            }
        }
        assert_eq!(shown[0], "order-7");
        assert_eq!(shown[3], "\\xff\\u{0}k");
    }

    #[test]
    fn hex_round_trips_and_refuses_what_is_not_hex() {
        for bytes in [&b""[..], b"\x00\xffk", b"order-7"] {
            assert_eq!(parse_hex(&hex(bytes)).as_deref(), Some(bytes));
        }
        assert_eq!(parse_hex("FF00"), Some(vec![0xff, 0]));
        for bad in ["f", "zz", "0x00", "00 11"] {
            assert_eq!(parse_hex(bad), None, "{bad}");
        }
    }

    #[test]
    fn escape_sequences_and_direction_overrides_are_shown_not_obeyed() {
        assert_eq!(printable("order-7", false), "order-7");
        assert_eq!(
            printable("a\u{1b}]0;pwned\u{7}b\u{9b}2J\u{202e}c\nd", false),
            "a\\u{1b}]0;pwned\\u{7}b\\u{9b}2J\\u{202e}c\\u{a}d"
        );
        assert_eq!(printable("line\nline\r", true), "line\nline\\u{d}");
        let json =
            serde_json::to_string(&serde_json::json!({"k": "a\u{1b}b\u{9b}c\u{202e}d"})).unwrap();
        let shown = printable_json(&json);
        assert!(
            !shown
                .chars()
                .any(|c| c.is_control() || is_invisible_format(c)),
            "{shown}"
        );
        let back: serde_json::Value = serde_json::from_str(&shown).unwrap();
        assert_eq!(
            back["k"], "a\u{1b}b\u{9b}c\u{202e}d",
            "the same value for a parser"
        );
    }
}
