//! The questions of a generated world, rendered as official HotpotQA records: twelve templates,
//! bridge and comparison alternating, each drawn until it passes the checks of a good question
//! (two distinct gold paragraphs; a bridge answer in neither the question nor the first
//! paragraph), then given distractor paragraphs phrased like the gold ones. The world itself
//! (entities, names, paragraphs) is the parent module's.

use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{sent, World};
use crate::env::hotpotqa::data::HotpotRecord;
use crate::seed::{derive, splitmix64};

/// Seed paths of the questions and the record ids (the world uses 1 and 2).
const QUESTION_STREAM: u64 = 3;
const ID_STREAM: u64 = 4;
/// Draws of one template before it gives up on a world.
const MAX_QUESTION_DRAWS: usize = 10_000;

/// A question before it becomes a record: two (entity, sentence) supporting facts, the first
/// being the entity the question names first.
struct Question {
    text: String,
    answer: String,
    kind: &'static str,
    facts: [(usize, usize); 2],
}

type Template = fn(&World, &mut ChaCha8Rng) -> Option<Question>;

/// Number of question templates: `records(TEMPLATE_COUNT, …)` asks one question of each.
pub const TEMPLATE_COUNT: usize = 12;

/// Bridge and comparison templates alternate, so the two types are balanced.
const TEMPLATES: [(&str, Template); TEMPLATE_COUNT] = [
    ("founder_birth_city", World::founder_birth_city),
    ("born_first", World::born_first),
    ("director_employer", World::director_employer),
    ("same_birth_city", World::same_birth_city),
    ("headquarters_country", World::headquarters_country),
    ("founded_earlier", World::founded_earlier),
    ("employer_founder", World::employer_founder),
    ("same_employer", World::same_employer),
    ("film_country", World::film_country),
    ("released_first", World::released_first),
    ("director_birth_city", World::director_birth_city),
    ("same_country", World::same_country),
];

/// The name of template `index % TEMPLATE_COUNT`: the template of generated record `index`.
pub fn template_name(index: usize) -> &'static str {
    TEMPLATES[index % TEMPLATE_COUNT].0
}

/// The template names, in record order.
pub fn template_names() -> impl Iterator<Item = &'static str> {
    TEMPLATES.iter().map(|(name, _)| *name)
}

impl World {
    /// `count` questions with `distractors` distractor paragraphs each; template `i % 12` makes
    /// record `i`.
    pub fn records(&self, count: usize, distractors: usize) -> Result<Vec<HotpotRecord>, String> {
        let mut rng =
            ChaCha8Rng::seed_from_u64(derive(self.seed, &[QUESTION_STREAM, self.split.tag()]));
        (0..count)
            .map(|index| {
                let (name, template) = TEMPLATES[index % TEMPLATES.len()];
                let question = self.draw_question(template, &mut rng).ok_or_else(|| {
                    format!("template `{name}` found no valid question in this world")
                })?;
                Ok(self.record(index, question, distractors, &mut rng))
            })
            .collect()
    }

    /// Draws from `template` until a question passes [`World::valid`].
    fn draw_question(&self, template: Template, rng: &mut ChaCha8Rng) -> Option<Question> {
        (0..MAX_QUESTION_DRAWS)
            .filter_map(|_| template(self, rng))
            .find(|q| self.valid(q))
    }

    /// Two distinct gold paragraphs; a bridge answer appears neither in the question nor in
    /// the first paragraph, so it needs the second hop.
    fn valid(&self, q: &Question) -> bool {
        if q.facts[0].0 == q.facts[1].0 {
            return false;
        }
        if q.kind != "bridge" {
            return true;
        }
        let answer = q.answer.to_lowercase();
        let (title, sentences) = &self.paragraphs[q.facts[0].0];
        let first = format!("{title} {}", sentences.concat()).to_lowercase();
        !first.contains(&answer) && !q.text.to_lowercase().contains(&answer)
    }

    fn record(
        &self,
        index: usize,
        q: Question,
        distractors: usize,
        rng: &mut ChaCha8Rng,
    ) -> HotpotRecord {
        let gold = [q.facts[0].0, q.facts[1].0];
        let mut ids: Vec<usize> = gold.to_vec();
        ids.extend(self.distractors(gold, distractors, rng));
        ids.shuffle(rng);
        let id = splitmix64(derive(
            self.seed,
            &[ID_STREAM, self.split.tag(), index as u64],
        ));
        HotpotRecord {
            id: format!("{id:016x}{index:08x}"),
            question: q.text,
            answer: q.answer,
            supporting_facts: q
                .facts
                .iter()
                .map(|&(e, s)| (self.names[e].clone(), s))
                .collect(),
            context: ids.iter().map(|&e| self.paragraphs[e].clone()).collect(),
            kind: q.kind.to_string(),
            level: "hard".to_string(),
        }
    }

    /// `n` distinct non-gold entities, of the gold paragraphs' kinds while there are enough
    /// (paragraphs phrased like the gold ones), then of any kind.
    fn distractors(&self, gold: [usize; 2], n: usize, rng: &mut ChaCha8Rng) -> Vec<usize> {
        let mut kinds = vec![self.layout.kind_of(gold[0]).clone()];
        if self.layout.kind_of(gold[1]) != &kinds[0] {
            kinds.push(self.layout.kind_of(gold[1]).clone());
        }
        let mut alike: Vec<usize> = kinds
            .into_iter()
            .flatten()
            .filter(|e| !gold.contains(e))
            .collect();
        let (picked, _) = alike.partial_shuffle(rng, n);
        let mut chosen = picked.to_vec();
        if chosen.len() < n {
            let mut rest: Vec<usize> = (0..self.names.len())
                .filter(|e| !gold.contains(e) && !chosen.contains(e))
                .collect();
            let (picked, _) = rest.partial_shuffle(rng, n - chosen.len());
            chosen.extend_from_slice(picked);
        }
        chosen
    }
}

/// Bridge templates: the question names one entity; its paragraph names the bridge entity,
/// whose paragraph holds the answer.
impl World {
    fn founder_birth_city(&self, rng: &mut ChaCha8Rng) -> Option<Question> {
        let k = rng.random_range(0..self.companies.len());
        let founder = self.companies[k].founder;
        Some(Question {
            text: format!("In which city was the founder of {} born?", self.company(k)),
            answer: self.city(self.people[founder].city).to_string(),
            kind: "bridge",
            facts: [
                (self.company_id(k), sent::COMPANY_FOUNDER),
                (self.person_id(founder), sent::PERSON_CITY),
            ],
        })
    }

    fn director_employer(&self, rng: &mut ChaCha8Rng) -> Option<Question> {
        let f = rng.random_range(0..self.films.len());
        let director = self.films[f].director;
        Some(Question {
            text: format!("Which company employs the director of {}?", self.film(f)),
            answer: self.company(self.people[director].employer).to_string(),
            kind: "bridge",
            facts: [
                (self.film_id(f), sent::FILM_DIRECTOR),
                (self.person_id(director), sent::PERSON_EMPLOYER),
            ],
        })
    }

    fn headquarters_country(&self, rng: &mut ChaCha8Rng) -> Option<Question> {
        let k = rng.random_range(0..self.companies.len());
        let city = self.companies[k].city;
        Some(Question {
            text: format!(
                "In which country are the headquarters of {}?",
                self.company(k)
            ),
            answer: self.country(self.cities[city].country).to_string(),
            kind: "bridge",
            facts: [
                (self.company_id(k), sent::COMPANY_CITY),
                (self.city_id(city), sent::CITY_COUNTRY),
            ],
        })
    }

    fn employer_founder(&self, rng: &mut ChaCha8Rng) -> Option<Question> {
        let p = rng.random_range(0..self.people.len());
        let employer = self.people[p].employer;
        Some(Question {
            text: format!("Who founded the company that employs {}?", self.person(p)),
            answer: self.person(self.companies[employer].founder).to_string(),
            kind: "bridge",
            facts: [
                (self.person_id(p), sent::PERSON_EMPLOYER),
                (self.company_id(employer), sent::COMPANY_FOUNDER),
            ],
        })
    }

    fn film_country(&self, rng: &mut ChaCha8Rng) -> Option<Question> {
        let f = rng.random_range(0..self.films.len());
        let city = self.films[f].city;
        Some(Question {
            text: format!("In which country was {} shot?", self.film(f)),
            answer: self.country(self.cities[city].country).to_string(),
            kind: "bridge",
            facts: [
                (self.film_id(f), sent::FILM_CITY),
                (self.city_id(city), sent::CITY_COUNTRY),
            ],
        })
    }

    fn director_birth_city(&self, rng: &mut ChaCha8Rng) -> Option<Question> {
        let f = rng.random_range(0..self.films.len());
        let director = self.films[f].director;
        Some(Question {
            text: format!("In which city was the director of {} born?", self.film(f)),
            answer: self.city(self.people[director].city).to_string(),
            kind: "bridge",
            facts: [
                (self.film_id(f), sent::FILM_DIRECTOR),
                (self.person_id(director), sent::PERSON_CITY),
            ],
        })
    }
}

/// Two distinct indices below `n`, in random order.
fn pair(n: usize, rng: &mut ChaCha8Rng) -> Option<(usize, usize)> {
    let (a, b) = (rng.random_range(0..n), rng.random_range(0..n));
    (a != b).then_some((a, b))
}

/// Two distinct indices below `n` whose `key`s are equal with probability one half (a
/// balanced yes/no), `None` when the drawn first index has no partner of the wanted kind.
fn yes_no_pair<K: PartialEq>(
    n: usize,
    key: impl Fn(usize) -> K,
    rng: &mut ChaCha8Rng,
) -> Option<(usize, usize, bool)> {
    let same = rng.random_bool(0.5);
    let a = rng.random_range(0..n);
    let partners: Vec<usize> = (0..n)
        .filter(|&b| b != a && (key(a) == key(b)) == same)
        .collect();
    let &b = partners.choose(rng)?;
    Some(if rng.random_bool(0.5) {
        (a, b, same)
    } else {
        (b, a, same)
    })
}

fn yes_no(same: bool) -> String {
    if same { "yes" } else { "no" }.to_string()
}

/// Comparison templates: the question names both entities; one fact of each decides.
impl World {
    fn born_first(&self, rng: &mut ChaCha8Rng) -> Option<Question> {
        let (a, b) = pair(self.people.len(), rng)?;
        let (ya, yb) = (self.people[a].year, self.people[b].year);
        (ya != yb).then(|| Question {
            text: format!(
                "Who was born first, {} or {}?",
                self.person(a),
                self.person(b)
            ),
            answer: self.person(if ya < yb { a } else { b }).to_string(),
            kind: "comparison",
            facts: [
                (self.person_id(a), sent::PERSON_YEAR),
                (self.person_id(b), sent::PERSON_YEAR),
            ],
        })
    }

    fn founded_earlier(&self, rng: &mut ChaCha8Rng) -> Option<Question> {
        let (a, b) = pair(self.companies.len(), rng)?;
        let (ya, yb) = (self.companies[a].year, self.companies[b].year);
        (ya != yb).then(|| Question {
            text: format!(
                "Which company was founded earlier, {} or {}?",
                self.company(a),
                self.company(b)
            ),
            answer: self.company(if ya < yb { a } else { b }).to_string(),
            kind: "comparison",
            facts: [
                (self.company_id(a), sent::COMPANY_FOUNDER),
                (self.company_id(b), sent::COMPANY_FOUNDER),
            ],
        })
    }

    fn released_first(&self, rng: &mut ChaCha8Rng) -> Option<Question> {
        let (a, b) = pair(self.films.len(), rng)?;
        let (ya, yb) = (self.films[a].year, self.films[b].year);
        (ya != yb).then(|| Question {
            text: format!(
                "Which film came out first, {} or {}?",
                self.film(a),
                self.film(b)
            ),
            answer: self.film(if ya < yb { a } else { b }).to_string(),
            kind: "comparison",
            facts: [
                (self.film_id(a), sent::FILM_DIRECTOR),
                (self.film_id(b), sent::FILM_DIRECTOR),
            ],
        })
    }

    fn same_birth_city(&self, rng: &mut ChaCha8Rng) -> Option<Question> {
        let (a, b, same) = yes_no_pair(self.people.len(), |i| self.people[i].city, rng)?;
        Some(Question {
            text: format!(
                "Were {} and {} born in the same city?",
                self.person(a),
                self.person(b)
            ),
            answer: yes_no(same),
            kind: "comparison",
            facts: [
                (self.person_id(a), sent::PERSON_CITY),
                (self.person_id(b), sent::PERSON_CITY),
            ],
        })
    }

    fn same_employer(&self, rng: &mut ChaCha8Rng) -> Option<Question> {
        let (a, b, same) = yes_no_pair(self.people.len(), |i| self.people[i].employer, rng)?;
        Some(Question {
            text: format!(
                "Do {} and {} work for the same company?",
                self.person(a),
                self.person(b)
            ),
            answer: yes_no(same),
            kind: "comparison",
            facts: [
                (self.person_id(a), sent::PERSON_EMPLOYER),
                (self.person_id(b), sent::PERSON_EMPLOYER),
            ],
        })
    }

    fn same_country(&self, rng: &mut ChaCha8Rng) -> Option<Question> {
        let (a, b, same) = yes_no_pair(self.cities.len(), |i| self.cities[i].country, rng)?;
        Some(Question {
            text: format!(
                "Are {} and {} in the same country?",
                self.city(a),
                self.city(b)
            ),
            answer: yes_no(same),
            kind: "comparison",
            facts: [
                (self.city_id(a), sent::CITY_COUNTRY),
                (self.city_id(b), sent::CITY_COUNTRY),
            ],
        })
    }
}
