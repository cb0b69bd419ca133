//! Where a route sends its requests: its upstream URL, parsed once when the config is
//! validated into what the request path uses (scheme, authority, base path and `Host`),
//! so that nothing is parsed per request. The config owns it; `upstream` reads it.

use std::fmt;

use http::HeaderValue;
use http::uri::{Authority, Scheme, Uri};

/// A route's upstream, as the request path uses it.
#[derive(Debug, Clone)]
pub struct Upstream {
    uri: Uri,
    scheme: Scheme,
    authority: Authority,
    /// The URL's path without its trailing `/`, when it has one to prefix.
    base_path: Option<String>,
    host: HeaderValue,
}

impl TryFrom<Uri> for Upstream {
    /// Why the URL cannot be an upstream, for the config error.
    type Error = &'static str;

    fn try_from(uri: Uri) -> Result<Upstream, &'static str> {
        let scheme = match uri.scheme_str() {
            Some("http") => Scheme::HTTP,
            Some("https") => Scheme::HTTPS,
            _ => return Err("the scheme must be http or https"),
        };
        let Some(authority) = uri.authority().cloned() else {
            return Err("the URL needs a host");
        };
        if uri.query().is_some() {
            return Err("the URL must not have a query");
        }
        let host =
            HeaderValue::from_str(authority.as_str()).map_err(|_| "the URL's host is not a valid Host header")?;
        let base = uri.path().trim_end_matches('/');
        Ok(Upstream {
            scheme,
            base_path: (!base.is_empty()).then(|| base.to_string()),
            authority,
            host,
            uri,
        })
    }
}

impl fmt::Display for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.uri.fmt(f)
    }
}

impl Upstream {
    pub(crate) fn scheme(&self) -> &Scheme {
        &self.scheme
    }

    pub(crate) fn authority(&self) -> &Authority {
        &self.authority
    }

    /// The URL's path without its trailing `/`, when it has one to prefix.
    pub(crate) fn base_path(&self) -> Option<&str> {
        self.base_path.as_deref()
    }

    /// The `Host` the upstream is sent.
    pub(crate) fn host(&self) -> &HeaderValue {
        &self.host
    }
}
