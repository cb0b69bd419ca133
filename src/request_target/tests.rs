use super::*;

fn canonical(path: &str) -> Result<String, RequestTargetError> {
    canonical_path(path, &PathPolicy::default()).map(Cow::into_owned)
}

#[test]
fn the_probes_spellings_are_the_guarded_path_or_refused() {
    for spelling in [
        "/open/../v1/pay",
        "/v1/./pay",
        "/open/%2e%2e/v1/pay",
        "/open/%2E%2E/v1/pay",
        "/open/.%2e/v1/pay",
        "//v1/pay",
        "/v1//pay",
        "/v1///pay",
        "/%761/pay",
        "/v1/%70ay",
        "/v1/%70%61%79",
        "/v1/pay/.",
        "/v1/pay/x/..",
        "/../v1/pay",
        "/./v1/pay",
    ] {
        let path = canonical(spelling).unwrap_or_else(|error| panic!("{spelling}: {error}"));
        assert!(path == "/v1/pay" || path == "/v1/pay/", "{spelling} -> {path}");
    }
    assert_eq!(canonical("/v1/pay;x"), Err(RequestTargetError::Parameter));
    assert_eq!(canonical("/v1%2Fpay"), Err(RequestTargetError::EscapedSlash));
    assert_eq!(canonical("/v1%2fpay"), Err(RequestTargetError::EscapedSlash));
    assert_eq!(canonical("/v1%5Cpay"), Err(RequestTargetError::EscapedSlash));
    assert_eq!(canonical("/v1\\pay"), Err(RequestTargetError::EscapedSlash));
    for malformed in ["/v1/%", "/v1/%7", "/v1/%zz", "/v1/%+1", "/v1/%7g"] {
        assert_eq!(
            canonical(malformed),
            Err(RequestTargetError::MalformedEscape),
            "{malformed}"
        );
    }
}

#[test]
fn canonical_paths_are_left_alone_and_other_escapes_keep_their_meaning() {
    for path in ["/", "/v1/pay", "/v1/pay/", "/a.b/c..d/.e/..f", "/x~y_z-1", "*"] {
        assert!(
            matches!(canonical_path(path, &PathPolicy::default()), Ok(Cow::Borrowed(_))),
            "{path}"
        );
    }
    // Reserved and non-ASCII escapes stay encoded, in upper-case hex.
    assert_eq!(canonical("/a%3fb").as_deref(), Ok("/a%3Fb"));
    assert_eq!(canonical("/caf%c3%a9").as_deref(), Ok("/caf%C3%A9"));
    assert_eq!(canonical("/100%25").as_deref(), Ok("/100%25"));
    // A double encoding is one decoding away from a dot, not a dot.
    assert_eq!(canonical("/a/%252e%252e/b").as_deref(), Ok("/a/%252e%252e/b"));
    assert_eq!(canonical("/a/b/..").as_deref(), Ok("/a/"));
    assert_eq!(canonical("/..").as_deref(), Ok("/"));
    assert_eq!(canonical("//").as_deref(), Ok("/"));
}

#[test]
fn the_policy_keeps_what_it_is_told_to() {
    let keep = PathPolicy {
        merge_slashes: false,
        escaped_slashes: Spelling::Keep,
        path_parameters: Spelling::Keep,
    };
    let canonical = |path| canonical_path(path, &keep).map(Cow::into_owned);
    assert_eq!(canonical("/v1//pay").as_deref(), Ok("/v1//pay"));
    assert_eq!(canonical("/v1/./x/../pay").as_deref(), Ok("/v1/pay"));
    assert_eq!(canonical("/v1%2fpay").as_deref(), Ok("/v1%2Fpay"));
    assert_eq!(canonical("/v1/pay;x").as_deref(), Ok("/v1/pay;x"));
    assert_eq!(canonical("/v1/%"), Err(RequestTargetError::MalformedEscape));
    assert!(PathPolicy::default().to_string().contains("slashes merged"));
}

fn request(version: Version, uri: &str, hosts: &[&str]) -> Result<Option<String>, RequestTargetError> {
    let uri: Uri = uri.parse().expect("a URI");
    let mut headers = HeaderMap::new();
    for host in hosts {
        headers.append(header::HOST, HeaderValue::from_str(host).expect("a header value"));
    }
    authority(version, &uri, &headers).map(|value| value.map(|value| value.to_str().expect("ASCII").to_string()))
}

#[test]
fn one_valid_host_names_the_request() {
    const HTTP_10: Version = Version::HTTP_10;
    const HTTP_11: Version = Version::HTTP_11;
    const HTTP_2: Version = Version::HTTP_2;
    assert_eq!(
        request(HTTP_11, "/x", &["pay.example:8443"]),
        Ok(Some("pay.example:8443".into()))
    );
    assert_eq!(request(HTTP_11, "/x", &["[::1]:80"]), Ok(Some("[::1]:80".into())));
    assert_eq!(request(HTTP_11, "/x", &[]), Err(RequestTargetError::MissingHost));
    assert_eq!(request(HTTP_10, "/x", &[]), Ok(None));
    assert_eq!(
        request(HTTP_11, "/x", &["a.example", "b.example"]),
        Err(RequestTargetError::RepeatedHost)
    );
    for invalid in [
        "a.example, b.example",
        "user@a.example",
        "a.example/x",
        "",
        "a.example:",
        "a.example:123456",
        "a.example:80:80",
        "[::1",
        "[]",
        "a b",
        "a.example?",
    ] {
        assert_eq!(
            request(HTTP_11, "/x", &[invalid]),
            Err(RequestTargetError::InvalidHost),
            "{invalid:?}"
        );
    }
    // An absolute-form target names its own authority; Host is ignored (RFC 9112 §3.2.2).
    assert_eq!(
        request(HTTP_11, "http://pay.example/z", &["other.example"]),
        Ok(Some("pay.example".into()))
    );
    assert_eq!(
        request(HTTP_11, "http://user@pay.example/z", &["pay.example"]),
        Err(RequestTargetError::InvalidHost)
    );
    // HTTP/2: `:authority` (the URI's) and `host` must agree.
    assert_eq!(
        request(HTTP_2, "https://pay.example/z", &[]),
        Ok(Some("pay.example".into()))
    );
    assert_eq!(
        request(HTTP_2, "https://pay.example/z", &["PAY.example"]),
        Ok(Some("pay.example".into()))
    );
    assert_eq!(
        request(HTTP_2, "https://pay.example/z", &["other.example"]),
        Err(RequestTargetError::ConflictingHost)
    );
    assert_eq!(request(HTTP_2, "/z", &[]), Ok(None));
}

#[test]
fn routes_match_the_host_without_its_port_brackets_or_trailing_dot() {
    assert_eq!(host_of("pay.example:8080"), "pay.example");
    assert_eq!(host_of("pay.example."), "pay.example");
    assert_eq!(host_of("[::1]:80"), "::1");
    assert_eq!(host_of("[::1]"), "::1");
}

#[test]
fn escapes_must_decode_to_utf8() {
    for overlong in [
        "/open/%C0%AE%C0%AE/v1/pay",
        "/open/%E0%80%AE/v1",
        "/v1%C0%AFpay",
        "/a/%FF",
        "/a/%C3",
    ] {
        assert_eq!(canonical(overlong), Err(RequestTargetError::InvalidUtf8), "{overlong}");
    }
    let keep = PathPolicy {
        merge_slashes: true,
        escaped_slashes: Spelling::Keep,
        path_parameters: Spelling::Reject,
    };
    assert_eq!(
        canonical_path("/v1%C0%AFpay", &keep),
        Err(RequestTargetError::InvalidUtf8)
    );
    assert_eq!(canonical("/caf%C3%A9").as_deref(), Ok("/caf%C3%A9"));
    assert_eq!(canonical("/%E2%82%AC").as_deref(), Ok("/%E2%82%AC"));
}

/// Dot segments removed where the path needs work anyway (an escape, a dot segment), and
/// what the policy keeps kept there too: a trailing slash, a run of slashes with
/// `merge_slashes = false`, a raw backslash with `escaped_slashes = "keep"`.
#[test]
fn a_rebuilt_path_keeps_its_trailing_slash_and_what_the_policy_keeps() {
    assert_eq!(canonical("/a/./b/").as_deref(), Ok("/a/b/"));
    assert_eq!(canonical("/a/%62/").as_deref(), Ok("/a/b/"));
    assert_eq!(canonical("/a//x/../b").as_deref(), Ok("/a/b"));
    let keep = PathPolicy {
        merge_slashes: false,
        escaped_slashes: Spelling::Keep,
        path_parameters: Spelling::Keep,
    };
    let kept = |path| canonical_path(path, &keep).map(Cow::into_owned);
    assert_eq!(kept("/v1//x/../pay").as_deref(), Ok("/v1//pay"));
    assert_eq!(kept("/v1//x/./").as_deref(), Ok("/v1//x/"));
    assert_eq!(kept("/v1\\pay/./x").as_deref(), Ok("/v1\\pay/x"));
    assert_eq!(canonical("/v1\\pay"), Err(RequestTargetError::EscapedSlash));
}

#[test]
fn a_bracketed_host_without_a_port_is_one() {
    assert_eq!(request(Version::HTTP_11, "/x", &["[::1]"]), Ok(Some("[::1]".into())));
    assert_eq!(request(Version::HTTP_11, "/x", &["[1]"]), Ok(Some("[1]".into())));
    for bad in ["[]", "[::1", "[::1]x", "[::1]:", "[::1]:123456", "[g]"] {
        assert_eq!(
            request(Version::HTTP_11, "/x", &[bad]),
            Err(RequestTargetError::InvalidHost),
            "{bad}"
        );
    }
}
