//! JSON-RPC and GraphQL routes (docs/design.md §28): one endpoint carries reads and
//! writes, and only some calls are guarded. `classify` reads a body already read
//! whole and says whether its call is guarded; `with_id` gives a recorded JSON-RPC
//! answer the id of the retry that reads it, every other byte as recorded. Nothing
//! here is guessed from text: a body is parsed as JSON, and a GraphQL document by
//! apollo-parser; what cannot be parsed is refused or passed as the route says.

use std::borrow::Cow;

use apollo_parser::cst;
use bytes::Bytes;
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;

use crate::config::{Calls, Unparsable};
use crate::error::CallError;

/// What a call on a JSON-RPC or GraphQL route is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    /// Guarded. On JSON-RPC, the call's `id`, `None` for a notification.
    Guarded { id: Option<CallId> },
    /// Forwarded unguarded, as a request with no key on a route that does not require
    /// one is.
    Passed,
}

/// A JSON-RPC call's `id`: its JSON text as sent, and where it stands in the body,
/// found once, when the call is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CallId {
    pub(crate) text: Bytes,
    at: (usize, usize),
}

impl CallId {
    /// The call's bytes without the id's value (the member's name and colon stay):
    /// what its fingerprint covers on a route that fingerprints bytes.
    pub(crate) fn without(&self, body: &[u8]) -> Vec<u8> {
        let (start, end) = self.at;
        match (body.get(..start), body.get(end..)) {
            (Some(before), Some(after)) => [before, after].concat(),
            _ => body.to_vec(),
        }
    }
}

/// What the guard reads of a JSON-RPC request: the rest (its params) is skipped, not
/// copied. `id` is `None` when absent (a notification), `Some("null")` when null.
#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(borrow, default)]
    jsonrpc: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    method: Option<Cow<'a, str>>,
    #[serde(borrow, default, deserialize_with = "present")]
    id: Option<&'a RawValue>,
}

/// A member that is there, `null` included.
fn present<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(deserializer).map(Some)
}

/// Whether the call in `body` is guarded on a route with `calls`.
pub(crate) fn classify(calls: &Calls, body: &[u8]) -> Result<Call, CallError> {
    let batch = body.iter().find(|byte| !byte.is_ascii_whitespace()) == Some(&b'[');
    match calls {
        Calls::JsonRpc { methods } if batch => {
            let calls: Vec<Envelope> = serde_json::from_slice(body).map_err(|_| CallError::NotJsonRpc)?;
            for call in &calls {
                if guarded(methods, call)? {
                    return Err(CallError::GuardedInBatch);
                }
            }
            Ok(Call::Passed)
        }
        Calls::JsonRpc { methods } => {
            let call: Envelope = serde_json::from_slice(body).map_err(|_| CallError::NotJsonRpc)?;
            if !guarded(methods, &call)? {
                return Ok(Call::Passed);
            }
            let id = call.id.map(|id| id.get().as_bytes()).and_then(|text| {
                let at = within(body, text)?;
                Some(CallId {
                    text: Bytes::copy_from_slice(text),
                    at,
                })
            });
            Ok(Call::Guarded { id })
        }
        Calls::GraphQl { unparsable } if batch => {
            let operations: Vec<GraphQlRequest> =
                serde_json::from_slice(body).map_err(|_| CallError::GraphQl("the body is not JSON"))?;
            for operation in &operations {
                if graphql(operation, *unparsable)? != Call::Passed {
                    return Err(CallError::MutationInBatch);
                }
            }
            Ok(Call::Passed)
        }
        Calls::GraphQl { unparsable } => match serde_json::from_slice::<GraphQlRequest>(body) {
            Ok(operation) => graphql(&operation, *unparsable),
            Err(_) => unreadable(*unparsable, "the body is not JSON with a \"query\" string"),
        },
    }
}

/// Where `part`, a slice of `text` (a borrowed raw value of it), starts and ends in it.
fn within(text: &[u8], part: &[u8]) -> Option<(usize, usize)> {
    let start = (part.as_ptr() as usize).checked_sub(text.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (text.get(start..end)? == part).then_some((start, end))
}

/// Whether a JSON-RPC 2.0 call is to one of `methods`, once checked to be one.
fn guarded(methods: &[String], call: &Envelope) -> Result<bool, CallError> {
    match (call.jsonrpc.as_deref(), call.method.as_deref()) {
        (Some("2.0"), Some(method)) => Ok(methods.iter().any(|listed| listed == method)),
        _ => Err(CallError::NotJsonRpc),
    }
}

/// A GraphQL request over HTTP, as its JSON body says it.
#[derive(Deserialize)]
struct GraphQlRequest {
    query: String,
    #[serde(rename = "operationName", default)]
    operation_name: Option<String>,
}

/// What an operation that cannot be told gets on a route that says `unparsable`.
fn unreadable(unparsable: Unparsable, why: &'static str) -> Result<Call, CallError> {
    match unparsable {
        Unparsable::Refuse => Err(CallError::GraphQl(why)),
        Unparsable::Pass => Ok(Call::Passed),
    }
}

/// A mutation is guarded; a query or a subscription passes. The operation is the one
/// `operationName` names, or the document's only one.
fn graphql(request: &GraphQlRequest, unparsable: Unparsable) -> Result<Call, CallError> {
    let tree = apollo_parser::Parser::new(&request.query).parse();
    if tree.errors().next().is_some() {
        return unreadable(unparsable, "the document does not parse");
    }
    let operations: Vec<cst::OperationDefinition> = tree
        .document()
        .definitions()
        .filter_map(|definition| match definition {
            cst::Definition::OperationDefinition(operation) => Some(operation),
            _ => None,
        })
        .collect();
    let chosen = match &request.operation_name {
        Some(name) => operations
            .iter()
            .find(|operation| operation.name().is_some_and(|named| named.text() == name.as_str())),
        None if operations.len() == 1 => operations.first(),
        None => None,
    };
    let Some(operation) = chosen else {
        return unreadable(
            unparsable,
            "no operation has the operationName, or the document has several and no operationName",
        );
    };
    let mutation = operation
        .operation_type()
        .is_some_and(|kind| kind.mutation_token().is_some());
    Ok(if mutation {
        Call::Guarded { id: None }
    } else {
        Call::Passed
    })
}

/// A recorded JSON-RPC answer as the retry whose call's id is `id` gets it: the
/// answer's `id` member replaced by `id`, every other byte as recorded. In a
/// `text/event-stream` answer, each event's `data` that is a JSON-RPC answer is; the
/// server's own requests and notifications in it (they have a `method`) keep theirs.
/// A body that is no JSON-RPC answer (an HTML error page) is returned as it is.
pub(crate) fn with_id(body: &Bytes, event_stream: bool, id: &[u8]) -> Bytes {
    if !event_stream {
        return splice(body, id).map_or_else(|| body.clone(), Bytes::from);
    }
    let mut out = Vec::with_capacity(body.len() + 16);
    let mut changed = false;
    for line in body.split_inclusive(|byte| *byte == b'\n') {
        let data = line
            .strip_prefix(b"data:")
            .map(|rest| rest.strip_prefix(b" ").unwrap_or(rest));
        let spliced = data.and_then(|data| {
            let end = data.len()
                - data
                    .iter()
                    .rev()
                    .take_while(|byte| **byte == b'\n' || **byte == b'\r')
                    .count();
            splice(&data[..end], id).map(|json| (line.len() - data.len(), json, &data[end..]))
        });
        match spliced {
            Some((prefix, json, ending)) => {
                out.extend_from_slice(&line[..prefix]);
                out.extend_from_slice(&json);
                out.extend_from_slice(ending);
                changed = true;
            }
            None => out.extend_from_slice(line),
        }
    }
    if changed { Bytes::from(out) } else { body.clone() }
}

/// What `splice` reads of a recorded message: which members it has (their values
/// skipped, not copied), and its `id` as recorded.
#[derive(Deserialize)]
struct Answer<'a> {
    #[serde(default, deserialize_with = "seen")]
    jsonrpc: bool,
    #[serde(default, deserialize_with = "seen")]
    method: bool,
    #[serde(default, deserialize_with = "seen")]
    result: bool,
    #[serde(default, deserialize_with = "seen")]
    error: bool,
    #[serde(borrow, default, deserialize_with = "present")]
    id: Option<&'a RawValue>,
}

/// Whether a member is there (`null` included), its value skipped.
fn seen<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<bool, D::Error> {
    IgnoredAny::deserialize(deserializer).map(|_| true)
}

/// `text` with its top-level `id` replaced by `id`, if it is a JSON-RPC answer: an
/// object with `jsonrpc`, an `id`, a `result` or an `error`, and no `method`.
fn splice(text: &[u8], id: &[u8]) -> Option<Vec<u8>> {
    let message: Answer = serde_json::from_slice(text).ok()?;
    let answer = message.jsonrpc && !message.method && (message.result || message.error);
    if !answer {
        return None;
    }
    let old = message.id?.get().as_bytes();
    let (start, end) = within(text, old)?;
    let mut out = Vec::with_capacity(text.len() - old.len() + id.len());
    out.extend_from_slice(&text[..start]);
    out.extend_from_slice(id);
    out.extend_from_slice(&text[end..]);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rpc() -> Calls {
        Calls::JsonRpc {
            methods: vec!["tools/call".into()],
        }
    }

    fn gql(unparsable: Unparsable) -> Calls {
        Calls::GraphQl { unparsable }
    }

    /// The id `classify` read of a guarded call, as sent.
    fn id(result: Result<Call, CallError>) -> Option<Bytes> {
        match result {
            Ok(Call::Guarded { id }) => id.map(|id| id.text),
            other => panic!("not guarded: {other:?}"),
        }
    }

    /// A guarded call's bytes as its fingerprint reads them.
    fn without_id(body: &[u8]) -> Option<Vec<u8>> {
        match classify(&rpc(), body) {
            Ok(Call::Guarded { id }) => id.map(|id| id.without(body)),
            other => panic!("not guarded: {other:?}"),
        }
    }

    #[test]
    fn only_the_listed_methods_are_guarded() {
        let call = br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{}}"#;
        assert_eq!(id(classify(&rpc(), call)), Some(Bytes::from_static(b"7")));
        let list = br#"{"jsonrpc":"2.0","id":"a","method":"tools/list"}"#;
        assert_eq!(classify(&rpc(), list), Ok(Call::Passed));
        let notification = br#"{"jsonrpc":"2.0","method":"tools/call"}"#;
        assert_eq!(classify(&rpc(), notification), Ok(Call::Guarded { id: None }));
        let escaped = br#"{"jsonrpc":"2.0","id":null,"method":"tools\/call"}"#;
        assert_eq!(id(classify(&rpc(), escaped)), Some(Bytes::from_static(b"null")));
        for bad in [
            &b"{}"[..],
            b"[1]",
            b"not json",
            br#"{"jsonrpc":"1.0","method":"tools/call"}"#,
        ] {
            assert_eq!(classify(&rpc(), bad), Err(CallError::NotJsonRpc), "{bad:?}");
        }
        let mixed =
            br#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"},{"jsonrpc":"2.0","id":2,"method":"tools/call"}]"#;
        assert_eq!(classify(&rpc(), mixed), Err(CallError::GuardedInBatch));
        let reads = br#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"},{"jsonrpc":"2.0","method":"ping"}]"#;
        assert_eq!(classify(&rpc(), reads), Ok(Call::Passed));
    }

    #[test]
    fn only_mutations_are_guarded_and_the_operation_name_chooses() {
        let body =
            |query: &str, name: Option<&str>| serde_json::json!({"query": query, "operationName": name}).to_string();
        let refuse = gql(Unparsable::Refuse);
        let guarded = Call::Guarded { id: None };
        assert_eq!(
            classify(&refuse, body("{ me { id } }", None).as_bytes()),
            Ok(Call::Passed)
        );
        assert_eq!(
            classify(&refuse, body("query Q { me { id } }", None).as_bytes()),
            Ok(Call::Passed)
        );
        assert_eq!(
            classify(&refuse, body("subscription S { ticks }", None).as_bytes()),
            Ok(Call::Passed)
        );
        assert_eq!(
            classify(&refuse, body("mutation M { pay(amount: 5) { id } }", None).as_bytes()),
            Ok(guarded.clone())
        );
        // A mutation named in a comment or a string is still a query.
        let sly = r#"query Q { search(text: "mutation { pay }") { id } } # mutation"#;
        assert_eq!(classify(&refuse, body(sly, None).as_bytes()), Ok(Call::Passed));
        let two = "query Read { me { id } } mutation Pay { pay(amount: 5) { id } }";
        assert_eq!(
            classify(&refuse, body(two, Some("Pay")).as_bytes()),
            Ok(guarded.clone())
        );
        assert_eq!(classify(&refuse, body(two, Some("Read")).as_bytes()), Ok(Call::Passed));
        assert!(
            classify(&refuse, body(two, None).as_bytes()).is_err(),
            "two operations, no name"
        );
        assert!(classify(&refuse, body(two, Some("Other")).as_bytes()).is_err());
        assert!(classify(&refuse, body("mutation { pay(", None).as_bytes()).is_err());
        assert_eq!(
            classify(&gql(Unparsable::Pass), body("mutation { pay(", None).as_bytes()),
            Ok(Call::Passed)
        );
        let batch = format!(
            "[{},{}]",
            body("{ me { id } }", None),
            body("mutation { pay { id } }", None)
        );
        assert_eq!(classify(&refuse, batch.as_bytes()), Err(CallError::MutationInBatch));
    }

    #[test]
    fn a_calls_fingerprinted_bytes_leave_out_its_id_only() {
        let first = without_id(br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"id":1}}"#);
        let retry = without_id(br#"{"jsonrpc":"2.0","id":"retry-8","method":"tools/call","params":{"id":1}}"#);
        assert_eq!(first, retry);
        assert_eq!(
            first.as_deref(),
            Some(&br#"{"jsonrpc":"2.0","id":,"method":"tools/call","params":{"id":1}}"#[..])
        );
        let other = without_id(br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"id":2}}"#);
        assert_ne!(first, other, "the params count");
        assert_eq!(without_id(br#"{"jsonrpc":"2.0","method":"tools/call"}"#), None);
    }

    #[test]
    fn a_replay_gets_the_retrys_id_and_every_other_byte_as_recorded() {
        let null = Bytes::from_static(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":null}");
        assert_eq!(
            with_id(&null, false, b"3"),
            Bytes::from_static(b"{\"jsonrpc\":\"2.0\",\"id\":3,\"result\":null}")
        );
        let recorded = Bytes::from_static(b"{\"jsonrpc\":\"2.0\",  \"result\":{\"id\":1,\"n\":2.50},\"id\":1}");
        assert_eq!(
            with_id(&recorded, false, b"\"retry-2\""),
            Bytes::from_static(b"{\"jsonrpc\":\"2.0\",  \"result\":{\"id\":1,\"n\":2.50},\"id\":\"retry-2\"}")
        );
        let not_rpc = Bytes::from_static(b"{\"id\":\"pay_1\",\"status\":\"ok\"}");
        assert_eq!(
            with_id(&not_rpc, false, b"9"),
            not_rpc,
            "a resource's id is not a call's"
        );
        let stream = Bytes::from_static(
            b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"id\":40}\n\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\r\n\r\n",
        );
        assert_eq!(
            with_id(&stream, true, b"2"),
            Bytes::from_static(
                b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"id\":40}\n\ndata: {\"jsonrpc\":\"2.0\",\"id\":2,\"result\":{}}\r\n\r\n"
            )
        );
    }
}
