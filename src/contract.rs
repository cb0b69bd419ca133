//! The published idempotency contract (docs/design.md §15): what a client of each guarded route
//! may rely on (its key rules, how long a key lives, what the fingerprint covers, every
//! status and problem it can answer with), as the `/.well-known/idempotency` document,
//! an OpenAPI 3.1 fragment, and a Markdown page for an API portal. Made from the
//! validated config alone: pure, no I/O.

use serde_json::{Value, json};

use crate::config::{
    Calls, FingerprintBody, IdempotencyPolicy, KeySource, Mode, Profile, ReplayKind, Route, StreamMode, Unparsable,
    UpstreamKey,
};
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
        "header": has_header_source(policy).then(|| header_name(policy)),
        "required": policy.required,
        "key": {
            "sources": policy.key.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "sources_meaning": "the first source the request carries gives its key; header:NAME a header field, json:/pointer a value in the JSON body (a string as it is, any other value by its canonical form; json:/a&/b several values as one key), form:NAME a field of a form body, query:NAME a query parameter, body no key at all (the request itself, within dedup_window_seconds)",
            "dedup_window_seconds": policy.dedup_window.map(|window| window.as_secs()),
            "min_length": 1,
            "max_length": MAX_KEY_LEN,
            "characters": "visible ASCII (0x21 to 0x7E)",
            "forms": ["a bare token: abc", "an RFC 8941 string: \"abc\" (the same key)"],
            "repeated": "refused: one field line, one key",
        },
        "retention_seconds": policy.retention.as_secs(),
        "remember_seconds": policy.remember.as_secs(),
        "expiry": expiry(policy),
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
        "stream": {
            "mode": policy.stream.as_str(),
            "meaning": streaming(policy),
        },
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
            "expires_header": "Idempotency-Expires",
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
        "calls": calls(policy),
        "cors": cors(route),
    })
}

/// Which calls a JSON-RPC or GraphQL route guards (`null` on another route).
fn calls(policy: &IdempotencyPolicy) -> Value {
    match &policy.calls {
        None => Value::Null,
        Some(Calls::JsonRpc { methods }) => json!({
            "protocol": "jsonrpc",
            "guarded_methods": methods,
            "meaning": "only calls to these methods are guarded, every other call passes unguarded; the fingerprint is the call without its id; a replay is the recorded answer with the retry's id; the proxy's own refusals are JSON-RPC error objects (code -32600 for call-unreadable, -32000 otherwise) with the HTTP status of the problem and its fields, slug included, in error.data; a batch that holds a guarded call is refused (call-unreadable)",
        }),
        Some(Calls::GraphQl { unparsable }) => json!({
            "protocol": "graphql",
            "guarded_operations": "mutation",
            "unparsable": match unparsable {
                Unparsable::Refuse => "refuse",
                Unparsable::Pass => "pass",
            },
            "meaning": "only a mutation (the operation operationName names, or the document's only one) is guarded; queries and subscriptions pass unguarded; a batch that holds a mutation is refused (call-unreadable)",
        }),
    }
}

/// The origins whose preflights the route answers (`null` without `[route.cors]`).
fn cors(route: &Route) -> Value {
    let Some(cors) = &route.cors else {
        return Value::Null;
    };
    json!({
        "allow_origins": cors.origins.clone().unwrap_or_else(|| vec!["*".to_string()]),
        "allow_credentials": cors.credentials,
        "allow_headers": cors.headers.to_str().unwrap_or_default(),
        "expose_headers": ["Idempotent-Replayed", "Idempotency-Expires", "Idempotency-Reconciled", "Retry-After"],
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
    let jsonrpc = matches!(policy.calls, Some(Calls::JsonRpc { .. }));
    covers.push(match policy.fingerprint_body {
        FingerprintBody::Bytes if jsonrpc => "body bytes, without the call's id".into(),
        FingerprintBody::Bytes => "body bytes".into(),
        FingerprintBody::Json { .. } => "body, as canonical JSON (bytes when it is not JSON)".into(),
    });
    covers
}

/// Whether a client may send its key in a header on the route.
fn has_header_source(policy: &IdempotencyPolicy) -> bool {
    policy.key.iter().any(|source| matches!(source, KeySource::Header(_)))
}

/// The header's name as the config spells it canonically (`Idempotency-Key`).
fn header_name(policy: &IdempotencyPolicy) -> String {
    canonical_header(policy.header.as_str())
}

/// A header name with each part capitalised, as specs write it.
fn canonical_header(name: &str) -> String {
    name.split('-')
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
            Listed::WhenCalls => policy.calls.is_some(),
            Listed::WhenRemembered => {
                policy.remember > policy.retention && policy.replay != crate::config::ReplayKind::Refetch
            }
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
        let inputs = key_inputs(route, policy);
        let references: Vec<Value> = inputs
            .parameters
            .iter()
            .map(|(name, _)| json!({"$ref": format!("#/components/parameters/{name}")}))
            .collect();
        parameters.extend(inputs.parameters);
        let jsonrpc = matches!(policy.calls, Some(Calls::JsonRpc { .. }));
        let schema = match policy.profile {
            _ if jsonrpc => "#/components/schemas/JsonRpcError",
            Profile::Ietf => "#/components/schemas/IdempotencyProblem",
            Profile::Stripe => "#/components/schemas/StripeError",
        };
        let media = match policy.profile {
            Profile::Ietf if !jsonrpc => "application/problem+json",
            _ => "application/json",
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
                    "Idempotency-Expires": {
                        "description": format!(
                            "On a recorded response and every replay of it: when its replays stop (an HTTP date, the first request's time plus {} s){}.",
                            policy.retention.as_secs(),
                            match policy.remember > policy.retention && policy.replay != ReplayKind::Refetch {
                                true => format!("; until {} s from it, the same request then gets 410 response-expired", policy.remember.as_secs()),
                                false => String::new(),
                            }
                        ),
                        "schema": {"type": "string"},
                    },
                },
            }),
        );
        let mut operations = serde_json::Map::new();
        for method in &policy.methods {
            let mut operation = json!({
                "summary": format!("Guarded by idemproxy (route {})", route.name),
                "description": inputs.description,
                "parameters": references,
                "responses": responses,
            });
            if let Some(body) = &inputs.request_body {
                operation["requestBody"] = body.clone();
            }
            if policy.calls.is_some() {
                operation["x-idemproxy-calls"] = calls(policy);
            }
            if route.cors.is_some() {
                operation["x-idemproxy-cors"] = cors(route);
            }
            operations.insert(method.as_str().to_ascii_lowercase(), operation);
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
                        "reason": {"type": "string", "description": "on outcome-unknown: why (upstream-timeout, upstream-failed, response-too-large, over-budget, stream-broken, lease-expired, moved-in-flight: in flight in the store it was copied from, or unreadable: the recorded response cannot be opened)"},
                    },
                },
                "JsonRpcError": {
                    "type": "object",
                    "description": "On a JSON-RPC route: a JSON-RPC 2.0 error response in the call's id, the problem's fields (slug included) in error.data",
                    "required": ["jsonrpc", "id", "error"],
                    "properties": {
                        "jsonrpc": {"type": "string", "enum": ["2.0"]},
                        "id": {"type": ["string", "number", "null"]},
                        "error": {
                            "type": "object",
                            "required": ["code", "message", "data"],
                            "properties": {
                                "code": {"type": "integer", "enum": [-32600, -32000]},
                                "message": {"type": "string"},
                                "data": {"type": "object", "required": ["slug"], "properties": {"slug": {"type": "string"}}},
                            },
                        },
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

/// How long a route's key and its response last, in words (docs/design.md §24).
fn expiry(policy: &IdempotencyPolicy) -> String {
    let retention = humantime::format_duration(policy.retention);
    if policy.replay == ReplayKind::Refetch || policy.remember <= policy.retention {
        let horizon = humantime::format_duration(policy.remember.max(policy.retention));
        return format!(
            "A key lives {horizon} from its first request (its answer replayed until then, as Idempotency-Expires says); after that it is free, and a request with it runs as new."
        );
    }
    format!(
        "A key's answer is replayed for {retention} from its first request (Idempotency-Expires says until when); the key is remembered for {} from it: in between, the same request gets 410 response-expired (naming when the operation completed and its status) and is never run again, another request with the key 422. After that it is free, and a request with it runs as new.",
        humantime::format_duration(policy.remember)
    )
}

/// Which responses a route streams, and what a retry then sees, in words
/// (docs/design.md §25).
fn streaming(policy: &IdempotencyPolicy) -> String {
    let which = match policy.stream {
        StreamMode::Never => {
            return "Every response is read whole, recorded, then sent with its length.".to_string();
        }
        StreamMode::Auto => "A text/event-stream response, and one with no Content-Length,",
        StreamMode::Always => "Every response",
    };
    let joins = match policy.wait_for_in_flight.is_zero() || policy.replay != ReplayKind::Stored {
        true => "a retry while it streams gets 409 request-in-progress",
        false => "a retry while it streams (on the same instance) joins it: the events so far, then the rest live",
    };
    format!(
        "{which} reaches the first client as the upstream sends it and is recorded as it passes; {joins}; a retry after it ends gets the recorded body byte for byte (chunk timing is not kept). A stream that breaks, or passes {} bytes, is never replayed: its key's outcome is unknown (409).",
        policy.max_response_body_bytes
    )
}

/// Where a client sends its key on one route, as OpenAPI says it.
struct KeyInputs {
    /// A component parameter for each `header:` and `query:` source, by its name.
    parameters: Vec<(String, Value)>,
    /// The fields of the `json:` and `form:` sources, as the request body's schema.
    request_body: Option<Value>,
    /// The sources in words, `body` included, which has no field at all.
    description: String,
}

/// The route's key sources as OpenAPI inputs. A key the route requires is marked
/// required only where it has one source: OpenAPI cannot say "one of these".
fn key_inputs(route: &Route, policy: &IdempotencyPolicy) -> KeyInputs {
    let required = policy.required && policy.key.len() == 1;
    let retention = policy.retention.as_secs();
    let remembered = match policy.remember > policy.retention && policy.replay != ReplayKind::Refetch {
        true => format!(
            " After that, until {} seconds, it gets 410 response-expired and never runs again.",
            policy.remember.as_secs()
        ),
        false => String::new(),
    };
    let meaning = format!(
        "A unique key per operation: a retry with the same key and the same request gets the first answer again (with Idempotent-Replayed: true, and Idempotency-Expires saying until when) for {retention} seconds.{remembered}"
    );
    let token = json!({"type": "string", "minLength": 1, "maxLength": MAX_KEY_LEN, "pattern": "^[\\x21-\\x7E]+$"});
    let mut parameters = Vec::new();
    let mut json_body = json!({"type": "object"});
    let mut form_body = json!({"type": "object"});
    let (mut json_fields, mut form_fields) = (false, false);
    for source in &policy.key {
        let (name, place) = match source {
            KeySource::Header(name) => (canonical_header(name.as_str()), "header"),
            KeySource::Query(name) => (name.clone(), "query"),
            KeySource::Json(pointers) => {
                let value = json!({
                    "description": format!("{meaning} A string is the key as it is; any other JSON value is the key by its canonical form."),
                    "anyOf": [token, {"type": ["number", "boolean", "object", "array"]}],
                });
                for pointer in pointers {
                    json_fields |= add_property(&mut json_body, pointer.tokens(), &value, required);
                }
                continue;
            }
            KeySource::Form(name) => {
                let value = json!({"description": meaning, "allOf": [token]});
                form_fields |= add_property(&mut form_body, std::slice::from_ref(name), &value, required);
                continue;
            }
            KeySource::Body => continue,
        };
        let suffix = match parameters.len() {
            0 => String::new(),
            count => (count + 1).to_string(),
        };
        parameters.push((
            format!("{}IdempotencyKey{suffix}", component_name(&route.name)),
            json!({
                "name": name,
                "in": place,
                "required": required,
                "description": meaning,
                "schema": token,
            }),
        ));
    }
    let mut content = serde_json::Map::new();
    if json_fields {
        content.insert("application/json".into(), json!({"schema": json_body}));
    }
    if form_fields {
        content.insert("application/x-www-form-urlencoded".into(), json!({"schema": form_body}));
    }
    let mut description = format!(
        "The idempotency key is taken from the first of {} that the request carries{}.",
        crate::config::key::describe(&policy.key),
        if policy.required { "; one is required" } else { "" },
    );
    if let Some(window) = policy.dedup_window {
        description.push_str(&format!(
            " A request with none of them is keyed by itself: an identical request within {} seconds is the same operation and gets the first answer again.",
            window.as_secs()
        ));
    }
    KeyInputs {
        parameters,
        request_body: (!content.is_empty()).then(|| json!({"required": required, "content": content})),
        description,
    }
}

/// Adds the field at `tokens` (a JSON pointer's) to an object schema, nesting objects
/// on the way. A pointer through an array index is left to the description: the schema
/// cannot tell an index from a name. Returns whether the field was added.
fn add_property(schema: &mut Value, tokens: &[String], leaf: &Value, required: bool) -> bool {
    let Some((first, rest)) = tokens.split_first() else {
        return false;
    };
    if first == "-" || (!first.is_empty() && first.bytes().all(|byte| byte.is_ascii_digit())) {
        return false;
    }
    if required {
        let mut names = schema["required"]
            .as_array_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        if !names.iter().any(|name| name == first) {
            names.push(Value::String(first.clone()));
        }
        schema["required"] = Value::Array(names);
    }
    let property = &mut schema["properties"][first.as_str()];
    if rest.is_empty() {
        *property = leaf.clone();
        return true;
    }
    if property.is_null() {
        *property = json!({"type": "object"});
    }
    add_property(property, rest, leaf, required)
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
        let required = match (policy.required, policy.dedup_window) {
            (_, Some(_)) => "or without one, the request itself (below)",
            (true, None) => "required",
            (false, None) => "optional (without it, the request is not guarded)",
        };
        if policy.key_is_one_header() {
            page.push_str(&format!("- Header: `{}`, {required}.\n", header_name(policy)));
        } else {
            let sources: Vec<String> = policy.key.iter().map(|source| format!("`{source}`")).collect();
            page.push_str(&format!(
                "- Key: the first of {} the request carries, {required}. A JSON value that is not a string is the key by its canonical form.\n",
                sources.join(", ")
            ));
        }
        page.push_str(&format!(
            "- A key is 1 to {MAX_KEY_LEN} visible ASCII characters; in a header, bare (`abc`) or quoted (`\"abc\"`, the same key), one field line.\n- {}\n",
            expiry(policy),
        ));
        page.push_str(&format!("- Streaming: {}\n", streaming(policy)));
        if let Some(window) = policy.dedup_window {
            page.push_str(&format!(
                "- A request with no key is keyed by itself: an identical request within {} is the same operation and gets the first answer again (a second identical payment in that time is not made).\n",
                humantime::format_duration(window)
            ));
        }
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
        match &policy.calls {
            None => {}
            Some(Calls::JsonRpc { methods }) => {
                let methods: Vec<String> = methods.iter().map(|method| format!("`{method}`")).collect();
                page.push_str(&format!(
                    "- JSON-RPC 2.0: only calls to {} are guarded; other calls need no key. A retry may carry a new `id`: its replay answers with it. Errors are JSON-RPC error objects, the problem's `slug` in `error.data`; a batch must not hold a guarded call.\n",
                    methods.join(", ")
                ));
            }
            Some(Calls::GraphQl { .. }) => page.push_str(
                "- GraphQL: only mutations are guarded (the operation `operationName` names, or the only one); queries and subscriptions need no key.\n",
            ),
        }
        if let Some(cors) = &route.cors {
            let origins = cors.origins.clone().unwrap_or_else(|| vec!["*".to_string()]);
            page.push_str(&format!(
                "- Browsers: preflights from {} are answered, allowing `{}`; `Idempotent-Replayed` and `Idempotency-Expires` are exposed.\n",
                origins.iter().map(|origin| format!("`{origin}`")).collect::<Vec<_>>().join(", "),
                header_name(policy)
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
    /// Each route's JSON-RPC methods or GraphQL mode and its CORS origins are in the
    /// contract, the OpenAPI document and the page; a JSON-RPC route's problems are
    /// JSON-RPC errors there, and it lists `call-unreadable`.
    #[test]
    fn the_contract_names_each_routes_calls_and_origins() {
        let source = concat!(
            "[[route]]\nname = \"mcp\"\npath_prefix = \"/mcp\"\nupstream = \"http://127.0.0.1:9\"\n",
            "[route.idempotency]\njsonrpc_methods = [\"tools/call\"]\n",
            "[route.cors]\nallow_origins = [\"https://app.example.com\"]\n",
            "[[route]]\nname = \"gql\"\npath_prefix = \"/graphql\"\nupstream = \"http://127.0.0.1:9\"\n",
            "[route.idempotency]\ngraphql = \"mutations\"\ngraphql_unparsable = \"pass\"\n",
            "[[route]]\nname = \"plain\"\npath_prefix = \"/plain\"\nupstream = \"http://127.0.0.1:9\"\n",
            "[route.idempotency]\n",
        );
        let config = crate::Config::parse(source, std::path::Path::new("t.toml")).expect("a valid config");
        let document = document(&config.routes);
        let routes = &document["routes"];
        assert_eq!(routes[0]["calls"]["guarded_methods"], json!(["tools/call"]));
        assert_eq!(routes[0]["cors"]["allow_origins"], json!(["https://app.example.com"]));
        assert!(
            routes[0]["fingerprint"]["covers"]
                .to_string()
                .contains("without the call's id"),
            "{}",
            routes[0]
        );
        let slugs = |route: &Value| -> Vec<String> {
            route["responses"]
                .as_array()
                .expect("responses")
                .iter()
                .filter_map(|response| response["problem"].as_str().map(String::from))
                .collect()
        };
        assert!(
            slugs(&routes[0]).contains(&"call-unreadable".to_string()),
            "{:?}",
            slugs(&routes[0])
        );
        assert_eq!(routes[1]["calls"]["protocol"], "graphql");
        assert_eq!(routes[1]["calls"]["unparsable"], "pass");
        assert_eq!((&routes[2]["calls"], &routes[2]["cors"]), (&Value::Null, &Value::Null));
        assert!(
            !slugs(&routes[2]).contains(&"call-unreadable".to_string()),
            "{:?}",
            slugs(&routes[2])
        );

        let openapi = openapi(&config.routes, "test");
        let post = &openapi["paths"]["/mcp"]["post"];
        assert_eq!(post["x-idemproxy-calls"]["guarded_methods"], json!(["tools/call"]));
        assert_eq!(
            post["x-idemproxy-cors"]["allow_origins"],
            json!(["https://app.example.com"])
        );
        assert_eq!(
            post["responses"]["409"]["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/JsonRpcError"
        );
        assert!(openapi["paths"]["/plain"]["post"].get("x-idemproxy-calls").is_none());

        let page = markdown(&config.routes);
        assert!(page.contains("only calls to `tools/call` are guarded"), "{page}");
        assert!(page.contains("preflights from `https://app.example.com`"), "{page}");
        assert!(page.contains("GraphQL: only mutations are guarded"), "{page}");
    }

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

    /// Each route's key sources are published: in the document, as OpenAPI inputs (a
    /// header or query parameter, a request-body property, nested for a deep pointer),
    /// and on the page; a route that takes no header has no `header`.
    #[test]
    fn the_contract_names_each_routes_key_sources() {
        let route = |name: &str, policy: &str| {
            format!(
                "[[route]]\nname = \"{name}\"\npath_prefix = \"/{name}\"\nupstream = \"http://127.0.0.1:9\"\n[route.idempotency]\n{policy}\n"
            )
        };
        let source = [
            route("plain", ""),
            route(
                "mixed",
                "key = [\"header:X-Request-Id\", \"query:request_id\", \"form:ref\", \"body\"]\ndedup_window = \"10m\"\nscope_headers = [\"authorization\"]",
            ),
            route("orders", "key = [\"json:/tenant&/order/id\"]\nrequired = true"),
        ]
        .concat();
        let config = crate::Config::parse(&source, std::path::Path::new("t.toml")).expect("a valid config");
        let document = document(&config.routes);
        let key = |index: usize| document["routes"][index]["key"].clone();
        assert_eq!(key(0)["sources"], json!(["header:idempotency-key"]));
        assert_eq!(document["routes"][0]["header"], "Idempotency-Key");
        assert_eq!(
            key(1)["sources"],
            json!(["header:x-request-id", "query:request_id", "form:ref", "body"])
        );
        assert_eq!(key(1)["dedup_window_seconds"], 600);
        assert_eq!(document["routes"][1]["header"], "X-Request-Id");
        assert_eq!(key(2)["sources"], json!(["json:/tenant&/order/id"]));
        assert_eq!(document["routes"][2]["header"], Value::Null, "no header source");

        let openapi = openapi(&config.routes, "1");
        let component = |name: &str| openapi["components"]["parameters"][name].clone();
        assert_eq!(component("PlainIdempotencyKey")["in"], "header");
        assert_eq!(component("PlainIdempotencyKey")["required"], true);
        assert_eq!(component("MixedIdempotencyKey")["name"], "X-Request-Id");
        assert_eq!(component("MixedIdempotencyKey2")["in"], "query");
        assert_eq!(component("MixedIdempotencyKey2")["name"], "request_id");
        assert_eq!(
            component("MixedIdempotencyKey")["required"],
            false,
            "one of several sources: none alone is required"
        );
        let mixed = &openapi["paths"]["/mixed"]["post"];
        assert_eq!(mixed["parameters"].as_array().map(Vec::len), Some(2));
        let form = &mixed["requestBody"]["content"]["application/x-www-form-urlencoded"]["schema"];
        assert_eq!(form["properties"]["ref"]["allOf"][0]["maxLength"], MAX_KEY_LEN);
        assert!(
            mixed["description"]
                .as_str()
                .is_some_and(|text| text.contains("within 600 seconds")),
            "{mixed}"
        );
        let orders = &openapi["paths"]["/orders"]["post"];
        assert_eq!(orders["parameters"], json!([]), "no header parameter");
        assert_eq!(orders["requestBody"]["required"], true);
        let body = &orders["requestBody"]["content"]["application/json"]["schema"];
        assert_eq!(body["required"], json!(["tenant", "order"]));
        assert_eq!(body["properties"]["order"]["required"], json!(["id"]));
        assert!(
            body["properties"]["order"]["properties"]["id"]["anyOf"].is_array(),
            "{body}"
        );
        assert!(body["properties"]["tenant"]["anyOf"].is_array(), "{body}");

        let page = markdown(&config.routes);
        assert!(page.contains("- Header: `Idempotency-Key`, required."), "{page}");
        assert!(
            page.contains("- Key: the first of `header:x-request-id`, `query:request_id`, `form:ref`, `body`"),
            "{page}"
        );
        assert!(page.contains("within 10m is the same operation"), "{page}");
        assert!(
            page.contains("- Key: the first of `json:/tenant&/order/id` the request carries, required."),
            "{page}"
        );
    }
}
