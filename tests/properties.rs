//! Property tests with proptest: key parsing, key derivation, the record encoding, and
//! the config loader. They run inside `cargo test` with proptest's default 256 cases.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

use std::path::Path;

use http::{HeaderName, HeaderValue};
use idemproxy::config::Config;
use idemproxy::config::JsonPointer;
use idemproxy::error::KeyError;
use idemproxy::idempotency::{parse_key_value, store_key};
use idemproxy::record::{decode_headers, encode_headers};
use proptest::prelude::*;

/// What the contract says a bare key is: 1 to 255 visible ASCII characters, no comma.
fn is_acceptable_bare(raw: &[u8]) -> bool {
    let trimmed = raw.trim_ascii();
    !trimmed.is_empty()
        && trimmed.len() <= 255
        && trimmed.first() != Some(&b'"')
        && trimmed.iter().all(|b| (0x21..=0x7e).contains(b) && *b != b',')
}

proptest! {
    #[test]
    fn key_parsing_never_panics_and_accepts_exactly_the_contract(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
        let parsed = parse_key_value(&raw);
        if raw.trim_ascii().first() != Some(&b'"') {
            prop_assert_eq!(parsed.is_ok(), is_acceptable_bare(&raw), "{:?} -> {:?}", raw, parsed);
        }
        if let Ok(key) = parsed {
            prop_assert!(!key.as_str().is_empty() && key.as_str().len() <= 255);
            prop_assert!(key.as_str().bytes().all(|b| (0x21..=0x7e).contains(&b)));
        }
    }

    #[test]
    fn visible_ascii_keys_are_accepted_up_to_255_characters_and_no_further(
        key in "[!#-+--~]{230,280}",
        quoted in any::<bool>(),
    ) {
        // Any visible ASCII but '"' and ','; a backslash is escaped in the quoted form.
        let raw = if quoted { format!("\"{}\"", key.replace('\\', "\\\\")) } else { key.clone() };
        let parsed = parse_key_value(raw.as_bytes());
        if key.len() <= 255 {
            prop_assert_eq!(parsed.map(|k| k.as_str().to_string()), Ok(key));
        } else {
            prop_assert_eq!(parsed, Err(KeyError::TooLong));
        }
    }

    #[test]
    fn quoted_and_bare_forms_name_the_same_key(key in "[!#-+--~]{1,255}") {
        // Any visible ASCII but '"', ',' and '\\' (the class above skips them).
        prop_assume!(!key.contains('\\'));
        let quoted = format!("\"{key}\"");
        prop_assert_eq!(parse_key_value(key.as_bytes()), parse_key_value(quoted.as_bytes()));
    }

    #[test]
    fn control_space_and_non_ascii_bytes_inside_a_key_are_refused(
        prefix in "[a-z]{1,5}",
        bad in prop_oneof![0u8..=0x20, 0x7fu8..=0xff],
        suffix in "[a-z]{1,5}",
    ) {
        let mut raw = prefix.into_bytes();
        raw.push(bad);
        raw.extend_from_slice(suffix.as_bytes());
        let parsed = parse_key_value(&raw);
        prop_assert_eq!(parsed, Err(KeyError::NotVisibleAscii), "{:?}", raw);
    }

    #[test]
    fn key_derivation_is_injective(
        a in proptest::collection::vec(proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..6), 0..3), 0..3),
        b in proptest::collection::vec(proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..6), 0..3), 0..3),
        key_a in "[a-c:]{1,4}",
        key_b in "[a-c:]{1,4}",
    ) {
        let (sa, sb) = (a, b);
        let ka = parse_key_value(key_a.as_bytes()).expect("key");
        let kb = parse_key_value(key_b.as_bytes()).expect("key");
        let da = store_key("p", "r", &as_refs(&sa), &ka);
        let db = store_key("p", "r", &as_refs(&sb), &kb);
        prop_assert_eq!(da == db, sa == sb && key_a == key_b);
        // The raw client bytes never appear in the store key.
        let hash = da.as_str().strip_prefix("p:r:{").and_then(|rest| rest.strip_suffix('}'));
        prop_assert!(hash.is_some_and(|hash| hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit())), "{:?}", da);
    }

    #[test]
    fn record_headers_round_trip(headers in proptest::collection::vec(("[a-z-]{1,20}", proptest::collection::vec(field_value_byte(), 0..40)), 0..12)) {
        let headers: Vec<(HeaderName, HeaderValue)> = headers
            .into_iter()
            .map(|(name, value)| {
                let name = HeaderName::from_bytes(name.as_bytes()).expect("a token is a header name");
                (name, HeaderValue::from_bytes(&value).expect("field-value bytes make a header value"))
            })
            .collect();
        prop_assert_eq!(decode_headers(&encode_headers(&headers)), Some(headers));
    }

    #[test]
    fn record_header_decoding_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = decode_headers(&raw);
    }

    #[test]
    fn the_config_loader_never_panics_on_any_text(text in "\\PC{0,400}") {
        let _ = Config::parse(&text, Path::new("fuzz.toml"));
    }

    #[test]
    fn the_config_loader_never_panics_on_mutated_configs(cut in 0usize..900, insert in "[\\[\\]=\"a-z0-9._ \n-]{0,12}") {
        let valid = include_str!("../proxy.toml");
        let cut = valid.char_indices().map(|(i, _)| i).nth(cut % valid.chars().count()).unwrap_or(0);
        let mutated = format!("{}{}{}", &valid[..cut], insert, &valid[cut..]);
        match Config::parse(&mutated, Path::new("fuzz.toml")) {
            Ok(_) => {}
            Err(error) => {
                let message = error.to_string();
                prop_assert!(message.starts_with("fuzz.toml:"), "{}", message);
            }
        }
    }
}

/// A byte a header field value may hold (RFC 9110 §5.5: visible ASCII, space, tab,
/// and obs-text).
fn field_value_byte() -> impl Strategy<Value = u8> {
    prop_oneof![Just(b'\t'), 0x20u8..=0x7e, 0x80u8..=0xff]
}

fn as_refs(scope: &[Vec<Vec<u8>>]) -> Vec<Vec<&[u8]>> {
    scope
        .iter()
        .map(|values| values.iter().map(Vec::as_slice).collect())
        .collect()
}

// === the JSON fingerprint's canonical form ===

/// A JSON value as the test builds it: numbers as exact decimals (`-`? digits × 10^exp).
#[derive(Debug, Clone)]
enum Json {
    Null,
    Bool(bool),
    Number { negative: bool, digits: String, exp: i32 },
    Text(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

fn json_value() -> impl Strategy<Value = Json> {
    let number = (any::<bool>(), "[1-9][0-9]{0,25}", -30i32..30).prop_map(|(negative, digits, exp)| Json::Number {
        negative,
        digits,
        exp,
    });
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        number,
        "\\PC{0,12}".prop_map(Json::Text),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Json::Array),
            proptest::collection::btree_map("[a-z~/é]{0,6}", inner, 0..6)
                .prop_map(|members| Json::Object(members.into_iter().collect())),
        ]
    })
}

/// A pseudo-random choice among `n`, from `seed`.
fn pick(seed: &mut u64, n: u64) -> u64 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (*seed >> 33) % n
}

/// Writes `value` one of many equivalent ways, chosen by `seed`: member order,
/// whitespace, string escapes and number spelling vary; the value does not.
fn render(value: &Json, seed: &mut u64, out: &mut String) {
    let space = [" ", "", "\n\t", "  "];
    let gap = |choice: u64| space[choice as usize % space.len()];
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(flag) => out.push_str(if *flag { "true" } else { "false" }),
        Json::Number { negative, digits, exp } => {
            if *negative {
                out.push('-');
            }
            let padded = pick(seed, 3) as i32;
            let (digits, exp) = (format!("{digits}{}", "0".repeat(padded as usize)), exp - padded);
            match pick(seed, 3) {
                0 => out.push_str(&format!("{digits}e{exp}")),
                1 => out.push_str(&format!("{digits}E{}{exp}", if exp >= 0 { "+" } else { "" })),
                _ if exp >= 0 => out.push_str(&format!("{digits}{}", "0".repeat(exp as usize))),
                _ => {
                    let point = digits.len() as i32 + exp;
                    if point > 0 {
                        let (int, frac) = digits.split_at(point as usize);
                        out.push_str(&format!("{int}.{frac}"));
                    } else {
                        out.push_str(&format!("0.{}{digits}", "0".repeat((-point) as usize)));
                    }
                }
            }
        }
        Json::Text(text) => {
            out.push('"');
            for c in text.chars() {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    c if (c as u32) < 0x20 || pick(seed, 4) == 0 => {
                        let mut units = [0u16; 2];
                        for unit in c.encode_utf16(&mut units) {
                            out.push_str(&format!("\\u{unit:04X}"));
                        }
                    }
                    c => out.push(c),
                }
            }
            out.push('"');
        }
        Json::Array(items) => {
            out.push('[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                out.push_str(gap(pick(seed, 4)));
                render(item, seed, out);
            }
            out.push(']');
        }
        Json::Object(members) => {
            let mut order: Vec<&(String, Json)> = members.iter().collect();
            for at in (1..order.len()).rev() {
                order.swap(at, pick(seed, at as u64 + 1) as usize);
            }
            out.push('{');
            for (index, (key, member)) in order.into_iter().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                out.push_str(gap(pick(seed, 4)));
                render(&Json::Text(key.clone()), seed, out);
                out.push_str(gap(pick(seed, 4)));
                out.push(':');
                render(member, seed, out);
            }
            out.push_str(gap(pick(seed, 4)));
            out.push('}');
        }
    }
}

fn rendered(value: &Json, seed: u64) -> String {
    let mut out = String::new();
    render(value, &mut seed.clone(), &mut out);
    out
}

/// The JSON pointer of each value inside `value`, with a copy of `value` where that
/// value is changed into a different one.
fn changes(value: &Json, pointer: String, out: &mut Vec<(String, Json)>) {
    let changed = match value {
        Json::Null => Json::Bool(false),
        Json::Bool(flag) => Json::Bool(!flag),
        Json::Number { negative, digits, exp } => Json::Number {
            negative: *negative,
            digits: format!("{digits}1"),
            exp: *exp,
        },
        Json::Text(text) => Json::Text(format!("{text}x")),
        Json::Array(items) => {
            let mut more = items.clone();
            more.push(Json::Null);
            Json::Array(more)
        }
        Json::Object(members) => {
            let mut more = members.clone();
            more.retain(|(key, _)| key != "added");
            more.push(("added".into(), Json::Null));
            if more.len() == members.len() {
                more.pop();
            }
            Json::Object(more)
        }
    };
    out.push((pointer.clone(), changed));
    let escape = |token: &str| token.replace('~', "~0").replace('/', "~1");
    match value {
        Json::Array(items) => {
            for (index, item) in items.iter().enumerate() {
                let mut inner = Vec::new();
                changes(item, format!("{pointer}/{index}"), &mut inner);
                for (at, changed) in inner {
                    let mut copy = items.clone();
                    copy[index] = changed;
                    out.push((at, Json::Array(copy)));
                }
            }
        }
        Json::Object(members) => {
            for (index, (key, member)) in members.iter().enumerate() {
                let mut inner = Vec::new();
                changes(member, format!("{pointer}/{}", escape(key)), &mut inner);
                for (at, changed) in inner {
                    let mut copy = members.clone();
                    copy[index].1 = changed;
                    out.push((at, Json::Object(copy)));
                }
            }
        }
        _ => {}
    }
}

fn canonical(text: &str, ignore: &[&str]) -> Option<Vec<u8>> {
    let ignore: Vec<JsonPointer> = ignore
        .iter()
        .map(|p| JsonPointer::parse(p).expect("a pointer"))
        .collect();
    idemproxy::canonical_json::canonical(text.as_bytes(), &ignore)
}

proptest! {
    #[test]
    fn equal_json_spelled_differently_has_one_canonical_form(value in json_value(), a in any::<u64>(), b in any::<u64>()) {
        let (first, second) = (rendered(&value, a), rendered(&value, b));
        let canonical_first = canonical(&first, &[]);
        prop_assert!(canonical_first.is_some(), "not canonical: {}", first);
        prop_assert_eq!(canonical_first, canonical(&second, &[]), "{} vs {}", first, second);
    }

    #[test]
    fn any_changed_value_changes_the_canonical_form_unless_it_is_ignored(value in json_value(), seed in any::<u64>(), choice in any::<prop::sample::Index>()) {
        let mut all = Vec::new();
        changes(&value, String::new(), &mut all);
        let (pointer, changed) = choice.get(&all).clone();
        let (before, after) = (rendered(&value, seed), rendered(&changed, seed));
        prop_assert_ne!(canonical(&before, &[]), canonical(&after, &[]), "{} vs {}", before, after);
        if !pointer.is_empty() {
            // The changed value's own pointer ignores it.
            prop_assert_eq!(canonical(&before, &[&pointer]), canonical(&after, &[&pointer]), "{}: {} vs {}", pointer, before, after);
        }
    }

    /// An ignored pointer drops only the value at its own path: the same value under
    /// another member (the same names all the way down, another path) still counts.
    #[test]
    fn an_ignored_pointer_drops_its_own_path_and_no_other(value in json_value(), seed in any::<u64>(), choice in any::<prop::sample::Index>()) {
        let mut all = Vec::new();
        changes(&value, String::new(), &mut all);
        let (pointer, changed) = choice.get(&all).clone();
        let pair = |x: &Json| Json::Object(vec![("x".into(), x.clone()), ("y".into(), value.clone())]);
        let (before, after) = (rendered(&pair(&value), seed), rendered(&pair(&changed), seed));
        let ignored = format!("/y{pointer}");
        prop_assert_ne!(canonical(&before, &[&ignored]), canonical(&after, &[&ignored]), "{}: {} vs {}", ignored, before, after);
    }

    /// Nor does it drop a member named as its last token on the way to it: with
    /// `/y/.../ts` ignored, a top-level `ts` still counts.
    #[test]
    fn an_ignored_pointer_drops_no_member_named_like_it_on_the_way(value in json_value(), seed in any::<u64>(), choice in any::<prop::sample::Index>()) {
        let mut all = Vec::new();
        changes(&value, String::new(), &mut all);
        let (pointer, _) = choice.get(&all).clone();
        let last = pointer.rsplit('/').next().unwrap_or_default().replace("~1", "/").replace("~0", "~");
        prop_assume!(!pointer.is_empty() && last != "y");
        let doc = |member: &str| Json::Object(vec![("y".into(), value.clone()), (last.clone(), Json::Text(member.into()))]);
        let (before, after) = (rendered(&doc("a"), seed), rendered(&doc("b"), seed));
        let ignored = format!("/y{pointer}");
        prop_assert_ne!(canonical(&before, &[&ignored]), canonical(&after, &[&ignored]), "{}: {} vs {}", ignored, before, after);
    }
}

#[test]
fn hostile_json_is_fingerprinted_in_bounded_work() {
    let mib = 1024 * 1024;
    // Nesting far past the bound is not canonical (bytes), and costs one pass.
    assert_eq!(canonical(&"[".repeat(mib), &[]), None);
    assert_eq!(canonical(&"{\"a\":".repeat(mib / 5), &[]), None);
    // A number of a million digits is kept exactly: one digit more is another number.
    let huge = "9".repeat(mib);
    assert_ne!(canonical(&huge, &[]), canonical(&format!("{huge}9"), &[]));
    assert_eq!(canonical(&format!("{huge}.000"), &[]), canonical(&huge, &[]));
    // An exponent too long to hold is refused rather than approximated.
    assert_eq!(canonical(&format!("1e{}", "9".repeat(19)), &[]), None);
    // A hundred thousand keys in one object: sorted once.
    let members: Vec<String> = (0..100_000).rev().map(|i| format!("\"k{i}\":{i}")).collect();
    let object = format!("{{{}}}", members.join(","));
    let sorted: Vec<String> = (0..100_000).map(|i| format!("\"k{i}\":{i}")).collect();
    assert_eq!(
        canonical(&object, &[]),
        canonical(&format!("{{{}}}", sorted.join(",")), &[])
    );
}
