//! The searchable corpus of one QA env: passages (title + text) behind a [`Bm25`] index over
//! "title text", and the Search-R1 rendering of a result list as
//! `\n\n<information>Doc i(Title: t) text\n…</information>\n\n`. A query whose words are
//! exactly a title's words (BM25's tokens, in order) returns that passage first, as a wiki's
//! search goes to the page of that name; the BM25 ranking fills the rest. Without it, bag-of-words
//! scores can rank a paragraph that repeats a shared name word ("Ulsol Oraivi" works at "Ulsol
//! Dynamics") above the named one. Which paragraphs go in (a record's own context, or a whole
//! world) is the env's choice; this module only indexes and renders them.

use std::collections::{HashMap, HashSet};

use super::bm25::{tokenize, Bm25};

/// A corpus passage.
struct Passage {
    title: String,
    text: String,
}

/// Passages and their BM25 index.
pub struct Corpus {
    passages: Vec<Passage>,
    index: Bm25,
    /// Title tokens → passages with that title, in corpus order.
    by_title: HashMap<Vec<String>, Vec<usize>>,
}

impl Corpus {
    /// Indexes the distinct `(title, sentences)` paragraphs, in first-seen order.
    pub fn new<'a>(paragraphs: impl IntoIterator<Item = &'a (String, Vec<String>)>) -> Self {
        let mut seen = HashSet::new();
        let mut passages = Vec::new();
        for (title, sentences) in paragraphs {
            let text = sentences.concat().trim().to_string();
            if seen.insert((title.clone(), text.clone())) {
                passages.push(Passage {
                    title: title.clone(),
                    text,
                });
            }
        }
        let docs: Vec<String> = passages
            .iter()
            .map(|p| format!("{} {}", p.title, p.text))
            .collect();
        let mut by_title: HashMap<Vec<String>, Vec<usize>> = HashMap::new();
        for (i, p) in passages.iter().enumerate() {
            by_title.entry(tokenize(&p.title)).or_default().push(i);
        }
        Corpus {
            index: Bm25::new(&docs),
            passages,
            by_title,
        }
    }

    /// The `k` best passages for `query`, best first: those titled exactly `query`, then by
    /// BM25 score (only scores > 0).
    fn search(&self, query: &str, k: usize) -> Vec<usize> {
        let titled = self.by_title.get(&tokenize(query));
        let mut hits: Vec<usize> = titled.into_iter().flatten().copied().take(k).collect();
        let ranked = self.index.search(query, k + hits.len());
        for (doc, _) in ranked {
            if hits.len() < k && !hits.contains(&doc) {
                hits.push(doc);
            }
        }
        hits
    }

    /// Number of distinct passages.
    pub fn len(&self) -> usize {
        self.passages.len()
    }

    /// Whether the corpus holds no passage.
    pub fn is_empty(&self) -> bool {
        self.passages.is_empty()
    }

    /// Titles of the `k` best passages for `query`, best first.
    pub fn titles(&self, query: &str, k: usize) -> Vec<&str> {
        self.search(query, k)
            .into_iter()
            .map(|doc| self.passages[doc].title.as_str())
            .collect()
    }

    /// (title, text) of the `k` best passages for `query`, best first.
    pub fn passages(&self, query: &str, k: usize) -> Vec<(&str, &str)> {
        self.search(query, k)
            .into_iter()
            .map(|doc| {
                let p = &self.passages[doc];
                (p.title.as_str(), p.text.as_str())
            })
            .collect()
    }

    /// The `<information>` block of (title, text) passages, in order.
    pub fn render_passages(passages: &[(&str, &str)]) -> String {
        let docs: String = passages
            .iter()
            .enumerate()
            .map(|(i, (title, text))| format!("Doc {}(Title: {title}) {text}\n", i + 1))
            .collect();
        format!("\n\n<information>{docs}</information>\n\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paragraph(title: &str, text: &str) -> (String, Vec<String>) {
        (title.to_string(), vec![text.to_string()])
    }

    #[test]
    fn an_exact_title_ranks_first_and_bm25_fills_the_rest() {
        let person = |name: &str, year: u32, city: &str, employer: &str| {
            paragraph(
                name,
                &format!(
                    "{name} (born {year}) is a chemist. {name} was born in {city}. {name} is \
                     employed by {employer}."
                ),
            )
        };
        let company = |name: &str, year: u32, founder: &str, city: &str| {
            paragraph(
                name,
                &format!(
                    "{name} is a company founded in {year} by {founder}. {name} has its \
                     headquarters in {city}."
                ),
            )
        };
        let paragraphs = [
            person("Orarov Melivi", 1904, "Eretorport", "Iviqui Dynamics"),
            company("Ulsol Dynamics", 1868, "Fenlo Oramir", "Kaport"),
            company("Iviqui Dynamics", 1924, "Torrov Fenivi", "Melthaport"),
            person("Torpim Mirqui", 1935, "Kaport", "Iviqui Dynamics"),
            person("Melpim Mirnax", 1964, "Eretorport", "Ulsol Dynamics"),
            person("Fenvor Ultha", 1985, "Eretorport", "Ulsol Dynamics"),
            person("Ulsol Oraivi", 1921, "Quivorburg", "Ulsol Dynamics"),
            paragraph("Kaport", "Kaport is a city."),
            paragraph("Kaport", "Kaport is a city."),
        ];
        let corpus = Corpus::new(&paragraphs);
        assert_eq!(corpus.len(), 8, "duplicate paragraphs are indexed once");
        let bm25_first = corpus.index.search("Ulsol Dynamics", 1)[0].0;
        assert_eq!(
            corpus.passages[bm25_first].title, "Ulsol Oraivi",
            "BM25 alone"
        );
        assert_eq!(
            corpus.titles("ulsol  DYNAMICS", 3),
            vec!["Ulsol Dynamics", "Ulsol Oraivi", "Melpim Mirnax"]
        );
        assert_eq!(corpus.titles("Ulsol Dynamics", 1), vec!["Ulsol Dynamics"]);
        assert_eq!(corpus.titles("Dynamics Ulsol", 1), vec!["Ulsol Oraivi"]);
        assert_eq!(corpus.titles("a city", 1), vec!["Kaport"]);
        assert!(corpus.titles("zzz", 3).is_empty());
        let block = Corpus::render_passages(&corpus.passages("Kaport", 1));
        assert_eq!(
            block,
            "\n\n<information>Doc 1(Title: Kaport) Kaport is a city.\n</information>\n\n"
        );
    }
}
