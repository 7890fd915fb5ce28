//! A small in-memory BM25 index (Okapi BM25, k1 = 1.2, b = 0.75, Lucene's non-negative idf)
//! over lower-cased alphanumeric tokens. Ranking ties break by document index, so results are
//! deterministic.

use std::collections::HashMap;

const K1: f32 = 1.2;
const B: f32 = 0.75;

/// BM25 index over a fixed list of documents.
pub struct Bm25 {
    /// term → (document, term frequency) postings.
    postings: HashMap<String, Vec<(usize, u32)>>,
    doc_len: Vec<f32>,
    avg_len: f32,
}

/// Lower-cased runs of alphanumeric characters.
pub fn tokenize(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|t| !t.is_empty())
        .map(str::to_lowercase)
        .collect()
}

impl Bm25 {
    /// Indexes `docs`; a document's index in the slice is its id in search results.
    pub fn new<S: AsRef<str>>(docs: &[S]) -> Self {
        let mut postings: HashMap<String, Vec<(usize, u32)>> = HashMap::new();
        let mut doc_len = Vec::with_capacity(docs.len());
        for (doc, text) in docs.iter().enumerate() {
            let tokens = tokenize(text.as_ref());
            doc_len.push(tokens.len() as f32);
            let mut counts: HashMap<String, u32> = HashMap::new();
            for token in tokens {
                *counts.entry(token).or_default() += 1;
            }
            for (term, tf) in counts {
                postings.entry(term).or_default().push((doc, tf));
            }
        }
        let avg_len = doc_len.iter().sum::<f32>() / doc_len.len().max(1) as f32;
        Bm25 {
            postings,
            doc_len,
            avg_len: avg_len.max(1.0),
        }
    }

    /// The `k` best documents for `query` as (index, score), best first; only scores > 0.
    pub fn search(&self, query: &str, k: usize) -> Vec<(usize, f32)> {
        let n = self.doc_len.len() as f32;
        let mut scores = vec![0.0f32; self.doc_len.len()];
        let mut terms = tokenize(query);
        terms.sort();
        terms.dedup();
        for term in &terms {
            let Some(list) = self.postings.get(term) else {
                continue;
            };
            let df = list.len() as f32;
            let idf = (1.0 + (n - df + 0.5) / (df + 0.5)).ln();
            for &(doc, tf) in list {
                let tf = tf as f32;
                let norm = K1 * (1.0 - B + B * self.doc_len[doc] / self.avg_len);
                scores[doc] += idf * tf * (K1 + 1.0) / (tf + norm);
            }
        }
        let mut ranked: Vec<(usize, f32)> = scores
            .into_iter()
            .enumerate()
            .filter(|&(_, s)| s > 0.0)
            .collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        ranked.truncate(k);
        ranked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_matching_documents_first() {
        let docs = [
            "Velmora Port is a city in Quandia.",
            "Karo Zenith was born in Velmora Port. Karo Zenith founded Drax Labs.",
            "The Silent Harbor is a film.",
        ];
        let index = Bm25::new(&docs);
        let hits = index.search("Who founded Drax Labs?", 3);
        assert_eq!(hits[0].0, 1);
        assert_eq!(
            hits.len(),
            1,
            "documents without query terms are not returned"
        );
        let hits = index.search("velmora", 1);
        assert_eq!(hits.len(), 1);
        assert_eq!(hits[0].0, 0, "shorter document wins on equal tf");
        assert!(index.search("", 3).is_empty());
        assert!(index.search("zzz", 3).is_empty());
    }

    #[test]
    fn score_matches_the_formula() {
        let docs = ["apple banana", "banana cherry cherry", "date"];
        let index = Bm25::new(&docs);
        let hits = index.search("cherry", 1);
        let (n, df, tf, dl, avg) = (3.0f32, 1.0f32, 2.0f32, 3.0f32, 6.0f32 / 3.0);
        let idf = (1.0 + (n - df + 0.5) / (df + 0.5)).ln();
        let want = idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * dl / avg));
        assert!((hits[0].1 - want).abs() < 1e-6);
    }
}
