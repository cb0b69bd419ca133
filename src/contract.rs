//! The published idempotency contract (docs/design.md §15): what a client of each guarded route
//! may rely on (its key rules, how long a key lives, what the fingerprint covers, every
//! status and problem it can answer with), as the `/.well-known/idempotency` document,
//! an OpenAPI 3.1 fragment, and a Markdown page for an API portal. Made from the
//! validated config alone: pure, no I/O.

use serde_json::{Value, json};

use crate::config::{FingerprintBody, IdempotencyPolicy, Mode, Profile, ReplayKind, Route, UpstreamKey};
use crate::idempotency::MAX_KEY_LEN;
use crate::problem::{Listed, ProblemKind, problem_type};

/// The draft this contract follows.
pub const SPECIFICATION: &str = "https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/";

/// The contract of `routes` (the guarded ones among them), as the well-known document.
pub fn document<'a>(routes: impl IntoIterator<Item = &'a Route>) -> Value {
    let routes: Vec<Value> = routes
        .into_iter()
        .filter_map(|route| route.idempotency.as_deref().map(|policy| describe(route, policy)))
        .collect();
    json!({
        "specification": SPECIFICATION,
        "routes": routes,
    })
}

fn describe(route: &Route, policy: &IdempotencyPolicy) -> Value {
    let (body, ignored) = match &policy.fingerprint_body {
        FingerprintBody::Bytes => ("bytes", Vec::new()),
        FingerprintBody::Json { ignore } => ("json", ignore.iter().map(ToString::to_string).collect()),
    };
    let responses: Vec<Value> = answers(policy)
        .map(|(status, kind)| {
            json!({
                "status": status,
                "problem": kind.slug(),
                "type": problem_type(route.docs_url.as_deref(), kind.slug()),
                "meaning": kind.row().meaning,
            })
        })
        .collect();
    let millis = |duration: std::time::Duration| u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
    json!({
        "name": route.name,
        "host": route.host,
        "path_prefix": route.path_prefix,
        "methods": policy.methods.iter().map(|method| method.as_str()).collect::<Vec<_>>(),
        "header": header_name(policy),
        "required": policy.required,
        "key": {
            "min_length": 1,
            "max_length": MAX_KEY_LEN,
            "characters": "visible ASCII (0x21 to 0x7E)",
            "forms": ["a bare token: abc", "an RFC 8941 string: \"abc\" (the same key)"],
            "repeated": "refused: one field line, one key",
        },
        "retention_seconds": policy.retention.as_secs(),
        "expiry": "a key lives retention_seconds from its first request; after that it is free, and a request with it runs as new",
        "scope": {
            "headers": policy.scope_headers.iter().map(|name| name.as_str()).collect::<Vec<_>>(),
            "jwt_claim": policy.scope_jwt.as_ref().map(|jwt| jwt.describe()),
        },
        "fingerprint": {
            "covers": covers(policy),
            "headers": policy.fingerprint_headers.iter().map(|name| name.as_str()).collect::<Vec<_>>(),
            "body": body,
            "ignored_json_pointers": ignored,
        },
        "wait_for_in_flight_ms": millis(policy.wait_for_in_flight),
        "mode": match policy.mode {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
        },
        "profile": policy.profile.as_str(),
        "replay": {
            "mode": policy.replay.as_str(),
            "headers": match policy.replay {
                ReplayKind::Stored => None,
                ReplayKind::Status | ReplayKind::Refetch => {
                    Some(policy.replay_headers.iter().map(|name| name.as_str()).collect::<Vec<_>>())
                }
            },
            "refetch": policy.refetch.as_ref().map(|refetch| json!({
                "method": refetch.method.as_str(),
                "path": refetch.path.template(),
            })),
            "marker": "Idempotent-Replayed: true",
            "reconciled_marker": "Idempotency-Reconciled: true",
            "meaning": replay_meaning(policy),
        },
        "upstream_key": match policy.upstream_key {
            UpstreamKey::Client => "client",
            UpstreamKey::Derived => "derived",
            UpstreamKey::None => "none",
        },
        "reconcile": route.reconcile().map(|reconcile| json!({
            "first_after_ms": millis(reconcile.first_after),
            "every_ms": millis(reconcile.every),
            "give_up_after_ms": millis(reconcile.give_up_after),
        })),
        "responses": responses,
        "docs_url": route.docs_url.as_deref(),
    })
}

/// What a retry of a completed request gets on the route, in words.
fn replay_meaning(policy: &IdempotencyPolicy) -> &'static str {
    match policy.replay {
        ReplayKind::Stored => {
            "a retry of a completed request gets the recorded response again (status, headers, body), with the marker; a response learned by resolving an unknown outcome carries both"
        }
        ReplayKind::Status => {
            "a retry of a completed request gets the recorded status and the fields in headers again, with an empty body and the marker: no body is stored"
        }
        ReplayKind::Refetch => {
            "a retry of a completed request is answered by the upstream's answer to the refetch request, sent with the retry's own headers (its credentials) and no body, with the marker; nothing of the body is stored, and a failed refetch is 503 replay-unavailable, never a second run"
        }
    }
}

/// What the route's fingerprint covers, in words: what makes two requests "the same".
fn covers(policy: &IdempotencyPolicy) -> Vec<String> {
    let mut covers = vec!["method".to_string(), "path".into(), "query".into()];
    covers.extend(policy.fingerprint_headers.iter().map(|name| format!("header {name}")));
    covers.push(match policy.fingerprint_body {
        FingerprintBody::Bytes => "body bytes".into(),
        FingerprintBody::Json { .. } => "body, as canonical JSON (bytes when it is not JSON)".into(),
    });
    covers
}

/// The header's name as the config spells it canonically (`Idempotency-Key`).
fn header_name(policy: &IdempotencyPolicy) -> String {
    policy
        .header
        .as_str()
        .split('-')
        .map(|part| {
            let mut chars = part.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_ascii_uppercase().to_string() + chars.as_str()
            })
        })
        .collect::<Vec<_>>()
        .join("-")
}

/// The problems `policy`'s route can answer with, each with its status under the
/// route's profile, in the rows' order.
fn answers(policy: &IdempotencyPolicy) -> impl Iterator<Item = (u16, ProblemKind)> + '_ {
    ProblemKind::ALL
        .into_iter()
        // A shadow-mode route forwards every request as an unguarded route would: it
        // answers none of the guard's problems, only the upstream's failures.
        .filter(|kind| policy.mode == Mode::Enforce || kind.row().in_shadow)
        .filter(|kind| match kind.row().listed {
            Listed::Always => true,
            Listed::WhenRequired => policy.required,
            Listed::WhenScopeJwt => policy.scope_jwt.is_some(),
            Listed::WhenRefetch => policy.replay == crate::config::ReplayKind::Refetch,
            Listed::Never => false,
        })
        .map(|kind| (policy.profile.status(kind).as_u16(), kind))
}

/// An OpenAPI 3.1 fragment: for each guarded route, its methods on its path prefix
/// with the key's header parameter and every problem response, and the components
/// they share. An API's own spec merges it in.
pub fn openapi<'a>(routes: impl IntoIterator<Item = &'a Route>, version: &str) -> Value {
    let mut paths = serde_json::Map::new();
    let mut parameters = serde_json::Map::new();
    for route in routes {
        let Some(policy) = route.idempotency.as_deref() else {
            continue;
        };
        let parameter = format!("{}IdempotencyKey", component_name(&route.name));
        parameters.insert(
            parameter.clone(),
            json!({
                "name": header_name(policy),
                "in": "header",
                "required": policy.required,
                "description": format!(
                    "A unique key per operation: a retry with the same key and the same request gets the first answer again (with Idempotent-Replayed: true) for {} seconds.",
                    policy.retention.as_secs()
                ),
                "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LEN, "pattern": "^[\\x21-\\x7E]+$"},
            }),
        );
        let schema = match policy.profile {
            Profile::Ietf => "#/components/schemas/IdempotencyProblem",
            Profile::Stripe => "#/components/schemas/StripeError",
        };
        let media = match policy.profile {
            Profile::Ietf => "application/problem+json",
            Profile::Stripe => "application/json",
        };
        let mut responses = serde_json::Map::new();
        for (status, kind) in answers(policy) {
            let entry = responses.entry(status.to_string()).or_insert_with(|| {
                json!({
                    "description": "",
                    "content": {media: {"schema": {"$ref": schema}}},
                })
            });
            let line = format!("`{}`: {}.", kind.slug(), kind.row().meaning);
            if let Some(description) = entry.get_mut("description") {
                let text = description.as_str().unwrap_or_default();
                *description = Value::String(if text.is_empty() {
                    line
                } else {
                    format!("{text} {line}")
                });
            }
        }
        // Whatever the upstream answers, and every replay of it, besides the problems.
        responses.insert(
            "default".to_string(),
            json!({
                "description": format!("The upstream's own response. Replay mode `{}`: {}.", policy.replay.as_str(), replay_meaning(policy)),
                "headers": {
                    "Idempotent-Replayed": {
                        "description": "On a replay of a recorded response.",
                        "schema": {"type": "string", "enum": ["true"]},
                    },
                    "Idempotency-Reconciled": {
                        "description": "On a replay of a response learned by resolving an unknown outcome (the route's probe, or an operator).",
                        "schema": {"type": "string", "enum": ["true"]},
                    },
                },
            }),
        );
        let mut operations = serde_json::Map::new();
        for method in &policy.methods {
            operations.insert(
                method.as_str().to_ascii_lowercase(),
                json!({
                    "summary": format!("Guarded by idemproxy (route {})", route.name),
                    "parameters": [{"$ref": format!("#/components/parameters/{parameter}")}],
                    "responses": responses,
                }),
            );
        }
        paths.insert(route.path_prefix.clone(), Value::Object(operations));
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Idempotency contract",
            "version": version,
            "description": format!("What idemproxy promises on each guarded operation ({SPECIFICATION}). Each path is a prefix: the operations under it answer the same way."),
        },
        "paths": paths,
        "components": {
            "parameters": parameters,
            "schemas": {
                "IdempotencyProblem": {
                    "type": "object",
                    "description": "RFC 9457 problem details",
                    "required": ["type", "title", "status", "detail"],
                    "properties": {
                        "type": {"type": "string", "format": "uri"},
                        "title": {"type": "string"},
                        "status": {"type": "integer"},
                        "detail": {"type": "string"},
                        "operation": {"type": "string", "description": "on outcome-unknown: the operation's id"},
                        "reconciling": {"type": "boolean", "description": "on outcome-unknown: whether the proxy is asking the upstream"},
                        "reason": {"type": "string", "description": "on outcome-unknown: why (upstream-timeout, upstream-failed, response-too-large, over-budget, lease-expired, or unreadable: the recorded response cannot be opened)"},
                    },
                },
                "StripeError": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["type", "code", "message"],
                            "properties": {
                                "type": {"type": "string", "enum": ["idempotency_error", "invalid_request_error", "api_error"]},
                                "code": {"type": "string"},
                                "message": {"type": "string"},
                                "doc_url": {"type": "string", "format": "uri"},
                            },
                        },
                    },
                },
            },
        },
    })
}

/// A route name as an OpenAPI component name: its letters and digits, capitalised
/// at each break.
fn component_name(route: &str) -> String {
    route
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|part| !part.is_empty())
        .map(|part| part[..1].to_ascii_uppercase() + &part[1..])
        .collect()
}

/// A Markdown page of the contract, one section per guarded route, for an API portal.
pub fn markdown<'a>(routes: impl IntoIterator<Item = &'a Route>) -> String {
    let mut page = String::from("# Idempotency\n\n");
    page.push_str(&format!(
        "Requests that change something accept an idempotency key ([the IETF draft]({SPECIFICATION})). Send a unique key with each operation; if you are not sure it went through, send it again with the same key and the same request: you get the first answer again, marked `Idempotent-Replayed: true`, and the operation runs at most once.\n"
    ));
    for route in routes {
        let Some(policy) = route.idempotency.as_deref() else {
            continue;
        };
        let methods: Vec<&str> = policy.methods.iter().map(|method| method.as_str()).collect();
        page.push_str(&format!("\n## `{}` {}\n\n", methods.join(", "), route.path_prefix));
        page.push_str(&format!(
            "- Header: `{}`, {}.\n- A key is 1 to {MAX_KEY_LEN} visible ASCII characters, bare (`abc`) or quoted (`\"abc\"`, the same key); one field line.\n- A key lives {} from its first request; after that it is free again.\n",
            header_name(policy),
            if policy.required { "required" } else { "optional (without it, the request is not guarded)" },
            humantime::format_duration(policy.retention),
        ));
        page.push_str(&format!(
            "- The same key with a different request ({}) is refused.\n",
            covers(policy).join(", ")
        ));
        match policy.replay {
            ReplayKind::Stored => {}
            ReplayKind::Status => page.push_str(
                "- A retry of a completed request gets its status (and the fields the route keeps) again, with an empty body.\n",
            ),
            ReplayKind::Refetch => page.push_str(
                "- A retry of a completed request is answered by asking the API again for the operation's current state, with your retry's own credentials; the first answer's body is not kept.\n",
            ),
        }
        if !policy.wait_for_in_flight.is_zero() {
            page.push_str(&format!(
                "- A retry while the first request is in flight waits up to {} for its answer.\n",
                humantime::format_duration(policy.wait_for_in_flight)
            ));
        }
        if let Some(docs) = &route.docs_url {
            page.push_str(&format!("- Errors are documented at <{docs}>.\n"));
        }
        page.push_str("\n| status | problem | meaning |\n|---|---|---|\n");
        for (status, kind) in answers(policy) {
            page.push_str(&format!("| {status} | `{}` | {} |\n", kind.slug(), kind.row().meaning));
        }
    }
    page
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A route lists every guarded route's problem, and the conditional ones only where
    /// they can occur: `missing-idempotency-key` where the key is required,
    /// `unverified-scope` where a JWT scopes it; never one any request may get.
    #[test]
    fn a_route_lists_the_problems_it_can_answer_with() {
        let source = "[[route]]\nname = \"a\"\npath_prefix = \"/a\"\nupstream = \"http://127.0.0.1:9\"\n\
                      [route.idempotency]\nrequired = false\nprofile = \"stripe\"\n";
        let config = crate::Config::parse(source, std::path::Path::new("t.toml")).expect("a valid config");
        let policy = config.routes[0].idempotency.as_deref().expect("guarded");
        let listed: Vec<(u16, &str)> = answers(policy).map(|(status, kind)| (status, kind.slug())).collect();
        assert_eq!(listed.len(), 15, "{listed:?}");
        assert!(
            listed.contains(&(400, "idempotency-key-reused")),
            "Stripe's status: {listed:?}"
        );
        for absent in [
            "missing-idempotency-key",
            "unverified-scope",
            "no-route",
            "internal-error",
        ] {
            assert!(listed.iter().all(|(_, slug)| *slug != absent), "{absent}: {listed:?}");
        }
        // In shadow mode, only what a forwarded request can still get.
        let shadow = source.replace("required = false", "mode = \"shadow\"");
        let config = crate::Config::parse(&shadow, std::path::Path::new("t.toml")).expect("a valid config");
        let policy = config.routes[0].idempotency.as_deref().expect("guarded");
        let listed: Vec<&str> = answers(policy).map(|(_, kind)| kind.slug()).collect();
        assert_eq!(
            listed,
            [
                "request-body-incomplete",
                "upstream-unavailable",
                "upstream-timeout",
                "upstream-failed"
            ]
        );
    }

    /// Each route's replay mode is published in the document, the OpenAPI fragment and
    /// the Markdown page; `replay-unavailable` is listed only where a refetch can fail.
    #[test]
    fn the_contract_names_each_routes_replay_mode() {
        let route = |name: &str, policy: &str| {
            format!(
                "[[route]]\nname = \"{name}\"\npath_prefix = \"/{name}\"\nupstream = \"http://127.0.0.1:9\"\n[route.idempotency]\n{policy}"
            )
        };
        let source = [
            route("stored", ""),
            route(
                "status",
                "replay = \"status\"\nreplay_headers = [\"location\", \"x-id\"]\n",
            ),
            route(
                "refetch",
                "replay = \"refetch\"\nrefetch = { method = \"HEAD\", path = \"/ops/{record}\" }\n",
            ),
        ]
        .concat();
        let config = crate::Config::parse(&source, std::path::Path::new("t.toml")).expect("a valid config");
        let document = document(&config.routes);
        let replay = |index: usize| document["routes"][index]["replay"].clone();
        assert_eq!(replay(0)["mode"], "stored");
        assert_eq!(replay(0)["headers"], Value::Null);
        assert_eq!(replay(1)["mode"], "status");
        assert_eq!(replay(1)["headers"], json!(["location", "x-id"]));
        assert_eq!(replay(2)["mode"], "refetch");
        assert_eq!(replay(2)["refetch"], json!({"method": "HEAD", "path": "/ops/{record}"}));
        let slugs = |index: usize| -> Vec<String> {
            document["routes"][index]["responses"]
                .as_array()
                .expect("responses")
                .iter()
                .map(|answer| answer["problem"].as_str().unwrap_or_default().to_string())
                .collect()
        };
        assert!(!slugs(0).contains(&"replay-unavailable".to_string()));
        assert!(slugs(2).contains(&"replay-unavailable".to_string()));
        let openapi = openapi(&config.routes, "1").to_string();
        assert!(openapi.contains("Replay mode `refetch`"), "{openapi}");
        assert!(openapi.contains("Replay mode `status`"), "{openapi}");
        let page = markdown(&config.routes);
        assert!(page.contains("with an empty body"), "{page}");
        assert!(page.contains("asking the API again"), "{page}");
    }
}
