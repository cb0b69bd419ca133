//! A model check of the record protocol (DESIGN §4), by breadth-first search over
//! every interleaving of 2 or 3 proxies serving the same key: claim, forward,
//! complete, mark-unknown and release; the lease clock; client retries (each extra
//! proxy is a retry); and store operations that are applied after their caller timed
//! out, or whose reply is lost. A proxy that crashes is a proxy that never takes its
//! next step, which the search already covers.
//!
//! Invariants: the upstream runs the key at most once, and a completed record is
//! never overwritten. Two negative controls must each find a counterexample: writes
//! without compare-and-set, and takeover of records whose lease expired.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

use std::collections::{HashMap, VecDeque};
use std::fmt;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Record {
    Free,
    InFlight { owner: u8, lease_valid: bool },
    Completed { owner: u8 },
    Unknown { owner: u8 },
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
enum Op {
    Claim,
    Complete,
    MarkUnknown,
    Release,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Reply {
    Acquired,
    Existing,
    Done,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Phase {
    Idle,
    Claiming,
    Forwarding,
    Executed,
    /// Completing, with how many attempts so far (the proxy retries once).
    Completing(u8),
    /// Releasing in the background, with how many attempts so far.
    Releasing(u8),
    Done,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Proxy {
    phase: Phase,
    inbox: Option<Reply>,
}

#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct State {
    record: Record,
    proxies: Vec<Proxy>,
    /// Operations sent and not yet applied by the store, kept sorted.
    network: Vec<(u8, Op)>,
    executions: u8,
    completed_overwritten: bool,
}

#[derive(Clone, Copy, Debug)]
struct Variant {
    compare_and_set: bool,
    takeover_expired_leases: bool,
}

const CORRECT: Variant = Variant {
    compare_and_set: true,
    takeover_expired_leases: false,
};

#[derive(Clone, Copy, Debug)]
enum Action {
    Send(u8, Op),
    Receive(u8, Reply),
    Timeout(u8),
    Forward(u8),
    Refused(u8),
    Apply(u8, Op),
    LeaseExpires,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = |p: &u8| (b'A' + p) as char;
        match self {
            Action::Send(p, op) => write!(f, "{} sends {op:?}", name(p)),
            Action::Receive(p, reply) => write!(f, "{} gets {reply:?}", name(p)),
            Action::Timeout(p) => write!(f, "{} times out", name(p)),
            Action::Forward(p) => write!(f, "{} forwards (upstream runs)", name(p)),
            Action::Refused(p) => write!(f, "{} is refused by the upstream", name(p)),
            Action::Apply(p, op) => write!(f, "store applies {}'s {op:?}", name(p)),
            Action::LeaseExpires => write!(f, "the lease expires"),
        }
    }
}

impl State {
    fn initial(proxies: usize) -> State {
        State {
            record: Record::Free,
            proxies: vec![
                Proxy {
                    phase: Phase::Idle,
                    inbox: None
                };
                proxies
            ],
            network: Vec::new(),
            executions: 0,
            completed_overwritten: false,
        }
    }

    fn send(&mut self, proxy: u8, op: Op) {
        self.network.push((proxy, op));
        self.network.sort();
    }

    fn violation(&self) -> Option<&'static str> {
        if self.executions > 1 {
            Some("the upstream ran the key twice")
        } else if self.completed_overwritten {
            Some("a completed record was overwritten")
        } else {
            None
        }
    }

    /// The store applies one operation, as its Lua script would.
    fn apply(&mut self, proxy: u8, op: Op, variant: Variant) -> Reply {
        let owned_in_flight = |record: Record| matches!(record, Record::InFlight { owner, .. } if owner == proxy);
        let before = self.record;
        let reply = match op {
            Op::Claim => match self.record {
                Record::Free => {
                    self.record = Record::InFlight {
                        owner: proxy,
                        lease_valid: true,
                    };
                    Reply::Acquired
                }
                Record::InFlight {
                    owner,
                    lease_valid: true,
                } if owner == proxy => Reply::Acquired,
                Record::InFlight { lease_valid: false, .. } if variant.takeover_expired_leases => {
                    self.record = Record::InFlight {
                        owner: proxy,
                        lease_valid: true,
                    };
                    Reply::Acquired
                }
                _ => Reply::Existing,
            },
            Op::Complete => {
                let allowed = !variant.compare_and_set
                    || matches!(self.record, Record::InFlight { owner, lease_valid: true } if owner == proxy);
                if allowed {
                    self.record = Record::Completed { owner: proxy };
                }
                Reply::Done
            }
            Op::MarkUnknown => {
                if !variant.compare_and_set || owned_in_flight(self.record) {
                    self.record = Record::Unknown { owner: proxy };
                }
                Reply::Done
            }
            Op::Release => {
                if !variant.compare_and_set || owned_in_flight(self.record) {
                    self.record = Record::Free;
                }
                Reply::Done
            }
        };
        if matches!(before, Record::Completed { .. }) && self.record != before {
            self.completed_overwritten = true;
        }
        reply
    }

    /// Every state one step away, with the step.
    fn successors(&self, variant: Variant) -> Vec<(Action, State)> {
        let mut next = Vec::new();
        for (index, proxy) in self.proxies.iter().enumerate() {
            let p = index as u8;
            let mut step = |action: Action, change: &dyn Fn(&mut State)| {
                let mut state = self.clone();
                change(&mut state);
                next.push((action, state));
            };
            let set = move |state: &mut State, phase: Phase| {
                state.proxies[index] = Proxy { phase, inbox: None };
            };
            match (proxy.phase, proxy.inbox) {
                (Phase::Idle, _) => step(Action::Send(p, Op::Claim), &|s| {
                    s.send(p, Op::Claim);
                    set(s, Phase::Claiming);
                }),
                (Phase::Claiming, inbox) => {
                    match inbox {
                        Some(Reply::Acquired) => {
                            step(Action::Receive(p, Reply::Acquired), &|s| set(s, Phase::Forwarding))
                        }
                        Some(reply) => step(Action::Receive(p, reply), &|s| set(s, Phase::Done)),
                        None => {}
                    }
                    // A claim that times out may still be applied: release it.
                    step(Action::Timeout(p), &|s| {
                        s.send(p, Op::Release);
                        set(s, Phase::Releasing(1));
                    });
                }
                (Phase::Forwarding, _) => {
                    step(Action::Forward(p), &|s| {
                        s.executions += 1;
                        set(s, Phase::Executed);
                    });
                    step(Action::Refused(p), &|s| {
                        s.send(p, Op::Release);
                        set(s, Phase::Releasing(1));
                    });
                }
                (Phase::Executed, _) => {
                    step(Action::Send(p, Op::Complete), &|s| {
                        s.send(p, Op::Complete);
                        set(s, Phase::Completing(1));
                    });
                    step(Action::Send(p, Op::MarkUnknown), &|s| {
                        s.send(p, Op::MarkUnknown);
                        set(s, Phase::Done);
                    });
                }
                (Phase::Completing(attempt), inbox) => {
                    if let Some(reply) = inbox {
                        step(Action::Receive(p, reply), &|s| set(s, Phase::Done));
                    }
                    step(Action::Timeout(p), &|s| {
                        if attempt < 2 {
                            s.send(p, Op::Complete);
                            set(s, Phase::Completing(attempt + 1));
                        } else {
                            set(s, Phase::Done);
                        }
                    });
                }
                (Phase::Releasing(attempt), inbox) => {
                    if let Some(reply) = inbox {
                        step(Action::Receive(p, reply), &|s| set(s, Phase::Done));
                    }
                    step(Action::Timeout(p), &|s| {
                        if attempt < 2 {
                            s.send(p, Op::Release);
                            set(s, Phase::Releasing(attempt + 1));
                        } else {
                            set(s, Phase::Done);
                        }
                    });
                }
                (Phase::Done, _) => {}
            }
        }
        let mut seen = Vec::new();
        for (position, &(p, op)) in self.network.iter().enumerate() {
            if seen.contains(&(p, op)) {
                continue;
            }
            seen.push((p, op));
            let mut state = self.clone();
            state.network.remove(position);
            let reply = state.apply(p, op, variant);
            // The reply reaches the proxy only if it still waits for that kind of answer.
            let proxy = &mut state.proxies[usize::from(p)];
            let waiting = matches!(
                (proxy.phase, op),
                (Phase::Claiming, Op::Claim)
                    | (Phase::Completing(_), Op::Complete)
                    | (Phase::Releasing(_), Op::Release)
            );
            if waiting {
                proxy.inbox = Some(reply);
            }
            next.push((Action::Apply(p, op), state));
        }
        if let Record::InFlight {
            owner,
            lease_valid: true,
        } = self.record
        {
            let mut state = self.clone();
            state.record = Record::InFlight {
                owner,
                lease_valid: false,
            };
            next.push((Action::LeaseExpires, state));
        }
        next
    }
}

struct Outcome {
    states: usize,
    counterexample: Option<(String, Vec<Action>)>,
}

fn explore(proxies: usize, variant: Variant) -> Outcome {
    let initial = State::initial(proxies);
    let mut index: HashMap<State, usize> = HashMap::new();
    let mut parents: Vec<Option<(usize, Action)>> = vec![None];
    let mut states = vec![initial.clone()];
    index.insert(initial, 0);
    let mut queue = VecDeque::from([0usize]);
    while let Some(current) = queue.pop_front() {
        let state = states[current].clone();
        if let Some(violation) = state.violation() {
            let mut trace = Vec::new();
            let mut at = current;
            while let Some((parent, action)) = parents[at] {
                trace.push(action);
                at = parent;
            }
            trace.reverse();
            return Outcome {
                states: states.len(),
                counterexample: Some((violation.to_string(), trace)),
            };
        }
        for (action, next) in state.successors(variant) {
            if index.contains_key(&next) {
                continue;
            }
            let id = states.len();
            index.insert(next.clone(), id);
            states.push(next);
            parents.push(Some((current, action)));
            queue.push_back(id);
        }
    }
    Outcome {
        states: states.len(),
        counterexample: None,
    }
}

fn one_line(trace: &[Action]) -> String {
    trace.iter().map(ToString::to_string).collect::<Vec<_>>().join(" -> ")
}

#[test]
fn the_protocol_is_safe_with_two_and_three_proxies() {
    for proxies in [2, 3] {
        let outcome = explore(proxies, CORRECT);
        println!(
            "model: {proxies} proxies, {} states explored, no violation",
            outcome.states
        );
        if let Some((violation, trace)) = outcome.counterexample {
            panic!("{violation}: {}", one_line(&trace));
        }
        assert!(outcome.states > 100, "the search explored too little to mean anything");
    }
}

#[test]
fn without_compare_and_set_a_counterexample_is_found() {
    let variant = Variant {
        compare_and_set: false,
        ..CORRECT
    };
    let outcome = explore(2, variant);
    let (violation, trace) = outcome.counterexample.expect("plain writes must break the protocol");
    println!(
        "negative control (no compare-and-set), {} states: {violation}: {}",
        outcome.states,
        one_line(&trace)
    );
}

#[test]
fn taking_over_expired_leases_gives_a_counterexample() {
    let variant = Variant {
        takeover_expired_leases: true,
        ..CORRECT
    };
    let outcome = explore(2, variant);
    let (violation, trace) = outcome.counterexample.expect("lease takeover must break the protocol");
    assert_eq!(violation, "the upstream ran the key twice");
    println!(
        "negative control (lease takeover), {} states: {violation}: {}",
        outcome.states,
        one_line(&trace)
    );
}
