//! A retry on a `replay = "refetch"` route (docs/design.md §20): its record keeps no
//! body, so the retry is answered by asking the upstream for the operation's current
//! state with `refetch`'s method and path, the retrying request's own headers (its
//! credentials, so the upstream authorises the replay again) and no body. A refetch
//! never runs the operation: one that fails answers 503 `replay-unavailable`.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response};
use http_body_util::BodyExt;

use super::send::send_within;
use super::{Answer, Guarded, Handled, Prepared, Proxy};
use crate::body::{StreamedBody, full};
use crate::error::{Outcome, Rejection, UpstreamError};
use crate::record::IDEMPOTENT_REPLAYED;
use crate::store::StoredResponse;
use crate::upstream::{self, Clock};

impl Proxy {
    /// Answers a retry of the completed record `stored` by the upstream's answer to the
    /// route's refetch: any status but a 5xx is the client's (a 401 or 403 included),
    /// marked as replayed; the body streams through, recorded nowhere.
    pub(super) async fn refetch(&self, guarded: &Guarded, prepared: &Prepared, stored: StoredResponse) -> Handled {
        // A refetch route always has its refetch: the config refuses one without.
        let Some(refetch) = &guarded.policy.refetch else {
            return Err(Rejection::ReplayUnavailable("the route has no refetch").into());
        };
        let path = refetch
            .path
            .render(&guarded.upstream_key(), &guarded.record.operation_id());
        let mut request = Request::new(full(Bytes::new()));
        *request.method_mut() = refetch.method.clone();
        *request.uri_mut() = path
            .parse()
            .map_err(|_| Rejection::ReplayUnavailable("the refetch path does not make a URI"))?;
        let headers = request.headers_mut();
        headers.clone_from(&prepared.head().headers);
        for name in [
            header::CONTENT_LENGTH,
            header::CONTENT_TYPE,
            header::TRANSFER_ENCODING,
            header::EXPECT,
        ] {
            headers.remove(name);
        }
        upstream::prepare_request(&mut request, &guarded.route.config.upstream, &guarded.client)
            .map_err(|_| Rejection::ReplayUnavailable("the refetch request cannot be made"))?;
        super::exchange::upstream_key(request.headers_mut(), &guarded.policy, &guarded.record, &guarded.key)?;
        let clock = Clock::start(refetch.timeout);
        let response = send_within(&guarded.route.client, request, &clock, self.shared.spans)
            .await
            .map_err(|error| {
                tracing::warn!(%error, "the refetch of a completed operation failed; answering 503, nothing runs again");
                Rejection::ReplayUnavailable(match error {
                    UpstreamError::Unavailable(_) => "the upstream refused the connection",
                    UpstreamError::Timeout(_) => "the upstream did not answer in time",
                    UpstreamError::Failed(_) => "the exchange broke off",
                })
            })?;
        let elapsed = clock.started.elapsed();
        if response.status().is_server_error() {
            tracing::warn!(
                status = response.status().as_u16(),
                "the refetch of a completed operation got a 5xx; answering 503, nothing runs again"
            );
            return Err(Rejection::ReplayUnavailable("the upstream answered the refetch with a 5xx").into());
        }
        let (mut parts, body) = response.into_parts();
        upstream::strip_hop_by_hop(&mut parts.headers);
        parts
            .headers
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        let body = StreamedBody::new(Vec::new(), body, clock.deadline, clock.timeout).boxed_unsync();
        Ok(Answer {
            response: Response::from_parts(parts, body),
            outcome: Outcome::Replayed,
            upstream: Some(elapsed),
            execution: stored.trace,
        })
    }
}
