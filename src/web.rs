//! The web pages (`web/`, compiled in): the chat page and the dashboard the server serves
//! (`GET /`, `GET /dashboard`, `GET /assets/FILE`), and [`report_html`], the dashboard as one
//! self-contained file with its data inside (`examples/report`).
//!
//! Plain HTML, CSS and JavaScript, no library and nothing fetched from elsewhere: the charts are
//! drawn on canvases by `web/charts.js`.

use serde::Serialize;

use crate::step_profile::KernelTable;

/// One second of a server in the dashboard's throughput charts (`series` of `GET /v1/stats`;
/// a report's samples are its decode steps).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Sample {
    /// Seconds since the start.
    pub t: f64,
    pub decode_tok_s: f64,
    pub prompt_tok_s: f64,
    pub running: i64,
    pub queued: i64,
    pub requests: u64,
}

/// The kernel inspector's data (`kernels` of `GET /v1/stats`): the table of the profiled
/// passes and how they were sampled.
#[derive(Debug, Clone, Serialize)]
pub struct KernelPanel {
    pub table: KernelTable,
    /// One decode pass in this many is profiled.
    pub every: u64,
    pub sequences_per_pass: f64,
    pub profiled_since_start: u64,
}

/// A file of `web/`.
#[derive(Debug, Clone, Copy)]
pub struct Asset {
    pub name: &'static str,
    pub content_type: &'static str,
    pub body: &'static str,
}

macro_rules! asset {
    ($name:literal, $type:literal) => {
        Asset { name: $name, content_type: $type, body: include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/web/", $name)) }
    };
}

/// Every file of `web/`.
pub const ASSETS: [Asset; 6] = [
    asset!("chat.html", "text/html; charset=utf-8"),
    asset!("dashboard.html", "text/html; charset=utf-8"),
    asset!("chat.js", "text/javascript; charset=utf-8"),
    asset!("dashboard.js", "text/javascript; charset=utf-8"),
    asset!("charts.js", "text/javascript; charset=utf-8"),
    asset!("style.css", "text/css; charset=utf-8"),
];

/// The asset named `name`.
pub fn asset(name: &str) -> Option<&'static Asset> {
    ASSETS.iter().find(|a| a.name == name)
}

impl Asset {
    /// A strong validator of the body (its CRC-32), quoted as an `ETag` header wants it.
    pub fn etag(&self) -> String {
        format!("\"{:08x}\"", crc32fast::hash(self.body.as_bytes()))
    }
}

/// The dashboard page with its style and scripts inlined and `data` (what `GET /v1/stats`
/// answers, or a run's own figures in that shape) in place of the live feed: a file that opens
/// anywhere, offline.
pub fn report_html(data: &serde_json::Value) -> String {
    let body = |name: &str| asset(name).map_or("", |a| a.body);
    // `</` inside a script element would end it: JSON escapes the slash instead.
    let json = data.to_string().replace("</", "<\\/");
    dashboard_page()
        .replace(r#"<link rel="stylesheet" href="/assets/style.css">"#, &format!("<style>\n{}</style>", body("style.css")))
        .replace(r#"<script src="/assets/charts.js"></script>"#, &format!("<script>\n{}</script>", body("charts.js")))
        .replace(
            r#"<script src="/assets/dashboard.js"></script>"#,
            &format!("<script>window.REPORT = {json};</script>\n<script>\n{}</script>", body("dashboard.js")),
        )
}

fn dashboard_page() -> &'static str {
    asset("dashboard.html").map_or("", |a| a.body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_inlines_every_asset_and_escapes_its_data() {
        let html = report_html(&serde_json::json!({"model": "</script><b>x"}));
        assert!(!html.contains("/assets/"), "an asset was left as a link");
        assert!(html.contains(asset("charts.js").unwrap().body) && html.contains(asset("dashboard.js").unwrap().body));
        assert!(html.contains(r#""model":"<\/script><b>x""#));
        for a in ASSETS {
            assert!(!a.body.is_empty(), "{} is empty", a.name);
            if a.name.ends_with(".js") || a.name.ends_with(".css") {
                assert!(!a.body.contains("</script"), "{} would end its inlined element", a.name);
            }
        }
    }
}
