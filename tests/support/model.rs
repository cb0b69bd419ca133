//! The model check's engine: a breadth-first search over every interleaving of 2 or 3
//! proxies serving the same key: claim, forward, complete, mark-unknown and release;
//! the lease clock; client retries (each extra proxy is a retry); and store operations
//! that are applied after their caller timed out, or whose reply is lost. A proxy that
//! crashes is a proxy that never takes its next step, which the search already covers.
//! An operator and a probe (two resolvers, the same store operation) may each resolve
//! an unknown record once, truthfully, racing each other and the proxies: as applied when the upstream ran the key, as not applied when it
//! did not, and only once the owner can no longer forward it (past its upstream
//! timeout, which the lease outlasts).
//! The store's answers come from `protocol::Record::apply`, which the conformance test
//! holds the real stores to.

use std::collections::{HashMap, VecDeque};
use std::fmt;

use super::protocol::{CORRECT, Event, Op, Record, Reply, Variant};

/// The resolvers of an unknown record: an operator and the route's probe.
const RESOLVERS: u8 = 2;

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
    /// How many resolutions have been sent (an operator's, a probe's).
    resolutions: u8,
}

#[derive(Clone, Copy, Debug)]
pub enum Action {
    Send(u8, Op),
    Receive(u8, Reply),
    Timeout(u8),
    Forward(u8),
    Refused(u8),
    Apply(u8, Op),
    /// The operator resolves `claim`'s unknown outcome.
    Resolve(u8, Op),
    LeaseExpires,
    /// The retention of the completed record passes: its response is dropped, and
    /// every later claim finds it spent (410, never a second run).
    ResponseExpires,
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
            Action::Resolve(p, op) => write!(f, "the operator sends {op:?} for {}'s claim", name(p)),
            Action::LeaseExpires => write!(f, "the lease expires"),
            Action::ResponseExpires => write!(f, "the response's retention passes"),
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
            resolutions: 0,
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

    /// The store applies one operation: `Record::apply`, which the conformance test
    /// holds the real stores to, plus the check that nothing overwrote a completion.
    fn apply(&mut self, proxy: u8, op: Op, variant: Variant) -> Reply {
        let before = self.record;
        let reply = self.record.apply(proxy, op, variant);
        let completed = matches!(
            before,
            Record::Completed { .. } | Record::Reconciled { .. } | Record::Spent { .. }
        );
        if completed && self.record != before {
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
        let unknown_claim = match self.record {
            Record::Unknown { owner }
            | Record::InFlight {
                owner,
                lease_valid: false,
            } => Some(owner),
            _ => None,
        };
        // A proxy that may still forward: one about to, or one whose claim answered
        // Acquired. Resolving "not applied" before it cannot is a double execution
        // (the search finds it); the real lease outlasts the claim's store timeout and
        // the upstream timeout together, so an owner past its lease never forwards.
        let could_forward = self.proxies.iter().any(|proxy| {
            proxy.phase == Phase::Forwarding || (proxy.phase == Phase::Claiming && proxy.inbox == Some(Reply::Acquired))
        });
        if let Some(claim) = unknown_claim.filter(|_| self.resolutions < RESOLVERS && !could_forward) {
            let op = if self.executions > 0 {
                Op::ResolveApplied
            } else {
                Op::ResolveNotApplied
            };
            // Sent as the claim it learned about, and applied whenever the network
            // delivers it: by then the key may hold a later claim.
            let mut state = self.clone();
            state.send(claim, op);
            state.resolutions += 1;
            next.push((Action::Resolve(claim, op), state));
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
            // The reply reaches the proxy only if it still waits for that kind of answer
            // (the operator's is read off the record).
            if let Some(proxy) = state.proxies.get_mut(usize::from(p)) {
                let waiting = matches!(
                    (proxy.phase, op),
                    (Phase::Claiming, Op::Claim)
                        | (Phase::Completing(_), Op::Complete)
                        | (Phase::Releasing(_), Op::Release)
                );
                if waiting {
                    proxy.inbox = Some(reply);
                }
            }
            next.push((Action::Apply(p, op), state));
        }
        if let Record::InFlight { lease_valid: true, .. } = self.record {
            let mut state = self.clone();
            state.record.expire_lease();
            next.push((Action::LeaseExpires, state));
        }
        if let Record::Completed { .. } | Record::Reconciled { .. } = self.record {
            let mut state = self.clone();
            state.record.expire_response();
            next.push((Action::ResponseExpires, state));
        }
        next
    }
}

pub struct Outcome {
    pub states: usize,
    pub counterexample: Option<(String, Vec<Action>)>,
    /// How each explored state was reached: its parent and the step from it.
    parents: Vec<Option<(usize, Action)>>,
}

impl Outcome {
    /// The steps from the initial state to state `id`.
    fn path(&self, id: usize) -> Vec<Action> {
        let mut trace = Vec::new();
        let mut at = id;
        while let Some((parent, action)) = self.parents.get(at).copied().flatten() {
            trace.push(action);
            at = parent;
        }
        trace.reverse();
        trace
    }

    /// What the store saw on the way to each explored state: the operations it
    /// applied and the lease expiring, in order. Only the longest are kept, since a
    /// trace checked step by step checks every prefix of itself too.
    pub fn store_traces(&self) -> Vec<Vec<Event>> {
        let mut traces: Vec<Vec<Event>> = (0..self.states)
            .map(|id| {
                self.path(id)
                    .into_iter()
                    .filter_map(|action| match action {
                        Action::Apply(owner, op) => Some(Event::Apply { owner, op }),
                        Action::LeaseExpires => Some(Event::LeaseExpires),
                        Action::ResponseExpires => Some(Event::ResponseExpires),
                        _ => None,
                    })
                    .collect()
            })
            .collect();
        traces.sort();
        traces.dedup();
        // Sorted, a trace is followed by the traces it is a prefix of, if any.
        traces
            .iter()
            .enumerate()
            .filter(|(i, trace)| traces.get(i + 1).is_none_or(|next| !next.starts_with(trace)))
            .map(|(_, trace)| trace.clone())
            .collect()
    }
}

pub fn explore(proxies: usize, variant: Variant) -> Outcome {
    let initial = State::initial(proxies);
    let mut index: HashMap<State, usize> = HashMap::new();
    let mut parents: Vec<Option<(usize, Action)>> = vec![None];
    let mut states = vec![initial.clone()];
    index.insert(initial, 0);
    let mut queue = VecDeque::from([0usize]);
    while let Some(current) = queue.pop_front() {
        let state = states[current].clone();
        if let Some(violation) = state.violation() {
            let mut outcome = Outcome {
                states: states.len(),
                counterexample: None,
                parents,
            };
            outcome.counterexample = Some((violation.to_string(), outcome.path(current)));
            return outcome;
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
        parents,
    }
}

pub fn one_line(trace: &[Action]) -> String {
    trace.iter().map(ToString::to_string).collect::<Vec<_>>().join(" -> ")
}
