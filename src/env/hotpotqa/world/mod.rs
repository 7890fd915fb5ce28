//! Generated worlds for the QA task: one made-up world per (seed, split), so that validation
//! asks about entities training never saw. A world holds countries, cities, people, companies
//! and films with invented names and relations (a city lies in a country, a person is born in a
//! city and works for a company, a company has a founder and headquarters, a film a director
//! and a shooting city); each entity has one paragraph (title = its name) stating its facts in a
//! few short sentences. Questions are HotpotQA's two types, rendered in the official schema
//! with sentence-level supporting facts: **bridge** (the answer is in the paragraph of an entity
//! named only in the first paragraph, never in the first paragraph itself) and **comparison**
//! (two named entities, one attribute each: who/which came first, or a balanced yes/no).
//!
//! Train and val worlds of one seed never share an entity name: every name is assigned to one
//! side of a seed-dependent partition by a hash of its normalized words (in any order), and a
//! world only draws names from its own side. The name *words* (the [`lexicon`] of invented
//! words, company kinds, film nouns) are shared by both, so a validation name is a new
//! combination of familiar words. Every word a world writes is in [`vocabulary`], which the
//! built-in tokenizer turns into whole-word tokens for a run on generated worlds: a name is two
//! tokens to copy, not ten bytes to spell. Output is a pure function of (seed, split, size, questions,
//! distractors). The questions are the `questions` submodule's. What this module does not do:
//! retrieval and scoring (the env), the 80-record fixture ([`super::synthetic`]).

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::OnceLock;

use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::metric::normalize_answer;
use super::synthetic::{capitalize, JOBS, SYLLABLES};
use crate::env::stable_hash;
use crate::seed::derive;

/// Smallest and largest `world_size` (entities per world).
pub const MIN_WORLD_SIZE: usize = 40;
/// Largest `world_size` (entities per world).
pub const MAX_WORLD_SIZE: usize = 5000;

/// Invented name words: people, cities and countries are two of them, companies and films one
/// and a kind or noun.
const LEXICON_SIZE: usize = 192;
const COMPANY_KINDS: [&str; 12] = [
    "Labs",
    "Works",
    "Dynamics",
    "Foods",
    "Motors",
    "Textiles",
    "Press",
    "Systems",
    "Mills",
    "Studios",
    "Partners",
    "Logistics",
];
const FILM_NOUNS: [&str; 12] = [
    "Harbor", "Orchard", "Signal", "Lantern", "Meridian", "Voyage", "Cipher", "Garden", "Mirror",
    "River", "Winter", "Crown",
];
/// The words of the paragraphs, questions and the env's own text that are not names, years or
/// jobs (a test checks that every word a world writes is in [`vocabulary`]).
const TEXT_WORDS: &str = "
headquarters employed employs earlier came come out shot work Give short back No yet
";
/// Seed paths of the name partition and the world (the questions use 3 and 4).
const NAME_STREAM: u64 = 1;
const WORLD_STREAM: u64 = 2;
/// Draws of one name before its pool counts as spent.
const MAX_NAME_DRAWS: usize = 100_000;

/// The side of the name partition a world draws from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    /// The training side: the names training worlds draw from.
    Train,
    /// The validation side: names no training world of the same seed uses.
    Val,
}

impl Split {
    fn tag(self) -> u64 {
        match self {
            Split::Train => 0,
            Split::Val => 1,
        }
    }
}

/// A name's words, normalized and sorted: names with the same key score as the same answer or
/// look alike to bag-of-words search ("Kalo Mirzen", "Mirzen Kalo").
fn name_key(name: &str) -> String {
    let normalized = normalize_answer(name);
    let mut words: Vec<&str> = normalized.split(' ').collect();
    words.sort_unstable();
    words.join(" ")
}

/// The split whose worlds may use `name` under `seed`, decided by [`name_key`], so names that
/// score or search alike always fall on the same side.
pub fn name_side(seed: u64, name: &str) -> Split {
    let key = stable_hash(name_key(name).as_bytes());
    if derive(seed, &[NAME_STREAM, key]) & 1 == 0 {
        Split::Train
    } else {
        Split::Val
    }
}

/// A paragraph: (title, sentences); sentences after the first start with a space.
pub type Paragraph = (String, Vec<String>);

mod questions;
pub use questions::{template_name, template_names, TEMPLATE_COUNT};

/// Entities of each kind, as index ranges of [`World::paragraphs`].
#[derive(Clone, Debug)]
struct Layout {
    countries: Range<usize>,
    cities: Range<usize>,
    people: Range<usize>,
    companies: Range<usize>,
    films: Range<usize>,
}

impl Layout {
    /// About 4 % countries, 15 % each of cities, companies and films, the rest people.
    fn for_size(size: usize) -> Layout {
        let countries = (size / 25).max(2);
        let others = (size * 3 / 20).max(6);
        let people = size - countries - 3 * others;
        let mut start = 0;
        let mut next = |n: usize| {
            start += n;
            start - n..start
        };
        Layout {
            countries: next(countries),
            cities: next(others),
            people: next(people),
            companies: next(others),
            films: next(others),
        }
    }

    /// The kind range holding entity `id`.
    fn kind_of(&self, id: usize) -> &Range<usize> {
        [
            &self.countries,
            &self.cities,
            &self.people,
            &self.companies,
            &self.films,
        ]
        .into_iter()
        .find(|r| r.contains(&id))
        .expect("entity ids lie in a kind range")
    }
}

struct City {
    country: usize,
    year: u32,
}
struct Person {
    year: u32,
    city: usize,
    employer: usize,
    job: &'static str,
}
struct Company {
    year: u32,
    founder: usize,
    city: usize,
}
struct Film {
    year: u32,
    director: usize,
    city: usize,
}

/// Sentence indices of the facts in each paragraph.
mod sent {
    pub const CITY_COUNTRY: usize = 0;
    pub const PERSON_YEAR: usize = 0;
    pub const PERSON_CITY: usize = 1;
    pub const PERSON_EMPLOYER: usize = 2;
    pub const COMPANY_FOUNDER: usize = 0;
    pub const COMPANY_CITY: usize = 1;
    pub const FILM_DIRECTOR: usize = 0;
    pub const FILM_CITY: usize = 1;
}

/// One generated world. Entity ids index `names` and `paragraphs`; relations hold ids local
/// to their kind (city 3 is entity `layout.cities.start + 3`).
pub struct World {
    /// Seed of the world's content (names drawn, relations, questions).
    seed: u64,
    split: Split,
    layout: Layout,
    names: Vec<String>,
    cities: Vec<City>,
    people: Vec<Person>,
    companies: Vec<Company>,
    films: Vec<Film>,
    paragraphs: Vec<Paragraph>,
}

/// The name words: [`LEXICON_SIZE`] capitalized two-syllable words, the same for every seed
/// and split (a fixed hash order of all of them, so the list is stable).
pub fn lexicon() -> &'static [String] {
    static LEXICON: OnceLock<Vec<String>> = OnceLock::new();
    LEXICON.get_or_init(|| {
        let words: BTreeSet<String> = SYLLABLES
            .iter()
            .flat_map(|a| {
                SYLLABLES
                    .iter()
                    .map(move |b| capitalize(&format!("{a}{b}")))
            })
            .collect();
        let mut words: Vec<String> = words.into_iter().collect();
        words.sort_by_key(|w| stable_hash(w.as_bytes()));
        words.truncate(LEXICON_SIZE);
        words
    })
}

/// Every word a generated world writes in its paragraphs and questions, and the env in its
/// instruction and observations, except years: the name words, company kinds, film nouns, jobs
/// and the template words.
pub fn vocabulary() -> Vec<String> {
    let fixed = COMPANY_KINDS
        .iter()
        .chain(&FILM_NOUNS)
        .chain(&JOBS)
        .copied()
        .chain(TEXT_WORDS.split_whitespace());
    lexicon()
        .iter()
        .cloned()
        .chain(fixed.map(str::to_string))
        .collect()
}

/// A name word.
fn word(rng: &mut ChaCha8Rng) -> String {
    lexicon().choose(rng).expect("non-empty").clone()
}

/// "a" or "an" before `word`.
fn article(word: &str) -> &'static str {
    if word.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

fn pick<'a>(rng: &mut ChaCha8Rng, items: &'a [&'a str]) -> &'a str {
    items.choose(rng).expect("non-empty")
}

/// Draws names of this world's side of the partition, each new by [`name_key`] and without a
/// repeated word.
struct Namer {
    seed: u64,
    split: Split,
    used: BTreeSet<String>,
}

impl Namer {
    fn draw(
        &mut self,
        rng: &mut ChaCha8Rng,
        kind: &str,
        make: fn(&mut ChaCha8Rng) -> String,
    ) -> Result<String, String> {
        for _ in 0..MAX_NAME_DRAWS {
            let name = make(rng);
            let key = name_key(&name);
            let repeats = key.split(' ').collect::<BTreeSet<_>>().len() < key.split(' ').count();
            if !repeats && name_side(self.seed, &name) == self.split && self.used.insert(key) {
                return Ok(name);
            }
        }
        Err(format!(
            "the {kind} names of this split ran out; use a smaller world_size"
        ))
    }

    fn draw_all(
        &mut self,
        rng: &mut ChaCha8Rng,
        range: &Range<usize>,
        kind: &str,
        make: fn(&mut ChaCha8Rng) -> String,
    ) -> Result<Vec<String>, String> {
        range.clone().map(|_| self.draw(rng, kind, make)).collect()
    }
}

/// People, cities and countries: two name words.
fn two_words(rng: &mut ChaCha8Rng) -> String {
    format!("{} {}", word(rng), word(rng))
}
fn company_name(rng: &mut ChaCha8Rng) -> String {
    format!("{} {}", word(rng), pick(rng, &COMPANY_KINDS))
}
fn film_name(rng: &mut ChaCha8Rng) -> String {
    format!("The {} {}", word(rng), pick(rng, &FILM_NOUNS))
}

impl World {
    /// The world of `split` under `seed` with `size` entities (names from the side of the
    /// partition of `seed`).
    pub fn generate(seed: u64, split: Split, size: usize) -> Result<World, String> {
        Self::generate_in(seed, seed, split, size)
    }

    /// A world whose content comes from `seed` and whose names come from `split`'s side of
    /// the partition of `partition_seed`: the worlds of any seeds under one partition seed
    /// share no name across the two splits (a world per episode, e.g.).
    pub fn generate_in(
        partition_seed: u64,
        seed: u64,
        split: Split,
        size: usize,
    ) -> Result<World, String> {
        if !(MIN_WORLD_SIZE..=MAX_WORLD_SIZE).contains(&size) {
            return Err(format!(
                "must be in {MIN_WORLD_SIZE}..={MAX_WORLD_SIZE}, got {size}"
            ));
        }
        let layout = Layout::for_size(size);
        let mut rng = ChaCha8Rng::seed_from_u64(derive(seed, &[WORLD_STREAM, split.tag()]));
        let names = Self::names(&layout, partition_seed, split, &mut rng)?;
        let mut world = World {
            seed,
            split,
            cities: Self::cities(&layout, &mut rng),
            people: Self::people(&layout, &mut rng),
            companies: Self::companies(&layout, &mut rng),
            films: Self::films(&layout, &mut rng),
            layout,
            names,
            paragraphs: Vec::new(),
        };
        world.paragraphs = (0..world.names.len())
            .map(|id| world.paragraph(id))
            .collect();
        Ok(world)
    }

    fn names(
        layout: &Layout,
        seed: u64,
        split: Split,
        rng: &mut ChaCha8Rng,
    ) -> Result<Vec<String>, String> {
        let mut namer = Namer {
            seed,
            split,
            used: BTreeSet::new(),
        };
        let mut names = namer.draw_all(rng, &layout.countries, "country", two_words)?;
        names.extend(namer.draw_all(rng, &layout.cities, "city", two_words)?);
        names.extend(namer.draw_all(rng, &layout.people, "person", two_words)?);
        names.extend(namer.draw_all(rng, &layout.companies, "company", company_name)?);
        names.extend(namer.draw_all(rng, &layout.films, "film", film_name)?);
        Ok(names)
    }

    /// City i < number of countries lies in country i and is its capital, so every country
    /// has one; the others lie anywhere.
    fn cities(layout: &Layout, rng: &mut ChaCha8Rng) -> Vec<City> {
        let countries = layout.countries.len();
        (0..layout.cities.len())
            .map(|i| City {
                country: if i < countries {
                    i
                } else {
                    rng.random_range(0..countries)
                },
                year: rng.random_range(1100..1900),
            })
            .collect()
    }

    fn people(layout: &Layout, rng: &mut ChaCha8Rng) -> Vec<Person> {
        (0..layout.people.len())
            .map(|_| Person {
                year: rng.random_range(1900..2000),
                city: rng.random_range(0..layout.cities.len()),
                employer: rng.random_range(0..layout.companies.len()),
                job: pick(rng, &JOBS),
            })
            .collect()
    }

    fn companies(layout: &Layout, rng: &mut ChaCha8Rng) -> Vec<Company> {
        (0..layout.companies.len())
            .map(|_| Company {
                year: rng.random_range(1850..2020),
                founder: rng.random_range(0..layout.people.len()),
                city: rng.random_range(0..layout.cities.len()),
            })
            .collect()
    }

    fn films(layout: &Layout, rng: &mut ChaCha8Rng) -> Vec<Film> {
        (0..layout.films.len())
            .map(|_| Film {
                year: rng.random_range(1930..2024),
                director: rng.random_range(0..layout.people.len()),
                city: rng.random_range(0..layout.cities.len()),
            })
            .collect()
    }

    /// Every entity's paragraph; entity ids index it.
    pub fn paragraphs(&self) -> &[Paragraph] {
        &self.paragraphs
    }

    fn country(&self, i: usize) -> &str {
        &self.names[self.layout.countries.start + i]
    }
    fn city(&self, i: usize) -> &str {
        &self.names[self.layout.cities.start + i]
    }
    fn person(&self, i: usize) -> &str {
        &self.names[self.layout.people.start + i]
    }
    fn company(&self, i: usize) -> &str {
        &self.names[self.layout.companies.start + i]
    }
    fn film(&self, i: usize) -> &str {
        &self.names[self.layout.films.start + i]
    }

    /// The paragraph of entity `id`: its name in every sentence, facts in the order of
    /// [`sent`].
    fn paragraph(&self, id: usize) -> Paragraph {
        let l = &self.layout;
        let name = self.names[id].clone();
        let sentences = if l.countries.contains(&id) {
            let capital = id - l.countries.start;
            vec![
                format!("{name} is a country."),
                format!(" The capital of {name} is {}.", self.city(capital)),
            ]
        } else if l.cities.contains(&id) {
            let c = &self.cities[id - l.cities.start];
            vec![
                format!("{name} is a city in {}.", self.country(c.country)),
                format!(" {name} was founded in {}.", c.year),
            ]
        } else if l.people.contains(&id) {
            let p = &self.people[id - l.people.start];
            vec![
                format!("{name} (born {}) is {} {}.", p.year, article(p.job), p.job),
                format!(" {name} was born in {}.", self.city(p.city)),
                format!(" {name} is employed by {}.", self.company(p.employer)),
            ]
        } else if l.companies.contains(&id) {
            let c = &self.companies[id - l.companies.start];
            vec![
                format!(
                    "{name} is a company founded in {} by {}.",
                    c.year,
                    self.person(c.founder)
                ),
                format!(" {name} has its headquarters in {}.", self.city(c.city)),
            ]
        } else {
            let f = &self.films[id - l.films.start];
            vec![
                format!(
                    "{name} is a {} film directed by {}.",
                    f.year,
                    self.person(f.director)
                ),
                format!(" {name} was shot in {}.", self.city(f.city)),
            ]
        };
        (name, sentences)
    }

    fn person_id(&self, i: usize) -> usize {
        self.layout.people.start + i
    }
    fn city_id(&self, i: usize) -> usize {
        self.layout.cities.start + i
    }
    fn company_id(&self, i: usize) -> usize {
        self.layout.companies.start + i
    }
    fn film_id(&self, i: usize) -> usize {
        self.layout.films.start + i
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::super::corpus::Corpus;
    use super::super::data::{parse_records, to_json, HotpotRecord};
    use super::*;

    fn world(seed: u64, split: Split) -> World {
        World::generate(seed, split, 400).unwrap()
    }

    /// Normalized paragraph titles and non-yes/no answers of a world's records.
    fn names_and_answers(world: &World, records: &[HotpotRecord]) -> BTreeSet<String> {
        let titles = world.paragraphs().iter().map(|(t, _)| t);
        let answers = records.iter().map(|r| &r.answer);
        titles
            .chain(answers)
            .map(|s| normalize_answer(s))
            .filter(|s| s != "yes" && s != "no")
            .collect()
    }

    #[test]
    fn generation_is_deterministic_per_seed() {
        let a = world(3, Split::Train).records(240, 6).unwrap();
        let b = world(3, Split::Train).records(240, 6).unwrap();
        assert_eq!(to_json(&a), to_json(&b));
        let c = world(4, Split::Train).records(240, 6).unwrap();
        assert_ne!(to_json(&a), to_json(&c));
    }

    #[test]
    fn train_and_val_worlds_share_no_name_or_answer() {
        for seed in 0..3 {
            let (train, val) = (world(seed, Split::Train), world(seed, Split::Val));
            let train_names = names_and_answers(&train, &train.records(1200, 6).unwrap());
            let val_names = names_and_answers(&val, &val.records(1200, 6).unwrap());
            assert_eq!(train_names.len(), 400, "answers are entity names");
            assert_eq!(val_names.len(), 400);
            let shared: Vec<_> = train_names.intersection(&val_names).collect();
            assert!(shared.is_empty(), "seed {seed}: {shared:?}");
            assert!(train
                .names
                .iter()
                .all(|n| name_side(seed, n) == Split::Train));
            assert!(val.names.iter().all(|n| name_side(seed, n) == Split::Val));
        }
    }

    #[test]
    fn records_are_well_formed_and_round_trip() {
        let records = world(5, Split::Val).records(600, 6).unwrap();
        let json = to_json(&records);
        assert_eq!(parse_records(&json, "generated").unwrap(), records);
        let ids: BTreeSet<&str> = records.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids.len(), records.len(), "ids are unique");
        for r in &records {
            let titles: BTreeSet<&str> = r.context.iter().map(|(t, _)| t.as_str()).collect();
            assert_eq!(titles.len(), 8, "{}: 2 gold + 6 distinct distractors", r.id);
            assert_eq!(r.supporting_facts.len(), 2);
            for (title, sent) in &r.supporting_facts {
                let (_, sentences) = r.context.iter().find(|(t, _)| t == title).unwrap();
                assert!(sentences[*sent].contains(title.as_str()), "{title} {sent}");
                assert!(sentences[1..].iter().all(|s| s.starts_with(' ')));
            }
            assert_eq!(r.level, "hard");
        }
        let count = |f: &dyn Fn(&HotpotRecord) -> bool| records.iter().filter(|r| f(r)).count();
        assert_eq!(count(&|r| r.kind == "bridge"), 300);
        assert_eq!(count(&|r| r.kind == "comparison"), 300);
        let yes = count(&|r| r.answer == "yes");
        let no = count(&|r| r.answer == "no");
        assert_eq!(yes + no, 150);
        assert!((50..=100).contains(&yes), "yes {yes} of 150");
    }

    #[test]
    fn answers_follow_from_the_supporting_sentences() {
        let records = world(6, Split::Train).records(600, 6).unwrap();
        let sentence = |r: &HotpotRecord, k: usize| {
            let (title, sent) = &r.supporting_facts[k];
            let (_, sentences) = r.context.iter().find(|(t, _)| t == title).unwrap();
            sentences[*sent].clone()
        };
        for r in &records {
            let (first, second) = (sentence(r, 0), sentence(r, 1));
            let (a, b) = (&r.supporting_facts[0].0, &r.supporting_facts[1].0);
            if r.kind == "bridge" {
                assert!(r.question.contains(a.as_str()), "{}", r.question);
                assert!(
                    first.contains(b.as_str()),
                    "the first fact names the bridge"
                );
                assert!(second.contains(&r.answer), "{} → {}", r.question, r.answer);
            } else {
                assert!(r.question.contains(a.as_str()) && r.question.contains(b.as_str()));
                if r.answer != "yes" && r.answer != "no" {
                    assert!(r.answer == *a || r.answer == *b, "{}", r.question);
                }
            }
        }
    }

    #[test]
    fn a_bridge_answer_is_not_in_the_first_paragraph() {
        let records = world(7, Split::Val).records(1200, 6).unwrap();
        let mut bridges = 0;
        for r in records.iter().filter(|r| r.kind == "bridge") {
            let first = &r.supporting_facts[0].0;
            let (title, sentences) = r.context.iter().find(|(t, _)| t == first).unwrap();
            let text = format!("{title} {}", sentences.concat()).to_lowercase();
            assert!(!text.contains(&r.answer.to_lowercase()), "{}", r.question);
            assert!(!r.question.to_lowercase().contains(&r.answer.to_lowercase()));
            bridges += 1;
        }
        assert_eq!(bridges, 600);
    }

    #[test]
    fn a_title_search_ranks_its_paragraph_first() {
        for (seed, split) in [(8, Split::Train), (8, Split::Val), (9, Split::Train)] {
            let world = world(seed, split);
            let corpus = Corpus::new(world.paragraphs());
            assert_eq!(corpus.len(), 400);
            for (title, _) in world.paragraphs() {
                assert_eq!(corpus.titles(title, 1), vec![title.as_str()], "seed {seed}");
            }
        }
        let world = world(8, Split::Train);
        for r in world.records(240, 6).unwrap() {
            let own = Corpus::new(&r.context);
            for (title, _) in &r.supporting_facts {
                assert_eq!(own.titles(title, 1), vec![title.as_str()], "{}", r.id);
            }
        }
    }

    #[test]
    fn every_word_a_world_writes_is_one_builtin_token() {
        use crate::env::{Action, Env};
        let tok = crate::tokenizer::Tokenizer::builtin_with_words(&vocabulary());
        let mut texts: Vec<String> = Vec::new();
        for split in [Split::Train, Split::Val] {
            let world = world(10, split);
            for (title, sentences) in world.paragraphs() {
                texts.push(format!("Title: {title} {}", sentences.concat()));
            }
            for r in world.records(240, 6).unwrap() {
                texts.push(format!("{} {}", r.question, r.answer));
            }
        }
        let mut env = super::super::HotpotQaEnv::new(Default::default()).unwrap();
        texts.push(env.instruction());
        texts.push(env.state_text());
        texts.push(env.step(&Action::Answer("x".into())).unwrap().observation);
        let mut missing = BTreeSet::new();
        for text in &texts {
            for word in text
                .split(|c: char| !c.is_alphabetic())
                .filter(|w| w.len() > 1)
            {
                for piece in [word.to_string(), format!(" {word}")] {
                    if tok.encode(&piece).len() != 1 {
                        missing.insert(word.to_string());
                    }
                }
            }
        }
        assert!(missing.is_empty(), "not whole tokens: {missing:?}");
        assert_eq!(lexicon().len(), LEXICON_SIZE);
        assert_eq!(
            lexicon().iter().collect::<BTreeSet<_>>().len(),
            LEXICON_SIZE
        );
    }

    #[test]
    fn world_size_is_bounded() {
        for size in [MIN_WORLD_SIZE - 1, MAX_WORLD_SIZE + 1] {
            let err = World::generate(0, Split::Train, size).err().unwrap();
            assert!(err.contains(&size.to_string()), "{err}");
        }
        let small = World::generate(0, Split::Val, MIN_WORLD_SIZE).unwrap();
        assert_eq!(small.paragraphs().len(), MIN_WORLD_SIZE);
        assert_eq!(small.records(120, 6).unwrap().len(), 120);
    }
}
