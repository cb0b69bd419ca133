//! A Jepsen-style history checker. Tests record every client operation with its result
//! (ok, fail, or unknown when the client could not tell), the upstream keeps its own
//! log of executions (each with a unique id that its response echoes), and at the end
//! the store's keys are dumped with their TTLs. `check` then measures:
//!
//! - AtMostOnce: executions that took effect per scoped key <= 1 (an execution
//!   without effect is one the upstream lost before it committed, which a probe's
//!   "not applied" releases the key after);
//! - ReplayFidelity: every successful response for a key has the same execution id and
//!   the same bytes (status, headers but `Date`, body);
//! - NoForeignReplay: no client gets a response recorded for another scope or key;
//! - UnknownSticky: once a key has answered "unknown", its record changes only by a
//!   resolution that agrees with what the upstream did: a reconciled replay only when
//!   an execution of the key took effect (applied), and a new execution (or a fresh
//!   success) only when none before it had (not applied);
//! - TtlFloor: every store key has a TTL, none below what `remember` allows (a response
//!   kept beside its record, Redis's `…:r`, what the retention allows), and no key name
//!   holds raw client key bytes;
//! - ExpiredAfterARun: a 410 `response-expired` (a retry past the retention, within
//!   `remember`) only for a key that ran: it says the operation completed.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::client::TestResponse;
use super::upstream::Execution;

#[derive(Debug, Clone)]
pub enum OpResult {
    /// A 2xx: the upstream's answer, fresh or replayed.
    Ok {
        execution: u64,
        bytes: Bytes,
        replayed: bool,
        /// Replayed from a resolution of an unknown outcome (`Idempotency-Reconciled`).
        reconciled: bool,
    },
    /// A problem response, with its slug.
    Fail { status: u16, slug: String },
    /// The client got no answer it could read: a timeout or a reset.
    Unknown,
}

#[derive(Debug, Clone)]
pub struct Op {
    pub scope: String,
    pub key: String,
    pub started: Instant,
    pub ended: Instant,
    pub result: OpResult,
}

#[derive(Default)]
pub struct History {
    ops: Mutex<Vec<Op>>,
}

/// The bytes that must be identical on every replay: status, headers but `Date` and
/// the replay marker, and body.
pub fn comparable_bytes(response: &TestResponse) -> Bytes {
    let mut headers: Vec<String> = response
        .headers
        .iter()
        // The framing is not the answer: a streamed first response is chunked, its
        // replay carries its length.
        .filter(|(name, _)| {
            !matches!(
                name.as_str(),
                "date" | "idempotent-replayed" | "content-length" | "transfer-encoding"
            )
        })
        .map(|(name, value)| format!("{name}: {}", String::from_utf8_lossy(value.as_bytes())))
        .collect();
    headers.sort();
    let mut out = format!("{}\n{}\n\n", response.status.as_u16(), headers.join("\n")).into_bytes();
    out.extend_from_slice(&response.body);
    Bytes::from(out)
}

impl History {
    pub fn record(&self, scope: &str, key: &str, started: Instant, outcome: Result<TestResponse, String>) {
        let result = match outcome {
            Err(_) => OpResult::Unknown,
            Ok(response) if response.status.is_success() => OpResult::Ok {
                execution: response
                    .header("x-execution-id")
                    .and_then(|id| id.parse().ok())
                    .expect("a 2xx from the fake upstream carries x-execution-id"),
                bytes: comparable_bytes(&response),
                replayed: response.replayed(),
                reconciled: response.header("idempotency-reconciled") == Some("true"),
            },
            Ok(response) => OpResult::Fail {
                status: response.status.as_u16(),
                slug: if response.header("content-type") == Some("application/problem+json") {
                    response.problem()
                } else {
                    format!("upstream-{}", response.status.as_u16())
                },
            },
        };
        self.ops.lock().expect("history lock").push(Op {
            scope: scope.to_string(),
            key: key.to_string(),
            started,
            ended: Instant::now(),
            result,
        });
    }

    pub fn ops(&self) -> Vec<Op> {
        self.ops.lock().expect("history lock").clone()
    }
}

/// What the contract promises about the store at the end of a run.
pub struct Contract {
    /// How long a recorded response is kept: a response key (`…:r`) lives this long
    /// from its claim.
    pub retention: Duration,
    /// How long a key is known: a record key lives this long from its claim.
    pub remember: Duration,
    pub run_started: Instant,
    /// The raw keys clients sent: none may appear inside a store key name.
    pub raw_keys: Vec<String>,
    /// Windows in which the store was really unavailable; a 503 outside them counts.
    pub outage_windows: Vec<(Instant, Instant)>,
    /// Whether unknown outcomes may be resolved (a route with a probe, or an operator
    /// in the run). Without, an unknown key never changes: no reconciled replay, no
    /// fresh success and no execution after it, whatever the upstream did.
    pub resolving: bool,
}

#[derive(Debug, Default)]
pub struct Report {
    pub ops: usize,
    pub ok: usize,
    pub replayed: usize,
    pub unknown: usize,
    pub failures: BTreeMap<String, usize>,
    pub keys: usize,
    pub executions: usize,
    pub max_executions_per_key: usize,
    pub fidelity_violations: usize,
    pub foreign_replays: usize,
    pub unknown_sticky_violations: usize,
    /// 410s for a key no execution of which took effect.
    pub expired_without_a_run: usize,
    pub expired: usize,
    pub store_keys: usize,
    pub keys_without_ttl: usize,
    pub ttl_floor_violations: usize,
    pub raw_key_bytes_in_names: usize,
    pub unavailable_outside_outage: usize,
    /// Each 503 outside the outage windows: its slug and when it started and ended,
    /// relative to the end of the last window before it (or the start of the first).
    pub unavailable_outside: Vec<String>,
}

/// Where `op` fell against the outage windows, for a failure message.
fn outside_window(op: &Op, windows: &[(Instant, Instant)]) -> String {
    let slug = match &op.result {
        OpResult::Fail { slug, .. } => slug.as_str(),
        _ => "",
    };
    let signed = |at: Instant, mark: Instant| {
        if at >= mark {
            format!("+{:.2?}", at - mark)
        } else {
            format!("-{:.2?}", mark - at)
        }
    };
    match windows
        .iter()
        .filter(|(_, to)| *to <= op.started)
        .map(|(_, to)| *to)
        .max()
    {
        Some(end) => format!(
            "{slug}: started {} and ended {} after a window's end",
            signed(op.started, end),
            signed(op.ended, end)
        ),
        None => match windows.iter().map(|(from, _)| *from).min() {
            Some(start) => format!(
                "{slug}: started {} and ended {} against the first window's start",
                signed(op.started, start),
                signed(op.ended, start)
            ),
            None => format!("{slug}: no outage window"),
        },
    }
}

/// A scoped key as the upstream saw it.
fn scoped(execution: &Execution) -> (String, String) {
    let scope = execution
        .headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    (scope, execution.key.clone())
}

pub fn check(history: &History, executions: &[Execution], store: &[(String, i64)], contract: &Contract) -> Report {
    let ops = history.ops();
    let mut report = Report {
        ops: ops.len(),
        executions: executions.len(),
        store_keys: store.len(),
        ..Report::default()
    };

    // AtMostOnce.
    let mut per_key: HashMap<(String, String), Vec<&Execution>> = HashMap::new();
    for execution in executions {
        per_key.entry(scoped(execution)).or_default().push(execution);
    }
    report.max_executions_per_key = per_key
        .values()
        .map(|runs| runs.iter().filter(|run| run.effect).count())
        .max()
        .unwrap_or(0);
    let by_id: HashMap<u64, &Execution> = executions.iter().map(|e| (e.id, e)).collect();

    // ReplayFidelity and NoForeignReplay.
    let mut first_ok: HashMap<(String, String), (u64, Bytes)> = HashMap::new();
    let mut keys = std::collections::HashSet::new();
    for op in &ops {
        let scoped_key = (op.scope.clone(), op.key.clone());
        keys.insert(scoped_key.clone());
        match &op.result {
            OpResult::Ok {
                execution,
                bytes,
                replayed,
                ..
            } => {
                report.ok += 1;
                report.replayed += usize::from(*replayed);
                match by_id.get(execution) {
                    Some(source) if scoped(source) == scoped_key => {}
                    _ => report.foreign_replays += 1,
                }
                match first_ok.get(&scoped_key) {
                    None => {
                        first_ok.insert(scoped_key, (*execution, bytes.clone()));
                    }
                    Some((id, first)) => {
                        if id != execution || first != bytes {
                            report.fidelity_violations += 1;
                        }
                    }
                }
            }
            OpResult::Fail { slug, .. } => *report.failures.entry(slug.clone()).or_default() += 1,
            OpResult::Unknown => report.unknown += 1,
        }
    }
    report.keys = keys.len();

    // UnknownSticky, restated for resolutions: from the end of the first "unknown"
    // answer for a key, what a later request gets must agree with what the upstream
    // did. A reconciled replay says the operation took effect: some execution of the
    // key must have. A fresh execution (or a fresh success) says the key was released
    // as not applied: no execution of the key before it may have taken effect.
    let mut unknown_since: HashMap<(String, String), Instant> = HashMap::new();
    for op in &ops {
        if let OpResult::Fail { slug, .. } = &op.result
            && matches!(
                slug.as_str(),
                "outcome-unknown" | "upstream-timeout" | "upstream-failed"
            )
        {
            let entry = unknown_since
                .entry((op.scope.clone(), op.key.clone()))
                .or_insert(op.ended);
            *entry = (*entry).min(op.ended);
        }
    }
    let took_effect_before = |key: &(String, String), at: Instant| {
        !contract.resolving
            || per_key
                .get(key)
                .is_some_and(|runs| runs.iter().any(|run| run.effect && run.at < at))
    };
    for op in &ops {
        let key = (op.scope.clone(), op.key.clone());
        let Some(since) = unknown_since.get(&key) else {
            continue;
        };
        match &op.result {
            OpResult::Ok { reconciled: true, .. } if !contract.resolving || !took_effect_before(&key, op.ended) => {
                report.unknown_sticky_violations += 1;
            }
            OpResult::Ok {
                replayed: false,
                execution,
                ..
            } if op.started > *since => {
                let at = by_id.get(execution).map_or(op.ended, |run| run.at);
                if took_effect_before(&key, at) {
                    report.unknown_sticky_violations += 1;
                }
            }
            _ => {}
        }
    }
    for execution in executions {
        let key = scoped(execution);
        if let Some(since) = unknown_since.get(&key)
            && execution.at > *since
            && took_effect_before(&key, execution.at)
        {
            report.unknown_sticky_violations += 1;
        }
    }

    // ExpiredAfterARun.
    for op in &ops {
        if let OpResult::Fail { status: 410, .. } = op.result {
            report.expired += 1;
            let ran = per_key
                .get(&(op.scope.clone(), op.key.clone()))
                .is_some_and(|runs| runs.iter().any(|run| run.effect && run.at < op.started));
            report.expired_without_a_run += usize::from(!ran);
        }
    }

    // 503s outside the windows in which the store was down (with 2 s to reconnect).
    for op in &ops {
        if let OpResult::Fail { status: 503, .. } = op.result {
            let inside = contract
                .outage_windows
                .iter()
                .any(|(from, to)| op.ended >= *from && op.started <= *to + Duration::from_secs(2));
            report.unavailable_outside_outage += usize::from(!inside);
            if !inside {
                report
                    .unavailable_outside
                    .push(outside_window(op, &contract.outage_windows));
            }
        }
    }

    // TtlFloor and the key audit: a record lives `remember`, a response kept beside it
    // (Redis's `…:r`) `retention`.
    let floor = |horizon: Duration| horizon.saturating_sub(contract.run_started.elapsed() + Duration::from_secs(2));
    for (name, ttl) in store {
        let floor = match name.ends_with(":r") {
            true => floor(contract.retention),
            false => floor(contract.remember),
        };
        if *ttl < 0 {
            report.keys_without_ttl += 1;
        } else if (*ttl as u128) < floor.as_millis() {
            report.ttl_floor_violations += 1;
        }
        if contract.raw_keys.iter().any(|raw| name.contains(raw.as_str())) {
            report.raw_key_bytes_in_names += 1;
        }
    }
    report
}

impl Report {
    pub fn print(&self, scenario: &str) {
        println!(
            "checker[{scenario}]: ops={} ok={} (replayed {}) unknown={} failures={:?} keys={} executions={} \
             | AtMostOnce max/key={} | ReplayFidelity violations={} | NoForeignReplay violations={} \
             | UnknownSticky violations={} | ExpiredAfterARun 410s={} without_a_run={} \
             | TtlFloor store_keys={} without_ttl={} below_floor={} raw_key_bytes={} | 503 outside outage={}",
            self.ops,
            self.ok,
            self.replayed,
            self.unknown,
            self.failures,
            self.keys,
            self.executions,
            self.max_executions_per_key,
            self.fidelity_violations,
            self.foreign_replays,
            self.unknown_sticky_violations,
            self.expired,
            self.expired_without_a_run,
            self.store_keys,
            self.keys_without_ttl,
            self.ttl_floor_violations,
            self.raw_key_bytes_in_names,
            self.unavailable_outside_outage,
        );
    }

    /// Fails the test on any violation, after printing the figures.
    pub fn assert_clean(&self, scenario: &str) {
        self.print(scenario);
        assert!(self.max_executions_per_key <= 1, "{scenario}: AtMostOnce violated");
        assert_eq!(self.fidelity_violations, 0, "{scenario}: ReplayFidelity violated");
        assert_eq!(self.foreign_replays, 0, "{scenario}: NoForeignReplay violated");
        assert_eq!(self.unknown_sticky_violations, 0, "{scenario}: UnknownSticky violated");
        assert_eq!(
            self.expired_without_a_run, 0,
            "{scenario}: a 410 for a key that never ran"
        );
        assert_eq!(self.keys_without_ttl, 0, "{scenario}: a store key has no TTL");
        assert_eq!(
            self.ttl_floor_violations, 0,
            "{scenario}: a store key's TTL is below the retention floor"
        );
        assert_eq!(
            self.raw_key_bytes_in_names, 0,
            "{scenario}: raw client key bytes in a store key"
        );
        assert_eq!(
            self.unavailable_outside_outage, 0,
            "{scenario}: 503 while the store was available: {:?}",
            self.unavailable_outside
        );
    }
}
