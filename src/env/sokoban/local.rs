//! The lines that `render: grid_local` appends to Sokoban's grid: what each move would do and
//! where the boxes still to place and their targets lie, written in action words.
//!
//! A small model trained from scratch cannot locate cells in a row-major grid, so these lines
//! spell out what the grid only implies. First one line per action, starting with the action word
//! as the answer writes it: `Up: wall` (no move), `move` (the player walks), `push box` (a box
//! onto the floor), `push box to target`, `push box from target` (a box off its target) and
//! `cannot push` (a box against a wall or another box: no move). Each outcome word is one token
//! of the built-in vocabulary. Then, for each box not on a target (reading order), a block:
//! `Box:` with its offset from the player, `Target:` with the offset of the free target paired
//! with it, and `Box to target:` with that target's offset from the box. An offset is one line
//! per axis, rows first (`Up 1`, `Left 2`), so every direction word starts a line; a zero offset
//! writes no line (the player stands on that target). Each box takes the nearest free target not
//! taken by an earlier box (rows plus columns, walls ignored; ties go to the first in reading
//! order), so the pairs are distinct. A solved room has no blocks.
//!
//! This module only reads a room: it owns no dynamics (outcomes come from [`Room::push`] on a
//! copy, so they always agree with the step).

use super::room::{bit, Room, DIRECTIONS, MAX_CELLS};

/// Indices of [`DIRECTIONS`].
const UP: usize = 0;
const DOWN: usize = 1;
const LEFT: usize = 2;
const RIGHT: usize = 3;

/// What moving in one direction would do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveOutcome {
    /// A wall (or the room's edge) is ahead: no move.
    Wall,
    /// The player walks onto a free cell.
    Move,
    /// A box is pushed onto the floor.
    PushBox,
    /// A box is pushed onto a target.
    PushBoxToTarget,
    /// A box on a target is pushed onto the floor.
    PushBoxFromTarget,
    /// A box is ahead with a wall or another box behind it: no move.
    CannotPush,
}

impl MoveOutcome {
    /// The outcome of moving in `dir` (an index of [`DIRECTIONS`]) from the current state.
    pub fn of(room: &Room, dir: usize) -> MoveOutcome {
        let mut after = *room;
        let effect = after.push(dir);
        match effect.box_move {
            Some((_, to)) if room.is_target(to) => MoveOutcome::PushBoxToTarget,
            Some((from, _)) if room.is_target(from) => MoveOutcome::PushBoxFromTarget,
            Some(_) => MoveOutcome::PushBox,
            None if effect.moved => MoveOutcome::Move,
            None => match room.neighbour(room.player, dir) {
                Some(ahead) if room.has_box(ahead) => MoveOutcome::CannotPush,
                _ => MoveOutcome::Wall,
            },
        }
    }

    /// The words the render writes after the action word.
    pub fn text(self) -> &'static str {
        match self {
            MoveOutcome::Wall => "wall",
            MoveOutcome::Move => "move",
            MoveOutcome::PushBox => "push box",
            MoveOutcome::PushBoxToTarget => "push box to target",
            MoveOutcome::PushBoxFromTarget => "push box from target",
            MoveOutcome::CannotPush => "cannot push",
        }
    }
}

/// The `grid_local` lines for `room` (without the grid), joined by `\n`.
pub fn local_text(room: &Room) -> String {
    let mut lines: Vec<String> = (0..DIRECTIONS.len())
        .map(|dir| format!("{}: {}", DIRECTIONS[dir], MoveOutcome::of(room, dir).text()))
        .collect();
    for (box_cell, target) in box_target_pairs(room) {
        lines.push("Box:".into());
        lines.extend(offset_lines(room, room.player, box_cell));
        lines.push("Target:".into());
        lines.extend(offset_lines(room, room.player, target));
        lines.push("Box to target:".into());
        lines.extend(offset_lines(room, box_cell, target));
    }
    lines.join("\n")
}

/// Each box off a target (reading order) with the nearest free target no earlier box took.
fn box_target_pairs(room: &Room) -> Vec<(usize, usize)> {
    let mut free: Vec<usize> = cells(room.targets & !room.boxes).collect();
    cells(room.boxes & !room.targets)
        .filter_map(|box_cell| {
            let nearest = (0..free.len()).min_by_key(|&i| distance(room, box_cell, free[i]))?;
            Some((box_cell, free.remove(nearest)))
        })
        .collect()
}

/// The cells of a mask, in reading order.
fn cells(mask: u128) -> impl Iterator<Item = usize> {
    (0..MAX_CELLS).filter(move |&cell| mask & bit(cell) != 0)
}

/// Rows plus columns between two cells.
fn distance(room: &Room, a: usize, b: usize) -> usize {
    let (rows, cols) = offset(room, a, b);
    rows.unsigned_abs() + cols.unsigned_abs()
}

/// `(rows, cols)` from `from` to `to`; positive is down and right.
fn offset(room: &Room, from: usize, to: usize) -> (isize, isize) {
    let (w, from, to) = (room.width as isize, from as isize, to as isize);
    (to / w - from / w, to % w - from % w)
}

/// The offset from `from` to `to` as action words with counts, rows first (`Up 1`, `Left 2`).
fn offset_lines(room: &Room, from: usize, to: usize) -> Vec<String> {
    let (rows, cols) = offset(room, from, to);
    [
        (rows, if rows < 0 { UP } else { DOWN }),
        (cols, if cols < 0 { LEFT } else { RIGHT }),
    ]
    .into_iter()
    .filter(|&(count, _)| count != 0)
    .map(|(count, dir)| format!("{} {}", DIRECTIONS[dir], count.unsigned_abs()))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The grid followed by its local lines, as `render: grid_local` writes it.
    fn grid_local(grid: &str) -> String {
        let room = Room::parse(grid).unwrap();
        format!("{}\n{}", room.render(), local_text(&room))
    }

    #[test]
    fn moves_onto_floor_into_walls_and_pushes_onto_floor_and_targets() {
        let grid = "######\n##___#\n#OXP##\n#__X_#\n#O___#\n######";
        let expected = [
            grid,
            "Up: move",
            "Down: push box",
            "Left: push box to target",
            "Right: wall",
            // Box beside the player, its target just beyond it.
            "Box:\nLeft 1\nTarget:\nLeft 2\nBox to target:\nLeft 1",
            // The second box: the target at the same distance was taken, the other one remains.
            "Box:\nDown 1\nTarget:\nDown 2\nLeft 2\nBox to target:\nDown 1\nLeft 2",
        ];
        assert_eq!(grid_local(grid), expected.join("\n"));
    }

    #[test]
    fn pushes_off_a_target_and_boxes_blocked_by_a_wall_or_a_box() {
        let grid = "#######\n###_###\n###√###\n##XSX√#\n###O###\n#######";
        let expected = [
            grid,
            "Up: push box from target",
            "Down: move",
            "Left: cannot push",
            "Right: cannot push",
            // The player stands on the nearest free target: its offset writes no line.
            "Box:\nLeft 1\nTarget:\nBox to target:\nRight 1",
            "Box:\nRight 1\nTarget:\nDown 1\nBox to target:\nDown 1\nLeft 1",
        ];
        assert_eq!(grid_local(grid), expected.join("\n"));
    }

    #[test]
    fn a_solved_room_lists_no_boxes_and_the_room_edge_is_a_wall() {
        let grid = "P√_\n___";
        assert_eq!(
            grid_local(grid),
            "P√_\n___\nUp: wall\nDown: move\nLeft: wall\nRight: push box from target"
        );
    }

    #[test]
    fn outcomes_agree_with_the_push() {
        let grids = [
            "######\n##___#\n#OXP##\n#__X_#\n#O___#\n######",
            "#######\n###_###\n###√###\n##XSX√#\n###O###\n#######",
        ];
        for grid in grids {
            let room = Room::parse(grid).unwrap();
            for dir in 0..DIRECTIONS.len() {
                let outcome = MoveOutcome::of(&room, dir);
                let moves = !matches!(outcome, MoveOutcome::Wall | MoveOutcome::CannotPush);
                let mut after = room;
                assert_eq!(after.push(dir).moved, moves, "{grid}: {outcome:?}");
                let placed = after.boxes_on_targets() as i32 - room.boxes_on_targets() as i32;
                let want = match outcome {
                    MoveOutcome::PushBoxToTarget => 1,
                    MoveOutcome::PushBoxFromTarget => -1,
                    _ => 0,
                };
                assert_eq!(placed, want, "{grid}: {outcome:?}");
            }
        }
    }
}
