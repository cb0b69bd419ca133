//! A record's scope: the values that keep one client's records apart from another's,
//! from `scope_headers` (each header's values, as sent) and, with `scope_jwt`, the
//! verified claim (see `jwt`). One function turns a request into its scope, for the
//! proxy and the records API alike; `idempotency::store_key` hashes it. No I/O here.

use http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::jwt::ScopeClaim;

/// The scope of a request: the verified claim first, when the route has `scope_jwt`,
/// then every value of each of `scope_headers`, in order. `store_key` length-prefixes
/// every part, so no two different scopes meet. A string claim is one value (as it has
/// always been), a numeric claim two (`number` and its digits), so that `123` and
/// `"123"` never name the same scope.
pub fn values<'a>(
    headers: &'a HeaderMap,
    scope_headers: &[HeaderName],
    scope_claim: Option<&'a ScopeClaim>,
) -> Vec<Vec<&'a [u8]>> {
    let claim = scope_claim.map(|claim| match claim {
        ScopeClaim::String(value) => vec![value.as_bytes()],
        ScopeClaim::Number(value) => vec![b"number".as_slice(), value.as_bytes()],
    });
    claim
        .into_iter()
        .chain(
            scope_headers
                .iter()
                .map(|name| headers.get_all(name).iter().map(HeaderValue::as_bytes).collect()),
        )
        .collect()
}
