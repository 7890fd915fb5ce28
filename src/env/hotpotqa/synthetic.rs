//! Synthetic multi-hop questions in the official HotpotQA schema, so the QA task runs with no
//! downloaded data. A small made-up knowledge base (countries, cities, people, companies, films,
//! all with invented names) is drawn from a seed; each record is a bridge question (two hops
//! through a linking entity) or a comparison question (two entities, one attribute, including
//! yes/no), with its two gold paragraphs, distractor paragraphs from the same knowledge base,
//! and sentence-level supporting facts. Output is a pure function of (count, seed). This is the
//! shipped fixture (`world: fixture`); train and validation share its one knowledge base, so the
//! env's default is a generated world per split instead ([`super::world`]).

use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::data::HotpotRecord;
use crate::seed::{derive, splitmix64};

/// Records in the shipped fixture and the seed it was generated with.
pub const FIXTURE_RECORDS: usize = 80;
/// Seed the shipped fixture was generated with.
pub const FIXTURE_SEED: u64 = 2024;
/// Distractor paragraphs per record (the official distractor setting uses 8).
const DISTRACTORS: usize = 4;

/// Name parts of made-up entities (shared with the generated worlds).
pub(super) const SYLLABLES: [&str; 24] = [
    "ka", "lo", "mir", "zen", "tha", "vor", "bel", "dra", "qui", "sol", "nax", "ere", "ul", "ora",
    "fen", "gal", "tor", "ivi", "mel", "rov", "sta", "pim", "dur", "eko",
];
const CITY_SUFFIXES: [&str; 5] = ["burg", "port", "vale", "mora", "ton"];
const COMPANY_KINDS: [&str; 6] = ["Labs", "Works", "Dynamics", "Foods", "Motors", "Textiles"];
const FILM_ADJECTIVES: [&str; 8] = [
    "Silent", "Crimson", "Hidden", "Last", "Iron", "Golden", "Broken", "Distant",
];
const FILM_NOUNS: [&str; 8] = [
    "Harbor", "Orchard", "Signal", "Lantern", "Meridian", "Voyage", "Cipher", "Garden",
];
/// Occupations of made-up people (shared with the generated worlds).
pub(super) const JOBS: [&str; 8] = [
    "painter",
    "engineer",
    "novelist",
    "architect",
    "composer",
    "chemist",
    "photographer",
    "sculptor",
];
const LEVELS: [&str; 3] = ["easy", "medium", "hard"];

struct Person {
    name: String,
    country: usize,
    city: usize,
    year: u32,
    job: &'static str,
}
struct City {
    name: String,
    country: usize,
    year: u32,
}
struct Company {
    name: String,
    founder: usize,
    city: usize,
    year: u32,
}
struct Film {
    title: String,
    director: usize,
    city: usize,
    year: u32,
}

/// The made-up world questions are asked about.
struct Knowledge {
    countries: Vec<String>,
    cities: Vec<City>,
    people: Vec<Person>,
    companies: Vec<Company>,
    films: Vec<Film>,
}

/// A paragraph: (title, sentences).
type Paragraph = (String, Vec<String>);

/// `count` records drawn from a knowledge base and question stream determined by `seed`.
pub fn synthetic_records(count: usize, seed: u64) -> Vec<HotpotRecord> {
    let kb = Knowledge::generate(&mut ChaCha8Rng::seed_from_u64(derive(seed, &[0])));
    let mut rng = ChaCha8Rng::seed_from_u64(derive(seed, &[1]));
    (0..count).map(|i| kb.record(i, seed, &mut rng)).collect()
}

/// `word` with its first letter upper-cased.
pub(super) fn capitalize(word: &str) -> String {
    let mut chars = word.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

fn invented_word(rng: &mut ChaCha8Rng, syllables: usize) -> String {
    let word: String = (0..syllables)
        .map(|_| *SYLLABLES.choose(rng).expect("non-empty"))
        .collect();
    capitalize(&word)
}

/// Draws names until one is new.
fn unique(
    used: &mut std::collections::BTreeSet<String>,
    mut make: impl FnMut() -> String,
) -> String {
    loop {
        let name = make();
        if used.insert(name.clone()) {
            return name;
        }
    }
}

impl Knowledge {
    fn generate(rng: &mut ChaCha8Rng) -> Self {
        let mut used = std::collections::BTreeSet::new();
        let countries: Vec<String> = (0..4)
            .map(|_| unique(&mut used, || format!("{}ia", invented_word(rng, 2))))
            .collect();
        let cities: Vec<City> = (0..10)
            .map(|_| City {
                name: unique(&mut used, || {
                    let suffix = CITY_SUFFIXES.choose(rng).expect("non-empty");
                    format!("{}{suffix}", invented_word(rng, 2))
                }),
                country: rng.random_range(0..4),
                year: rng.random_range(1200..1850),
            })
            .collect();
        let people: Vec<Person> = (0..24)
            .map(|_| Person {
                name: unique(&mut used, || {
                    let surname_len = rng.random_range(2..=3);
                    format!(
                        "{} {}",
                        invented_word(rng, 2),
                        invented_word(rng, surname_len)
                    )
                }),
                country: rng.random_range(0..4),
                city: rng.random_range(0..10),
                year: rng.random_range(1900..1990),
                job: JOBS.choose(rng).expect("non-empty"),
            })
            .collect();
        let companies: Vec<Company> = (0..10)
            .map(|_| Company {
                name: unique(&mut used, || {
                    let kind = COMPANY_KINDS.choose(rng).expect("non-empty");
                    format!("{} {kind}", invented_word(rng, 2))
                }),
                founder: rng.random_range(0..24),
                city: rng.random_range(0..10),
                year: rng.random_range(1950..2016),
            })
            .collect();
        let films: Vec<Film> = (0..12)
            .map(|_| Film {
                title: unique(&mut used, || {
                    let adjective = FILM_ADJECTIVES.choose(rng).expect("non-empty");
                    let noun = FILM_NOUNS.choose(rng).expect("non-empty");
                    format!("The {adjective} {noun}")
                }),
                director: rng.random_range(0..24),
                city: rng.random_range(0..10),
                year: rng.random_range(1960..2021),
            })
            .collect();
        Knowledge {
            countries,
            cities,
            people,
            companies,
            films,
        }
    }

    fn nationality(&self, country: usize) -> String {
        format!("{}n", self.countries[country])
    }

    fn person_paragraph(&self, i: usize) -> Paragraph {
        let p = &self.people[i];
        (
            p.name.clone(),
            vec![
                format!(
                    "{} (born {}) is a {} {}.",
                    p.name,
                    p.year,
                    self.nationality(p.country),
                    p.job
                ),
                format!(" {} was born in {}.", p.name, self.cities[p.city].name),
            ],
        )
    }

    fn city_paragraph(&self, i: usize) -> Paragraph {
        let c = &self.cities[i];
        (
            c.name.clone(),
            vec![
                format!("{} is a city in {}.", c.name, self.countries[c.country]),
                format!(" It was founded in {}.", c.year),
            ],
        )
    }

    fn company_paragraph(&self, i: usize) -> Paragraph {
        let c = &self.companies[i];
        (
            c.name.clone(),
            vec![
                format!(
                    "{} is a company founded in {} by {}.",
                    c.name, c.year, self.people[c.founder].name
                ),
                format!(" Its headquarters are in {}.", self.cities[c.city].name),
            ],
        )
    }

    fn film_paragraph(&self, i: usize) -> Paragraph {
        let f = &self.films[i];
        (
            f.title.clone(),
            vec![
                format!(
                    "{} is a {} film directed by {}.",
                    f.title, f.year, self.people[f.director].name
                ),
                format!(" It was shot in {}.", self.cities[f.city].name),
            ],
        )
    }

    fn all_paragraphs(&self) -> Vec<Paragraph> {
        let mut all = Vec::new();
        all.extend((0..self.cities.len()).map(|i| self.city_paragraph(i)));
        all.extend((0..self.people.len()).map(|i| self.person_paragraph(i)));
        all.extend((0..self.companies.len()).map(|i| self.company_paragraph(i)));
        all.extend((0..self.films.len()).map(|i| self.film_paragraph(i)));
        all
    }

    /// Record `index`: the question template cycles so bridge and comparison alternate.
    fn record(&self, index: usize, seed: u64, rng: &mut ChaCha8Rng) -> HotpotRecord {
        let (question, answer, gold, kind) = self.question(index % 8, rng);
        let gold_titles: Vec<&String> = gold.iter().map(|(p, _)| &p.0).collect();
        let pool: Vec<Paragraph> = self
            .all_paragraphs()
            .into_iter()
            .filter(|p| !gold_titles.contains(&&p.0))
            .collect();
        let mut context: Vec<Paragraph> = gold.iter().map(|(p, _)| p.clone()).collect();
        context.extend(pool.choose_multiple(rng, DISTRACTORS).cloned());
        context.shuffle(rng);
        let id = splitmix64(derive(seed, &[2, index as u64]));
        HotpotRecord {
            id: format!("{id:016x}{:08x}", index),
            question,
            answer,
            supporting_facts: gold.iter().map(|(p, s)| (p.0.clone(), *s)).collect(),
            context,
            kind: kind.to_string(),
            level: LEVELS.choose(rng).expect("non-empty").to_string(),
        }
    }

    /// (question, answer, gold paragraphs with their supporting sentence, type).
    fn question(
        &self,
        template: usize,
        rng: &mut ChaCha8Rng,
    ) -> (String, String, Vec<(Paragraph, usize)>, &'static str) {
        match template {
            0 => {
                let c = rng.random_range(0..self.companies.len());
                let founder = self.companies[c].founder;
                (
                    format!(
                        "In which city was the founder of {} born?",
                        self.companies[c].name
                    ),
                    self.cities[self.people[founder].city].name.clone(),
                    vec![
                        (self.company_paragraph(c), 0),
                        (self.person_paragraph(founder), 1),
                    ],
                    "bridge",
                )
            }
            1 => {
                let (a, b) = self.distinct_pair(self.people.len(), rng, |_, _| true);
                let same = self.people[a].country == self.people[b].country;
                (
                    format!(
                        "Were {} and {} of the same nationality?",
                        self.people[a].name, self.people[b].name
                    ),
                    if same { "yes" } else { "no" }.to_string(),
                    vec![(self.person_paragraph(a), 0), (self.person_paragraph(b), 0)],
                    "comparison",
                )
            }
            2 => {
                let f = rng.random_range(0..self.films.len());
                let director = self.films[f].director;
                (
                    format!(
                        "What is the nationality of the director of {}?",
                        self.films[f].title
                    ),
                    self.nationality(self.people[director].country),
                    vec![
                        (self.film_paragraph(f), 0),
                        (self.person_paragraph(director), 0),
                    ],
                    "bridge",
                )
            }
            3 => {
                let (a, b) = self.distinct_pair(self.people.len(), rng, |a, b| {
                    self.people[a].year != self.people[b].year
                });
                let first = if self.people[a].year < self.people[b].year {
                    a
                } else {
                    b
                };
                (
                    format!(
                        "Who was born first, {} or {}?",
                        self.people[a].name, self.people[b].name
                    ),
                    self.people[first].name.clone(),
                    vec![(self.person_paragraph(a), 0), (self.person_paragraph(b), 0)],
                    "comparison",
                )
            }
            4 => {
                let c = rng.random_range(0..self.companies.len());
                let city = self.companies[c].city;
                (
                    format!(
                        "In which country are the headquarters of {}?",
                        self.companies[c].name
                    ),
                    self.countries[self.cities[city].country].clone(),
                    vec![
                        (self.company_paragraph(c), 1),
                        (self.city_paragraph(city), 0),
                    ],
                    "bridge",
                )
            }
            5 => {
                let (a, b) = self.distinct_pair(self.films.len(), rng, |a, b| {
                    self.films[a].year != self.films[b].year
                });
                let first = if self.films[a].year < self.films[b].year {
                    a
                } else {
                    b
                };
                (
                    format!(
                        "Which film came out first, {} or {}?",
                        self.films[a].title, self.films[b].title
                    ),
                    self.films[first].title.clone(),
                    vec![(self.film_paragraph(a), 0), (self.film_paragraph(b), 0)],
                    "comparison",
                )
            }
            6 => {
                let f = rng.random_range(0..self.films.len());
                let city = self.films[f].city;
                (
                    format!(
                        "In which year was the city where {} was shot founded?",
                        self.films[f].title
                    ),
                    self.cities[city].year.to_string(),
                    vec![(self.film_paragraph(f), 1), (self.city_paragraph(city), 1)],
                    "bridge",
                )
            }
            _ => {
                let (a, b) = self.distinct_pair(self.companies.len(), rng, |a, b| {
                    self.companies[a].year != self.companies[b].year
                });
                let first = if self.companies[a].year < self.companies[b].year {
                    a
                } else {
                    b
                };
                (
                    format!(
                        "Which company was founded earlier, {} or {}?",
                        self.companies[a].name, self.companies[b].name
                    ),
                    self.companies[first].name.clone(),
                    vec![
                        (self.company_paragraph(a), 0),
                        (self.company_paragraph(b), 0),
                    ],
                    "comparison",
                )
            }
        }
    }

    /// Two distinct indices below `n` satisfying `ok` (drawn until they do).
    fn distinct_pair(
        &self,
        n: usize,
        rng: &mut ChaCha8Rng,
        ok: impl Fn(usize, usize) -> bool,
    ) -> (usize, usize) {
        loop {
            let (a, b) = (rng.random_range(0..n), rng.random_range(0..n));
            if a != b && ok(a, b) {
                return (a, b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::data::{to_json, EMBEDDED_FIXTURE};
    use super::*;

    #[test]
    fn regenerating_the_fixture_yields_the_same_bytes() {
        let records = synthetic_records(FIXTURE_RECORDS, FIXTURE_SEED);
        assert_eq!(to_json(&records), EMBEDDED_FIXTURE);
    }

    #[test]
    fn records_are_consistent_multi_hop_questions() {
        let records = synthetic_records(40, 7);
        let bridges = records.iter().filter(|r| r.kind == "bridge").count();
        assert_eq!(bridges, 20);
        assert!(
            records.iter().any(|r| r.answer == "yes") || records.iter().any(|r| r.answer == "no")
        );
        for r in &records {
            assert_eq!(r.context.len(), 2 + DISTRACTORS);
            assert_eq!(r.supporting_facts.len(), 2);
            for (title, sent) in &r.supporting_facts {
                let (_, sentences) = r.context.iter().find(|(t, _)| t == title).unwrap();
                assert!(*sent < sentences.len());
            }
            let text: String = r
                .context
                .iter()
                .flat_map(|(_, s)| s.iter().cloned())
                .collect();
            if r.answer != "yes" && r.answer != "no" {
                assert!(text.contains(&r.answer), "{} → {}", r.question, r.answer);
            }
        }
        assert_ne!(to_json(&records), to_json(&synthetic_records(40, 8)));
    }
}
