//! The numeric answers of the Redis scripts (`scripts/*.lua`) and the Postgres store
//! functions (`postgres/schema.sql`): named once and decoded once, for both. A code a
//! decoder does not know is a protocol error from either store, never read as the
//! likeliest answer ("fenced", "settled"): a store that answers what its protocol has
//! no word for is misbehaving, and the request says so. The unit test below finds the
//! same numbers in the scripts' headers and in the functions' bodies.

use std::time::Duration;

use super::{Deferred, OwnerToken, ProbeStart, Resolved, Write};
use crate::error::StoreError;

/// `complete`, `mark_unknown` and `release`: the compare-and-set wrote.
pub(crate) const APPLIED: i64 = 1;
/// `complete`, `mark_unknown` and `release`: the record is not the caller's to change.
pub(crate) const FENCED: i64 = 0;

/// Postgres's `claim` (Redis claims with a native `SET NX`).
pub(crate) mod claim {
    /// The record is the claimant's (written now, or its own claim found again).
    pub(crate) const ACQUIRED: i64 = 1;
    /// Another claim's record, in the function's other columns.
    pub(crate) const EXISTING: i64 = 0;
    /// The scope holds its share of records.
    pub(crate) const SCOPE_FULL: i64 = -4;
    /// Fewer synchronous standbys stream than `min_replica_acks` asks: nothing written.
    pub(crate) const NOT_REPLICATED: i64 = -5;
    /// The plain claim statement only (`postgres::claim_plain`): another claim of the
    /// key committed between its snapshot and its insert; it runs again.
    pub(crate) const RACED: i64 = 2;
}

/// `resolve`.
pub(crate) mod resolve {
    pub(crate) const RESOLVED: i64 = 1;
    pub(crate) const NOT_UNKNOWN: i64 = 0;
    pub(crate) const ABSENT: i64 = -1;
    pub(crate) const OTHER_CLAIM: i64 = -2;
}

/// `begin_probe`.
pub(crate) mod probe {
    /// The lease is the caller's, for the claim named beside the code.
    pub(crate) const LEASED: i64 = 1;
    /// Not due for the wait beside the code.
    pub(crate) const NOT_DUE: i64 = 2;
    /// Nothing to probe (completed, in flight with its lease running, or unknown
    /// without a claim to fence on).
    pub(crate) const SETTLED: i64 = 0;
    /// No record.
    pub(crate) const ABSENT: i64 = -1;
    pub(crate) const GAVE_UP: i64 = -3;
}

/// `defer_probe`.
pub(crate) mod defer {
    pub(crate) const SCHEDULED: i64 = 1;
    /// No longer unknown for the claim named (resolved meanwhile, or gone).
    pub(crate) const SETTLED: i64 = 0;
    pub(crate) const GAVE_UP: i64 = -3;
}

fn unknown(step: &'static str) -> StoreError {
    StoreError::Protocol(step)
}

/// What `complete`, `mark_unknown` or `release` answered.
pub(crate) fn write(code: i64) -> Result<Write, StoreError> {
    match code {
        APPLIED => Ok(Write::Applied),
        FENCED => Ok(Write::Fenced),
        _ => Err(unknown("a write answered a code it has none for")),
    }
}

/// What `resolve` answered.
pub(crate) fn resolved(code: i64) -> Result<Resolved, StoreError> {
    match code {
        resolve::RESOLVED => Ok(Resolved::Resolved),
        resolve::NOT_UNKNOWN => Ok(Resolved::NotUnknown),
        resolve::OTHER_CLAIM => Ok(Resolved::OtherClaim),
        resolve::ABSENT => Ok(Resolved::Absent),
        _ => Err(unknown("a resolution answered a code it has none for")),
    }
}

/// What `begin_probe` answered: its code, the claim it leased for (read only for a
/// lease), and how long until due, in ms (read only when not due).
pub(crate) fn probe_start(
    code: i64,
    owner: impl FnOnce() -> Option<OwnerToken>,
    wait_ms: i64,
) -> Result<ProbeStart, StoreError> {
    match code {
        probe::LEASED => owner()
            .map(ProbeStart::Leased)
            .ok_or(unknown("a probe lease came without its claim's owner")),
        probe::NOT_DUE => Ok(ProbeStart::NotDue(Duration::from_millis(
            u64::try_from(wait_ms).unwrap_or(0),
        ))),
        probe::GAVE_UP => Ok(ProbeStart::GaveUp),
        probe::SETTLED | probe::ABSENT => Ok(ProbeStart::Settled),
        _ => Err(unknown("a probe lease answered a code it has none for")),
    }
}

/// What `defer_probe` answered.
pub(crate) fn deferred(code: i64) -> Result<Deferred, StoreError> {
    match code {
        defer::SCHEDULED => Ok(Deferred::Scheduled),
        defer::GAVE_UP => Ok(Deferred::GaveUp),
        defer::SETTLED => Ok(Deferred::Settled),
        _ => Err(unknown("a deferred probe answered a code it has none for")),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// The codes a script's header says it returns: in its `Returns` paragraph, each
    /// number before "when", or first in a `{…}` reply.
    fn in_header(script: &str) -> BTreeSet<i64> {
        let paragraph: Vec<&str> = script
            .lines()
            .skip_while(|line| !line.starts_with("-- Returns"))
            .take_while(|line| *line != "--")
            .flat_map(|line| line.trim_start_matches("--").split_whitespace())
            .collect();
        let mut codes = BTreeSet::new();
        for (at, word) in paragraph.iter().enumerate() {
            let first_in_reply = word.strip_prefix('{').map(|rest| rest.trim_end_matches(','));
            let before_when = paragraph.get(at + 1) == Some(&"when");
            let number = first_in_reply.or(before_when.then_some(*word));
            if let Some(code) = number.and_then(|number| number.trim_end_matches(',').parse().ok()) {
                codes.insert(code);
            }
        }
        codes
    }

    /// The codes a store function in schema.sql returns: each `RETURN n;` and
    /// `code := n;` in its body.
    fn in_function(schema: &str, name: &str) -> BTreeSet<i64> {
        let start = schema
            .find(&format!("FUNCTION {{schema}}.{name}("))
            .unwrap_or_else(|| panic!("no function {name}"));
        let body = &schema[start..];
        let body = &body[..body.find("END $$;").expect("the function ends")];
        let mut codes = BTreeSet::new();
        for line in body.lines().map(str::trim) {
            let number = line
                .strip_prefix("RETURN ")
                .or_else(|| line.strip_prefix("code := "))
                .and_then(|rest| rest.strip_suffix(';'));
            if let Some(code) = number.and_then(|number| number.parse().ok()) {
                codes.insert(code);
            }
        }
        codes
    }

    fn set(codes: &[i64]) -> BTreeSet<i64> {
        codes.iter().copied().collect()
    }

    #[test]
    fn the_scripts_and_the_functions_answer_the_codes_named_here() {
        let schema = include_str!("postgres/schema.sql");
        let writes = set(&[APPLIED, FENCED]);
        let resolves = set(&[
            resolve::RESOLVED,
            resolve::NOT_UNKNOWN,
            resolve::ABSENT,
            resolve::OTHER_CLAIM,
        ]);
        let probes = set(&[
            probe::LEASED,
            probe::NOT_DUE,
            probe::SETTLED,
            probe::ABSENT,
            probe::GAVE_UP,
        ]);
        let defers = set(&[defer::SCHEDULED, defer::SETTLED, defer::GAVE_UP]);
        let steps = [
            ("complete", include_str!("scripts/complete.lua"), &writes),
            ("mark_unknown", include_str!("scripts/mark_unknown.lua"), &writes),
            ("release", include_str!("scripts/release.lua"), &writes),
            ("resolve", include_str!("scripts/resolve.lua"), &resolves),
            ("begin_probe", include_str!("scripts/begin_probe.lua"), &probes),
            ("defer_probe", include_str!("scripts/defer_probe.lua"), &defers),
        ];
        for (name, script, codes) in steps {
            assert_eq!(&in_header(script), codes, "{name}.lua's header");
            assert_eq!(&in_function(schema, name), codes, "schema.sql's {name}");
        }
        let claims = set(&[
            claim::ACQUIRED,
            claim::EXISTING,
            claim::SCOPE_FULL,
            claim::NOT_REPLICATED,
        ]);
        assert_eq!(in_function(schema, "claim"), claims, "schema.sql's claim");
    }

    #[test]
    fn every_code_decodes_and_any_other_is_a_protocol_error() {
        let owner = OwnerToken([7; 16]);
        assert_eq!(write(1).ok(), Some(Write::Applied));
        assert_eq!(write(0).ok(), Some(Write::Fenced));
        assert_eq!(resolved(1).ok(), Some(Resolved::Resolved));
        assert_eq!(resolved(0).ok(), Some(Resolved::NotUnknown));
        assert_eq!(resolved(-1).ok(), Some(Resolved::Absent));
        assert_eq!(resolved(-2).ok(), Some(Resolved::OtherClaim));
        assert_eq!(probe_start(1, || Some(owner), 0).ok(), Some(ProbeStart::Leased(owner)));
        assert_eq!(
            probe_start(2, || None, 1_500).ok(),
            Some(ProbeStart::NotDue(Duration::from_millis(1_500)))
        );
        assert_eq!(probe_start(-3, || None, 0).ok(), Some(ProbeStart::GaveUp));
        assert_eq!(probe_start(0, || None, 0).ok(), Some(ProbeStart::Settled));
        assert_eq!(probe_start(-1, || None, 0).ok(), Some(ProbeStart::Settled));
        assert_eq!(deferred(1).ok(), Some(Deferred::Scheduled));
        assert_eq!(deferred(-3).ok(), Some(Deferred::GaveUp));
        assert_eq!(deferred(0).ok(), Some(Deferred::Settled));
        for code in [-9, 2, 3, 7] {
            assert!(write(code).is_err(), "write {code}");
            assert!(deferred(code).is_err(), "defer {code}");
        }
        for code in [-3, 2, 9] {
            assert!(resolved(code).is_err(), "resolve {code}");
        }
        for code in [-2, 3, 9] {
            assert!(probe_start(code, || Some(owner), 0).is_err(), "probe {code}");
        }
        assert!(probe_start(1, || None, 0).is_err(), "a lease without its claim");
    }
}
