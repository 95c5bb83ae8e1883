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
            eprintln!("{first} (see --help)");
            std::process::exit(i32::from(USAGE_ERROR));
        }
    }
}

/// Reports `result` on stderr in one line and turns it into the process's exit code: 2 when a
/// [`ConfigProblem`] is among its causes, 1 for other errors.
pub fn exit_code(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if let Some(problem) = e.chain().find_map(|c| c.downcast_ref::<ConfigProblem>()) {
                eprintln!("error: {problem}");
                ExitCode::from(USAGE_ERROR)
            } else if let Some(bad) = e.chain().find_map(|c| c.downcast_ref::<BadInput>()) {
                eprintln!("error: {bad}");
                ExitCode::from(USAGE_ERROR)
            } else {
                let line = format!("{e:#}")
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ");
                eprintln!("error: {line}");
                ExitCode::FAILURE
            }
        }
    }
}
