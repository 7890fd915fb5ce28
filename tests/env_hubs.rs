//! The env-hub servers of `examples/` (GEM, TextArena, TextWorld) through the env bridge: each
//! started on a free port, its episodes played by stepppo's `remote` env with the oracle agent
//! the server offers (`oracle_action`) and the random agent (listed or admissible actions). A
//! seed above a server's `seed_max` reaches it modulo its range, and one seed gives one episode
//! whatever else the server runs. Needs the hubs in the examples venv
//! (`STEPPPO_EXAMPLES_HUBS=1 bash scripts/examples_venv.sh`); skips, saying so, without them.

mod examples_python;
use examples_python::hub_python;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use serde_json::json;
use stepppo::env::{
    build_session, play_episode, response_text, Action, ActionSpace, Agent, AgentKind, AgentSession,
};

/// A hub server on a free port; killed when dropped.
struct HubServer {
    child: Child,
    url: String,
}

impl HubServer {
    fn start(python: &Path, script: &str, args: &[&str]) -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("examples")
            .join(script);
        let mut child = Command::new(python)
            .arg(&script)
            .args(args)
            .args(["--port", "0"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("the server starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = match line.trim().split_once(" at ") {
            Some((_, url)) => url.to_string(),
            None => panic!(
                "{} did not say where it listens: {line:?}",
                script.display()
            ),
        };
        HubServer { child, url }
    }

    fn session(&self, max_turns: usize) -> AgentSession {
        let config = json!({"url": self.url, "timeout": 60.0, "max_turns": max_turns});
        build_session("remote", &config).unwrap()
    }
}

impl Drop for HubServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Plays `seeds` with `kind`; the share of episodes won.
fn success(session: &mut AgentSession, kind: AgentKind, seeds: &[u64]) -> f64 {
    let mut agent = Agent::new(kind, 7);
    let won = seeds
        .iter()
        .map(|&seed| {
            let episode = play_episode(session, seed, &mut |s| agent.respond(s))
                .unwrap_or_else(|e| panic!("{kind:?}, seed {seed}: {e}"));
            usize::from(episode.success())
        })
        .sum::<usize>();
    won as f64 / seeds.len() as f64
}

#[test]
fn gem_guess_the_number_is_won_by_its_oracle_and_one_seed_is_one_game() {
    let Some(python) = hub_python("gem_guess_the_number", "gem") else {
        return;
    };
    let server = HubServer::start(
        &python,
        "gem_env_server.py",
        &["--env-id", "game:GuessTheNumber-v0-easy"],
    );
    let mut session = server.session(4);
    // A fixed range of ten numbers is listed, so constrained decoding applies.
    let numbers: Vec<String> = (1..=10).map(|n| n.to_string()).collect();
    assert!(
        matches!(session.env().action_space(), ActionSpace::Named(names) if names == numbers),
        "the easy game lists 1..10"
    );
    // Seeds beyond 2^32 − 1 (GEM's range) are sent modulo it, as the rollout's derived seeds are.
    let seeds = [0, 1, 2, u64::MAX, 1 << 40];
    assert_eq!(success(&mut session, AgentKind::Oracle, &seeds), 1.0);
    let mut other = server.session(4);
    let first = session.reset(1 << 40).unwrap();
    other.reset(5).unwrap();
    assert_eq!(first, server.session(4).reset(1 << 40).unwrap());
    assert!(
        first.contains("between 1 and 10"),
        "the episode's own rules: {first}"
    );
}

#[test]
fn gem_with_win_only_reward_pays_exactly_the_won_games() {
    let Some(python) = hub_python("gem_win_only_reward", "gem") else {
        return;
    };
    let server = HubServer::start(
        &python,
        "gem_env_server.py",
        &["--env-id", "game:GuessTheNumber-v0-easy", "--reward", "win"],
    );
    let mut session = server.session(8);
    // Guesses 1, 2, 3, ... in turn: wins the games whose number comes before the turn limit,
    // loses the others at it (where GEM's own reward pays a partial score).
    let (mut won, mut paid) = (0, 0.0f32);
    for seed in 0..12 {
        let mut guess = 0;
        let episode = play_episode(&mut session, seed, &mut |s| {
            guess += 1;
            let think = s.protocol().enable_think;
            Ok(response_text(&Action::Move(guess.to_string()), think))
        })
        .unwrap();
        won += usize::from(episode.success());
        let rewards: Vec<f32> = episode.turns.iter().map(|t| t.outcome.reward).collect();
        assert!(rewards.iter().all(|&r| r == 0.0 || r == 1.0), "{rewards:?}");
        paid += rewards.iter().sum::<f32>();
    }
    assert_eq!(paid, won as f32);
    assert!(
        0 < won && won < 12,
        "an ascending guesser wins some games: {won}"
    );
}

/// `--describe-state`: each observation ends with the numbers the hints so far leave, and the
/// bisection oracle halves them every turn.
#[test]
fn gem_guess_the_number_describes_the_numbers_the_hints_leave() {
    let Some(python) = hub_python("gem_describe_state", "gem") else {
        return;
    };
    let server = HubServer::start(
        &python,
        "gem_env_server.py",
        &[
            "--env-id",
            "game:GuessTheNumber-v0-easy",
            "--describe-state",
        ],
    );
    let mut session = server.session(4);
    let first = session.reset(11).unwrap();
    assert!(first.contains("The hints so far leave 1 to 10."), "{first}");
    // Guessing 1 then 10 narrows the range from both ends (unless either wins).
    let mut seen = Vec::new();
    let mut guesses = ["1", "10", "5", "6"].into_iter();
    let episode = play_episode(&mut session, 11, &mut |s| {
        seen.push(s.state_text().to_string());
        let think = s.protocol().enable_think;
        Ok(response_text(
            &Action::Move(guesses.next().unwrap().into()),
            think,
        ))
    })
    .unwrap();
    let narrowed = seen.iter().any(|o| o.contains("leave 2 to 9."));
    assert!(
        narrowed || episode.turns.len() < 3,
        "after guesses 1 and 10: {seen:?}"
    );
    assert_eq!(success(&mut session, AgentKind::Oracle, &[11, 12, 13]), 1.0);
}

#[test]
fn textarena_frozen_lake_is_won_by_its_oracle_and_played_by_the_random_agent() {
    let Some(python) = hub_python("textarena_frozen_lake", "textarena") else {
        return;
    };
    let server = HubServer::start(
        &python,
        "textarena_env_server.py",
        &["--env-id", "FrozenLake-v0"],
    );
    let mut session = server.session(16);
    assert_eq!(success(&mut session, AgentKind::Oracle, &[3, 4, 5]), 1.0);
    let random = success(&mut session, AgentKind::Random, &[3, 4, 5, 6]);
    assert!(
        random < 1.0,
        "a random walk does not cross every lake: {random}"
    );
}

/// `--describe-moves`: every observation ends with what each move leads to, and following it
/// (never into a hole or off the edge) is what the oracle does.
#[test]
fn textarena_frozen_lake_describes_where_each_move_leads() {
    let Some(python) = hub_python("textarena_describe_moves", "textarena") else {
        return;
    };
    let server = HubServer::start(
        &python,
        "textarena_env_server.py",
        &["--env-id", "FrozenLake-v0", "--describe-moves"],
    );
    let mut session = server.session(16);
    let first = session.reset(3).unwrap();
    let said = first
        .lines()
        .find(|l| l.starts_with("What each move leads to: up: "))
        .unwrap_or_else(|| panic!("no move description in {first:?}"));
    assert!(said.contains("right: "), "{said}");
    // Seed 3's lake: a hole below the start, the edge above and to the left.
    assert!(
        said.contains("down: a hole") && said.contains("up: the edge"),
        "{said}"
    );
    assert_eq!(success(&mut session, AgentKind::Oracle, &[3, 4, 5]), 1.0);
}

#[test]
fn a_textworld_pool_game_is_won_by_its_walkthrough_and_played_among_its_admissible_commands() {
    let Some(python) = hub_python("textworld_pool", "textworld") else {
        return;
    };
    let pool = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let made = Command::new("bash")
        .arg(root.join("scripts/make_textworld_pool.sh"))
        .arg(pool.path())
        .arg("2")
        .env("TW_MAKE", python.with_file_name("tw-make"))
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let pool_dir = pool.path().to_str().unwrap();
    let server = HubServer::start(&python, "textworld_env_server.py", &["--pool", pool_dir]);
    let mut session = server.session(20);
    // The pool's seed_max is 1: seed 7 is sent as 7 mod 2, game 1 (the server refuses 7 itself).
    assert_eq!(success(&mut session, AgentKind::Oracle, &[0, 7]), 1.0);
    let mut random = Agent::new(AgentKind::Random, 3);
    let episode = play_episode(&mut session, 0, &mut |s| random.respond(s)).unwrap();
    assert!(
        episode.turns.iter().all(|t| t.outcome.info.action_is_valid),
        "the random agent plays admissible commands only"
    );
    // A command with a NUL byte and non-ASCII letters (as a sampling model may write) is read as
    // an unknown command, not passed to the interpreter, which a NUL crashes.
    let mut odd = ["take\u{0}key é", "\u{0}"].into_iter();
    let episode = play_episode(&mut session, 1, &mut |s| {
        let think = s.protocol().enable_think;
        Ok(response_text(
            &Action::Move(odd.next().unwrap_or("look").into()),
            think,
        ))
    });
    let episode = episode.expect("the server answers every command");
    assert!(!episode.turns[0].outcome.info.action_is_valid);
    assert_eq!(success(&mut session, AgentKind::Oracle, &[1]), 1.0);
}
