//! What a route's horizon holds at a rate of fresh keys (`idemproxy check --rate`,
//! docs/remember.md): every key of the last `remember` is a record, and those of the last
//! `retention` hold their response too. Every record costs at least what one past its
//! retention was measured to cost on each store (`tests/remember.rs`); the responses
//! come on top, and are given as a ceiling, at the route's `max_response_body_bytes`
//! each, since their size is the API's. An estimate to size a store with,
//! not a bound: the store's own bounds refuse new claims (503 `store-full`) when it is
//! full, and never evict a live record.

use std::fmt;
use std::time::Duration;

use crate::config::{Backend, Config};

/// Fresh keys a second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate(f64);

impl Rate {
    /// `100/s`, `6000/min`, `20000/h`, or a bare number (a second).
    pub fn parse(text: &str) -> Result<Rate, &'static str> {
        let (count, per) = text.split_once('/').unwrap_or((text, "s"));
        let count: f64 = count
            .trim()
            .parse()
            .map_err(|_| "give fresh keys per second, minute or hour: 100/s, 6000/min, 20000/h")?;
        let seconds = match per.trim() {
            "s" | "sec" | "second" => 1.0,
            "m" | "min" | "minute" => 60.0,
            "h" | "hour" => 3600.0,
            _ => return Err("the unit is s, min or h: 100/s, 6000/min, 20000/h"),
        };
        if !count.is_finite() || count <= 0.0 {
            return Err("the rate must be more than zero");
        }
        Ok(Rate(count / seconds))
    }

    /// How many keys arrive at this rate in `window`.
    fn over(self, window: Duration) -> f64 {
        self.0 * window.as_secs_f64()
    }
}

/// What a record past its retention costs `backend`, in bytes, as measured
/// (docs/remember.md): the memory store's own count, SQLite's file pages, Redis's
/// `used_memory`, Postgres's relation size with its indexes.
pub fn spent_record_bytes(backend: &Backend) -> u64 {
    match backend {
        Backend::Memory(_) => 245,
        Backend::Sqlite(_) => 638,
        Backend::Redis(_) => 411,
        Backend::Postgres(_) => 352,
    }
}

/// One guarded route's horizon at the rate.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteHorizon {
    pub route: String,
    /// Records held: every key of the last `remember`.
    pub records: f64,
    /// Of those, the ones still holding their response: every key of the last
    /// `retention`.
    pub with_response: f64,
    /// What the records cost without their responses, at the measured figure.
    pub bytes: f64,
    /// The most the responses of the last `retention` may add:
    /// `max_response_body_bytes` each.
    pub response_bytes: f64,
}

/// Every guarded route's horizon at one rate, and the store's bounds.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    pub rate: Rate,
    pub backend: &'static str,
    pub routes: Vec<RouteHorizon>,
    /// `max_records` and `max_bytes`, where the store keeps them itself.
    pub bounds: Option<(usize, usize)>,
}

/// The horizon of each of `config`'s guarded routes at `rate`.
pub fn estimate(config: &Config, rate: Rate) -> Estimate {
    let backend = &config.store.backend;
    let spent = spent_record_bytes(backend) as f64;
    let routes = config
        .routes
        .iter()
        .filter_map(|route| {
            let policy = route.idempotency.as_ref()?;
            let records = rate.over(policy.remember.max(policy.retention));
            let with_response = rate.over(policy.retention);
            Some(RouteHorizon {
                route: route.name.to_string(),
                records,
                with_response,
                bytes: records * spent,
                response_bytes: with_response * policy.max_response_body_bytes as f64,
            })
        })
        .collect();
    let bounds = match backend {
        Backend::Memory(limits) => Some((limits.max_records, limits.max_bytes)),
        Backend::Sqlite(sqlite) => Some((sqlite.limits.max_records, sqlite.limits.max_bytes)),
        Backend::Redis(_) | Backend::Postgres(_) => None,
    };
    Estimate {
        rate,
        backend: backend.name(),
        routes,
        bounds,
    }
}

impl Estimate {
    fn records(&self) -> f64 {
        self.routes.iter().map(|route| route.records).sum()
    }

    fn bytes(&self) -> f64 {
        self.routes.iter().map(|route| route.bytes).sum()
    }

    /// Where the store's own bounds cannot hold every route's horizon at the rate.
    pub fn warnings(&self) -> Vec<String> {
        let Some((max_records, max_bytes)) = self.bounds else {
            return Vec::new();
        };
        let mut warnings = Vec::new();
        if self.records() > max_records as f64 {
            warnings.push(format!(
                "at {} the routes' horizons hold {} records, more than store.max_records ({max_records}): new keys would get 503 store-full; raise max_records or shorten remember",
                self.rate,
                count(self.records())
            ));
        }
        if self.bytes() > max_bytes as f64 {
            warnings.push(format!(
                "at {} the routes' horizons need about {} of store before their responses, more than store.max_bytes ({}): new keys would get 503 store-full; raise max_bytes or shorten remember",
                self.rate,
                size(self.bytes()),
                size(max_bytes as f64)
            ));
        }
        warnings
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} fresh keys/s", count(self.0))
    }
}

/// What `check --rate` prints: one line per guarded route, then the total.
impl fmt::Display for Estimate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for route in &self.routes {
            writeln!(
                f,
                "horizon {} at {}: {} records, about {} of {} store, and {} responses (at most {} more)",
                route.route,
                self.rate,
                count(route.records),
                size(route.bytes),
                self.backend,
                count(route.with_response),
                size(route.response_bytes),
            )?;
        }
        let bounds = match self.bounds {
            Some((records, bytes)) => format!(" (store.max_records {records}, store.max_bytes {})", size(bytes as f64)),
            None => " (bound the store itself: Redis maxmemory, Postgres disk)".to_string(),
        };
        let responses: f64 = self.routes.iter().map(|route| route.response_bytes).sum();
        writeln!(
            f,
            "horizon all routes: {} records, about {} and at most {} of responses{bounds}",
            count(self.records()),
            size(self.bytes()),
            size(responses)
        )
    }
}

/// A count, rounded to what an estimate can say.
fn count(value: f64) -> String {
    match value {
        v if v >= 1e9 => format!("{:.1} billion", v / 1e9),
        v if v >= 1e6 => format!("{:.1} million", v / 1e6),
        v if v >= 1e4 => format!("{:.0} thousand", v / 1e3),
        v => format!("{v:.0}"),
    }
}

/// Bytes, in the largest binary unit that keeps a whole number in front.
fn size(bytes: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(store: &str, remember: &str) -> Config {
        let source = format!(
            "{store}\n[[route]]\nname = \"payments\"\npath_prefix = \"/p\"\nupstream = \"http://127.0.0.1:9\"\n\
             [route.idempotency]\nretention = \"1h\"\nremember = \"{remember}\"\nmax_response_body_bytes = 1000\n"
        );
        Config::parse(&source, std::path::Path::new("t.toml")).expect("a valid config")
    }

    #[test]
    fn a_rate_reads_per_second_minute_or_hour() {
        assert_eq!(Rate::parse("100/s"), Ok(Rate(100.0)));
        assert_eq!(Rate::parse("6000/min"), Ok(Rate(100.0)));
        assert_eq!(Rate::parse("360000/h"), Ok(Rate(100.0)));
        assert_eq!(Rate::parse("5"), Ok(Rate(5.0)));
        for bad in ["", "x/s", "10/day", "0/s", "-1/s", "inf/s"] {
            assert!(Rate::parse(bad).is_err(), "{bad:?}");
        }
    }

    /// Every key of the last `remember` is a record; those of the last `retention`
    /// hold a response: 100/s for 30 days is 259.2 million records, 360,000 with a
    /// response, at SQLite's measured figure.
    #[test]
    fn a_horizon_holds_every_key_of_its_remember() {
        let sqlite = "[store]\nbackend = \"sqlite\"\npath = \"/tmp/x.db\"\nmax_bytes = \"1GiB\"";
        let estimate = estimate(&config(sqlite, "30d"), Rate(100.0));
        let route = &estimate.routes[0];
        assert_eq!(route.records, 100.0 * 30.0 * 86_400.0);
        assert_eq!(route.with_response, 360_000.0);
        assert_eq!(route.bytes, 259_200_000.0 * 638.0);
        assert_eq!(route.response_bytes, 360_000.0 * 1000.0);
        let warnings = estimate.warnings();
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].contains("store.max_records (10000000)"), "{warnings:?}");
        assert!(
            warnings[1].contains("154.0 GiB of store before their responses, more than store.max_bytes (1.0 GiB)"),
            "{warnings:?}"
        );
        let printed = estimate.to_string();
        assert!(
            printed.contains(
                "horizon payments at 100 fresh keys/s: 259.2 million records, about 154.0 GiB of sqlite store, and 360 thousand responses (at most 343.3 MiB more)"
            ),
            "{printed}"
        );
        // A horizon the store holds warns of nothing; Redis keeps no bounds of its own.
        let small = self::estimate(&config(sqlite, "1h"), Rate(0.01));
        assert!(small.warnings().is_empty(), "{:?}", small.warnings());
        let redis = self::estimate(
            &config("[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1\"", "30d"),
            Rate(100.0),
        );
        assert!(redis.warnings().is_empty());
        assert!(redis.to_string().contains("Redis maxmemory"));
    }
}
