//! HTML building blocks: escaping (every string from a model, an environment, a file name or a
//! query passes through [`esc`] before it reaches markup) and the page shell shared by every
//! page (stylesheet and script from `/assets/`, a header, an error box the script fills).

use std::fmt::Write as _;

/// `text` with `& < > " '` replaced by character references: safe in element content and in
/// quoted attribute values.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + text.len() / 8);
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Which page a document is: the script reads it from `<body data-page>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageKind {
    Run,
    List,
    Trajectory,
    Error,
}

impl PageKind {
    fn name(self) -> &'static str {
        match self {
            PageKind::Run => "run",
            PageKind::List => "list",
            PageKind::Trajectory => "trajectory",
            PageKind::Error => "error",
        }
    }
}

/// The fixed parts around a page's `main` markup. `root` is PATH as given; `generation` the
/// snapshot's, which the script compares with `/api/status` to notice new records; `live`
/// asks the script to reload by itself when there are.
pub struct Shell<'a> {
    pub kind: PageKind,
    pub title: &'a str,
    pub root: &'a str,
    pub generation: u64,
    pub live: bool,
}

impl Shell<'_> {
    /// The whole document around `main` (already escaped markup).
    pub fn wrap(&self, main: &str) -> String {
        let mut out = String::with_capacity(main.len() + 1024);
        let _ = write!(
            out,
            "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
             <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
             <title>{title} · stepppo view</title>\
             <link rel=\"stylesheet\" href=\"/assets/app.css\"></head>\n\
             <body data-page=\"{kind}\" data-generation=\"{generation}\" data-live=\"{live}\">\
             <header><a class=\"home\" href=\"/\">stepppo view</a> \
             <span class=\"path\">{root}</span> \
             <a href=\"/trajectories\">trajectories</a> \
             <span id=\"live\" class=\"live\"></span></header>\n<main>{main}</main>\n\
             <div id=\"errors\"></div>\
             <script src=\"/assets/app.js\"></script></body></html>\n",
            title = esc(self.title),
            kind = self.kind.name(),
            generation = self.generation,
            live = u8::from(self.live),
            root = esc(self.root),
        );
        out
    }
}

/// A number for a table cell: up to `digits` decimals, `—` for non-finite values.
pub fn num(x: f64, digits: usize) -> String {
    if x.is_finite() {
        format!("{x:.digits$}")
    } else {
        "—".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_leaves_no_markup() {
        let hostile = "</pre><script>alert('x')</script>\"&";
        let out = esc(hostile);
        assert_eq!(
            out,
            "&lt;/pre&gt;&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&quot;&amp;"
        );
    }

    #[test]
    fn the_shell_escapes_its_title_and_path() {
        let shell = Shell {
            kind: PageKind::Run,
            title: "<b>",
            root: "runs/<x>",
            generation: 3,
            live: false,
        };
        let page = shell.wrap("<p>ok</p>");
        assert!(page.contains("&lt;b&gt; · stepppo view"));
        assert!(page.contains("runs/&lt;x&gt;"));
        assert!(page.contains("data-generation=\"3\""));
        assert!(!page.contains("<b>"));
    }
}
