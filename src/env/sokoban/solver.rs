//! Breadth-first Sokoban solver (the oracle): a shortest sequence of moves (counting every
//! player move, as the env's step cap does) that puts every box on a target. States are
//! (box mask, player cell); the search gives up after `max_states` distinct states.

use std::collections::{HashMap, VecDeque};

use super::room::Room;

/// A search state: (box mask, player cell).
type Key = (u128, usize);

/// A shortest solution as directions (0 Up, 1 Down, 2 Left, 3 Right), `Some(vec![])` when the
/// room is already solved, `None` when unsolvable or the state bound is hit.
pub fn solve(room: &Room, max_states: usize) -> Option<Vec<usize>> {
    let start: Key = (room.boxes, room.player);
    let mut parent: HashMap<Key, (Key, usize)> = HashMap::new();
    let mut queue = VecDeque::from([start]);
    let mut seen = std::collections::HashSet::from([start]);
    while let Some(key) = queue.pop_front() {
        let state = Room {
            boxes: key.0,
            player: key.1,
            ..*room
        };
        if state.solved() {
            return Some(unwind(&parent, start, key));
        }
        for dir in 0..4 {
            let mut next = state;
            if !next.push(dir).moved {
                continue;
            }
            let next_key = (next.boxes, next.player);
            if seen.insert(next_key) {
                if seen.len() > max_states {
                    return None;
                }
                parent.insert(next_key, (key, dir));
                queue.push_back(next_key);
            }
        }
    }
    None
}

fn unwind(parent: &HashMap<Key, (Key, usize)>, start: Key, mut at: Key) -> Vec<usize> {
    let mut path = Vec::new();
    while at != start {
        let (prev, dir) = parent[&at];
        path.push(dir);
        at = prev;
    }
    path.reverse();
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Independent check: is there a solution of at most `depth` moves? (plain depth-first.)
    fn solvable_within(room: Room, depth: usize) -> bool {
        if room.solved() {
            return true;
        }
        depth > 0
            && (0..4).any(|dir| {
                let mut next = room;
                next.push(dir).moved && solvable_within(next, depth - 1)
            })
    }

    #[test]
    fn bfs_is_optimal_and_its_path_solves() {
        let rooms = [
            "######\n#P___#\n#__X_#\n#___O#\n######",
            "######\n#__O_#\n#_X__#\n#P___#\n######",
            "#######\n#P____#\n#_X#__#\n#__O__#\n#######",
        ];
        for text in rooms {
            let room = Room::parse(text).unwrap();
            let path = solve(&room, 100_000).unwrap();
            let mut replay = room;
            for &dir in &path {
                replay.push(dir);
            }
            assert!(replay.solved(), "{text}");
            assert!(solvable_within(room, path.len()));
            assert!(
                !solvable_within(room, path.len() - 1),
                "{text}: shorter exists"
            );
        }
    }

    #[test]
    fn unsolvable_and_bounded_searches_return_none() {
        let cornered = Room::parse("#####\n#X__#\n#_P_#\n#__O#\n#####").unwrap();
        assert_eq!(solve(&cornered, 100_000), None);
        let room = Room::parse("######\n#__O_#\n#_X__#\n#P___#\n######").unwrap();
        assert_eq!(solve(&room, 2), None);
        let done = Room::parse("####\n#P√#\n####").unwrap();
        assert_eq!(solve(&done, 10), Some(vec![]));
    }
}
