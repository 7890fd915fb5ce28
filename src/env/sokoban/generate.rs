//! Room generation by reverse play (gym-sokoban / RAGEN `sokoban/utils.py`): a random-walk
//! topology stamped with 3×3 masks, the player and boxes placed on targets, then a bounded
//! depth-first search in which the player *pulls* boxes away from their targets; the reachable
//! state with the best score `box_swaps × Σ Manhattan displacement` (no box left on a target)
//! becomes the puzzle; then RAGEN's random player movement (up to 3 steps) is applied.
//!
//! Differences: a box swap is counted when the pulled box differs from the previously pulled one
//! (RAGEN passes the parent's `last_pull` down, which counts nearly every pull); the state bound
//! (`max_states`, RAGEN 300 000) is configurable; failures are retried by the caller with a
//! deterministic re-seed instead of Python's salted `hash(str(seed))`.

use std::collections::HashSet;

use rand::seq::IndexedRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::room::{bit, Room};

/// The five 3×3 stamps of the topology walk.
const MASKS: [[[u8; 3]; 3]; 5] = [
    [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
    [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
    [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
];
const WALK_DIRECTIONS: [(isize, isize); 4] = [(1, 0), (0, 1), (-1, 0), (0, -1)];
const P_CHANGE_DIRECTIONS: f64 = 0.35;
/// Topologies tried per generation call (RAGEN `tries = 4`).
const TRIES: usize = 4;

/// Generation settings.
#[derive(Clone, Copy, Debug)]
pub struct GenParams {
    /// Room columns, border walls included.
    pub width: usize,
    /// Room rows, border walls included.
    pub height: usize,
    /// Boxes (and targets) to place.
    pub num_boxes: usize,
    /// Depth (TTL) of the reverse search.
    pub search_depth: usize,
    /// Most distinct states the reverse search explores.
    pub max_states: usize,
}

/// One generation call: up to four topologies; `None` when every reverse search scored 0.
pub fn generate_room(params: &GenParams, rng: &mut ChaCha8Rng) -> Option<Room> {
    let (room, displacement) = (0..TRIES).find_map(|_| {
        let walls = topology(params, rng);
        let room = place_player_and_boxes(params, walls, rng)?;
        reverse_play(params, room)
    })?;
    Some(random_player_movement(room, displacement, rng))
}

/// RAGEN's `add_random_player_movement`: with probability 0.8 (box displaced by 1) or 0.5,
/// walk the player up to 3 steps to unvisited free cells, continuing each time with
/// probability 0.5. Boxes do not move.
fn random_player_movement(mut room: Room, displacement: usize, rng: &mut ChaCha8Rng) -> Room {
    let start_probability = if displacement == 1 { 0.8 } else { 0.5 };
    if rng.random::<f64>() >= start_probability {
        return room;
    }
    let mut visited = vec![room.player];
    for _ in 0..3 {
        let options: Vec<usize> = (0..4)
            .filter_map(|dir| room.neighbour(room.player, dir))
            .filter(|&c| !room.is_wall(c) && !room.has_box(c) && !visited.contains(&c))
            .collect();
        let Some(&next) = options.choose(rng) else {
            break;
        };
        room.player = next;
        visited.push(next);
        if rng.random::<f64>() >= 0.5 {
            break;
        }
    }
    room
}

/// Random-walk floor plan; returns the wall mask (borders are always walls).
fn topology(params: &GenParams, rng: &mut ChaCha8Rng) -> u128 {
    let (rows, cols) = (params.height, params.width);
    let mut floor = vec![false; rows * cols];
    let steps = (1.7 * (rows + cols) as f64) as usize;
    let mut direction = *WALK_DIRECTIONS.choose(rng).expect("non-empty");
    let mut row = rng.random_range(1..rows) as isize;
    let mut col = rng.random_range(1..cols) as isize;
    for _ in 0..steps {
        if rng.random::<f64>() < P_CHANGE_DIRECTIONS {
            direction = *WALK_DIRECTIONS.choose(rng).expect("non-empty");
        }
        row = (row + direction.0).clamp(1, rows as isize - 2);
        col = (col + direction.1).clamp(1, cols as isize - 2);
        let mask = MASKS.choose(rng).expect("non-empty");
        for (dr, mask_row) in mask.iter().enumerate() {
            for (dc, &on) in mask_row.iter().enumerate() {
                if on == 1 {
                    let (r, c) = (row as usize + dr - 1, col as usize + dc - 1);
                    floor[r * cols + c] = true;
                }
            }
        }
    }
    let mut walls = 0u128;
    for r in 0..rows {
        for c in 0..cols {
            let border = r == 0 || c == 0 || r == rows - 1 || c == cols - 1;
            if border || !floor[r * cols + c] {
                walls |= bit(r * cols + c);
            }
        }
    }
    walls
}

/// Puts the player and `num_boxes` boxes (each on its own target) on distinct floor cells.
fn place_player_and_boxes(params: &GenParams, walls: u128, rng: &mut ChaCha8Rng) -> Option<Room> {
    let cells = params.width * params.height;
    let mut free: Vec<usize> = (0..cells).filter(|&c| walls & bit(c) == 0).collect();
    if free.len() < params.num_boxes + 1 {
        return None;
    }
    let player = free.swap_remove(rng.random_range(0..free.len()));
    let mut targets = 0u128;
    for _ in 0..params.num_boxes {
        targets |= bit(free.swap_remove(rng.random_range(0..free.len())));
    }
    Some(Room {
        width: params.width,
        height: params.height,
        walls,
        targets,
        boxes: targets,
        player,
    })
}

/// Bounded reverse search from the solved room; the best-scoring start state (with its box
/// displacement), if any scores > 0.
fn reverse_play(params: &GenParams, solved: Room) -> Option<(Room, usize)> {
    let origins: Vec<usize> = (0..solved.width * solved.height)
        .filter(|&c| solved.has_box(c))
        .collect();
    let mut search = ReverseSearch {
        max_states: params.max_states,
        explored: HashSet::new(),
        origins: origins.clone(),
        best: None,
    };
    let mut boxes = origins;
    search.visit(solved, &mut boxes, 0, None, params.search_depth);
    search
        .best
        .map(|(_, room, displacement)| (room, displacement))
}

struct ReverseSearch {
    max_states: usize,
    explored: HashSet<(u128, usize)>,
    /// Target cell of each box (box ids are indices).
    origins: Vec<usize>,
    /// (score, room, box displacement) of the best state so far.
    best: Option<(usize, Room, usize)>,
}

impl ReverseSearch {
    fn visit(
        &mut self,
        room: Room,
        boxes: &mut [usize],
        swaps: usize,
        last_pull: Option<usize>,
        ttl: usize,
    ) {
        if ttl <= 1 || self.explored.len() >= self.max_states {
            return;
        }
        if !self.explored.insert((room.boxes, room.player)) {
            return;
        }
        self.consider(room, boxes, swaps);
        for dir in 0..4 {
            let Some(next) = room
                .neighbour(room.player, dir)
                .filter(|&c| !room.is_wall(c) && !room.has_box(c))
            else {
                continue;
            };
            let behind = room.neighbour(room.player, opposite(dir));
            let pulled = behind.and_then(|b| boxes.iter().position(|&p| p == b));
            let mut child = Room {
                player: next,
                ..room
            };
            let (child_swaps, child_last) = match pulled {
                Some(id) => {
                    child.boxes = (room.boxes & !bit(boxes[id])) | bit(room.player);
                    boxes[id] = room.player;
                    (swaps + usize::from(last_pull != Some(id)), Some(id))
                }
                None => (swaps, last_pull),
            };
            self.visit(child, boxes, child_swaps, child_last, ttl - 1);
            if let (Some(id), Some(b)) = (pulled, behind) {
                boxes[id] = b;
            }
        }
    }

    fn consider(&mut self, room: Room, boxes: &[usize], swaps: usize) {
        if room.boxes & room.targets != 0 {
            return;
        }
        let width = room.width;
        let displacement: usize = boxes
            .iter()
            .zip(&self.origins)
            .map(|(&b, &o)| (b / width).abs_diff(o / width) + (b % width).abs_diff(o % width))
            .sum();
        let score = swaps * displacement;
        if score > 0 && self.best.is_none_or(|(best, _, _)| score > best) {
            self.best = Some((score, room, displacement));
        }
    }
}

fn opposite(dir: usize) -> usize {
    dir ^ 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn params() -> GenParams {
        GenParams {
            width: 6,
            height: 6,
            num_boxes: 1,
            search_depth: 30,
            max_states: 300_000,
        }
    }

    #[test]
    fn generated_rooms_are_well_formed() {
        for seed in 0..30 {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let Some(room) = generate_room(&params(), &mut rng) else {
                continue;
            };
            assert_eq!(room.boxes.count_ones(), 1);
            assert_eq!(room.targets.count_ones(), 1);
            assert_eq!(room.boxes & room.targets, 0, "no box starts on a target");
            assert_eq!(room.boxes & room.walls, 0);
            assert!(!room.is_wall(room.player) && !room.has_box(room.player));
            let border: Vec<char> = room.render().lines().next().unwrap().chars().collect();
            assert!(border.iter().all(|&c| c == '#'));
            assert!(super::super::solver::solve(&room, 1_000_000).is_some());
        }
    }

    #[test]
    fn opposite_pairs_up_down_and_left_right() {
        assert_eq!(
            [opposite(0), opposite(1), opposite(2), opposite(3)],
            [1, 0, 3, 2]
        );
    }
}
