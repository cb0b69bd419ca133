//! A model check of the record protocol (docs/design.md §4), by breadth-first search over
//! every interleaving of 2 or 3 proxies serving the same key (the engine is
//! `tests/support/model.rs`; the store's answers are `tests/support/protocol.rs`, the
//! same function the conformance test holds the real stores to).
//!
//! Invariants: the upstream runs the key at most once, and a completed record is
//! never overwritten. An operator (or probe) resolves an unknown outcome once,
//! truthfully. Three negative controls must each find a counterexample: writes
//! without compare-and-set, takeover of records whose lease expired, and a resolution
//! that is not fenced on the claim it learned about.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

mod support;

use support::model::{explore, one_line};
use support::protocol::{CORRECT, Variant};

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

#[test]
fn a_resolution_not_fenced_on_its_claim_gives_a_counterexample() {
    let variant = Variant {
        resolutions_fenced_on_their_claim: false,
        ..CORRECT
    };
    let outcome = explore(3, variant);
    let (violation, trace) = outcome
        .counterexample
        .expect("a resolution that lands on a later claim must break the protocol");
    assert_eq!(violation, "the upstream ran the key twice");
    println!(
        "negative control (resolution not fenced on its claim), {} states: {violation}: {}",
        outcome.states,
        one_line(&trace)
    );
}
