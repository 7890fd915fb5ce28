//! Constrained decoding of a turn's response (`constrained_decoding: true`): a token-level
//! grammar of what a valid turn may contain, so the model only *chooses the action*. For an env
//! with named actions the response must be `<answer>A</answer>` (up to `max_actions_per_turn`
//! names joined by `||`), preceded by `<think>…</think>` when the protocol asks for thoughts; the
//! thoughts are free text that may not contain the end-of-turn token or the first token of
//! `</think>`. Every response the grammar admits parses as a valid turn.
//!
//! A request of the gateway that forces a tool call samples under [`ResponseGrammar::tool_call`]:
//! the opening of a call of an allowed function, then free text.
//!
//! The grammar is a small nondeterministic automaton over token ids (action names may share
//! tokens; nothing needs to be merged). [`ResponseGrammar::allowed`] walks it over the tokens
//! generated so far and returns the tokens that may come next. The rollout samples among those
//! only, and the update scores every response token under the same renormalised distribution
//! (`Model::head_logprobs_entropy` with a logit bias), so a token the grammar forces has
//! log-prob 0 and no gradient, and a negative advantage moves probability to the other actions,
//! never out of the format.

use crate::env::{ActionSpace, AgentSession, ProtocolConfig};
use crate::tokenizer::Tokenizer;

/// Why a grammar cannot be built for an env.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The env has no named action space (its answers are free text).
    #[error("env `{env}` answers free text (search or answer), which constrained decoding cannot enumerate; set constrained_decoding: false")]
    FreeTextAnswers {
        /// Tag of the env.
        env: String,
    },
    /// A tag, separator, action name or tool-call opening tokenizes to nothing.
    #[error("env `{env}`: `{text}` encodes to no tokens")]
    EmptyPiece {
        /// Tag of the env (`tool_choice` for a forced tool call).
        env: String,
        /// The text that encoded to no tokens.
        text: String,
    },
}

/// The tokens that may come next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Allowed {
    /// Exactly these (sorted, no duplicates).
    Only(Vec<u32>),
    /// Every token but these (sorted, no duplicates).
    AllBut(Vec<u32>),
}

impl Allowed {
    /// Whether `token` may come next.
    pub fn contains(&self, token: u32) -> bool {
        match self {
            Allowed::Only(ids) => ids.binary_search(&token).is_ok(),
            Allowed::AllBut(ids) => ids.binary_search(&token).is_err(),
        }
    }

    /// The allowed ids below `vocab`, ascending.
    pub fn ids(&self, vocab: usize) -> Vec<u32> {
        match self {
            Allowed::Only(ids) => ids
                .iter()
                .copied()
                .filter(|&t| (t as usize) < vocab)
                .collect(),
            Allowed::AllBut(_) => (0..vocab as u32).filter(|&t| self.contains(t)).collect(),
        }
    }

    /// The union of two sets.
    fn union(self, other: Allowed) -> Allowed {
        use Allowed::{AllBut, Only};
        match (self, other) {
            (Only(a), Only(b)) => Only(sorted_union(a, b)),
            (AllBut(e), Only(s)) | (Only(s), AllBut(e)) => AllBut(
                e.into_iter()
                    .filter(|t| s.binary_search(t).is_err())
                    .collect(),
            ),
            (AllBut(a), AllBut(b)) => AllBut(
                a.into_iter()
                    .filter(|t| b.binary_search(t).is_ok())
                    .collect(),
            ),
        }
    }
}

fn sorted_union(mut a: Vec<u32>, b: Vec<u32>) -> Vec<u32> {
    a.extend(b);
    a.sort_unstable();
    a.dedup();
    a
}

/// One automaton state.
#[derive(Clone, Debug, Default)]
struct Node {
    /// Token → next node.
    edges: Vec<(u32, usize)>,
    /// Free text: every token but these loops back to this node.
    free_except: Option<Vec<u32>>,
    /// A complete response may end here (the end-of-turn token is allowed).
    accepting: bool,
}

/// The token grammar of one env's valid responses. See the module documentation.
#[derive(Clone, Debug)]
pub struct ResponseGrammar {
    nodes: Vec<Node>,
    eos: u32,
}

impl ResponseGrammar {
    /// The grammar of `session`'s env and protocol, with pieces encoded by `tok`.
    pub fn for_session(tok: &Tokenizer, session: &AgentSession) -> Result<Self, GrammarError> {
        let env = session.env().tag();
        let ActionSpace::Named(names) = session.env().action_space() else {
            return Err(GrammarError::FreeTextAnswers {
                env: env.to_string(),
            });
        };
        let protocol = session.protocol();
        Self::answering(tok, (env, protocol), &names, protocol.max_actions_per_turn)
    }

    /// The grammar of every answer of `session`'s env under constrained decoding: its named
    /// actions' ([`Self::for_session`]); `None` for an env that answers free text, whose states
    /// offer the actions to choose among ([`Self::for_actions`] each turn).
    pub fn for_env(tok: &Tokenizer, session: &AgentSession) -> Result<Option<Self>, GrammarError> {
        match session.env().action_space() {
            ActionSpace::FreeText => Ok(None),
            _ => Self::for_session(tok, session).map(Some),
        }
    }

    /// The grammar of an answer naming one of `actions` (the actions a state admits, which hold
    /// for one action: one per turn) in the protocol of `env`.
    pub fn for_actions(
        tok: &Tokenizer,
        (env, protocol): (&str, &ProtocolConfig),
        actions: &[String],
    ) -> Result<Self, GrammarError> {
        Self::answering(tok, (env, protocol), actions, 1)
    }

    /// `<answer>` with up to `max_actions` of `names`, thoughts first where `protocol` asks.
    fn answering(
        tok: &Tokenizer,
        (env, protocol): (&str, &ProtocolConfig),
        names: &[String],
        max_actions: usize,
    ) -> Result<Self, GrammarError> {
        let encode = |text: &str| {
            let ids = tok.encode(text);
            if ids.is_empty() {
                Err(GrammarError::EmptyPiece {
                    env: env.to_string(),
                    text: text.to_string(),
                })
            } else {
                Ok(ids)
            }
        };
        let pieces = Pieces {
            think: if protocol.enable_think {
                Some((encode("<think>")?, encode("</think>")?))
            } else {
                None
            },
            open: encode("<answer>")?,
            close: encode("</answer>")?,
            separator: encode("||")?,
            actions: names.iter().map(|n| encode(n)).collect::<Result<_, _>>()?,
            max_actions,
        };
        Ok(Self::build(&pieces, tok.eos_id()))
    }

    /// A reply that opens with one of `openings` (e.g. the start of a call of each function
    /// `tool_choice` allows), then free text: what a request forcing a tool call samples under.
    pub fn tool_call(tok: &Tokenizer, openings: &[String]) -> Result<Self, GrammarError> {
        let mut g = ResponseGrammar {
            nodes: vec![Node::default()],
            eos: tok.eos_id(),
        };
        let free = g.add(Node {
            free_except: Some(vec![tok.eos_id()]),
            accepting: true,
            ..Node::default()
        });
        for opening in openings {
            let ids = tok.encode(opening);
            if ids.is_empty() {
                return Err(GrammarError::EmptyPiece {
                    env: "tool_choice".into(),
                    text: opening.clone(),
                });
            }
            g.literal(0, &ids, Some(free));
        }
        Ok(g)
    }

    fn build(p: &Pieces, eos: u32) -> Self {
        let mut g = ResponseGrammar {
            nodes: vec![Node::default()],
            eos,
        };
        let mut at = 0;
        if let Some((open, close)) = &p.think {
            let thoughts = g.literal(at, open, None);
            g.nodes[thoughts].free_except = Some(sorted_union(vec![close[0], eos], Vec::new()));
            at = g.literal(thoughts, close, None);
        }
        let mut choice = g.literal(at, &p.open, None);
        let done = g.add(Node {
            accepting: true,
            ..Node::default()
        });
        for i in 0..p.max_actions.max(1) {
            let chosen = g.add(Node::default());
            for action in &p.actions {
                g.literal(choice, action, Some(chosen));
            }
            g.literal(chosen, &p.close, Some(done));
            if i + 1 < p.max_actions {
                choice = g.literal(chosen, &p.separator, None);
            }
        }
        g
    }

    fn add(&mut self, node: Node) -> usize {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// Appends the chain of `tokens` from `from`, ending at `to` (a new node when `None`);
    /// returns the end node.
    fn literal(&mut self, from: usize, tokens: &[u32], to: Option<usize>) -> usize {
        let mut at = from;
        for (i, &t) in tokens.iter().enumerate() {
            let next = match to {
                Some(end) if i + 1 == tokens.len() => end,
                _ => self.add(Node::default()),
            };
            self.nodes[at].edges.push((t, next));
            at = next;
        }
        at
    }

    /// The tokens that may follow `generated`; `None` when `generated` already left the grammar
    /// (e.g. a response recorded without constraints), which callers treat as unconstrained.
    pub fn allowed(&self, generated: &[u32]) -> Option<Allowed> {
        let mut states = vec![0usize];
        for &t in generated {
            states = self.advance(&states, t);
            if states.is_empty() {
                return None;
            }
        }
        Some(
            states
                .iter()
                .map(|&s| self.allowed_at(s))
                .reduce(Allowed::union)
                .unwrap_or(Allowed::Only(Vec::new())),
        )
    }

    /// Per response token, what the grammar allowed at its position (`None` past a token the
    /// grammar did not admit).
    pub fn allowed_per_token(&self, response: &[u32]) -> Vec<Option<Allowed>> {
        (0..response.len())
            .map(|j| {
                self.allowed(&response[..j])
                    .filter(|a| a.contains(response[j]))
            })
            .collect()
    }

    fn advance(&self, states: &[usize], token: u32) -> Vec<usize> {
        let mut next: Vec<usize> = Vec::new();
        for &s in states {
            let node = &self.nodes[s];
            next.extend(
                node.edges
                    .iter()
                    .filter(|(t, _)| *t == token)
                    .map(|&(_, n)| n),
            );
            if let Some(except) = &node.free_except {
                if except.binary_search(&token).is_err() {
                    next.push(s);
                }
            }
        }
        next.sort_unstable();
        next.dedup();
        next
    }

    fn allowed_at(&self, state: usize) -> Allowed {
        let node = &self.nodes[state];
        let mut ids: Vec<u32> = node.edges.iter().map(|&(t, _)| t).collect();
        if node.accepting {
            ids.push(self.eos);
        }
        let only = Allowed::Only(sorted_union(ids, Vec::new()));
        match &node.free_except {
            Some(except) => only.union(Allowed::AllBut(except.clone())),
            None => only,
        }
    }
}

/// The encoded pieces of a grammar.
struct Pieces {
    think: Option<(Vec<u32>, Vec<u32>)>,
    open: Vec<u32>,
    close: Vec<u32>,
    separator: Vec<u32>,
    actions: Vec<Vec<u32>>,
    max_actions: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `<answer>`=1, `</answer>`=2, `||`=3, actions Up=10, Down=11, "Do"+"wn2"=11,12; eos 0.
    fn grammar(max_actions: usize, think: bool) -> ResponseGrammar {
        ResponseGrammar::build(
            &Pieces {
                think: think.then(|| (vec![20], vec![21, 22])),
                open: vec![1],
                close: vec![2],
                separator: vec![3],
                actions: vec![vec![10], vec![11], vec![11, 12]],
                max_actions,
            },
            0,
        )
    }

    fn only(ids: &[u32]) -> Option<Allowed> {
        Some(Allowed::Only(ids.to_vec()))
    }

    #[test]
    fn one_action_forces_the_tags_and_chooses_among_the_names() {
        let g = grammar(1, false);
        assert_eq!(g.allowed(&[]), only(&[1]));
        assert_eq!(g.allowed(&[1]), only(&[10, 11]));
        // "Down" is complete and also the start of "Down2": close or continue.
        assert_eq!(g.allowed(&[1, 11]), only(&[2, 12]));
        assert_eq!(g.allowed(&[1, 11, 12]), only(&[2]));
        assert_eq!(g.allowed(&[1, 10, 2]), only(&[0]));
        assert_eq!(g.allowed(&[10]), None);
    }

    #[test]
    fn several_actions_are_joined_by_the_separator_up_to_the_cap() {
        let g = grammar(2, false);
        assert_eq!(g.allowed(&[1, 10]), only(&[2, 3]));
        assert_eq!(g.allowed(&[1, 10, 3]), only(&[10, 11]));
        assert_eq!(g.allowed(&[1, 10, 3, 10]), only(&[2]));
    }

    #[test]
    fn thoughts_are_free_text_without_the_end_tokens() {
        let g = grammar(1, true);
        assert_eq!(g.allowed(&[]), only(&[20]));
        let free = g.allowed(&[20, 7, 8]).unwrap();
        assert_eq!(free, Allowed::AllBut(vec![0]));
        assert!(free.contains(21) && free.contains(5) && !free.contains(0));
        // 21 opens `</think>` (21 22) and is not free text: the tag must be completed.
        assert_eq!(g.allowed(&[20, 21]), only(&[22]));
        assert_eq!(g.allowed(&[20, 21, 22]), only(&[1]));
    }

    #[test]
    fn per_token_sets_stop_where_the_response_leaves_the_grammar() {
        let g = grammar(1, false);
        let sets = g.allowed_per_token(&[1, 10, 7, 2]);
        assert_eq!(sets[0], only(&[1]));
        assert_eq!(sets[1], only(&[10, 11]));
        assert_eq!(sets[2], None);
        assert_eq!(sets[3], None);
        assert_eq!(Allowed::AllBut(vec![2]).ids(4), vec![0, 1, 3]);
    }
}
