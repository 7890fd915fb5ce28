//! FrozenLake: a random square map of frozen cells and holes with a guaranteed start→goal
//! path, gymnasium dynamics (optionally slippery) and RAGEN's text render.
//!
//! Generator (RAGEN `frozen_lake/utils.py`): each cell is frozen with probability `p` (the
//! probability of *frozen*, as the code does; its docstring says hole), start and goal are drawn
//! uniformly, and the map is accepted when start ≠ goal and a 4-neighbour path exists.
//! Render: rows joined by `\n`, no separators; `P` player, `_` frozen, `O` hole, `G` goal, `X`
//! player in a hole, `√` player on the goal. Reward 1 on the goal, else 0; the episode terminates
//! on G or H and is truncated after `max_steps` actions.
//!
//! `render: grid_local` appends lines to the grid naming what each move leads to and the moves that
//! bring the player toward the goal with their distance (`Left: ice`, `Down: hole`, `Right: wall`,
//! `Up: goal`, `Goal:`, `Down 2`, `Left 1`). A small model trained from scratch cannot locate cells
//! in a row-major grid without absolute positions (RoPE gives only relative ones), so the built-in
//! default uses this render. Every action word starts a line, so it is the very token the answer
//! writes: the model can relate them by identity instead of learning that ` down` means `Down`
//! (that alone took oracle cloning from 0.09 to 0.73 success after 100 updates). `render:
//! grid_local_outcomes` also repeats each goal line's outcome (`Down 2: hole`), so the direction
//! and what it leads to sit on one line. `grid` (the default) is RAGEN's text unchanged.
//!
//! `distance_reward: c` (default 0) adds shaping: each move earns c × (distance to the goal before
//! − after), so a run can trade RAGEN's sparse reward for a per-step one without changing which
//! episodes succeed. `distance: manhattan` (default) counts rows plus columns, holes ignored;
//! `distance: path` pays by the shortest path over ice instead: a move earns +c exactly when it
//! is on a shortest path and −c otherwise (off the path, into a hole, or into a wall: a wasted move
//! costs like a wrong one, so bumping a wall is never a safe choice for a myopic return).
//!
//! Differences from RAGEN / ROLL:
//! - `is_slippery` defaults to true (RAGEN's `FrozenLakeEnvConfig`); ROLL's `traj_envs.yaml` sets
//!   it false. Slippery moves go the intended way with `success_rate` (default 1/3) and each
//!   perpendicular way with (1 − success_rate)/2 (gymnasium).
//! - A map is accepted only when its shortest start→goal path fits in `max_steps` moves, so every
//!   episode is solvable within the action cap (neither reference checks this), and needs at
//!   least `min_path` moves (default 1, any map: long-horizon maps for a larger value).
//! - Action names are `Left, Down, Right, Up` without numeric ids; invalid text never reaches the
//!   env (see the protocol). The RNG is owned and seeded from the reset seed only.

use std::collections::VecDeque;

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{bad_value, env_rng, flag, Action, ActionSpace, Env, EnvError, EnvInfo, Transition};

const ACTIONS: [&str; 4] = ["Left", "Down", "Right", "Up"];
/// Indices of [`ACTIONS`] (and [`OFFSETS`]).
const LEFT: usize = 0;
const DOWN: usize = 1;
const RIGHT: usize = 2;
const UP: usize = 3;
/// Row/column offsets of Left, Down, Right, Up (gymnasium order 0..3).
const OFFSETS: [(isize, isize); 4] = [(0, -1), (1, 0), (0, 1), (-1, 0)];

/// How a state is written for the agent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FrozenLakeRender {
    /// RAGEN's grid unchanged: rows joined by `\n`, no separators; `P` player, `_` frozen, `O`
    /// hole, `G` goal, `X` player in a hole, `√` player on the goal.
    #[default]
    Grid,
    /// The grid, then a line per move naming what it leads to (`Left: ice`, `Down: hole`,
    /// `Right: wall`, `Up: goal`) and the moves that bring the player toward the goal with their
    /// distance (`Goal:`, `Down 2`, `Left 1`). Every action word starts a line, so it is the
    /// very token the answer writes. A small model trained from scratch cannot locate cells in a
    /// row-major grid, so the built-in default uses this render.
    GridLocal,
    /// `grid_local` with each `Goal:` line also naming what its move leads to (`Down 2: hole`),
    /// so the direction and its outcome sit on one line.
    GridLocalOutcomes,
}

/// The distance to the goal that `distance_reward` shapes with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ShapingDistance {
    /// Rows plus columns, holes ignored: a move into a hole toward the goal earns the bonus.
    #[default]
    Manhattan,
    /// Moves along the shortest path over ice: a move earns the bonus exactly when it is on a
    /// shortest path to the goal, and every other move (off the path, into a hole or a wall) −coef.
    Path,
}

/// Which of the env's planning facts the state critic reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CriticFacts {
    /// The map's facts, then each move's: wall, hole, goal, nearer over ice, nearer by
    /// Manhattan distance, and the landing cell's adjacent holes and moves nearer over ice.
    #[default]
    All,
    /// As `all`, without the two per-move facts that say which moves bring the goal nearer
    /// over ice (the oracle's own decision rule).
    NoNearer,
    /// The map's facts only, no per-move fact.
    Map,
}

/// FrozenLake's own keys (`env_type: frozen_lake`): a random square map of frozen cells and
/// holes (RAGEN's generator) with a start→goal path that fits in `max_steps`, gymnasium
/// dynamics, reward 1 on the goal, else 0; the episode ends on the goal or in a hole. Actions:
/// `Left`, `Down`, `Right`, `Up`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(default)]
pub struct FrozenLakeConfig {
    /// Side of the square map, in 2..=64.
    pub size: usize,
    /// Probability that a cell is frozen (not a hole), in (0, 1].
    pub p: f64,
    /// Slippery ice: a move goes the intended way with `success_rate` and each perpendicular
    /// way with (1 − success_rate)/2, as gymnasium's (RAGEN's default; ROLL's configs use
    /// false).
    pub is_slippery: bool,
    /// Probability that a slippery move goes the intended way, in [0, 1].
    pub success_rate: f64,
    /// Env actions per episode (at least 1); a map is accepted only when its shortest
    /// start→goal path fits in this many moves, so every episode is solvable.
    pub max_steps: usize,
    /// Fewest moves a map's shortest start→goal path may need (1 to `max_steps`, and at most
    /// 2 × (size − 1)); longer ones make long-horizon maps. 1, any map, by default.
    pub min_path: usize,
    /// How a state is written for the agent.
    #[serde(default)]
    pub render: FrozenLakeRender,
    /// Per-move shaping added to the reward; 0 (RAGEN's sparse reward) by default. With
    /// `manhattan` it is potential-based (Ng et al., 1999), Φ(s) = −coef · distance to the goal:
    /// every move adds coef × (distance before − distance after), so an episode's shaping
    /// telescopes to coef × (start distance − end distance). With `path` a move earns +coef when
    /// it is on a shortest path over ice and −coef otherwise, a wall bump included (not a
    /// potential: a bump leaves Φ unchanged but costs a move). Success still means the goal.
    #[serde(default)]
    pub distance_reward: f64,
    /// Which distance `distance_reward` measures.
    #[serde(default)]
    pub distance: ShapingDistance,
    /// The planning facts a state critic (`critic.mode: state`) reads; the policy never sees
    /// them. For ablations of the asymmetric critic.
    #[serde(default)]
    pub critic_facts: CriticFacts,
}

impl Default for FrozenLakeConfig {
    fn default() -> Self {
        FrozenLakeConfig {
            size: 4,
            p: 0.8,
            is_slippery: true,
            success_rate: 1.0 / 3.0,
            max_steps: 10,
            min_path: 1,
            render: FrozenLakeRender::Grid,
            distance_reward: 0.0,
            distance: ShapingDistance::Manhattan,
            critic_facts: CriticFacts::All,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cell {
    Frozen,
    Hole,
    Goal,
}

/// The FrozenLake env.
pub struct FrozenLakeEnv {
    cfg: FrozenLakeConfig,
    cells: Vec<Cell>,
    player: usize,
    steps: usize,
    finished: bool,
    rng: ChaCha8Rng,
}

impl FrozenLakeEnv {
    /// Checks `cfg` (size in 2..=64, p in (0, 1], success_rate in [0, 1], max_steps ≥ 1, min_path
    /// in 1..=min(max_steps, 2 × (size − 1))) and resets to the map of seed 0; an out-of-range key is an [`EnvError::BadValue`].
    pub fn new(cfg: FrozenLakeConfig) -> Result<Self, EnvError> {
        let env = "frozen_lake";
        if !(2..=64).contains(&cfg.size) {
            return Err(bad_value(env, "size", "must be in 2..=64"));
        }
        if !(cfg.p > 0.0 && cfg.p <= 1.0) {
            return Err(bad_value(env, "p", "must be in (0, 1]"));
        }
        if !(0.0..=1.0).contains(&cfg.success_rate) {
            return Err(bad_value(env, "success_rate", "must be in [0, 1]"));
        }
        if cfg.max_steps == 0 {
            return Err(bad_value(env, "max_steps", "must be at least 1"));
        }
        if !(1..=cfg.max_steps.min(2 * (cfg.size - 1))).contains(&cfg.min_path) {
            return Err(bad_value(
                env,
                "min_path",
                "must be in 1..=min(max_steps, 2 × (size − 1))",
            ));
        }
        let mut lake = FrozenLakeEnv {
            cells: vec![Cell::Frozen; cfg.size * cfg.size],
            cfg,
            player: 0,
            steps: 0,
            finished: false,
            rng: env_rng(0, 0),
        };
        lake.reset(0)?;
        Ok(lake)
    }

    /// Side of the map.
    pub fn size(&self) -> usize {
        self.cfg.size
    }

    /// The goal's cell index (every generated map has one).
    fn goal(&self) -> usize {
        self.cells
            .iter()
            .position(|&c| c == Cell::Goal)
            .unwrap_or(0)
    }

    /// Manhattan distance from `pos` to the goal.
    fn goal_distance(&self, pos: usize) -> usize {
        let (size, goal) = (self.cfg.size, self.goal());
        (pos / size).abs_diff(goal / size) + (pos % size).abs_diff(goal % size)
    }

    /// The `distance_reward` of the move from `before` to the current cell (no map scan when off).
    fn shaping(&self, before: usize) -> f32 {
        let coef = self.cfg.distance_reward;
        if coef == 0.0 {
            return 0.0;
        }
        let closer = match self.cfg.distance {
            ShapingDistance::Manhattan => {
                self.goal_distance(before) as f64 - self.goal_distance(self.player) as f64
            }
            ShapingDistance::Path => {
                let moves = moves_to_goal(&self.cells, self.cfg.size);
                match (moves[before], moves[self.player]) {
                    (Some(from), Some(to)) if to + 1 == from => 1.0,
                    _ => -1.0,
                }
            }
        };
        (coef * closer) as f32
    }

    /// What the move in direction `dir` (Left, Down, Right, Up) would do, each in [0, 1]: it
    /// hits the wall, it steps into a hole, it reaches the goal, it brings the goal one move
    /// nearer over ice, it brings it nearer by Manhattan distance; and, when it lands on ice, that
    /// cell's adjacent holes and its moves that bring the goal nearer over ice (quarters). What
    /// the policy's next choice can lead to is what its value turns on, and the render names only
    /// the first three.
    /// `moves` is [`moves_to_goal`] of the map.
    fn move_facts(&self, dir: usize, moves: &[Option<usize>]) -> [f32; MOVE_FACTS] {
        let size = self.cfg.size;
        let next = neighbour(size, self.player, dir);
        let wall = next == self.player;
        let cell = self.cells[next];
        let nearer = |from: usize, to: usize| matches!((moves[from], moves[to]), (Some(a), Some(b)) if b < a);
        let lands_on_ice = !wall && cell == Cell::Frozen;
        let around = |count: &dyn Fn(usize) -> bool| {
            let hits = (0..4)
                .map(|d| neighbour(size, next, d))
                .filter(|&n| n != next && count(n))
                .count();
            if lands_on_ice {
                hits as f32 / 4.0
            } else {
                0.0
            }
        };
        [
            flag(wall),
            flag(!wall && cell == Cell::Hole),
            flag(!wall && cell == Cell::Goal),
            flag(!wall && nearer(self.player, next)),
            flag(self.goal_distance(next) < self.goal_distance(self.player)),
            around(&|n| self.cells[n] == Cell::Hole),
            around(&|n| nearer(next, n)),
        ]
    }

    /// The facts of the move in direction `dir` that `critic_facts` lets the critic read.
    fn read_move_facts(&self, dir: usize, moves: &[Option<usize>]) -> Vec<f32> {
        let facts = self.move_facts(dir, moves);
        match self.cfg.critic_facts {
            CriticFacts::All => facts.to_vec(),
            CriticFacts::NoNearer => facts
                .iter()
                .enumerate()
                .filter(|(i, _)| !NEARER_FACTS.contains(i))
                .map(|(_, &f)| f)
                .collect(),
            CriticFacts::Map => Vec::new(),
        }
    }

    /// Fewest moves from the player to the goal over ice on the non-slippery map.
    pub fn moves_left(&self) -> Option<usize> {
        moves_to_goal(&self.cells, self.cfg.size)[self.player]
    }

    /// Whether a path over ice leads from the player to the goal on which every move brings the
    /// goal one step nearer (what a policy that only ever steps toward the goal can find).
    fn monotone_path_exists(&self) -> bool {
        let size = self.cfg.size;
        let goal = self.goal();
        let (pr, pc) = (self.player / size, self.player % size);
        let (gr, gc) = (goal / size, goal % size);
        let (rows, cols) = (pr.abs_diff(gr), pc.abs_diff(gc));
        let cell = |i: usize, j: usize| {
            let r = if gr >= pr { pr + i } else { pr - i };
            let c = if gc >= pc { pc + j } else { pc - j };
            r * size + c
        };
        // open[i][j]: cell (i rows, j columns toward the goal) is reachable by such a path.
        let mut open = vec![vec![false; cols + 1]; rows + 1];
        for i in 0..=rows {
            for j in 0..=cols {
                let from_start = i == 0 && j == 0;
                let from_before = (i > 0 && open[i - 1][j]) || (j > 0 && open[i][j - 1]);
                open[i][j] = self.cells[cell(i, j)] != Cell::Hole && (from_start || from_before);
            }
        }
        open[rows][cols]
    }

    fn generate(&mut self, seed: u64) {
        let mut rng = env_rng(seed, 1);
        let n = self.cfg.size * self.cfg.size;
        loop {
            let mut cells: Vec<Cell> = (0..n)
                .map(|_| {
                    if rng.random::<f64>() < self.cfg.p {
                        Cell::Frozen
                    } else {
                        Cell::Hole
                    }
                })
                .collect();
            let start = rng.random_range(0..n);
            let goal = rng.random_range(0..n);
            if start == goal {
                continue;
            }
            cells[start] = Cell::Frozen;
            cells[goal] = Cell::Goal;
            let fits = moves_to_goal(&cells, self.cfg.size)[start]
                .is_some_and(|moves| (self.cfg.min_path..=self.cfg.max_steps).contains(&moves));
            if fits {
                self.cells = cells;
                self.player = start;
                return;
            }
        }
    }

    /// The direction actually taken for an intended one (slippery dynamics).
    fn executed_direction(&mut self, intended: usize) -> usize {
        if !self.cfg.is_slippery {
            return intended;
        }
        let u: f64 = self.rng.random();
        let side = (1.0 - self.cfg.success_rate) / 2.0;
        if u < self.cfg.success_rate {
            intended
        } else if u < self.cfg.success_rate + side {
            (intended + 3) % 4
        } else {
            (intended + 1) % 4
        }
    }

    fn invalid(&self) -> Transition {
        Transition {
            observation: self.state_text(),
            reward: 0.0,
            terminated: self.finished,
            truncated: false,
            info: EnvInfo {
                success: self.cells[self.player] == Cell::Goal,
                ..EnvInfo::default()
            },
        }
    }

    /// RAGEN's grid render.
    fn grid_text(&self) -> String {
        let size = self.cfg.size;
        let rows: Vec<String> = self
            .cells
            .chunks(size)
            .enumerate()
            .map(|(r, row)| {
                row.iter()
                    .enumerate()
                    .map(|(c, &cell)| match (r * size + c == self.player, cell) {
                        (true, Cell::Hole) => 'X',
                        (true, Cell::Goal) => '√',
                        (true, Cell::Frozen) => 'P',
                        (false, Cell::Hole) => 'O',
                        (false, Cell::Goal) => 'G',
                        (false, Cell::Frozen) => '_',
                    })
                    .collect()
            })
            .collect();
        rows.join("\n")
    }

    /// What each move leads to, then the moves toward the goal with their distance, one per line
    /// (`Left: ice` … `Up: goal`, `Goal:`, `Down 2`, `Left 1`); with `outcomes`, each goal line
    /// also names what its move leads to (`Down 2: hole`). Each line starts with the action word,
    /// so it is the same token the answer uses (a leading space would make it another one).
    fn local_text(&self, outcomes: bool) -> String {
        let size = self.cfg.size;
        let outcome = |dir: usize| {
            let next = neighbour(size, self.player, dir);
            match (next == self.player, self.cells[next]) {
                (true, _) => "wall",
                (false, Cell::Frozen) => "ice",
                (false, Cell::Hole) => "hole",
                (false, Cell::Goal) => "goal",
            }
        };
        let mut lines: Vec<String> = (0..4)
            .map(|dir| format!("{}: {}", ACTIONS[dir], outcome(dir)))
            .collect();
        let goal = self.goal();
        let rows = (goal / size) as isize - (self.player / size) as isize;
        let cols = (goal % size) as isize - (self.player % size) as isize;
        let toward = [
            (rows, if rows < 0 { UP } else { DOWN }),
            (cols, if cols < 0 { LEFT } else { RIGHT }),
        ];
        lines.push("Goal:".into());
        lines.extend(toward.iter().filter(|(distance, _)| *distance != 0).map(
            |&(distance, dir)| {
                let line = format!("{} {}", ACTIONS[dir], distance.unsigned_abs());
                if outcomes {
                    format!("{line}: {}", outcome(dir))
                } else {
                    line
                }
            },
        ));
        lines.join("\n")
    }
}

/// Numbers per move in the critic state ([`FrozenLakeEnv::move_facts`]).
const MOVE_FACTS: usize = 7;
/// The indices in [`FrozenLakeEnv::move_facts`] of the facts that say whether a move brings the
/// goal nearer over ice.
const NEARER_FACTS: [usize; 2] = [3, 6];

/// Cell reached from `pos` by direction `dir`; moving off the grid stays in place.
fn neighbour(size: usize, pos: usize, dir: usize) -> usize {
    let (row, col) = ((pos / size) as isize, (pos % size) as isize);
    let (dr, dc) = OFFSETS[dir];
    let (r, c) = (row + dr, col + dc);
    if r < 0 || c < 0 || r >= size as isize || c >= size as isize {
        pos
    } else {
        r as usize * size + c as usize
    }
}

/// Fewest moves over ice from each cell to the goal (BFS from the goal); `None` for holes and
/// cells cut off from it.
fn moves_to_goal(cells: &[Cell], size: usize) -> Vec<Option<usize>> {
    let mut moves = vec![None; cells.len()];
    let Some(goal) = cells.iter().position(|&c| c == Cell::Goal) else {
        return moves;
    };
    moves[goal] = Some(0);
    let mut queue = VecDeque::from([goal]);
    while let Some(pos) = queue.pop_front() {
        let next_moves = moves[pos].map(|m| m + 1);
        for dir in 0..4 {
            let next = neighbour(size, pos, dir);
            if moves[next].is_none() && cells[next] != Cell::Hole {
                moves[next] = next_moves;
                queue.push_back(next);
            }
        }
    }
    moves
}

impl Env for FrozenLakeEnv {
    fn tag(&self) -> &str {
        "frozen_lake"
    }

    fn reset(&mut self, seed: u64) -> Result<String, EnvError> {
        self.generate(seed);
        self.rng = env_rng(seed, 2);
        self.steps = 0;
        self.finished = false;
        Ok(self.state_text())
    }

    fn step(&mut self, action: &Action) -> Result<Transition, EnvError> {
        let intended = match action {
            Action::Move(name) => ACTIONS.iter().position(|a| a.eq_ignore_ascii_case(name)),
            _ => None,
        };
        let Some(intended) = intended.filter(|_| !self.finished) else {
            return Ok(self.invalid());
        };
        let dir = self.executed_direction(intended);
        let before = self.player;
        self.player = neighbour(self.cfg.size, self.player, dir);
        self.steps += 1;
        let cell = self.cells[self.player];
        let terminated = cell != Cell::Frozen;
        self.finished = terminated || self.steps >= self.cfg.max_steps;
        let goal_reward = if cell == Cell::Goal { 1.0 } else { 0.0 };
        Ok(Transition {
            observation: self.state_text(),
            reward: goal_reward + self.shaping(before),
            terminated,
            truncated: !terminated && self.steps >= self.cfg.max_steps,
            info: EnvInfo {
                success: cell == Cell::Goal,
                action_is_valid: true,
                action_is_effective: before != self.player,
                metrics: Vec::new(),
            },
        })
    }

    fn instruction(&self) -> String {
        let slip = if self.cfg.is_slippery {
            " The ice is slippery: a move may go sideways."
        } else {
            ""
        };
        format!(
            "FrozenLake: walk from P to the goal G without stepping into a hole O.{slip}\nSymbols: P player, _ ice, O hole, G goal, X player in a hole, √ player on the goal."
        )
    }

    fn state_text(&self) -> String {
        match self.cfg.render {
            FrozenLakeRender::Grid => self.grid_text(),
            FrozenLakeRender::GridLocal => {
                format!("{}\n{}", self.grid_text(), self.local_text(false))
            }
            FrozenLakeRender::GridLocalOutcomes => {
                format!("{}\n{}", self.grid_text(), self.local_text(true))
            }
        }
    }

    /// Planning facts of the whole map that the render does not state, each in [0, 1]:
    /// Manhattan distance to the goal, fewest moves over ice to it (1 when cut off), whether
    /// it can be reached, whether a path exists on which every move brings the goal nearer, the
    /// detour of the shortest path over the Manhattan distance, adjacent holes, the share of the
    /// action budget left, and whether the fewest moves fit in it; then each move's facts
    /// ([`FrozenLakeEnv::move_facts`], Left, Down, Right, Up). Facts, not the raw map: an MLP on
    /// a one-hot of every cell fits each batch's maps and does not carry over to fresh ones.
    fn critic_state(&self) -> Option<Vec<f32>> {
        let size = self.cfg.size;
        let budget = self.cfg.max_steps as f32;
        let left = self.cfg.max_steps.saturating_sub(self.steps);
        let manhattan = self.goal_distance(self.player);
        let moves = moves_to_goal(&self.cells, size);
        let fewest = moves[self.player];
        let adjacent_holes = (0..4)
            .map(|dir| neighbour(size, self.player, dir))
            .filter(|&next| next != self.player && self.cells[next] == Cell::Hole)
            .count();
        Some(
            vec![
                manhattan as f32 / (2 * (size - 1)).max(1) as f32,
                fewest.map_or(1.0, |m| (m as f32 / budget).min(1.0)),
                flag(fewest.is_some()),
                flag(self.monotone_path_exists()),
                fewest.map_or(1.0, |m| ((m - manhattan) as f32 / budget).min(1.0)),
                adjacent_holes as f32 / 4.0,
                left as f32 / budget,
                flag(fewest.is_some_and(|m| m <= left)),
            ]
            .into_iter()
            .chain((0..4).flat_map(|dir| self.read_move_facts(dir, &moves)))
            .collect(),
        )
    }

    fn action_space(&self) -> ActionSpace {
        ActionSpace::Named(ACTIONS.iter().map(|s| s.to_string()).collect())
    }

    fn max_steps(&self) -> usize {
        self.cfg.max_steps
    }

    fn oracle_action(&self) -> Result<Action, EnvError> {
        // The first direction (Left, Down, Right, Up order) that brings a shortest path one move
        // nearer.
        let size = self.cfg.size;
        let moves = moves_to_goal(&self.cells, size);
        let nearer = moves[self.player].and_then(|left| left.checked_sub(1));
        let dir = (0..4)
            .find(|&dir| nearer.is_some() && moves[neighbour(size, self.player, dir)] == nearer)
            .unwrap_or(0);
        Ok(Action::Move(ACTIONS[dir].to_string()))
    }

    fn random_action(&self, rng: &mut ChaCha8Rng) -> Result<Action, EnvError> {
        Ok(Action::Move(ACTIONS[rng.random_range(0..4)].to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lake(overrides: FrozenLakeConfig) -> FrozenLakeEnv {
        FrozenLakeEnv::new(overrides).unwrap()
    }

    #[test]
    fn render_uses_ragen_symbols() {
        let mut env = lake(FrozenLakeConfig::default());
        let text = env.reset(3).unwrap();
        let rows: Vec<&str> = text.split('\n').collect();
        assert_eq!(rows.len(), 4);
        assert!(rows.iter().all(|r| r.chars().count() == 4));
        assert_eq!(text.matches('P').count(), 1);
        assert_eq!(text.matches('G').count(), 1);
        assert!(text.chars().all(|c| "P_OG\n".contains(c)));
    }

    #[test]
    fn grid_local_names_each_move_and_the_goal_offset() {
        let mut env = lake(FrozenLakeConfig {
            is_slippery: false,
            render: FrozenLakeRender::GridLocal,
            ..FrozenLakeConfig::default()
        });
        env.reset(0).unwrap();
        env.cells = vec![Cell::Frozen; 16];
        env.cells[5] = Cell::Hole; // row 1, col 1
        env.cells[14] = Cell::Goal; // row 3, col 2
        env.player = 4; // row 1, col 0
        let text = env.state_text();
        assert_eq!(
            text,
            "____\nPO__\n____\n__G_\nLeft: wall\nDown: ice\nRight: hole\nUp: ice\nGoal:\nDown 2\nRight 2"
        );
        env.cfg.render = FrozenLakeRender::GridLocalOutcomes;
        assert!(env
            .state_text()
            .ends_with("Up: ice\nGoal:\nDown 2: ice\nRight 2: hole"));
        env.player = 15; // row 3, col 3: the goal is on the same row, to the left
        assert!(env
            .state_text()
            .ends_with("Left: goal\nDown: wall\nRight: wall\nUp: ice\nGoal:\nLeft 1: goal"));
        env.cfg.render = FrozenLakeRender::GridLocal;
        assert!(env.state_text().ends_with("Goal:\nLeft 1"));
    }

    #[test]
    fn grid_local_writes_action_words_as_the_answer_tokens() {
        let mut env = lake(FrozenLakeConfig {
            is_slippery: false,
            render: FrozenLakeRender::GridLocal,
            ..FrozenLakeConfig::default()
        });
        for seed in 0..8 {
            env.reset(seed).unwrap();
            crate::env::assert_action_words_are_answer_tokens(&env.state_text(), &ACTIONS);
        }
    }

    #[test]
    fn generated_maps_have_a_short_enough_path() {
        let mut env = lake(FrozenLakeConfig {
            size: 6,
            p: 0.6,
            ..FrozenLakeConfig::default()
        });
        for seed in 0..200 {
            env.reset(seed).unwrap();
            let moves = env.moves_left().expect("path exists");
            assert!((1..=10).contains(&moves));
        }
    }

    #[test]
    fn min_path_makes_every_map_need_that_many_moves_and_is_checked() {
        let mut env = lake(FrozenLakeConfig {
            size: 10,
            max_steps: 40,
            min_path: 15,
            ..FrozenLakeConfig::default()
        });
        for seed in 0..50 {
            env.reset(seed).unwrap();
            let moves = env.moves_left().expect("path exists");
            assert!((15..=40).contains(&moves), "seed {seed}: {moves} moves");
        }
        for (size, max_steps, min_path) in [(4, 10, 7), (10, 12, 13), (4, 10, 0)] {
            let cfg = FrozenLakeConfig {
                size,
                max_steps,
                min_path,
                ..FrozenLakeConfig::default()
            };
            let err = FrozenLakeEnv::new(cfg).err().expect("refused").to_string();
            assert!(err.contains("min_path"), "{err}");
        }
    }

    /// Reward and termination of `action` played from cell `pos` on a fresh episode.
    fn move_from(env: &mut FrozenLakeEnv, pos: usize, action: &str) -> (f32, bool) {
        env.player = pos;
        env.finished = false;
        env.steps = 0;
        let t = env.step(&Action::Move(action.into())).unwrap();
        (t.reward, t.terminated)
    }

    /// Whether a [`move_from`] result pays `want`.
    fn close((reward, _): (f32, bool), want: f32) -> bool {
        (reward - want).abs() < 1e-6
    }

    #[test]
    fn distance_reward_pays_each_move_by_how_much_closer_it_brings_the_goal() {
        let mut env = lake(FrozenLakeConfig {
            is_slippery: false,
            distance_reward: 0.1,
            ..FrozenLakeConfig::default()
        });
        env.reset(0).unwrap();
        env.cells = vec![Cell::Frozen; 16];
        env.cells[2] = Cell::Goal; // row 0, col 2
        env.cells[8] = Cell::Hole; // row 2, col 0
        let mut from = |pos: usize, action: &str| move_from(&mut env, pos, action);
        assert!(close(from(4, "Right"), 0.1), "toward the goal");
        assert!(close(from(5, "Down"), -0.1), "away from it");
        assert!(close(from(0, "Up"), 0.0), "into the wall");
        assert!(close(from(1, "Right"), 1.1), "onto the goal");
        let hole = from(4, "Down");
        assert!(
            close(hole, -0.1) && hole.1,
            "into a hole: the move's shaping, then the end"
        );
    }

    /// Resets `env` (4×4) and lays out this map:
    /// ```text
    /// ____
    /// _GO_
    /// _O__   cells 5 goal, 6 and 9 holes
    /// ____
    /// ```
    fn goal_behind_holes(env: &mut FrozenLakeEnv) {
        env.reset(0).unwrap();
        env.cells = vec![Cell::Frozen; 16];
        env.cells[5] = Cell::Goal;
        env.cells[6] = Cell::Hole;
        env.cells[9] = Cell::Hole;
    }

    #[test]
    fn the_critic_state_states_the_maps_planning_facts() {
        let mut env = lake(FrozenLakeConfig {
            is_slippery: false,
            max_steps: 10,
            ..FrozenLakeConfig::default()
        });
        // P at 10: both moves toward the goal are holes; the shortest way round is 6 moves
        // (Down, Left, Left, Up, Up, Right), Manhattan distance 2.
        goal_behind_holes(&mut env);
        env.player = 10;
        env.steps = 5;
        let state = env.critic_state().unwrap();
        let whole_map = [2.0 / 6.0, 0.6, 1.0, 0.0, 0.4, 0.5, 0.5, 0.0];
        // Per move: wall, hole, goal, nearer over ice, nearer by Manhattan distance, then the
        // landing cell's adjacent holes and moves nearer over ice (quarters). Left (9) and Up
        // (6) are holes a Manhattan step nearer; Down (14, 5 moves left) and Right (11, 5 moves
        // left) go round, each with one way on (13 and 7, 4 moves left) and no hole beside it.
        let hole_nearer = [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0];
        let way_round = [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.25];
        let expected: Vec<f32> = [whole_map.as_slice(), &hole_nearer, &way_round, &way_round]
            .concat()
            .into_iter()
            .chain(hole_nearer)
            .collect();
        assert_eq!(state.len(), expected.len());
        for (got, want) in state.iter().zip(&expected) {
            assert!((got - want).abs() < 1e-6, "{state:?} vs {expected:?}");
        }
        // From 4 (left of the goal): Left is the wall, Right the goal; Down lands on 8, beside
        // the hole at 9, from which Up (back to 4) is the one move nearer.
        env.player = 4;
        let moves = &env.critic_state().unwrap()[8..];
        assert_eq!(&moves[..7], &[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(&moves[7..14], &[0.0, 0.0, 0.0, 0.0, 0.0, 0.25, 0.25]);
        assert_eq!(&moves[14..21], &[0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]);
        // From 11 the goal is 3 moves away over ice but every path first moves away from it.
        env.player = 11;
        assert!(!env.monotone_path_exists());
        // From 4 (left of the goal) one move toward it suffices.
        env.player = 4;
        assert!(env.monotone_path_exists());
        assert_eq!(env.critic_state().unwrap()[3], 1.0);
    }

    #[test]
    fn critic_facts_choose_what_the_critic_reads() {
        let state_with = |critic_facts| {
            let mut env = lake(FrozenLakeConfig {
                is_slippery: false,
                critic_facts,
                ..FrozenLakeConfig::default()
            });
            goal_behind_holes(&mut env);
            env.player = 10;
            env.critic_state().unwrap()
        };
        let all = state_with(CriticFacts::All);
        let without_nearer = state_with(CriticFacts::NoNearer);
        assert_eq!(state_with(CriticFacts::Map), all[..8]);
        // Each move keeps wall, hole, goal, nearer by Manhattan distance and adjacent holes.
        let kept: Vec<f32> = (0..4)
            .flat_map(|dir| {
                let facts = &all[8 + dir * MOVE_FACTS..8 + (dir + 1) * MOVE_FACTS];
                [facts[0], facts[1], facts[2], facts[4], facts[5]]
            })
            .collect();
        assert_eq!(without_nearer, [&all[..8], kept.as_slice()].concat());
        // Down goes round the holes: the fact the ablation removes was there.
        assert_eq!(all[8 + MOVE_FACTS + 3], 1.0);
    }

    #[test]
    fn path_distance_reward_pays_moves_on_a_shortest_path_over_ice() {
        let mut env = lake(FrozenLakeConfig {
            is_slippery: false,
            distance_reward: 0.1,
            distance: ShapingDistance::Path,
            ..FrozenLakeConfig::default()
        });
        // P at 10: toward the goal are Left and Up, both holes; the ways round start Down or
        // Right.
        goal_behind_holes(&mut env);
        let mut from = |pos: usize, action: &str| move_from(&mut env, pos, action);
        assert!(close(from(10, "Up"), -0.1), "into a hole toward the goal");
        assert!(close(from(10, "Left"), -0.1), "into the other hole");
        assert!(
            close(from(10, "Down"), 0.1),
            "round the holes: 6 moves left, then 5"
        );
        assert!(close(from(11, "Left"), -0.1), "back into the dead end");
        assert!(close(from(15, "Down"), -0.1), "into the wall: a move lost");
        assert!(close(from(4, "Right"), 1.1), "onto the goal");
    }

    #[test]
    fn slippery_moves_match_the_spec_statistically() {
        let mut env = lake(FrozenLakeConfig {
            size: 5,
            ..FrozenLakeConfig::default()
        });
        env.cells = vec![Cell::Frozen; 25];
        env.cells[0] = Cell::Goal;
        let centre = 12;
        let trials = 40_000;
        let mut counts = [0usize; 4]; // intended, left-perpendicular, right-perpendicular, backward
        for i in 0..trials {
            let intended = i % 4;
            env.player = centre;
            env.finished = false;
            env.steps = 0;
            env.step(&Action::Move(ACTIONS[intended].to_string()))
                .unwrap();
            let taken = (0..4)
                .find(|&d| neighbour(5, centre, d) == env.player)
                .unwrap();
            counts[(taken + 4 - intended) % 4] += 1;
        }
        let freq = |k: usize| counts[k] as f64 / trials as f64;
        assert!((freq(0) - 1.0 / 3.0).abs() < 0.01, "{counts:?}");
        assert!((freq(3) - 1.0 / 3.0).abs() < 0.01, "{counts:?}");
        assert!((freq(1) - 1.0 / 3.0).abs() < 0.01, "{counts:?}");
        assert_eq!(counts[2], 0, "never moves backwards");
    }

    #[test]
    fn non_slippery_moves_are_exact_and_walls_block() {
        let mut env = lake(FrozenLakeConfig {
            is_slippery: false,
            ..FrozenLakeConfig::default()
        });
        env.reset(0).unwrap();
        env.cells = vec![Cell::Frozen; 16];
        env.cells[15] = Cell::Goal;
        env.player = 0;
        let t = env.step(&Action::Move("Up".into())).unwrap();
        assert!(!t.info.action_is_effective && env.player == 0);
        let t = env.step(&Action::Move("Right".into())).unwrap();
        assert!(t.info.action_is_effective && env.player == 1);
        let t = env.step(&Action::Move("Jump".into())).unwrap();
        assert!(!t.info.action_is_valid && env.player == 1);
    }

    #[test]
    fn falling_in_a_hole_terminates_without_success() {
        let mut env = lake(FrozenLakeConfig {
            is_slippery: false,
            ..FrozenLakeConfig::default()
        });
        env.reset(0).unwrap();
        env.cells = vec![Cell::Frozen; 16];
        env.cells[1] = Cell::Hole;
        env.cells[15] = Cell::Goal;
        env.player = 0;
        let t = env.step(&Action::Move("Right".into())).unwrap();
        assert!(t.terminated && !t.info.success && t.reward == 0.0);
        assert!(t.observation.starts_with("_X"));
    }
}
