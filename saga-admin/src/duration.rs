//! Durations as operators type them: `90s`, `15m`, `2h`, `7d`, `1h30m`, `500ms`.

use std::time::Duration;

use crate::error::AdminError;

/// Parses `text`: one or more numbers each followed by a unit (`ms`, `s`, `m`, `h`, `d`).
pub fn parse(text: &str) -> Result<Duration, AdminError> {
    let bad = || {
        AdminError::bad_input(format!(
            "bad duration {text:?}: use a number with a unit, such as 90s, 15m, 2h, 7d or 1h30m"
        ))
    };
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits == 0 {
            return Err(bad());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = match &rest[..unit_len] {
            "ms" => Duration::from_millis(1),
            "s" => Duration::from_secs(1),
            "m" => Duration::from_secs(60),
            "h" => Duration::from_secs(3600),
            "d" => Duration::from_secs(86_400),
            _ => return Err(bad()),
        };
        total = unit
            .checked_mul(u32::try_from(n).map_err(|_| bad())?)
            .and_then(|d| total.checked_add(d))
            .ok_or_else(bad)?;
        rest = &rest[unit_len..];
    }
    Ok(total)
}

/// `d` for people: `2h 5m`, `42s`, `350ms`.
pub fn human(d: Duration) -> String {
    let secs = d.as_secs();
    if secs == 0 {
        return format!("{}ms", d.as_millis());
    }
    let (days, hours, minutes, seconds) =
        (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    let parts: Vec<String> = [(days, "d"), (hours, "h"), (minutes, "m"), (seconds, "s")]
        .iter()
        .filter(|(n, _)| *n > 0)
        .take(2)
        .map(|(n, u)| format!("{n}{u}"))
        .collect();
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units_and_compounds() {
        assert_eq!(parse("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse("15m").unwrap(), Duration::from_secs(900));
        assert_eq!(parse("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse("7d").unwrap(), Duration::from_secs(7 * 86_400));
        assert_eq!(parse("500ms").unwrap(), Duration::from_millis(500));
        for bad in ["", "15", "m", "15 minutes", "-5m", "1.5h", "5y"] {
            let e = parse(bad).unwrap_err();
            assert!(e.to_string().contains("bad duration"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn durations_print_for_people() {
        assert_eq!(human(Duration::from_secs(7_500)), "2h 5m");
        assert_eq!(human(Duration::from_secs(42)), "42s");
        assert_eq!(human(Duration::from_millis(350)), "350ms");
    }
}
