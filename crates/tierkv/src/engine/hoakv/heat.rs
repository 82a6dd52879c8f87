//! The HotStore's heat-sorted order (HoaKV §3.2): every hot entry in one list, hottest
//! first, so that the coldest — the demotion victims, whose heat is HeatLimit — sit at the
//! tail.
//!
//! # The insertion step in O(1)
//! The paper moves an entry whose heat rose forward one neighbour at a time until its
//! predecessor is at least as hot: O(N) in the worst case, and in practice O(length of the
//! run of equal heats); that walk was 6.7 % of a profile of zipfian reads and updates.
//! A heat only ever rises by one, so the entry's final place is known: the front of its old
//! heat's run, exactly where the paper's walk stops. Keeping where each heat's run starts
//! ([`HeatOrder::run_start`]) and how long it is, the step is one swap: the entry takes the
//! run's front place, and the entry that stood there takes the entry's old place. The list
//! stays sorted; only the order within a run of equal heats differs from the paper's (not
//! arrival order), which no rule of the design depends on.
//!
//! Inserting a new entry of heat `h` appends it and lifts it over the runs of lower heats
//! (one swap per run); removing one sinks it below the lower runs, then pops it. Victims
//! come from the tail, so their removal takes one swap. Halving every heat (the sliding
//! window) keeps the order and rebuilds the run table.
//!
//! # Invariants
//! For every heat `h` with `count[h] > 0`: `list[run_start[h] .. run_start[h] + count[h]]`
//! are exactly the entries of heat `h`, and `run_start[h]` is the number of entries hotter
//! than `h`. `pos[list[p]] == p` for every position `p`.

/// Heats are 16 bits (the paper's hot index entry), saturating.
const HEATS: usize = 1 << 16;

/// The heat-sorted list of entry indexes. Entry indexes are small dense integers (the hot
/// index's entry slots).
#[derive(Debug)]
pub struct HeatOrder {
    list: Vec<u32>,
    /// By entry index: position in `list` (`u32::MAX`: not in the order).
    pos: Vec<u32>,
    /// By entry index: heat.
    heat: Vec<u16>,
    count: Vec<u32>,
    run_start: Vec<u32>,
}

impl Default for HeatOrder {
    fn default() -> Self {
        HeatOrder {
            list: Vec::new(),
            pos: Vec::new(),
            heat: Vec::new(),
            count: vec![0; HEATS],
            run_start: vec![0; HEATS],
        }
    }
}

impl HeatOrder {
    /// Entries in the order.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The heat of entry `idx` (0 when absent).
    pub fn heat(&self, idx: u32) -> u16 {
        self.heat.get(idx as usize).copied().unwrap_or(0)
    }

    /// The smallest heat (the tail's), if any entry.
    pub fn min_heat(&self) -> Option<u16> {
        self.list.last().map(|&i| self.heat(i))
    }

    /// Entry indexes from the coldest up.
    pub fn coldest(&self) -> impl Iterator<Item = u32> + '_ {
        self.list.iter().rev().copied()
    }

    fn set(&mut self, p: usize, idx: u32) {
        self.list[p] = idx;
        self.pos[idx as usize] = p as u32;
    }

    fn swap(&mut self, a: usize, b: usize) {
        if a != b {
            let (x, y) = (self.list[a], self.list[b]);
            self.set(a, y);
            self.set(b, x);
        }
    }

    /// Add entry `idx` (not in the order) with heat `h`, after every entry at least as hot.
    pub fn insert(&mut self, idx: u32, h: u16) {
        let i = idx as usize;
        if self.pos.len() <= i {
            self.pos.resize(i + 1, u32::MAX);
            self.heat.resize(i + 1, 0);
        }
        self.heat[i] = h;
        let mut at = self.list.len();
        self.list.push(idx);
        self.pos[i] = at as u32;
        // Lift it over the runs of colder entries, the coldest (the tail) first.
        for c in 0..h as usize {
            if self.count[c] > 0 {
                let rs = self.run_start[c] as usize;
                self.swap(rs, at);
                self.run_start[c] += 1;
                at = rs;
            }
        }
        if self.count[h as usize] == 0 {
            self.run_start[h as usize] = at as u32;
        }
        self.count[h as usize] += 1;
    }

    /// One more access of `idx`: heat + 1 (saturating) and the insertion step.
    pub fn touch(&mut self, idx: u32) {
        let i = idx as usize;
        let h = self.heat[i];
        if h == u16::MAX {
            return;
        }
        let (hu, p) = (h as usize, self.pos[i] as usize);
        let front = self.run_start[hu] as usize;
        self.swap(p, front);
        self.count[hu] -= 1;
        self.run_start[hu] += 1;
        if self.count[hu + 1] == 0 {
            self.run_start[hu + 1] = front as u32;
        }
        self.count[hu + 1] += 1;
        self.heat[i] = h + 1;
    }

    /// Take entry `idx` out of the order.
    pub fn remove(&mut self, idx: u32) {
        let i = idx as usize;
        let h = self.heat[i] as usize;
        // To the back of its run, then below every colder run, then off the end.
        let mut at = self.pos[i] as usize;
        let last = (self.run_start[h] + self.count[h] - 1) as usize;
        self.swap(at, last);
        at = last;
        self.count[h] -= 1;
        for c in (0..h).rev() {
            if self.count[c] > 0 {
                let end = (self.run_start[c] + self.count[c] - 1) as usize;
                self.swap(at, end);
                self.run_start[c] -= 1;
                at = end;
            }
        }
        debug_assert_eq!(at + 1, self.list.len());
        self.list.pop();
        self.pos[i] = u32::MAX;
    }

    /// Halve every heat (the window moved on): the order holds, the run table is rebuilt.
    pub fn halve(&mut self) {
        self.count.iter_mut().for_each(|c| *c = 0);
        for (p, &idx) in self.list.iter().enumerate() {
            let h = &mut self.heat[idx as usize];
            *h /= 2;
            if self.count[*h as usize] == 0 {
                self.run_start[*h as usize] = p as u32;
            }
            self.count[*h as usize] += 1;
        }
    }

    /// True when the list is sorted hottest first and every table agrees with it.
    pub fn check(&self) -> bool {
        let sorted = self.list.windows(2).all(|w| self.heat(w[0]) >= self.heat(w[1]));
        let pos_ok = self.list.iter().enumerate().all(|(p, &i)| self.pos.get(i as usize) == Some(&(p as u32)));
        let mut count = vec![0u32; HEATS];
        for &i in &self.list {
            count[self.heat(i) as usize] += 1;
        }
        let runs_ok = count.iter().enumerate().all(|(h, &c)| {
            c == self.count[h]
                && (c == 0
                    || self.list.get(self.run_start[h] as usize).is_some_and(|&i| self.heat(i) as usize == h)
                        && (self.run_start[h] == 0
                            || self
                                .list
                                .get(self.run_start[h] as usize - 1)
                                .is_some_and(|&i| self.heat(i) as usize > h)))
        });
        sorted && pos_ok && runs_ok
    }

    /// DRAM held.
    pub fn dram_bytes(&self) -> u64 {
        (self.list.capacity() * 4 + self.pos.capacity() * 4 + self.heat.capacity() * 2 + HEATS * 8) as u64
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u16),
        Touch(usize),
        Remove(usize),
        Halve,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u16..12).prop_map(Op::Insert),
            1 => Just(Op::Insert(u16::MAX - 1)),
            8 => any::<usize>().prop_map(Op::Touch),
            2 => any::<usize>().prop_map(Op::Remove),
            1 => Just(Op::Halve),
        ]
    }

    proptest! {
        /// Against a model of heats: the order is always sorted with consistent tables, a
        /// touch moves the entry to the front of its old run (where the paper's walk stops),
        /// and the tail is always a coldest entry.
        #[test]
        fn order_matches_a_model(ops in proptest::collection::vec(op(), 1..300)) {
            let mut o = HeatOrder::default();
            let mut model: Vec<Option<u16>> = Vec::new();
            for op in ops {
                let live: Vec<usize> = (0..model.len()).filter(|&i| model[i].is_some()).collect();
                match op {
                    Op::Insert(h) => {
                        let idx = model.iter().position(Option::is_none).unwrap_or(model.len());
                        if idx == model.len() { model.push(None); }
                        model[idx] = Some(h);
                        o.insert(idx as u32, h);
                    }
                    Op::Touch(n) if !live.is_empty() => {
                        let idx = live[n % live.len()];
                        let h = model[idx].unwrap();
                        let hotter = model.iter().flatten().filter(|&&x| x > h).count();
                        o.touch(idx as u32);
                        if h < u16::MAX {
                            model[idx] = Some(h + 1);
                            prop_assert_eq!(o.pos[idx] as usize, hotter, "a touch stops behind the hotter entries");
                        }
                    }
                    Op::Remove(n) if !live.is_empty() => {
                        let idx = live[n % live.len()];
                        model[idx] = None;
                        o.remove(idx as u32);
                    }
                    Op::Halve => {
                        model.iter_mut().flatten().for_each(|h| *h /= 2);
                        o.halve();
                    }
                    _ => {}
                }
                prop_assert!(o.check());
                prop_assert_eq!(o.len(), model.iter().flatten().count());
                for (i, h) in model.iter().enumerate() {
                    if let Some(h) = h { prop_assert_eq!(o.heat(i as u32), *h); }
                }
                prop_assert_eq!(o.min_heat(), model.iter().flatten().min().copied());
            }
        }
    }
}
