//! A Sokoban room as bit masks (walls, targets, boxes) over at most 128 cells plus the player
//! cell, the push move shared by the env and the solver, and the text render.

/// Directions in text-action order: Up, Down, Left, Right (gym-sokoban push actions 1–4).
pub const DIRECTIONS: [&str; 4] = ["Up", "Down", "Left", "Right"];

/// Largest number of cells a room may have (one bit per cell in a `u128`).
pub const MAX_CELLS: usize = 128;

/// What a push did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PushEffect {
    /// The player moved.
    pub moved: bool,
    /// A box moved from the first cell to the second.
    pub box_move: Option<(usize, usize)>,
}

/// A room and its dynamic state. Cells are numbered row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Room {
    /// Columns of the grid.
    pub width: usize,
    /// Rows of the grid.
    pub height: usize,
    /// One bit per wall cell.
    pub walls: u128,
    /// One bit per target cell.
    pub targets: u128,
    /// One bit per cell holding a box.
    pub boxes: u128,
    /// The player's cell.
    pub player: usize,
}

/// The mask with only `cell`'s bit set.
pub fn bit(cell: usize) -> u128 {
    1u128 << cell
}

impl Room {
    /// Cell one step from `cell` in `dir`, or `None` off the grid.
    pub fn neighbour(&self, cell: usize, dir: usize) -> Option<usize> {
        let (row, col) = (cell / self.width, cell % self.width);
        match dir {
            0 if row > 0 => Some(cell - self.width),
            1 if row + 1 < self.height => Some(cell + self.width),
            2 if col > 0 => Some(cell - 1),
            3 if col + 1 < self.width => Some(cell + 1),
            _ => None,
        }
    }

    /// Whether `cell` is a wall.
    pub fn is_wall(&self, cell: usize) -> bool {
        self.walls & bit(cell) != 0
    }

    /// Whether a box stands on `cell`.
    pub fn has_box(&self, cell: usize) -> bool {
        self.boxes & bit(cell) != 0
    }

    /// Whether `cell` is a target.
    pub fn is_target(&self, cell: usize) -> bool {
        self.targets & bit(cell) != 0
    }

    /// All boxes are on targets.
    pub fn solved(&self) -> bool {
        self.boxes == self.targets
    }

    /// Number of boxes on targets.
    pub fn boxes_on_targets(&self) -> u32 {
        (self.boxes & self.targets).count_ones()
    }

    /// Moves the player in `dir`, pushing a box when one is ahead and the cell beyond is free.
    pub fn push(&mut self, dir: usize) -> PushEffect {
        let still = PushEffect {
            moved: false,
            box_move: None,
        };
        let Some(next) = self
            .neighbour(self.player, dir)
            .filter(|&c| !self.is_wall(c))
        else {
            return still;
        };
        if !self.has_box(next) {
            self.player = next;
            return PushEffect {
                moved: true,
                box_move: None,
            };
        }
        let beyond = self
            .neighbour(next, dir)
            .filter(|&c| !self.is_wall(c) && !self.has_box(c));
        let Some(beyond) = beyond else {
            return still;
        };
        self.boxes = (self.boxes & !bit(next)) | bit(beyond);
        self.player = next;
        PushEffect {
            moved: true,
            box_move: Some((next, beyond)),
        }
    }

    /// Rows joined by `\n`: `#` wall, `_` empty, `O` target, `√` box on target, `X` box,
    /// `P` player, `S` player on target.
    pub fn render(&self) -> String {
        let rows: Vec<String> = (0..self.height)
            .map(|r| {
                (0..self.width)
                    .map(|c| self.symbol(r * self.width + c))
                    .collect()
            })
            .collect();
        rows.join("\n")
    }

    fn symbol(&self, cell: usize) -> char {
        let target = self.is_target(cell);
        if cell == self.player {
            return if target { 'S' } else { 'P' };
        }
        match (self.is_wall(cell), self.has_box(cell), target) {
            (true, _, _) => '#',
            (_, true, true) => '√',
            (_, true, false) => 'X',
            (_, false, true) => 'O',
            _ => '_',
        }
    }

    /// Parses the render format back into a room (for tests and fixtures).
    pub fn parse(text: &str) -> Option<Room> {
        let rows: Vec<Vec<char>> = text.lines().map(|l| l.chars().collect()).collect();
        let height = rows.len();
        let width = rows.first()?.len();
        if height * width > MAX_CELLS || rows.iter().any(|r| r.len() != width) {
            return None;
        }
        let mut room = Room {
            width,
            height,
            walls: 0,
            targets: 0,
            boxes: 0,
            player: usize::MAX,
        };
        for (i, ch) in rows.iter().flatten().enumerate() {
            match ch {
                '#' => room.walls |= bit(i),
                '_' => {}
                'O' => room.targets |= bit(i),
                '√' => {
                    room.targets |= bit(i);
                    room.boxes |= bit(i);
                }
                'X' => room.boxes |= bit(i),
                'P' => room.player = i,
                'S' => {
                    room.player = i;
                    room.targets |= bit(i);
                }
                _ => return None,
            }
        }
        (room.player != usize::MAX && room.boxes.count_ones() == room.targets.count_ones())
            .then_some(room)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_round_trips_and_pushes_follow_the_rules() {
        let text = "#####\n#P X_#\n#####";
        assert!(Room::parse(text).is_none(), "space is not a symbol");
        let text = "######\n#PXO_#\n#____#\n######";
        let mut room = Room::parse(text).unwrap();
        assert_eq!(room.render(), text);
        let effect = room.push(3);
        assert_eq!(effect.box_move, Some((8, 9)));
        assert!(room.solved());
        assert_eq!(room.render(), "######\n#_P√_#\n#____#\n######");
        let mut blocked = Room::parse("######\n#PXX_#\n#_O_O#\n######").unwrap();
        assert!(!blocked.push(3).moved, "two boxes cannot be pushed");
        assert!(!blocked.push(0).moved, "walls block");
        assert!(blocked.push(1).moved);
        assert_eq!(blocked.render().lines().nth(2), Some("#PO_O#"));
    }
}
