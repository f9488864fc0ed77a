//! `strftime_now`: the render's instant, formatted as Python's `strftime` formats it, in UTC.

use minijinja::{ErrorKind, State};

use super::NOW;

/// `datetime.now().strftime(format)`, at the render's instant (UTC).
pub(super) fn strftime_now(state: &State, format: &str) -> Result<String, minijinja::Error> {
    let now = state.lookup(NOW).and_then(|v| v.as_i64()).unwrap_or(0);
    strftime(format, &Moment::utc(now))
        .map_err(|problem| minijinja::Error::new(ErrorKind::InvalidOperation, problem))
}

/// A UTC calendar instant, for `strftime_now`.
pub(super) struct Moment {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// Monday is 0.
    weekday: usize,
    /// January 1st is 1.
    year_day: u32,
}

impl Moment {
    fn utc(unix_seconds: i64) -> Self {
        let days = unix_seconds.div_euclid(86_400);
        let seconds = unix_seconds.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        Self {
            year,
            month,
            day,
            hour: seconds / 3600,
            minute: seconds / 60 % 60,
            second: seconds % 60,
            // 1970-01-01 was a Thursday.
            weekday: (days + 3).rem_euclid(7) as usize,
            year_day: (days - days_from_civil(year, 1, 1) + 1) as u32,
        }
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
pub(super) fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month_from_march = (i64::from(month) + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + i64::from(day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// The date `days` after 1970-01-01, as (year, month, day).
pub(super) fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_from_march + 2) / 5 + 1) as u32;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month as u32, day)
}

pub(super) const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
pub(super) const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// C's `strftime` in the C locale, for the directives dates in templates use; glibc's `-` flag
/// (`%-d`) drops the padding.
pub(super) fn strftime(format: &str, t: &Moment) -> std::result::Result<String, String> {
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut directive = chars.next();
        let unpadded = directive == Some('-');
        if unpadded {
            directive = chars.next();
        }
        let Some(directive) = directive else {
            return Err(format!("strftime_now's format `{format}` ends in `%`"));
        };
        match directive {
            'F' => out.push_str(&strftime("%Y-%m-%d", t)?),
            'T' => out.push_str(&strftime("%H:%M:%S", t)?),
            '%' => out.push('%'),
            'a' => out.push_str(&WEEKDAYS[t.weekday][..3]),
            'A' => out.push_str(WEEKDAYS[t.weekday]),
            'b' | 'h' => out.push_str(&MONTHS[t.month as usize - 1][..3]),
            'B' => out.push_str(MONTHS[t.month as usize - 1]),
            'p' => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            'Y' => out.push_str(&t.year.to_string()),
            other => {
                let (number, width, pad) = strftime_number(other, t)
                    .ok_or_else(|| format!("strftime_now does not support `%{other}`"))?;
                if unpadded {
                    out.push_str(&number.to_string());
                } else {
                    out.push_str(&format!("{number:>width$}").replace(' ', pad));
                }
            }
        }
    }
    Ok(out)
}

/// A numeric directive's value, width and padding.
pub(super) fn strftime_number(directive: char, t: &Moment) -> Option<(i64, usize, &'static str)> {
    let hour12 = if t.hour % 12 == 0 { 12 } else { t.hour % 12 };
    Some(match directive {
        'd' => (i64::from(t.day), 2, "0"),
        'e' => (i64::from(t.day), 2, " "),
        'm' => (i64::from(t.month), 2, "0"),
        'y' => (t.year.rem_euclid(100), 2, "0"),
        'H' => (i64::from(t.hour), 2, "0"),
        'I' => (i64::from(hour12), 2, "0"),
        'M' => (i64::from(t.minute), 2, "0"),
        'S' => (i64::from(t.second), 2, "0"),
        'j' => (i64::from(t.year_day), 3, "0"),
        _ => return None,
    })
}
