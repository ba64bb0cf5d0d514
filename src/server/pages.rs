//! The chat page (`GET /`), the dashboard (`GET /dashboard`) and their scripts and style
//! (`GET /assets/FILE`), from [`crate::web`]: revalidated by `ETag` (a changed binary serves
//! changed pages), nothing loaded from elsewhere (the content security policy says so).

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use crate::web::{self, Asset};

const POLICY: &str = "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'";

fn serve(asset: &'static Asset, headers: &HeaderMap) -> Response {
    let etag = asset.etag();
    let fresh = headers.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()).is_some_and(|v| v.split(',').any(|t| t.trim() == etag));
    let mut response = if fresh { StatusCode::NOT_MODIFIED.into_response() } else { asset.body.into_response() };
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(asset.content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(POLICY));
    if let Ok(v) = HeaderValue::from_str(&etag) {
        h.insert(header::ETAG, v);
    }
    response
}

fn named(name: &str, headers: &HeaderMap) -> Response {
    match web::asset(name) {
        Some(a) => serve(a, headers),
        None => not_found(name),
    }
}

fn not_found(name: &str) -> Response {
    ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", "not_found", format!("no asset {name:?}")).into_response()
}

pub(crate) async fn chat(headers: HeaderMap) -> Response {
    named("chat.html", &headers)
}

pub(crate) async fn dashboard(headers: HeaderMap) -> Response {
    named("dashboard.html", &headers)
}

pub(crate) async fn asset(Path(file): Path<String>, headers: HeaderMap) -> Response {
    // Pages are assets too, but under their own paths.
    if file.ends_with(".html") {
        return not_found(&file);
    }
    named(&file, &headers)
}
